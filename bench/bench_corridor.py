"""
The corridor (nanoagent/tasks/corridor.py), where what a turn sees decides the outcome: held-out
success with the full history (cut at the context budget), last_k and summary, after the same
training, on several seeds (prints a table; asserts nothing).

    python bench/bench_corridor.py [--out out/bench-corridor] [--seeds 0 1] [--contexts full last_k summary]

Once: the corridor's prompt files and texts (prepare_data.py --task=corridor), and a tiny model whose
tokenizer knows its words, pretrained to copy a word read a while ago (python -m nanoagent.tiny
--pretrain copies.jsonl 1500: what a real model brings). Then for each seed and context, the same
training: `train.py --config=corridor seed=S rollout.context=C` (a warm start by imitation of the
demonstrator under that context, then GRPO), and its greedy evaluation on the held-out corridors
after the warm start and after RL, read from the run's metrics.jsonl.
"""

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(cmd):
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="out/bench-corridor")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--contexts", nargs="+", default=["full", "last_k", "summary"])
    parser.add_argument("overrides", nargs="*", help="train.py overrides for every run")
    args = parser.parse_args()
    data, model = os.path.join(args.out, "data"), os.path.join(args.out, "model")
    if not os.path.exists(os.path.join(model, "config.json")):
        run([sys.executable, "prepare_data.py", "--task=corridor", f"--out={data}"])
        run([sys.executable, "-m", "nanoagent.tiny", f"--out={model}", f"--text={data}/texts.jsonl",
             "--pretrain", f"{data}/copies.jsonl", "1500"])
    results = {}
    for seed in args.seeds:
        for context in args.contexts:
            run_dir = os.path.join(args.out, f"{context}-seed{seed}")
            start = time.perf_counter()
            if not os.path.exists(os.path.join(run_dir, "hf")):  # not run to its end yet
                run([sys.executable, "train.py", "--config=corridor", f"seed={seed}", f"model={model}",
                     f"run_dir={run_dir}", f"data.train_path={data}/train.parquet",
                     f"data.val_path={data}/val.parquet", f"rollout.context={context}", *args.overrides])
            metrics = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
            evals = [m for m in metrics if "eval/won" in m]
            results[seed, context] = (evals[0]["eval/won"], evals[-1]["eval/won"], evals[-1]["eval/door"],
                                      time.perf_counter() - start)
    print("\nheld-out corridors won (greedy): after the warm start -> after RL; reached the door; wall time")
    print(f"{'context':10s}" + "".join(f" | seed {s:<28d}" for s in args.seeds))
    for context in args.contexts:
        cells = [results[s, context] for s in args.seeds]
        print(f"{context:10s}" + "".join(f" | {w0:.2f} -> {w1:.2f}, door {d:.2f}, {t / 60:4.1f} min"
                                         for w0, w1, d, t in cells))


if __name__ == "__main__":
    main()
