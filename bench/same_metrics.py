"""
Does a refactor train the same? Runs short tiny-preset runs from a git revision (checked out in a
temporary worktree) and from this working tree, one after the other, and prints every metric of their
metrics.jsonl that differs, timings aside. Four runs, one path of train.py each: GRPO and PPO over two
mini-batches, GRPO exactly on-policy (the update's own forward gives the old logprobs) with k3 in the
loss, and PPO with step credit and k1 in the reward.

    python bench/same_metrics.py --before 2ea887c            # ~15 minutes on 2 cores
    python bench/same_metrics.py --before HEAD --runs grpo    # one run

engine_logprob_diff is vLLM's and moves with how it batches requests (1e-6 from run to run of the same
code); the exactly on-policy run's trainer figures move in the 7th digit from run to run of the same
code on the CPU too, so run --before HEAD to see that spread before reading a difference as a change.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMON = ["--config=tiny", "steps=4", "eval.every=2", "resume=never", "train.warm_start_steps=40",
          "train.warm_start_lr=1e-3", "rollout.prompts_per_step=16", "reward.format_weight=0.5"]
RUNS = {
    "grpo": ["algo=grpo", "ppo.mini_batch_size=32"],
    "ppo": ["algo=ppo", "ppo.mini_batch_size=32"],
    "grpo_on_policy": ["algo=grpo", "ppo.mini_batch_size=64", "train.kl_mode=loss"],
    "ppo_step_kl": ["algo=ppo", "ppo.credit=step", "ppo.mini_batch_size=32", "train.kl_mode=reward"],
}


def run(code_dir, overrides, run_dir):
    """The run's metrics.jsonl rows, from train.py in code_dir."""
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    cmd = [sys.executable, "train.py", *COMMON, *overrides, f"run_dir={run_dir}"]
    proc = subprocess.run(cmd, cwd=code_dir, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{code_dir}: {' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def differences(before, after):
    """(step, key, before, after) for each metric that differs, timings aside."""
    out = [("rows", "", len(before), len(after))] if len(before) != len(after) else []
    for b, a in zip(before, after):
        for key in sorted(set(b) | set(a)):
            timing = key.startswith("time/") or key.endswith("_per_s")
            if not timing and b.get(key) != a.get(key):
                out.append((b.get("step"), key, b.get(key), a.get(key)))
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, help="git revision to compare this working tree with")
    parser.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated, of {', '.join(RUNS)}")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        worktree = os.path.join(tmp, "before")
        subprocess.run(["git", "worktree", "add", "--detach", worktree, args.before], cwd=ROOT, check=True,
                       capture_output=True)
        try:
            for name in args.runs.split(","):
                rows = {side: run(code_dir, RUNS[name], os.path.join(tmp, f"{side}-{name}"))
                        for side, code_dir in (("before", worktree), ("after", ROOT))}
                diff = differences(rows["before"], rows["after"])
                print(f"{name}: {len(rows['after'])} rows, {len(diff)} differences")
                for step, key, b, a in diff:
                    print(f"  step {step} {key}: {b} -> {a}")
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", worktree], cwd=ROOT, capture_output=True)


if __name__ == "__main__":
    main()
