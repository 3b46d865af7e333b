"""
Prompt files. One row per task instance: `id`, `messages` (the chat prompt, a list of
{role, content}; stored as JSON text in parquet) and `answers` (gold answers, may be empty).
Both parquet (what prepare_data.py writes) and JSONL are read.
"""

import json
import os

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


def write_prompts(rows, path):
    """Write rows (dicts with id, messages, answers, ...) as parquet, messages as JSON text."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    table = pa.Table.from_pylist([{**r, "messages": json.dumps(r["messages"])} for r in rows])
    pq.write_table(table, path)
