"""
Prompts: the files they live in, the check that a run can train on them, and the order a run
takes them in. One row per task instance: `id`, `messages` (the chat prompt, a list of
{role, content}; stored as JSON text in parquet) and `answers` (gold answers, may be empty).
Both parquet (what prepare_data.py writes) and JSONL are read. A row that cannot be trained on
(check_prompts) is found when the file is loaded, not when its step comes: the data order is a
function of the step, so a row that crashed a step mid-run would crash every resume there again.
A file that a row names by a path relative to its prompt file's folder (FILE_FIELDS: a TextWorld
game) is found there whichever code read the rows (a run's train or val file, rollout.py --data)
and wherever the folder was moved: load_prompts makes the path absolute.
"""

import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from nanoagent.common import print0
from nanoagent.keys import ConfigError

ROLES = ("system", "user", "assistant", "tool")
# row fields that name a file relative to the prompt file's folder (nanoagent/tasks/textworld.py)
FILE_FIELDS = ("game",)


def load_prompts(path, limit=0, bad_prompts="refuse"):
    """
    The rows of a prompt file, messages decoded and every row checked (check_prompts; bad_prompts
    says whether bad rows refuse the file or are dropped). A file that is missing, empty or does not
    read is refused in one line (ConfigError, as train.py prints it) with its path, a bad JSONL row
    with its line: an empty split would otherwise fail only later, mid-run.
    """
    if not os.path.exists(path):
        raise ConfigError(f"prompt file {path!r} does not exist (write it with prepare_data.py)")
    lines = None  # a JSONL row's line in the file, 1-based, to name a bad row by
    try:
        if path.endswith(".parquet"):
            rows = pq.read_table(path).to_pylist()
        elif path.endswith(".jsonl"):
            with open(path, encoding="utf-8") as f:
                numbered = [(n, _json_or_text(line)) for n, line in enumerate(f, 1) if line.strip()]
            lines, rows = [n for n, _ in numbered], [row for _, row in numbered]
        else:
            raise ConfigError(f"prompt file {path!r}: expected .parquet or .jsonl")
    except pa.ArrowException as e:  # a truncated or overwritten file: "magic bytes not found in footer"
        reason = str(e).strip().splitlines()[0]
        raise ConfigError(f"prompt file {path!r} is not a parquet file that reads ({reason}); write it "
                          "again with prepare_data.py") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"prompt file {path!r} is not UTF-8 text ({e}); JSONL is one JSON object a "
                          "line") from None
    if not rows:
        raise ConfigError(f"prompt file {path!r} has no rows; write it again with prepare_data.py")
    prompt_dir = os.path.dirname(os.path.abspath(path))
    for row in rows:
        if not isinstance(row, dict):
            continue  # check_prompts names it
        if isinstance(row.get("messages"), str):
            row["messages"] = _json_or_text(row["messages"])
        for field in FILE_FIELDS:
            if isinstance(row.get(field), str):
                row[field] = os.path.join(prompt_dir, row[field])  # an absolute path stays as it is
    rows = check_prompts(rows, bad_prompts, path, lines)
    return rows[:limit] if limit else rows


