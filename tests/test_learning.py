"""
Does it learn? On the offline arithmetic task the agent is rewarded only when it calls the
calculator with the question's numbers and copies the result into its answer. A tiny random model
cannot find the tool-call format alone, so it is first warm-started by imitating scripted
demonstrations through the trainer's own forward, mask and loss code. The demonstrations leave
room: on one of the two question phrasings they mostly guess without the tool (and are wrong), so
the warm-started greedy policy answers those questions wrong. Then GRPO, PPO and PPO with
step-level credit (ppo.credit=step), each from the same warm-started export, must raise the
held-out greedy reward by >= 0.2 absolute.
"""

import json
import os
import sys

import pytest

import procs

pytestmark = pytest.mark.slow
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WARM_START = ["train.warm_start_steps=400", "train.warm_start_lr=3e-3"]
RL = ["steps=16", "eval.every=8", "train.lr=3e-4", "ppo.critic_lr=1e-3"]


def train(run_dir, *overrides):
    cmd = [sys.executable, "train.py", "--config=tiny", f"run_dir={run_dir}", "resume=never", *overrides]
    proc = procs.run(cmd, capture_output=True, text=True, timeout=1500, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]


def test_ppo_and_grpo_improve_on_the_warm_start(tmp_path):
    warm = train(tmp_path / "warm", "steps=0", "eval.every=1", *WARM_START)
    start = warm[0]["eval/reward"]
    assert start <= 0.7, f"the warm start leaves too little room for RL (held-out reward {start:.2f})"
    export = str(tmp_path / "warm" / "hf")
    curves = {}
    for algo, credit in (("grpo", "token"), ("ppo", "token"), ("ppo", "step")):
        name = algo if credit == "token" else f"{algo}-{credit}"
        metrics = train(tmp_path / name, f"model={export}", f"algo={algo}", f"ppo.credit={credit}", *RL)
        evals = [(m["step"], m["eval/reward"]) for m in metrics if "eval/reward" in m]
        steps = [m for m in metrics if "time/step" in m]
        curves[name] = {"train_reward": [round(m["reward"], 3) for m in steps], "eval_reward": evals,
                        "dropped_uniform": [round(m["dropped_uniform"], 3) for m in steps]}
        assert evals[0] == (0, pytest.approx(start, abs=1e-6))  # RL starts where the warm start ended
    print(json.dumps(curves))
    for algo, curve in curves.items():
        end = curve["eval_reward"][-1][1]
        assert end >= start + 0.2, f"{algo}: held-out greedy reward {start:.2f} -> {end:.2f}"
