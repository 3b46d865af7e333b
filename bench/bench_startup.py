"""
A run's fixed cost (prints figures; asserts nothing): what every train.py process pays before and
after its steps, which the test suite pays ~50 times.

    python bench/bench_startup.py [--repeats=3]

1. A child process that imports what train.py imports, builds the tiny model and starts the vLLM
   engine, then exits: the seconds of its imports, of the engine's start, and of its exit (from
   its last line to its end, seen by this process), once ending as Python ends (sys.exit: the
   interpreter's teardown) and once as train.py ends (common.exit_now).
2. One-step runs of train.py on the tiny preset (one rank, one thread, a 30-step warm start):
   the whole run's wall time.
Medians of --repeats runs each.
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHILD = """
import sys, time
start = time.perf_counter()
import torch, transformers, vllm
from nanoagent.common import exit_now
from nanoagent.engine import VLLMEngine, stop_token_ids
from nanoagent.tiny import ensure_tiny_model
from transformers import AutoTokenizer
imported = time.perf_counter()
path = ensure_tiny_model(sys.argv[2])
engine = VLLMEngine(path, stop_token_ids(AutoTokenizer.from_pretrained(path)), 1024, \
dtype="float32", compile=False)  # as the CPU presets
print(imported - start, time.perf_counter() - imported, flush=True)
exit_now(0) if sys.argv[1] == "exit_now" else sys.exit(0)
"""


def child(ending, cache):
    """(imports s, engine start s, exit s) of one child process."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    proc = subprocess.Popen([sys.executable, "-c", CHILD, ending, cache], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env=env)
    imports, engine = map(float, proc.stdout.readline().split())
    printed = time.perf_counter()
    proc.wait()
    return imports, engine, time.perf_counter() - printed


def one_step_run(cache, run_dir):
    cmd = [sys.executable, "train.py", "--config=tiny", "steps=1", "algo=grpo", "train.warm_start_steps=30",
           "rollout.prompts_per_step=4", "rollout.max_turns=2", "ppo.mini_batch_size=8", "task.num_val=8",
           f"run_dir={run_dir}", "resume=never"]
    start = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   env={**os.environ, "OMP_NUM_THREADS": "1", "NANOAGENT_CACHE": cache})
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        child("exit_now", tmp)  # builds the tiny model into the cache once
        for ending in ("sys.exit", "exit_now"):
            runs = [child(ending, tmp) for _ in range(args.repeats)]
            imports, engine, exit_s = (statistics.median(column) for column in zip(*runs))
            print(f"child ending with {ending:8s}: imports {imports:.2f} s | "
                  f"vLLM engine start {engine:.2f} s | exit {exit_s:.2f} s")
        runs = [one_step_run(tmp, os.path.join(tmp, "run")) for _ in range(args.repeats)]
        print(f"train.py, one step, one rank: {statistics.median(runs):.1f} s (median of {args.repeats})")


if __name__ == "__main__":
    main()
