"""
Write the prompt files RL trains and evaluates on.

    python prepare_data.py --task=hotpotqa --out=data/hotpotqa --train-size=20000 --val-size=500
    python prepare_data.py --task=synthetic --out=data/synthetic      # offline multi-hop world

hotpotqa: HotpotQA (datasets library or local JSON files) -> train.parquet / val.parquet with the
chat prompt, gold answers, question type/level and id. synthetic: a deterministic world of entities
and relations -> train.parquet, val.parquet and corpus.jsonl.

Status: the options below are final; the writers are not built yet (HotpotQA issue), so the script
says so and exits with status 3.
"""

import argparse
import sys


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", choices=["hotpotqa", "synthetic"], required=True)
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--source", default=None, help="hotpotqa: folder of local HotpotQA JSON files instead of the hub")
    parser.add_argument("--train-size", type=int, default=0, help="sampled training prompts (0: all)")
    parser.add_argument("--val-size", type=int, default=500, help="sampled validation prompts")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed: the same seed writes the same files")
    parser.parse_args(argv)
    print("prepare_data.py: the data writers are not built yet (see the HotpotQA issue); nothing was written.", file=sys.stderr)
    return 3


if __name__ == "__main__":
    sys.exit(main())
