"""
The step's metrics (nanoagent/metrics.py) over 2 gloo ranks under torchrun: a metric says only what
was measured. When DAPO leaves every trajectory of a step out, no engine logprob was compared with
the trainer's, and engine_logprob_diff must not read as a perfect 0; rank_imbalance compares the
ranks' trainer tokens. The step line says what docs/recipes.md says it does: the task's answer score,
each KL by what it is of, elapsed time and an ETA.
"""

import json
import os
import sys

import pytest
import torch

import procs
from nanoagent.agent import Trajectory
from nanoagent.config import make_config
from nanoagent.metrics import step_line, step_metrics
from nanoagent.tasks import arithmetic

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# each rank, for each case: one trajectory of two action tokens; it trains them (the trainer's
# logprobs differ from the engine's by 0.1 x (rank + 1) on the first) or, left out, compares nothing
RANK_SCRIPT = """
import json, sys
import torch
import torch.distributed as dist
from nanoagent.agent import Trajectory
from nanoagent.metrics import step_metrics

dist.init_process_group("gloo")
rank = dist.get_rank()
for case in json.loads(sys.argv[1]):
    trained = case[rank]
    t = Trajectory(sample={"id": str(rank)}, prompt_ids=[1, 2], messages=[], response_ids=[3, 4], action_mask=[1, 1],
                   rollout_logprobs=[-1.0, -2.0], versions=[0, 0], turn_spans=[(0, 2)], finish_reason="done")
    mask = torch.tensor([[0.0, 0.0, 1.0, 1.0]]) * trained
    batch = {"action_mask": mask, "rollout_logprobs": torch.tensor([[0.0, 0.0, -1.0, -2.0]]), "lengths": [4],
             "prompt": torch.tensor([0]), "prompt_length": torch.tensor([2]),
             "nucleus_logprobs": torch.tensor([[0.0, 0.0, -1.0 - 0.1 * (rank + 1), -2.0]]) * mask,
             "version": torch.zeros(1, 4, dtype=torch.long)}
    counts = {"groups_ended": 1, "groups_kept": 1, "carried_in": 0, "paused": 0, "held": 0, "refills": 0}
    dropped = {"dropped_uniform": 1 - trained, "dropped_overlong": 0, "dropped_env_error": 0}
    metrics = step_metrics(0, [t], dropped, batch, [], [], None, counts, [0.0, 1.0, 2.0, 3.0, 4.0])
    if rank == 0:
        print(json.dumps(metrics))
dist.destroy_process_group()
"""


CASES = [([1, 1], 0.2), ([1, 0], 0.1), ([0, 1], 0.2), ([0, 0], None)]  # (which ranks train, engine_logprob_diff)
IMBALANCE = {2: 1.0, 1: 2.0, 0: 0.0}  # trained trajectories -> the busiest rank's trainer tokens over the mean rank's


