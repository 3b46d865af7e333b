"""
Talk to a trained agent in the terminal and watch its reasoning, tool calls and tool results.

    python chat.py --model out/run/hf --index data/hotpotqa/index
    python chat.py --model out/run/hf --question "Who directed the film ...?"   # answer once, exit

Status: the options below are final; the chat loop needs the rollout engine and tools, which are
not built yet, so the script says so and exits with status 3.
"""

import argparse
import sys


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="exported checkpoint folder or hub id")
    parser.add_argument("--index", default=None, help="search index folder from build_index.py (enables the search tool)")
    parser.add_argument("--question", default=None, help="answer this one question and exit")
    parser.add_argument("--engine", choices=["vllm", "hf"], default="vllm", help="generation engine")
    parser.add_argument("--max-turns", type=int, default=6, help="tool-using turns per answer")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.parse_args(argv)
    print("chat.py: the chat loop is not built yet (it needs the rollout engine and tools); nothing was run.", file=sys.stderr)
    return 3


if __name__ == "__main__":
    sys.exit(main())
