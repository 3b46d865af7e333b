"""
The step's metrics (nanoagent/metrics.py) over 2 gloo ranks under torchrun: a metric says only what
was measured. When DAPO leaves every trajectory of a step out, no engine logprob was compared with
the trainer's, and engine_logprob_diff must not read as a perfect 0; rank_imbalance compares the
ranks' trainer tokens.
"""

import json
import os
import sys

import pytest

import procs

pytestmark = pytest.mark.slow
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
                   rollout_logprobs=[-1.0, -2.0], turn_spans=[(0, 2)], finish_reason="done")
    mask = torch.tensor([[0.0, 0.0, 1.0, 1.0]]) * trained
    batch = {"action_mask": mask, "rollout_logprobs": torch.tensor([[0.0, 0.0, -1.0, -2.0]]), "lengths": [4],
             "prompt": torch.tensor([0]), "prompt_length": torch.tensor([2]),
             "nucleus_logprobs": torch.tensor([[0.0, 0.0, -1.0 - 0.1 * (rank + 1), -2.0]]) * mask}
    metrics = step_metrics(0, [t], {"dropped_uniform": 1 - trained, "dropped_overlong": 0, "dropped_env_error": 0}, batch, [], [], None, [0.0, 1.0, 2.0, 3.0, 4.0])
    if rank == 0:
        print(json.dumps(metrics))
dist.destroy_process_group()
"""


CASES = [([1, 1], 0.2), ([1, 0], 0.1), ([0, 1], 0.2), ([0, 0], None)]  # (which ranks train, engine_logprob_diff)
IMBALANCE = {2: 1.0, 1: 2.0, 0: 0.0}  # trained trajectories -> the busiest rank's trainer tokens over the mean rank's


def test_engine_logprob_diff_only_where_a_rank_compared(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={procs.free_port()}", str(script),
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
