"""
train.py end to end under real torchrun (gloo, 2 CPU ranks) with the real vLLM CPU engine and the
tiny model: PPO and GRPO steps, the weight push, exact resume, the HF export, NaN skipping.
A short imitation warm start gets the tiny model calling the calculator, but what it then earns
depends on how this CPU rounds: a test whose premise is "the rewards varied, the policy moved"
scores with a scripted reward (tests/alternating_task.py) that varies within every group.
"""

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import procs
from nanoagent.engine import cpu_kv_cache_bytes

pytestmark = pytest.mark.slow
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BF16_LOGPROB_DIFF = 0.1  # measured: ~0.03 after the warm start and after an update; stale weights give several nats
QUICK = ["--config=tiny", "train.warm_start_steps=30", "train.tool_call_reward=0.1", "rollout.prompts_per_step=4", "rollout.max_turns=2",
         "ppo.mini_batch_size=8", "task.num_val=8"]


def train(run_dir, *overrides, nproc=2, env_cache=None, script="train.py"):
    cmd = [*procs.torchrun(nproc), os.path.join(ROOT, script), *QUICK, f"run_dir={run_dir}", *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "NANOAGENT_CACHE": env_cache or os.environ.get("NANOAGENT_CACHE", "")}
    proc = procs.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT, env={k: v for k, v in env.items() if v})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout, [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]


@pytest.mark.parametrize("algo,lora_rank", [("ppo", 0), ("grpo", 0), ("ppo", 8), ("grpo", 8)],
                         ids=["ppo", "grpo", "ppo-lora", "grpo-lora"])
def test_two_steps_push_export_in_bf16(algo, lora_rank, tmp_path):
    """What a GPU run does, on 2 CPU ranks: bf16 mixed precision (trainer and engine), activation
    checkpointing, models built on the meta device from rank 0's copy, a fresh model cache (the
    ranks build the tiny model at the same time). PPO runs with step-level credit (ppo.credit=step;
    token-level PPO runs on 2 ranks in test_resume_gives_the_same_next_step). GRPO with the layers' norms and
    MLPs compiled (train.compile), as a GPU run would. With LoRA adapters (lora_rank 8: the warm start's merged
    into the base, the KL reference that base, the engine given merged weights, the critic adapters of its own)
    and full fine-tuning; LoRA's compiled layers are checked against eager ones in tests/test_lora.py."""
    # a small token budget gives the ranks different numbers of micro-batches, which they must keep in step;
    # the scripted reward (1, 0, 1, 0 within each group) makes the rewards vary whatever this CPU's bf16 sampled;
    # a shorter warm start than QUICK's (a bf16 step is ~10x an fp32 one on a CPU without bf16 units) still makes some tool calls
    out, metrics = train(tmp_path / "run", f"algo={algo}", "steps=2", "train.warm_start_steps=10", "train.warm_start_lr=3e-3",
                         "train.micro_batch_tokens=600", "train.dtype=bfloat16",
                         f"data.task={os.path.join(ROOT, 'tests', 'alternating_task.py')}",
                         "rollout.dtype=bfloat16", "train.activation_checkpointing=true", f"train.lora_rank={lora_rank}",
                         *(["train.kl_mode=loss", "train.overlong_filter=true", f"train.compile={not lora_rank}"]
                           if algo == "grpo" else ["train.kl_mode=reward", "ppo.credit=step"]),
                         env_cache=str(tmp_path / "cache"))
    steps = [m for m in metrics if m["step"] >= 1]
    assert [m["step"] for m in steps] == [1, 2] and all("reward" in m for m in steps)
    for m in steps:
        # the engine sampled with the weights the trainer has (after the warm start, then after the update), up to bf16 rounding
        assert m["engine_logprob_diff"] <= BF16_LOGPROB_DIFF, m
        assert m.get("skipped", 0) == 0 and m["tokens_per_s"] > 0 and "kl" in m
        # grpo leaves (asked here) cut trajectories out of the update (DAPO); no group has one reward for all; ppo leaves none out
        assert m["dropped_uniform"] == 0
        trained = round(16 * (1 - m["dropped_overlong"]))  # of 4 prompts x 4 samples
        assert 0 <= trained <= 16 if algo == "grpo" else trained == 16
        assert m["policy_updates"] == math.ceil(trained / 8)  # mini-batches of 8 (QUICK), however many are left
    assert steps[0]["grad_norm"] > 0  # rewards varied, the policy moved
    if algo == "ppo":
        assert steps[0]["vf_loss"] > 0
    assert "step    2/2" in out and "exported" in out
    assert os.path.isdir(tmp_path / "run" / "hf" / "adapter") == bool(lora_rank)
    # the export loads in transformers and vLLM and both give the same logprobs
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.distributed import cleanup_dist_env_and_memory
    from vllm.inputs import TokensPrompt
    export = str(tmp_path / "run" / "hf")
    tok = AutoTokenizer.from_pretrained(export)
    assert tok.chat_template is not None
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is 12 * 34?"}], tokenize=False, add_generation_prompt=True)
    ids = tok.encode(prompt, add_special_tokens=False)
    llm = LLM(model=export, dtype="float32", enforce_eager=True, max_model_len=1024,
              kv_cache_memory_bytes=cpu_kv_cache_bytes(export, "float32", 1024))
    try:
        [gen] = llm.generate([TokensPrompt(prompt_token_ids=ids)], SamplingParams(max_tokens=12, temperature=1.0, logprobs=0, seed=0), use_tqdm=False)
    finally:  # the torch.distributed world of one the engine set up in this process goes with it: the worker's next test may start its own
        del llm
        cleanup_dist_env_and_memory()
    sampled = list(gen.outputs[0].token_ids)
    model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([ids + sampled])).logits[0, len(ids) - 1:-1]
    ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(sampled)[:, None]).squeeze(-1)
    engine = torch.tensor([lp[t].logprob for lp, t in zip(gen.outputs[0].logprobs, sampled)])
    assert (engine - ref).abs().max() <= 1e-4