def _json_or_text(text):
    """Decoded JSON, or the text itself when it is not JSON (check_prompts then names the row)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def row_problem(row, seen_ids):
    """Why a row cannot be trained on, or None. Wraps a bare-string answer into a list and reads
    missing or null answers as none (tasks may score without them); any other answer that is
    not a string is refused, not converted: `42` or `null` among the gold answers is a mistake
    in the file, and a string-only scorer would crash on it mid-run."""
    if not isinstance(row, dict):
        return "not a JSON object"
    row_id = row.get("id")
    if row_id is None or row_id == "" or not isinstance(row_id, (str, int)) or isinstance(row_id, bool):
        return f"id must be a non-empty string or an integer, got {row_id!r}"
    if row_id in seen_ids:
        return "duplicate id"  # a file concatenated twice, say: those rows would weigh double
    messages = row.get("messages")
    if not isinstance(messages, list) or not messages:
        return f"messages must be a non-empty list of {{role, content}}, got {messages!r:.40}"
    for m in messages:
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            return f"every message needs a role ({', '.join(ROLES)}) and a string content, got {m!r:.60}"
    answers = row.get("answers")
    if answers is None or isinstance(answers, str):
        row["answers"] = [] if answers is None else [answers]
    elif not isinstance(answers, list) or not all(isinstance(a, str) for a in answers):
        return f"answers must be a list of strings, got {answers!r:.40}"
    seen_ids.add(row_id)
    return None


def check_prompts(rows, bad_prompts, source, lines=None):
    """
    The rows a run can train on (row_problem): bad ones are refused with their count and the first
    ids (bad_prompts="refuse"), or dropped and counted ("drop"); a bad row without an id is named by
    its line in a JSONL file (lines: each row's, 1-based), else by its index in rows. load_prompts
    checks every file it reads, and train.py every task's prompts (files or made on the spot) on every
    rank, before any collective. 100k rows: under a second.
    """
    seen, bad, kept = set(), [], []
    for i, row in enumerate(rows):
        problem = row_problem(row, seen)
        if problem is None:
            kept.append(row)
        else:
            where = f"row {i}" if lines is None else f"line {lines[i]}"
            name = row.get("id") if isinstance(row, dict) and row.get("id") not in (None, "") else where
            bad.append(f"{name} ({problem})")
    if bad and bad_prompts == "refuse":
        raise ConfigError(f"{source}: {len(bad)} of {len(rows)} prompts cannot be trained on "
                         f"(first: {'; '.join(bad[:3])}); fix them or set data.bad_prompts=drop")
    if bad:
        print0(f"{source}: dropped {len(bad)} of {len(rows)} prompts that cannot be trained on "
               f"(first: {'; '.join(bad[:3])})")
    if not kept:
        raise ConfigError(f"{source}: no prompts to train on")
    return kept


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
        raise ConfigError(f"{source}: {len(over)} of {len(rows)} prompts are longer than "
                         f"data.max_prompt_tokens={max_tokens} (first: {', '.join(map(str, over[:3]))}); "
                         "raise data.max_prompt_tokens or set data.bad_prompts=drop")
    kept = [row for row, n in zip(rows, lengths) if n <= max_tokens]
    if over:
        print0(f"{source}: dropped {len(over)} of {len(rows)} prompts longer than "
               f"data.max_prompt_tokens={max_tokens} (first: {', '.join(map(str, over[:3]))})")
    if not kept:
        raise ConfigError(f"{source}: no prompts to train on")
    return kept


def write_prompts(out, splits):
    """{split: rows} -> OUT/<split>.parquet (messages as JSON text), which load_prompts reads back.
    The same rows give the same bytes. Every split is checked before anything is written, so
    prepare_data.py fails instead of writing a file (an empty one included) that training refuses."""
    for split, rows in splits.items():
        if not rows:
            raise ValueError(f"the {split} split has no prompts; nothing written to {out} "
                             "(check the sizes asked for and the source)")
        check_prompts(rows, "refuse", f"the {split} split")
    for split, rows in splits.items():
        path = os.path.join(out, f"{split}.parquet")
        pq.write_table(pa.Table.from_pylist([{**r, "messages": json.dumps(r["messages"])} for r in rows]),
                       path)
        print(f"wrote {len(rows)} prompts to {path}")


def balance_pools(rows, field):
    """The rows' indices by their value of `field` (data.balance_by), in the values' sorted order."""
    missing = [row["id"] for row in rows if field not in row]
    if missing:
        raise ConfigError(f"data.balance_by={field}: {len(missing)} of {len(rows)} training prompts have no "
                         f"{field!r} field (the first: {missing[0]!r})")
    values = sorted({str(row[field]) for row in rows})
    return [[i for i, row in enumerate(rows) if str(row[field]) == value] for value in values]


def step_prompts(rows, step, per_rank, rank, world, seed, shuffle, balance_by=""):
    """The prompts of one training step for one rank: a deterministic function of the step (the
    data position is step x prompts per step, so a resumed run continues where it stopped), in an
    order drawn anew every epoch: one permutation per epoch, not per prompt (100k rows: ~2 ms).
    With balance_by (a row field, e.g. a question's type), the positions take the field's values in
    turn, each value's rows in an order (and epochs) of their own: a step of 8 prompts over two types
    holds 4 of each, where a plain shuffle gives it anywhere from 0 to 8 of one."""
    start = (step * world + rank) * per_rank
    positions = np.arange(start, start + per_rank)
    pools = balance_pools(rows, balance_by) if balance_by else [range(len(rows))]
    orders, picked = {}, []
    for k, position in zip((positions % len(pools)).tolist(), (positions // len(pools)).tolist()):
        epoch, i = divmod(position, len(pools[k]))
        if (k, epoch) not in orders:
            rng = np.random.default_rng([seed, epoch, k] if balance_by else [seed, epoch])
            orders[k, epoch] = rng.permutation(len(pools[k])) if shuffle else np.arange(len(pools[k]))
        picked.append(rows[pools[k][orders[k, epoch][i]]])
    return picked


def spare_prompts(rows, step, rank, seed):
    """Prompts beyond a step's share (partial rollouts, dynamic sampling: nanoagent/partial.py), drawn at
    random from their own seeded stream per (step, rank), so the data order of step_prompts is the same
    with them or without, and a resumed step draws the same ones."""
    rng = np.random.default_rng([seed, step, rank, 1])
    while True:
        yield rows[rng.integers(len(rows))]
