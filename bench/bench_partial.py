"""
Partial rollouts against waiting for the slowest trajectory (prints figures; asserts nothing).

    python bench/bench_partial.py [--steps 20] [--repeats 2]
    python bench/bench_partial.py --config=demo model=out/demo/run/hf train.warm_start_steps=0

The workload is bench/longtail_task.py: most prompts' episodes last 1-2 turns, one in ten 8-10, and
every environment step takes 0-500 ms; GRPO on the tiny model with the real vLLM CPU engine. Or a
preset with overrides (the search demo's world with the model make demo trained, TextWorld's).
1. The tail: the rollouts of train.py's first three steps (rollout.prompts_per_step x group_size
   trajectories each) run to their end by nanoagent's loop (agent.Rollouts): the share of the wall time
   during which fewer than half of the trajectories are still running, and the engine's batch (requests
   in it) in each tenth of that time.
2. train.py's steps on that workload at the same batch, with rollout.max_staleness=0 (every step waits
   for its last trajectory) and =1 (rollout.extra_prompts = half of rollout.prompts_per_step; train.tis
   on in both), the runs in turn: the median time of a step and of its rollout over the steps after the
   first of all runs of each, and the ratio of the medians (a step's time depends on how many long
   episodes it draws and how long their environment steps take, so take many steps).
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
from nanoagent.data import step_prompts  # noqa: E402
from nanoagent.engine import SamplingConfig, make_engine  # noqa: E402
from nanoagent.hub import resolve_model  # noqa: E402
from nanoagent.tasks import load_task, task_data  # noqa: E402

TASK = os.path.join(ROOT, "bench", "longtail_task.py")
LONG_TAIL = [f"data.task={TASK}", "algo=grpo", "rollout.prompts_per_step=16", "rollout.group_size=4",
             "rollout.max_turns=10", "rollout.max_new_tokens=16", "ppo.mini_batch_size=64"]


def tails(cfg, steps):
    """The rollouts of train.py's first `steps` steps, each to its end: [(wall seconds, the share of it with
    fewer than half the trajectories running, the engine's mean batch in each tenth of it)]."""
    model_path = resolve_model(cfg.model, "bench_partial.py")
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    r = cfg.rollout
    engine = make_engine("vllm", model_path, tokenizer, r.max_context_tokens, r.dtype, compile=False)
    train_rows, _, env = task_data(load_task(cfg.data.task), cfg, tokenizer)
    rollouts = Rollouts(engine, env, SamplingConfig(r.max_new_tokens, r.temperature), r.max_turns,
                        r.max_context_tokens)
    rollouts.start(train_rows[:8], seed=0)  # a warm-up
    rollouts.run()
    results = []
    for step in range(steps):
        prompts = step_prompts(train_rows, step, r.prompts_per_step, 0, 1, cfg.seed, cfg.data.shuffle)
        trajs = rollouts.start([p for p in prompts for _ in range(r.group_size)], seed=step + 1)
        timeline = [(time.perf_counter(), len(trajs), 0)]  # (time, trajectories running, engine requests)

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
        results.append((end - start, few / (end - start), tenths))
    return results


def train_steps(preset, overrides, steps, run_dir):
    """Run train.py; the metrics of its steps after the first."""
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), f"--config={preset}", *overrides, f"steps={steps}",
           "eval.every=0", "resume=never", f"run_dir={run_dir}"]
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")})
    return [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))][1:]


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=2, choices=range(1, 100), metavar="N")
    parser.add_argument("--config", default=None, help="a preset (default: tiny on the long-tailed workload)")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_args()
    preset = args.config or "tiny"
    overrides = [*([] if args.config else LONG_TAIL), *args.overrides, "train.tis=true"]
    cfg = make_config(preset, overrides)
    partial = ["rollout.max_staleness=1", f"rollout.extra_prompts={cfg.rollout.prompts_per_step // 2}"]
    print(f"1. the tail: steps 1-3's rollouts of {cfg.rollout.prompts_per_step} x {cfg.rollout.group_size} "
          "trajectories to their end")
    for seconds, few, tenths in tails(cfg, 3):
        print(f"   {seconds:.1f}s, fewer than half running for {few:.0%} of it; engine batch by tenth: "
              + " ".join(f"{n:.0f}" for n in tenths))
    print(f"2. train.py, {args.repeats} runs of {args.steps} steps each (medians over steps 2..{args.steps} "
          "of all runs):")
    runs = {"max_staleness=0": [], "max_staleness=1": []}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for name, more in [("max_staleness=0", []), ("max_staleness=1", partial)]:
                run_dir = os.path.join(tmp, f"{name}-{repeat}")
                runs[name] += train_steps(preset, overrides + more, args.steps, run_dir)
    step = {}
    for name, metrics in runs.items():
        median = lambda key: statistics.median(m[key] for m in metrics)  # noqa: E731
        mean = lambda key: statistics.mean(m[key] for m in metrics)  # noqa: E731
        step[name] = median("time/step")
        print(f"   {name}: {step[name]:.2f} s/step (rollout {median('time/rollout'):.2f} s, "
              f"{median('groups_kept'):.0f} groups trained); staleness {mean('staleness'):.2f} mean, "
              f"carried {mean('carried'):.0%} of trajectories")
    ratio = step["max_staleness=0"] / step["max_staleness=1"]
    print(f"   steps per second, max_staleness=1 over 0: {ratio:.2f}x")


if __name__ == "__main__":
    main()
