"""
Prompts: the files they live in, the check that a run can train on them, and the order a run
takes them in. One row per task instance: `id`, `messages` (the chat prompt, a list of
{role, content}; stored as JSON text in parquet) and `answers` (gold answers, may be empty).
Both parquet (what prepare_data.py writes) and JSONL are read.
"""

import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from nanoagent.common import print0

REQUIRED = ("id", "messages")


def load_prompts(path, limit=0):
    """Rows as dicts with messages decoded; a missing file or column is refused with the path."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"prompt file {path!r} does not exist (write it with prepare_data.py)")
    if path.endswith(".parquet"):
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


def write_prompts(out, splits):
    """{split: rows} -> OUT/<split>.parquet (messages as JSON text), which load_prompts reads back.
    The same rows give the same bytes."""
    for split, rows in splits.items():
        path = os.path.join(out, f"{split}.parquet")
        pq.write_table(pa.Table.from_pylist([{**r, "messages": json.dumps(r["messages"])} for r in rows]), path)
        print(f"wrote {len(rows)} prompts to {path}")


def step_prompts(rows, step, per_rank, rank, world, seed, shuffle):
    """The prompts of one training step for one rank: a deterministic function of the step (the
    data position is step x prompts per step, so a resumed run continues where it stopped), in an
    order drawn anew every epoch: one permutation per epoch, not per prompt (100k rows: ~2 ms)."""
    start = (step * world + rank) * per_rank
    epochs, indices = np.divmod(np.arange(start, start + per_rank), len(rows))
    orders = {e: np.random.default_rng([seed, e]).permutation(len(rows)) if shuffle else np.arange(len(rows)) for e in set(epochs.tolist())}
    return [rows[orders[e][i]] for e, i in zip(epochs.tolist(), indices.tolist())]
