"""
Write the prompt files RL trains and evaluates on: the task's prepare() (nanoagent/tasks/).

    python prepare_data.py --task=hotpotqa --out=data/hotpotqa --train-size=20000 --val-size=500
    python prepare_data.py --task=hotpotqa --source=DIR --out=data/hotpotqa      # local HotpotQA JSON files
    python prepare_data.py --task=synthetic --out=data/synthetic                  # offline multi-hop world
    python prepare_data.py --task=gsm8k --out=data/gsm8k
    python prepare_data.py --task=path/to/my_task.py --out=data/mine

hotpotqa: HotpotQA questions (hub through the datasets library, or the original JSON files in
--source) -> OUT/train.parquet (sampled from HotpotQA's train split) and OUT/val.parquet (sampled
from its dev split). The passages come from the BeIR HotpotQA corpus, indexed by
build_index.py --corpus=BeIR/hotpotqa.

synthetic: a deterministic world of made-up entities and relations -> OUT/train.parquet,
OUT/val.parquet and OUT/corpus.jsonl, the passages to index.

gsm8k: GSM8K's math word problems (openai/gsm8k from the hub, or train.jsonl and test.jsonl in
--source) -> OUT/train.parquet (sampled from the train split) and OUT/val.parquet (from the test
split, all 1319 problems by default), for a calculator-using agent.

Sampling is seeded: the same options write byte-identical files.
"""

import argparse
import os
import shutil
import sys

from nanoagent.tasks import load_task, task_names


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", required=True,
                        help=f"a task in nanoagent/tasks/ ({', '.join(task_names())}) "
                             "or a path to a task file")
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--source", default=None,
                        help="where the task's raw data is, instead of the hub (hotpotqa: a folder of JSON "
                             "files; gsm8k: of JSONL files)")
    parser.add_argument("--train-size", type=int, default=0, help="sampled training prompts (0: all)")
    parser.add_argument("--val-size", type=int, default=None,
                        help="sampled validation prompts (default: the task's)")
    parser.add_argument("--seed", type=int, default=0,
                        help="sampling seed: the same seed writes the same files")
    args = parser.parse_args(argv)
    if args.train_size < 0 or (args.val_size is not None and args.val_size < 1):
        parser.error("--train-size must be >= 0 and --val-size >= 1")
    return args


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    made = not os.path.exists(args.out)  # a folder this run makes goes again if the run fails
    try:
        task = load_task(args.task)
        if task.prepare is None:
            raise ValueError(f"task {args.task!r} makes its prompts on the spot: there is nothing to prepare")
        os.makedirs(args.out, exist_ok=True)
        task.prepare(args.out, args.train_size, args.val_size, args.seed, args.source)
    except (OSError, ValueError) as e:
        if made:
            shutil.rmtree(args.out, ignore_errors=True)
        offline = isinstance(e, ConnectionError) and args.source is None  # the hub, offline or out of reach
        sys.exit(f"prepare_data.py: {e}" + ("; without the hub, pass --source=DIR, a folder of the task's "
                                            "raw files (see --help)" if offline else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
