"""
The advantage estimators side by side on `make demo`'s world, as Agent-R1 compares GRPO, PPO,
REINFORCE and RLOO: each from the same tiny pretrained model, the same warm start and the same RL
budget (the demo preset: 10 steps of 16 prompts x 4 samples), one after another on this machine;
prints held-out greedy EM before and after RL (overall, 1-hop, 2-hop), searches per question and
the median seconds per step. Asserts nothing.

    make demo SEED=0 DEMO=out/demo                               # the world and the pretrained model
    python bench/bench_estimators.py --demo=out/demo --seeds=0   # minutes per estimator on 2 CPU cores

The runs go to DEMO/estimators/<name>-seed<n>; a finished run is read, not run again.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = __file__.rsplit("/bench/", 1)[0]
ESTIMATORS = {  # name: overrides of the demo preset (docs/formulation.md)
    "GRPO": ["algo=grpo"],
    "PPO (token)": ["algo=ppo", "ppo.critic_lr=1e-3"],
    "PPO (step)": ["algo=ppo", "ppo.critic_lr=1e-3", "ppo.credit=step"],
    "StepPO": ["algo=ppo", "ppo.critic_lr=1e-3", "ppo.credit=step", "ppo.ratio=step", "ppo.whiten_over=steps",
               "train.loss_agg=step_mean_token_mean", "rollout.context=last_k", "ppo.gamma=0.99"],
    "REINFORCE++": ["algo=reinforce_plus_plus", "train.kl_mode=reward"],
    "RLOO": ["algo=rloo"],
    "REINFORCE": ["algo=reinforce"],
    "GSPO": ["algo=grpo", "ppo.ratio=sequence", "train.loss_agg=seq_mean_token_mean"],
}


def run(demo, name, seed):
    """The metrics of one estimator's run on the demo's world (run now if it has not finished before)."""
    run_dir = os.path.join(demo, "estimators",
                           f"{name.lower().replace(' ', '').replace('(', '-').replace(')', '')}-seed{seed}")
    if not os.path.exists(os.path.join(run_dir, "hf")):
        cmd = [sys.executable, "train.py", "--config=demo", f"seed={seed}", f"model={demo}/model",
               f"run_dir={run_dir}", f"data.train_path={demo}/data/train.parquet",
               f"data.val_path={demo}/data/val.parquet", f"task.index_dir={demo}/data/index",
               *ESTIMATORS[name]]
        print(" ".join(cmd[1:]), flush=True)
        proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if proc.returncode:
            sys.exit(f"{name}, seed {seed}: train.py exited {proc.returncode}\n{proc.stderr[-3000:]}")
    return [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--demo", default="out/demo", help="the folder make demo wrote (DEMO=...)")
    parser.add_argument("--seeds", default="0", help="comma-separated seeds of the RL runs")
    parser.add_argument("--estimators", default=",".join(list(ESTIMATORS)[:6]),
                        help=f"comma-separated, of: {', '.join(ESTIMATORS)}")
    args = parser.parse_args()
    demo = os.path.abspath(args.demo)
    rows = []
    for name in args.estimators.split(","):
        for seed in map(int, args.seeds.split(",")):
            metrics = run(demo, name, seed)
            evals = [m for m in metrics if "eval/em" in m]
            before, after = evals[0], evals[-1]
            seconds = statistics.median(m["time/step"] for m in metrics if "time/step" in m)
            rows.append(f"| {name} | {seed} | {before['eval/em']:.2f} -> {after['eval/em']:.2f} | "
                        f"{after['eval/1-hop/em']:.2f} / {after['eval/2-hop/em']:.2f} | "
                        f"{after['eval/tool_calls']:.2f} | {seconds:.1f} |")
    print("| estimator | seed | held-out EM before -> after | 1-hop / 2-hop EM after | "
          "searches per question after | s/step (median) |")
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