def test_resume_gives_the_same_next_step(tmp_path):
    moved = ["pg_loss", "vf_loss", "grad_norm", "vf_grad_norm", "entropy", "kl"]
    keys = ["reward", "response_tokens", "clipfrac", *moved]
    # an entropy bonus and a KL penalty make every compared number non-zero even when no trajectory
    # earns a reward; QUICK warm-starts, so the KL is to the warm-started policy (run_dir/warm_start)
    moving = ["algo=ppo", "train.entropy_coef=0.01", "train.kl_mode=reward"]
    with ThreadPoolExecutor(max_workers=2) as pool:  # one rank on one thread each: side by side on 2 cores
        (_, straight), _ = pool.map(lambda run: train(*run, nproc=1), [(tmp_path / "a", *moving, "steps=3", "train.save_every=2"),
                                                                         (tmp_path / "b", *moving, "steps=2")])
    assert sorted(os.listdir(tmp_path / "a" / "checkpoints")) == ["step_000002", "step_000003"]
    # b resumes for its third step; beside it, a fresh start into a's used run_dir moves that run aside
    # (none of it can be adopted or mixed in later)
    with ThreadPoolExecutor(max_workers=2) as pool:
        (out, resumed), (fresh_out, fresh) = pool.map(lambda run: train(*run, nproc=1), [(tmp_path / "b", *moving, "steps=3"),
                                                                                          (tmp_path / "a", *moving, "steps=1", "resume=never")])
    assert "resumed from" in out and "step_000002" in out and "warm start" not in out
    assert "resume changes steps: 2 -> 3" in out  # and config.json says so, in run_dir and in the checkpoint
    assert json.load(open(tmp_path / "b" / "config.json"))["steps"] == 3
    assert json.load(open(tmp_path / "b" / "checkpoints" / "step_000003" / "config.json"))["steps"] == 3
    step3 = [m for m in resumed if m["step"] == 3]
    assert len(step3) == 1
    expected = [m for m in straight if m["step"] == 3][0]
    for k in keys:
        assert step3[0][k] == pytest.approx(expected[k], rel=1e-5, abs=1e-7), k
    assert all(expected[k] != 0 for k in moved), expected
    assert [m["kl"] for m in straight if m["step"] == 1][0] <= 1e-6  # RL starts at its reference
    # fp32: the engine samples with exactly the trainer's weights
    assert all(m["engine_logprob_diff"] <= 1e-4 for m in straight + resumed if "engine_logprob_diff" in m)

    [aside] = tmp_path.glob("a.old-*")
    assert f"moved aside to {aside}" in fresh_out and "resumed from" not in fresh_out
    assert os.listdir(tmp_path / "a" / "checkpoints") == ["step_000001"] and [m["step"] for m in fresh] == [1]
    assert sorted(os.listdir(aside / "checkpoints")) == ["step_000002", "step_000003"]
    # the viewer's trajectories (log.trajectories_per_step: 2 groups of 4 a step) hold each step once
    # across the resume, and its step 3 is the straight run's; fp32: the trainer's logprobs are the
    # engine's on every action token
    kept = {run: [json.loads(line) for line in open(run / "trajectories.jsonl")]
            for run in (aside, tmp_path / "b")}
    for run, records in kept.items():
        assert [r["step"] for r in records] == [1] * 8 + [2] * 8 + [3] * 8, run
        assert all(abs(d) <= 1e-4 for r in records for turn in r["logprob_diff"] for d in turn), run
    flat = lambda record: [a for turn in record["advantages"] for a in turn]  # noqa: E731
    for straight_record, resumed_record in zip(kept[aside][16:], kept[tmp_path / "b"][16:]):
        assert straight_record["response_ids"] == resumed_record["response_ids"]
        assert flat(straight_record) == pytest.approx(flat(resumed_record), rel=1e-4, abs=1e-6)