@pytest.mark.slow
def test_engine_logprob_diff_only_where_a_rank_compared(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    cmd = [*procs.torchrun(2), str(script),
           json.dumps([trained for trained, _ in CASES])]
    proc = procs.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT,
                     env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()[-len(CASES):]
    for (trained, engine_diff), line in zip(CASES, lines, strict=True):
        metrics = json.loads(line)
        assert metrics["dropped_uniform"] == 1 - sum(trained) / 2
        assert metrics["rank_imbalance"] == IMBALANCE[sum(trained)]
        if engine_diff is None:  # every trajectory left out: nothing compared, nothing claimed
            assert "engine_logprob_diff" not in metrics, trained
        else:  # the ranks that compared; a rank that did not leaves the max alone
            assert metrics["engine_logprob_diff"] == pytest.approx(engine_diff, abs=1e-6), trained


def scored_step(cfg, answers, kl, updated=True):
    """step_metrics of arithmetic trajectories answering `answers` to 12*7 (one action token each,
    trained), scored by the task as train.py scores them, after one policy update or (updated=False:
    the critic's warm-up) none; kl: the k1 to a reference per trained token, or None."""
    trajs = []
    for answer in answers:
        sample = {"id": answer, "messages": [{"role": "user", "content": "Compute 12*7."}], "answers": ["84"]}
        text = f"<answer>{answer}</answer>"
        t = Trajectory(sample=sample,
                       prompt_ids=[1, 2],
                       messages=[*sample["messages"], {"role": "assistant", "content": text}],
                       response_ids=[3],
                       action_mask=[1],
                       rollout_logprobs=[-1.0],
                       versions=[4],
                       turn_spans=[(0, 1)],
                       final_text=text,
                       finish_reason="done")
        arithmetic.score(t, cfg)
        trajs.append(t)
    mask = torch.tensor([[0.0, 0.0, 1.0]] * len(trajs))
    batch = {"action_mask": mask,
             "rollout_logprobs": -mask,
             "nucleus_logprobs": -mask,
             "lengths": [3] * len(trajs),
             "prompt": torch.arange(len(trajs)),
             "prompt_length": torch.tensor([2] * len(trajs)),
             "version": torch.full_like(mask, 4, dtype=torch.long)}
    update = ({"pg_loss": 0.1, "clipfrac": 0.0, "approx_kl": 0.0123, "entropy": 0.9, "kl_loss": 0.0},
              {"grad_norm": 0.5, "skipped": 0.0})
    return step_metrics(4,
                        trajs,
                        {"dropped_uniform": 0, "dropped_overlong": 0, "dropped_env_error": 0},
                        batch,
                        [update] if updated else [],
                        [],
                        None if kl is None else kl * mask,
                        {"groups_ended": 1, "groups_kept": 1, "carried_in": 0, "paused": 0, "held": 0,
                         "refills": 0},
                        [0.0, 1.0, 2.0, 3.0, 4.0])


def test_step_line_shows_the_answer_score_each_kl_by_name_elapsed_and_eta(process_group):
    cfg = make_config("tiny")  # reward.metric=em, steps=20, no reference (train.kl_mode=none)
    metrics = scored_step(cfg, ["84", "84", "7", "84"], kl=None)
    # every score the task gives is a metric of the step
    assert metrics["em"] == 0.75 and metrics["f1"] == 0.75
    # step 5 of 20, the first 5 in 100 s: 15 to go at 20 s each
    line = step_line(metrics, cfg, 0, 100.0)
    assert "| em 0.750 |" in line and "kl_ref" not in line
    assert "| kl_old 0.0123 | clip 0.000 | ent 0.900 | gnorm 0.500 | skip 0.00 |" in line
    assert line.endswith("| elapsed 1m40s eta 5m00s")
    metrics.update({"eval/reward": 0.5, "eval/em": 0.5, "eval/f1": 0.625})
    assert step_line(metrics, cfg, 0, 100.0).endswith(
        "| elapsed 1m40s eta 5m00s | eval reward 0.500 em 0.500")

    # a reference (train.kl_mode=loss): its KL, not the update's; the score reward.metric names;
    # a resumed run's pace
    cfg = make_config("tiny", ["train.kl_mode=loss", "reward.metric=f1", "steps=4000"])
    metrics = scored_step(cfg, ["84", "7"], kl=0.02)
    line = step_line(metrics, cfg, 3, 40.0)  # resumed at step 3: 2 steps in 40 s, 3,995 to go
    assert "| f1 0.500 |" in line and "| em " not in line
    assert "| kl_ref 0.0200 |" in line and "kl_old" not in line
    assert line.endswith("| elapsed 40s eta 22h11m")

    # a task whose trajectories have no answer score (TextWorld's won, GSM8K's accuracy): none shown
    del metrics["f1"]
    assert "f1" not in step_line(metrics, cfg, 3, 40.0)

    # no policy update (the critic's warm-up): no update statistics read as zeros
    cfg = make_config("tiny", ["algo=ppo", "ppo.critic_warmup_steps=10"])
    line = step_line(scored_step(cfg, ["84", "7"], kl=None, updated=False), cfg, 0, 10.0)
    assert "| resp 1 | no policy update | drop 0.00+0.00 |" in line and "kl_" not in line

    # grpo.refill: the groups that train, of those asked for, and why fewer; partial rollouts: staleness
    cfg = make_config("tiny", ["grpo.refill=true", "rollout.max_staleness=1", "rollout.extra_prompts=4",
                               "train.tis=true"])
    metrics = scored_step(cfg, ["84", "7"], kl=None)  # one group of the 8 asked for trained
    assert metrics["groups_kept"] == 1 and metrics["sampled_per_kept"] == 1 and metrics["staleness"] == 0
    line = step_line(metrics, cfg, 0, 10.0)
    assert "| groups 1/8 (grpo.max_refill's spare prompts spent) | stale 0.00 carried 0.00 |" in line
    metrics["groups_kept"] = 8
    assert "| groups 8/8 | stale" in step_line(metrics, cfg, 0, 10.0)
