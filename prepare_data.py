"""
Write the prompt files RL trains and evaluates on.

    python prepare_data.py --task=hotpotqa --out=data/hotpotqa --train-size=20000 --val-size=500
    python prepare_data.py --task=hotpotqa --source=DIR --out=data/hotpotqa      # local HotpotQA JSON files
    python prepare_data.py --task=synthetic --out=data/synthetic                  # offline multi-hop world

hotpotqa: HotpotQA questions (hub through the datasets library, or the original JSON files in
--source) -> OUT/train.parquet (sampled from HotpotQA's train split) and OUT/val.parquet (sampled
from its dev split), one row per question with the chat prompt, gold answers, type, level and id.
The passages come from the BeIR HotpotQA corpus, indexed by build_index.py --corpus=BeIR/hotpotqa.

synthetic: a deterministic world of made-up entities and relations (nanoagent/synthetic.py) ->
OUT/train.parquet, OUT/val.parquet and OUT/corpus.jsonl, the passages to index.

Sampling is seeded: the same options write byte-identical files.
"""

import argparse
import json
import os
import sys


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", choices=["hotpotqa", "synthetic"], required=True)
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--source", default=None, help="hotpotqa: folder of local HotpotQA JSON files instead of the hub")
    parser.add_argument("--train-size", type=int, default=0, help="sampled training prompts (0: all)")
    parser.add_argument("--val-size", type=int, default=None, help="sampled validation prompts (default: hotpotqa 500, synthetic 100)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (synthetic: also the world): the same seed writes the same files")
    parser.add_argument("--people", type=int, default=200, help="synthetic: people in the world")
    parser.add_argument("--companies", type=int, default=40, help="synthetic: companies")
    parser.add_argument("--cities", type=int, default=50, help="synthetic: cities")
    parser.add_argument("--countries", type=int, default=10, help="synthetic: countries")
    args = parser.parse_args(argv)
    if args.task != "hotpotqa" and args.source:
        parser.error("--source is for --task=hotpotqa")
    if args.val_size is None:
        args.val_size = 500 if args.task == "hotpotqa" else 100
    if args.train_size < 0 or args.val_size < 1:
        parser.error("--train-size must be >= 0 and --val-size >= 1")
    return args


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    from nanoagent.hotpotqa import hotpotqa_row, load_hotpotqa, sample, write_prompts
    os.makedirs(args.out, exist_ok=True)
    if args.task == "hotpotqa":
        train = sample([hotpotqa_row(r) for r in load_hotpotqa("train", args.source)], args.train_size, args.seed, "train")
        val = sample([hotpotqa_row(r) for r in load_hotpotqa("val", args.source)], args.val_size, args.seed, "val")
    else:
        from nanoagent.synthetic import synthetic_task
        train, val, corpus = synthetic_task(args.seed, args.val_size, args.train_size, people=args.people,
                                            companies=args.companies, cities=args.cities, countries=args.countries)
        with open(os.path.join(args.out, "corpus.jsonl"), "w") as f:
            f.writelines(json.dumps(p) + "\n" for p in corpus)
        print(f"wrote {len(corpus)} passages to {os.path.join(args.out, 'corpus.jsonl')}")
    for name, rows in (("train", train), ("val", val)):
        path = write_prompts(rows, os.path.join(args.out, f"{name}.parquet"))
        print(f"wrote {len(rows)} prompts to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