def test_last_k_context_trains_on_two_ranks_and_resumes(tmp_path):
    """rollout.context=last_k with PPO's step-level GAE on 2 ranks: each turn a row of its own (a
    trajectory's rows stay in one mini-batch), the engine's logprobs are the trainer's on every row,
    and a run resumed from its step-2 checkpoint takes the same step 3."""
    lastk = ["algo=ppo", "ppo.credit=step", "rollout.context=last_k", "rollout.keep_turns=1", "rollout.max_turns=3",
             "train.entropy_coef=0.01", "train.kl_mode=reward"]
    _, straight = train(tmp_path / "a", *lastk, "steps=3", "train.save_every=2")
    steps = [m for m in straight if m["step"] >= 1]
    assert all(m["engine_logprob_diff"] <= 1e-4 and m["policy_updates"] == 2 and m["vf_loss"] > 0 for m in steps), steps
    assert max(m["turns"] for m in steps) > 1  # some trajectories have several turns, hence several rows
    # resume from step 2: the run copied, without its step-3 checkpoint
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    shutil.rmtree(tmp_path / "b" / "checkpoints" / "step_000003")
    out, resumed = train(tmp_path / "b", *lastk, "steps=3")
    assert "resumed from" in out and "step_000002" in out
    [step3] = [m for m in resumed if m["step"] == 3]
    for k in ["reward", "pg_loss", "vf_loss", "grad_norm", "vf_grad_norm", "context_tokens", "entropy"]:
        assert step3[k] == pytest.approx(steps[2][k], rel=1e-5, abs=1e-7), k


