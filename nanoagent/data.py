"""
Prompt files. One row per task instance: `id`, `messages` (the chat prompt, a list of
{role, content}; stored as JSON text in parquet) and `answers` (gold answers, may be empty).
Both parquet (what prepare_data.py writes) and JSONL are read.
"""

import json
import os
import random

from nanoagent.common import print0

REQUIRED = ("id", "messages")


def load_prompts(path, limit=0):
    """Rows as dicts with messages decoded; a missing file or column is refused with the path."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"prompt file {path!r} does not exist (write it with prepare_data.py)")
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq
        rows = pq.read_table(path).to_pylist()
    elif path.endswith(".jsonl"):
        with open(path) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    else:
        raise ValueError(f"prompt file {path!r}: expected .parquet or .jsonl")
    for i, row in enumerate(rows):
        missing = [c for c in REQUIRED if c not in row]
        if missing:
            raise ValueError(f"{path}: row {i} lacks column(s) {', '.join(missing)}; each row needs {', '.join(REQUIRED)}")
        if isinstance(row["messages"], str):
            row["messages"] = json.loads(row["messages"])
        row["answers"] = list(row.get("answers") or [])
    return rows[:limit] if limit else rows


def fit_prompts(rows, lengths, max_tokens, bad_prompts, source):
    """
    The rows a run can train on: prompts of at most max_tokens tokens (lengths: each row's prompt,
    chat template and tool schemas included). Longer ones are refused with their count and first
    ids (bad_prompts="refuse"), or dropped and counted ("drop"). Every rank checks the same rows
    when the data is loaded, before any collective, so no rank fails alone mid-run while the
    others wait for it.
    """
    over = [row["id"] for row, n in zip(rows, lengths) if n > max_tokens]
    if over and bad_prompts == "refuse":
        raise ValueError(f"{source}: {len(over)} of {len(rows)} prompts are longer than data.max_prompt_tokens={max_tokens} "
                         f"(first: {', '.join(map(str, over[:3]))}); raise data.max_prompt_tokens or set data.bad_prompts=drop")
    kept = [row for row, n in zip(rows, lengths) if n <= max_tokens]
    if over:
        print0(f"{source}: dropped {len(over)} of {len(rows)} prompts longer than data.max_prompt_tokens={max_tokens} "
               f"(first: {', '.join(map(str, over[:3]))})")
    if not kept:
        raise ValueError(f"{source}: no prompts to train on")
    return kept


# -----------------------------------------------------------------------------
# arithmetic: an offline task whose answer needs a tool (the tiny preset, the warm start)

ARITHMETIC_SYSTEM = "Use the calculator, then give the final answer as <answer>number</answer>."
ARITHMETIC_PHRASINGS = ("What is {a} * {b}?", "Compute {a} * {b}.")  # the numbers at the same place from the end


def arithmetic_pairs(seed, split):
    """The operand pairs of a split: a, b in 3..9 (products of two digits, which a tiny model
    cannot compute but the calculator can), with a quarter of the 49 pairs held out for "val" so
    held-out questions are ones the model never trained on."""
    pairs = [(a, b) for a in range(3, 10) for b in range(3, 10)]
    random.Random(f"arithmetic-{seed}").shuffle(pairs)
    held_out = len(pairs) // 4
    return pairs[:held_out] if split == "val" else pairs[held_out:]


def arithmetic_task(n, seed=0, split="train"):
    """n prompts "multiply two numbers": reward needs the calculator, called with the question's
    numbers, and copying its result. Deterministic in (seed, split)."""
    pairs = arithmetic_pairs(seed, split)
    rng = random.Random(f"arithmetic-{seed}-{split}")
    rows = []
    for i in range(n):
        a, b = pairs[rng.randrange(len(pairs))]
        phrasing = i % len(ARITHMETIC_PHRASINGS)
        question = ARITHMETIC_PHRASINGS[phrasing].format(a=a, b=b)
        rows.append({"id": f"{split}-{i}", "answers": [str(a * b)], "a": a, "b": b, "phrasing": phrasing,
                     "messages": [{"role": "system", "content": ARITHMETIC_SYSTEM}, {"role": "user", "content": question}]})
    return rows


def arithmetic_demonstration(row, rng):
    """
    Scripted assistant turns for a warm start by imitation, deliberately imperfect so RL has room:
    the demonstrator uses the calculator on 60% of the first phrasing and 20% of the second, and
    otherwise guesses without a tool: a + b, never the product for a, b >= 3. Imitation leaves a
    greedy policy that often guesses; RL has to learn that the calculator pays on both phrasings.
    """
    use_tool = rng.random() < (0.6 if row["phrasing"] == 0 else 0.2)
    if not use_tool:
        return [f"<answer>{row['a'] + row['b']}</answer>"]
    call = json.dumps({"name": "calculator", "arguments": {"expression": f"{row['a']} * {row['b']}"}})
    return [f"<tool_call>\n{call}\n</tool_call>", f"<answer>{row['a'] * row['b']}</answer>"]
