"""
Partial rollouts against waiting for the slowest trajectory (prints figures; asserts nothing).

    python bench/bench_partial.py [--steps 10]

The workload is bench/longtail_task.py: most prompts' episodes last 1-2 turns, one in ten 8-10, and
every environment step takes 0-500 ms; GRPO on the tiny model with the real vLLM CPU engine.
1. The tail: one step's rollout (rollout.prompts_per_step x group_size trajectories) run to its end by
   nanoagent's loop (agent.Rollouts): the share of its wall time during which fewer than half of the
   trajectories are still running, and the engine's batch (requests in it) in each tenth of that time.
2. train.py's steps on that workload at the same batch, with rollout.max_staleness=0 (every step waits
   for its last trajectory) and =1 (rollout.extra_prompts = half of prompts_per_step, train.tis on in
   both): the median time of a step and of its rollout over the steps after the first, and the ratio.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from transformers import AutoTokenizer  # noqa: E402

from nanoagent.agent import Rollouts  # noqa: E402
from nanoagent.config import make_config  # noqa: E402
from nanoagent.engine import SamplingConfig, make_engine  # noqa: E402
from nanoagent.hub import resolve_model  # noqa: E402
from nanoagent.tasks import load_task, task_data  # noqa: E402

TASK = os.path.join(ROOT, "bench", "longtail_task.py")
BATCH = ["--config=tiny", f"data.task={TASK}", "algo=grpo", "rollout.prompts_per_step=16",
         "rollout.group_size=4", "rollout.max_turns=10", "rollout.max_new_tokens=16",
         "ppo.mini_batch_size=64", "train.tis=true"]
PARTIAL = ["rollout.max_staleness=1", "rollout.extra_prompts=8"]


def tail(cfg):
    """One step's rollout to its end: (wall seconds, the share of it with fewer than half the trajectories
    running, the engine's mean batch in each tenth of it)."""
    model_path = resolve_model(cfg.model, "bench_partial.py")
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    r = cfg.rollout
    engine = make_engine("vllm", model_path, tokenizer, r.max_context_tokens, r.dtype, compile=False)
    task = load_task(cfg.data.task)
    train_rows, _, env = task_data(task, cfg, tokenizer)
    rollouts = Rollouts(engine, env, SamplingConfig(r.max_new_tokens, r.temperature), r.max_turns,
                        r.max_context_tokens)
    rollouts.start(train_rows[:8], seed=0)  # a warm-up
    rollouts.run()
    prompts = train_rows[8:8 + r.prompts_per_step]
    trajs = rollouts.start([p for p in prompts for _ in range(r.group_size)], seed=1)
    timeline = [(time.perf_counter(), len(trajs), 0)]  # (time, trajectories running, requests in the engine)

    def record():
        running = sum(t.finish_reason is None for t in trajs)
        timeline.append((time.perf_counter(), running, len(rollouts.generating)))
        return False

    rollouts.run(record)
    start, end = timeline[0][0], timeline[-1][0]
    few = sum(b[0] - a[0] for a, b in zip(timeline, timeline[1:]) if a[1] < len(trajs) / 2)
    tenths = []
    for k in range(10):
        lo, hi = start + k * (end - start) / 10, start + (k + 1) * (end - start) / 10
        spans = [(min(b[0], hi) - max(a[0], lo), a[2]) for a, b in zip(timeline, timeline[1:])
                 if b[0] > lo and a[0] < hi]
        tenths.append(sum(s * n for s, n in spans) / max(sum(s for s, _ in spans), 1e-9))
    return end - start, few / (end - start), tenths


def train_steps(overrides, steps, run_dir):
    """Run train.py; the median step and rollout times (s) over the steps after the first, and the metrics."""
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), *BATCH, *overrides, f"steps={steps}",
           "resume=never", f"run_dir={run_dir}"]
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")})
    metrics = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))][1:]
    median = lambda key: statistics.median(m[key] for m in metrics)  # noqa: E731
    return median("time/step"), median("time/rollout"), metrics


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    cfg = make_config(None, BATCH[1:])
    seconds, few, tenths = tail(cfg)
    print(f"1. the tail: {cfg.rollout.prompts_per_step} x {cfg.rollout.group_size} trajectories in "
          f"{seconds:.1f}s; fewer than half running for {few:.0%} of it")
    print("   engine batch by tenth of the rollout: " + " ".join(f"{n:.1f}" for n in tenths))
    print(f"2. train.py, {args.steps} steps each (medians over steps 2..{args.steps}):")
    with tempfile.TemporaryDirectory() as tmp:
        whole, whole_rollout, _ = train_steps([], args.steps, os.path.join(tmp, "whole"))
        partial, partial_rollout, metrics = train_steps(PARTIAL, args.steps, os.path.join(tmp, "partial"))
    print(f"   max_staleness=0: {whole:.2f} s/step (rollout {whole_rollout:.2f} s)")
    print(f"   max_staleness=1: {partial:.2f} s/step (rollout {partial_rollout:.2f} s); staleness "
          f"{statistics.mean(m['staleness'] for m in metrics):.2f} mean, "
          f"carried {statistics.mean(m['carried'] for m in metrics):.0%} of trajectories")
    print(f"   steps per second, max_staleness=1 over 0: {whole / partial:.2f}x")


if __name__ == "__main__":
    main()