def test_ranks_train_on_about_as_many_tokens_and_as_if_the_rows_had_stayed(tmp_path):
    """train.balance_ranks on 2 ranks: the first half of the prompts open with a long preamble
    (tests/uneven_task.py), so rank 0 rolls out about 1.8 times rank 1's tokens (rank_imbalance 1.28). Whole groups move until
    the ranks are about even (rank_imbalance: the busiest rank's trainer tokens over the mean rank's),
    and the update is the one the rows would have made where they were rolled out: with one
    mini-batch, the global token-mean loss and its gradient do not depend on which rank holds a row."""
    uneven = ["algo=grpo", "steps=1", f"data.task={os.path.join(ROOT, 'tests', 'uneven_task.py')}", "data.shuffle=false",
              "task.num_train=8", "rollout.prompts_per_step=8", "rollout.group_size=2",
              "ppo.mini_batch_size=16", "train.warm_start_steps=0"]
    [stay], [move] = [[m for m in train(tmp_path / name, *uneven, f"train.balance_ranks={on}")[1] if m["step"] == 1]
                      for name, on in [("stay", "false"), ("move", "true")]]
    assert stay["rank_imbalance"] > 1.2 and move["rank_imbalance"] < 1.1, (stay["rank_imbalance"], move["rank_imbalance"])
    for k in ["reward", "response_tokens", "turns", "tool_calls", "dropped_uniform", "pg_loss", "grad_norm", "entropy", "approx_kl"]:
        assert move[k] == pytest.approx(stay[k], rel=1e-5, abs=1e-7), k
    assert stay["pg_loss"] != 0 and stay["dropped_uniform"] == 0


def test_engine_logprob_diff_compares_like_with_like_under_top_p(tmp_path):
    """With rollout.top_p < 1 the engine reports logprobs renormalised over the nucleus it sampled
    from; engine_logprob_diff compares them with the trainer's renormalised the same way (fp32, the
    same weights: they agree), not with the full softmax that the trainer trains and TIS divides."""
    _, metrics = train(tmp_path / "run", "algo=grpo", "grpo.drop_uniform_groups=false", "rollout.top_p=0.9", "steps=1", nproc=1)
    [step] = [m for m in metrics if m["step"] >= 1]
    assert step["engine_logprob_diff"] <= 1e-4, step


def test_nan_loss_skips_the_update_and_is_logged(tmp_path):
    # every group is kept (the tiny model often earns one reward for all, and DAPO would leave the update nothing to poison)
    out, metrics = train(tmp_path / "run", "algo=grpo", "grpo.drop_uniform_groups=false", "steps=2", nproc=1, script="tests/nan_loss.py")
    first, second = [m for m in metrics if m["step"] >= 1]
    assert first["skipped"] > 0 and second["skipped"] == 0  # the fraction of the step's optimizer steps skipped
    assert f"skip {first['skipped']:.2f}" in out
    assert first["engine_logprob_diff"] <= 1e-4 and second["engine_logprob_diff"] <= 1e-4


