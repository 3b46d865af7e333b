"""
The data path of a training step and of start-up (prints figures; asserts nothing).

    python bench/bench_data.py

1. step_prompts at HotpotQA's size (100k rows, 128 prompts per step, 8 ranks): median time per
   call, against the implementation it replaced (the whole prompt list rebuilt and reshuffled
   once per prompt), run here as the baseline.
2. Prompt lengths at load time (ChatEnv.prompt_lengths: chat template + tool schema + one batched
   encode) for HotpotQA-like prompts with the tiny tokenizer: time per 1,000 rows.
"""

import os
import random
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bench.timing import median_time  # noqa: E402
from nanoagent.data import step_prompts  # noqa: E402
from nanoagent.env import tool_env  # noqa: E402
from nanoagent.tasks.hotpotqa import qa_row  # noqa: E402
from nanoagent.tiny import ensure_tiny_model  # noqa: E402
from nanoagent.tools import search_tool  # noqa: E402


def step_prompts_before(rows, step, per_rank, rank, world, seed, shuffle):
    """The replaced implementation, verbatim in its logic: one reshuffle of the whole list per prompt."""
    per_step = per_rank * world
    out = []
    for k in range(step * per_step, (step + 1) * per_step):
        epoch, i = divmod(k, len(rows))
        order = list(range(len(rows)))
        if shuffle:
            random.Random(f"{seed}-{epoch}").shuffle(order)
        out.append(rows[order[i]])
    return out[rank * per_rank:(rank + 1) * per_rank]


def main():
    rows = [{"id": i} for i in range(100_000)]
    per_rank, world = 16, 8
    steps = iter(range(10**6))
    now = median_time(lambda: step_prompts(rows, next(steps), per_rank, 3, world, 0, True), repeats=20)
    before = median_time(lambda: step_prompts_before(rows, next(steps), per_rank, 3, world, 0, True),
                         repeats=3)
    print(f"step_prompts, {len(rows):,} rows, {per_rank} prompts per rank x {world} ranks: "
          f"{now * 1e3:.2f} ms per step (before: {before:.2f} s; {before / now:,.0f}x)")

    from transformers import AutoTokenizer
    env = tool_env([search_tool(None)], AutoTokenizer.from_pretrained(ensure_tiny_model()))
    questions = [qa_row(str(i),
                        f"Which city was the director of the film number {i} born in, and in which year?",
                        ["x"], "bridge", "easy", [])
                 for i in range(5000)]
    start = time.perf_counter()
    lengths = env.prompt_lengths([q["messages"] for q in questions])
    seconds = time.perf_counter() - start
    print(f"prompt lengths at load time: {seconds / len(questions) * 1e6:.0f} ms per 1,000 prompts "
          f"of ~{lengths[0]} tokens (90k HotpotQA rows: {seconds / len(questions) * 90_000:.0f} s "
          f"on this machine)")


if __name__ == "__main__":
    main()