def test_sigterm_checkpoints_at_the_next_safe_point_and_exits_143(tmp_path):
    """
    A preemption: SIGTERM to one worker while step 2 runs (torchrun passes its own SIGTERM on to
    every worker; one is the harder case). Every rank stops at the next safe point (after the
    rollout or after the update), the checkpoint holds every logged step and nothing else, the
    workers exit 143 so torchrun fails the job, nothing is exported, and a rerun goes on from there.
    """
    run_dir = tmp_path / "run"
    overrides = ["algo=ppo", "rollout.engine=hf", "steps=4", "train.warm_start_steps=0", f"run_dir={run_dir}"]
    cmd = [*procs.torchrun(2), os.path.join(ROOT, "train.py"), *QUICK, *overrides]
    with open(tmp_path / "log", "w") as log:
        torchrun = procs.start(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    while "step    1/4" not in open(tmp_path / "log").read():
        assert torchrun.poll() is None, open(tmp_path / "log").read()[-3000:]
        time.sleep(0.05)
    with open(f"/proc/{torchrun.pid}/task/{torchrun.pid}/children") as f:
        workers = [int(pid) for pid in f.read().split() if "train.py" in open(f"/proc/{pid}/cmdline").read()]
    assert len(workers) == 2
    os.kill(workers[-1], signal.SIGTERM)
    # a bound, not a race: how soon the next safe point comes depends on the machine; 143 says the ranks stopped there
    assert torchrun.wait(timeout=600) != 0
    out = open(tmp_path / "log").read()
    assert "exitcode  : 143" in out, out[-3000:]
    stopped = re.search(r"SIGTERM during step (\d+).*: checkpoint of step (\d+)", out)
    assert stopped and int(stopped.group(1)) >= 2, out[-3000:]
    saved = int(stopped.group(2))
    assert os.listdir(run_dir / "checkpoints") == [f"step_{saved:06d}"] and not (run_dir / "hf").exists()
    assert [m["step"] for m in map(json.loads, open(run_dir / "metrics.jsonl"))] == list(range(1, saved + 1))

    out, metrics = train(run_dir, *overrides)
    assert f"resumed from {run_dir / 'checkpoints'}/step_{saved:06d} at step {saved}" in out
    assert [m["step"] for m in metrics] == [1, 2, 3, 4] and (run_dir / "hf").exists()


def test_ctrl_c_checkpoints_at_the_next_safe_point_and_a_second_one_aborts(tmp_path):
    """
    Ctrl-C (SIGINT) is a SIGTERM's twin: one line at once, a checkpoint at the next safe point, exit 130,
    no traceback (it used to be a 100-line KeyboardInterrupt traceback and no checkpoint). A second
    Ctrl-C aborts at once, with one line, and leaves the checkpoints as they were.
    """
    run_dir = tmp_path / "run"
    cmd = [sys.executable,
           os.path.join(ROOT, "train.py"),
           *QUICK,
           "rollout.engine=hf",
           "steps=20",
           "train.warm_start_steps=0",
           f"run_dir={run_dir}"]

    def start(name):
        with open(tmp_path / name, "w") as log:
            return procs.start(cmd,
                               stdout=log,
                               stderr=subprocess.STDOUT,
                               cwd=ROOT,
                               env={**os.environ, "OMP_NUM_THREADS": "1"})

    def wait_for(text, proc, name):
        while text not in open(tmp_path / name).read():
            assert proc.poll() is None, open(tmp_path / name).read()[-3000:]
            time.sleep(0.02)

    proc = start("first")
    wait_for("step    1/20", proc, "first")
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=600) == 130
    out = open(tmp_path / "first").read()
    said = "SIGINT: a checkpoint at the next safe point, then stopping (Ctrl-C again to abort)"
    assert said in out, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    stopped = re.search(r"SIGINT during step (\d+).*: checkpoint of step (\d+)", out)
    assert stopped, out[-3000:]
    saved = f"step_{int(stopped.group(2)):06d}"
    assert os.listdir(run_dir / "checkpoints") == [saved]

    proc = start("second")  # resumes from it
    wait_for(f"step {int(stopped.group(2)) + 1:4d}/20", proc, "second")
    proc.send_signal(signal.SIGINT)
    wait_for("Ctrl-C again to abort", proc, "second")
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) == 130
    out = open(tmp_path / "second").read()
    assert "train.py: interrupted" in out and "Traceback" not in out and "during step" not in out, out[-3000:]
    assert os.listdir(run_dir / "checkpoints") == [saved]


def test_a_run_that_trains_nothing_says_so_and_stops(tmp_path):
    """Every reward 0 (tests/zero_reward_task.py): each step says it trained nothing and why, and after
    train.max_idle_steps of them the run stops with one line saying what to do, its checkpoint written."""
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), "--config=tiny", "steps=10", f"run_dir={tmp_path / 'run'}",
           f"data.task={os.path.join(ROOT, 'tests', 'zero_reward_task.py')}", "train.max_idle_steps=2",
           "rollout.prompts_per_step=2", "rollout.max_turns=1", "rollout.max_new_tokens=8", "ppo.mini_batch_size=8"]
    proc = procs.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert len(lines) == 2 and all("TRAINED NOTHING: trajectories left out: 100% in groups of equal rewards" in s for s in lines)
    assert proc.stderr.strip().splitlines()[-1].startswith("train.py: error: 2 steps in a row trained nothing")
    assert "train.warm_start_steps" in proc.stderr and "Traceback" not in proc.stderr
    assert os.listdir(tmp_path / "run" / "checkpoints") == ["step_000002"]
    assert [m["trained"] for m in map(json.loads, open(tmp_path / "run" / "metrics.jsonl"))] == [0.0, 0.0]


def test_an_agent_trains_with_partial_rollouts_and_refill_within_the_staleness_bound_on_two_ranks(tmp_path):
    """
    docs/extending.md's agent written with the openai package (nanoagent/tasks/openai_agent.py), trained
    unchanged through each rank's endpoint and warm-started through it, with rollout.max_staleness=1, extra
    groups in flight and grpo.refill, on 2 ranks, where half the prompts' groups are uniform (a scripted
    reward: tests/half_uniform_agent_task.py). The agents' calls pause and go on under the next step's
    weights; the engine's logprobs are the trainer's on every token of this step's policy (the rows are what
    was sampled); no trained token is more than one step old; every step trains on rollout.prompts_per_step
    groups or its line says the spare prompts ran out. Resumed, it goes on without the groups paused at the
    checkpoint (docs/formulation.md: Partial rollouts) and exports. (Carrying over, deterministically:
    test_env.py, test_flow.py; partial rollouts of a tool task on 2 ranks: test_learning.py.)
    """
    overrides = ["algo=grpo", "rollout.max_staleness=1", "rollout.extra_prompts=4", "train.tis=true",
                 "grpo.refill=true", "grpo.max_refill=2",
                 f"data.task={os.path.join(ROOT, 'tests', 'half_uniform_agent_task.py')}"]
    first, _ = train(tmp_path / "run", "steps=2", *overrides)
    then, metrics = train(tmp_path / "run", "steps=3", *overrides)
    lines = [line for line in (first + then).splitlines() if line.startswith("step ")]
    assert "warm start" in first and [m["step"] for m in metrics] == [1, 2, 3] and len(lines) == 3
    for m, line in zip(metrics, lines):
        assert m["staleness_max"] <= 1 and 0 <= m["staleness"] <= 1, m
        assert m["groups_kept"] >= 4 or "(grpo.max_refill's spare prompts spent)" in line, line
        assert f"| stale {m['staleness']:.2f} carried {m['carried']:.2f} |" in line
        assert m.get("engine_logprob_diff", 0) <= 1e-4 and m["finish/env_error"] == 0, m
    assert sum("engine_logprob_diff" in m for m in metrics) >= 2, metrics  # steps trained
    assert sum(m["refills"] for m in metrics) > 0  # step 1's own prompts hold uniform ones (a seeded order)
    assert metrics[1]["carried"] > 0, metrics  # an agent paused at step 1 went on in step 2
    assert "resumed from" in then and metrics[2]["carried"] == 0 == metrics[2]["staleness"]
    assert os.path.exists(tmp_path / "run" / "hf" / "config.json")


def test_a_start_that_fails_leaves_the_run_folder_as_it_was(tmp_path):
    """resume=never moves a used run_dir aside and writes config.json only once everything is built:
    a start that fails (here: its prompt file is missing) used to leave a <run_dir>.old-* folder per try."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.json").write_text("{}")
    cmd = [sys.executable,
           os.path.join(ROOT, "train.py"),
           "--config=tiny",
           "data.task=gsm8k",
           f"data.train_path={tmp_path}/missing.parquet",
           f"run_dir={run_dir}",
           "resume=never"]
    proc = procs.run(cmd,
                     capture_output=True,
                     text=True,
                     timeout=300,
                     cwd=ROOT,
                     env={**os.environ, "OMP_NUM_THREADS": "1"})
    # one line, as a config error is (it was a 25-line traceback on rank 0)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        f"train.py: error: prompt file '{tmp_path}/missing.parquet' does not exist "
        "(write it with prepare_data.py)"
    ], proc.stderr
    assert sorted(os.listdir(tmp_path)) == ["run"] and os.listdir(run_dir) == ["config.json"]
    assert (run_dir / "config.json").read_text() == "{}"
