"""
GSM8K with a calculator: grade-school math word problems whose arithmetic the agent does by calling
the `calculator` tool. It is Agent-R1's minimal tool example (in its first form, v0: the calculator
on GSM8K): a real benchmark of multi-turn tool use whose reward needs no corpus or search index.

One prompt row per problem: `id` (GSM8K's split and position, e.g. "test-17"), `question`,
`answers` (the gold: the number after `####` in GSM8K's solution, commas removed, "1,200" ->
"1200"), `solution` (GSM8K's solution text, whose `<<48/2=24>>` annotations the demonstrations turn
into calculator calls) and `messages` (system + user). prepare() reads `openai/gsm8k` (config
"main") from the hub (the datasets library), or a folder with GSM8K's train.jsonl and test.jsonl
(one {"question", "answer"} a line; what tests use): OUT/train.parquet is sampled from the train
split, OUT/val.parquet from the test split (by default all 1319 problems, the test set GSM8K
figures are reported on).

The reward is Agent-R1 v0's for this example (github.com/0russwest0/Agent-R1, now the `legacy`
branch of AgentR1/Agent-R1: compute_score_format_answer in verl/utils/reward_score/gsm8k.py, commit
984cbed "support gsm8k", 2025-03-14, later moved to agent_r1/src/reward_score/gsm8k.py), written
anew on nanoagent's trajectories:
- format, in [0, 1]: 0.5 for each assistant turn but the last that is one tool call (after one
  <think>...</think>) that ran, plus 0.5 for a last turn that answers (<think>...</think> then
  <answer>...</answer>), capped at 1. A full format needs a successful calculator call, or two (the
  cap) when the last turn is not well formed.
- accuracy, 0 or 1: the trajectory ended by answering, and the last number in its <answer> equals
  the gold.
- reward = accuracy when the format is full, else format - 1: a right answer in the right format
  scores 1, a wrong one 0, a trajectory in the wrong format -1 or -0.5 (-0.5: an answer given
  without any tool call, however right).
Where this differs from Agent-R1's code, on purpose: <think> is asked for only with
reward.require_think=true (Agent-R1 always asks for it; set it to match); whitespace around the
tags is free (Agent-R1 wants exactly one newline between </think> and the next tag); a call ran
when the environment ran it without error (Agent-R1 looks for "error" in the tool's response); a
last turn cut by the token budget is no answer; and the answer is compared as a number: "72.0",
"$72", "72 dollars", "72." and "1,200" are 72, 72, 72, 72 and 1200 (Agent-R1 compares its last
match of -?\\d+\\.?\\d* with the gold as strings, so "72.0", "72." and "1,200" fail). The other
reward.* settings (metric, answer_weight, format_weight) do not apply to this task.

(Agent-R1's current GSM8K + Tool example replaces the calculator by a tool that grades a proposed
answer, and rewards only the last number of the response equal to the gold, with no format term.)
"""

import json
import os
import re
from fractions import Fraction

from nanoagent.data import load_prompts, write_prompts
from nanoagent.reward import TAG_RE, extract_answer, tags_well_formed
from nanoagent.tasks.hotpotqa import sample
from nanoagent.tools import calculate, calculator_tool

SYSTEM_PROMPT = (
    "Solve the math word problem. Do every calculation with the `calculator` tool, one call per turn, and "
    "read its result before you go on. First reason inside <think></think>, then either call the tool or, "
    "when you know the final answer, reply with only the number inside <answer></answer>, for example "
    "<answer>72</answer>."
)
QUESTION = "{}"
HUB_DATASET = ("openai/gsm8k", "main")
SPLITS = {"train": "train", "val": "test"}  # our split -> GSM8K's split (and file name, <split>.jsonl)

GOLD_RE = re.compile(r"-?\d+(?:\.\d+)?")
# A number in an answer: thousands commas allowed ("1,200"), a minus only where no digit precedes it
# ("5-3" holds 5 and 3, not -3), a decimal point only between digits ("72." is 72 and a full stop).
NUMBER_RE = re.compile(r"(?<!\d)-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")
ANNOTATION_RE = re.compile(r"<<(.*?)>>")
# a turn's shape, used with turn_kind's tag checks
TURN_RE = re.compile(r"\s*(?:<think>.*</think>\s*)?<(tool_call|answer)>.*</\1>\s*", re.DOTALL)


def gold_answer(solution, where):
    """The number after the last `####` of a GSM8K solution, commas removed ("1,200" -> "1200")."""
    if "####" not in solution:
        raise ValueError(f"{where}: the answer has no '#### <number>' line; expected GSM8K's solution format")
    gold = solution.rsplit("####", 1)[1].strip().replace(",", "")
    if not GOLD_RE.fullmatch(gold):
        raise ValueError(f"{where}: the final answer {gold!r} after #### is not a number")
    return gold


def gsm8k_row(record, split, index, where):
    """A prompt row from one GSM8K record ({"question", "answer"}); `where` names it in errors."""
    if (not isinstance(record, dict) or not isinstance(record.get("question"), str)
            or not isinstance(record.get("answer"), str)):
        raise ValueError(f"{where}: expected a JSON object with string fields question and answer "
                         "(GSM8K's format)")
    return {"id": f"{split}-{index}", "question": record["question"],
            "answers": [gold_answer(record["answer"], where)], "solution": record["answer"],
            "messages": [{"role": "system", "content": SYSTEM_PROMPT},
                         {"role": "user", "content": QUESTION.format(record["question"])}]}


def load_gsm8k(split, source=None):
    """
    The prompt rows of one split ("train": GSM8K's train, "val": its test) from `source`, a folder
    with GSM8K's JSONL files, or (source None) from the hub. A malformed line is refused with its
    file and line number.
    """
    name = SPLITS[split]
    if source is None:
        # here, not at the top: importing datasets takes seconds, and only this path needs it
        from datasets import load_dataset
        records = load_dataset(*HUB_DATASET, split=name)
        return [gsm8k_row(r, name, i, f"{HUB_DATASET[0]} {name} row {i}") for i, r in enumerate(records)]
    if not os.path.isdir(source):
        raise FileNotFoundError(f"GSM8K source {source!r} is not a folder; pass the folder that holds "
                                "train.jsonl and test.jsonl, or leave --source out to use the hub")
    path = os.path.join(source, f"{name}.jsonl")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{source} has no {name}.jsonl; expected GSM8K's train.jsonl and test.jsonl")
    rows = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not JSON ({e}); "
                                 "expected one {question, answer} object a line") from None
            rows.append(gsm8k_row(record, name, len(rows), where))
    return rows


def tools(cfg):
    return [calculator_tool()]


def prompts(cfg, split):
    return load_prompts(cfg.data.train_path if split == "train" else cfg.data.val_path,
                        bad_prompts=cfg.data.bad_prompts)


def same_number(prediction, gold):
    """Whether the last number in `prediction` equals the gold, exactly (Fraction: 72.0 == 72)."""
    numbers = NUMBER_RE.findall(prediction)
    return bool(numbers) and Fraction(numbers[-1].replace(",", "")) == Fraction(gold)


def turn_kind(text, require_think=False):
    """
    What an assistant turn is in Agent-R1's format: "tool_call" when it is one <tool_call>...</tool_call>,
    "answer" when it is one <answer>...</answer>, either after one <think>...</think> (optional unless
    require_think), with only whitespace around the tags; None when it is anything else.
    """
    opened = [name for closing, name in TAG_RE.findall(text) if not closing]
    if not tags_well_formed(text) or opened not in (["tool_call"], ["answer"], ["think", "tool_call"],
                                                    ["think", "answer"]):
        return None
    if (require_think and opened[0] != "think") or not TURN_RE.fullmatch(text):
        return None
    return opened[-1]


def format_score(traj, require_think=False):
    """Agent-R1's GSM8K format score in [0, 1]: 0.5 a turn but the last that is one tool call that
    ran, 0.5 for a last turn that answered, capped at 1 (module docstring)."""
    turns = [m["content"] for m in traj.messages[len(traj.sample["messages"]):] if m["role"] == "assistant"]
    score = 0.0
    for k, text in enumerate(turns[:-1]):
        calls = [c for c in traj.tool_calls if c.turn == k]
        if turn_kind(text, require_think) == "tool_call" and len(calls) == 1 and not calls[0].error:
            score += 0.5
    if turns and traj.finish_reason == "done" and turn_kind(turns[-1], require_think) == "answer":
        score += 0.5
    return min(score, 1.0)


def score(traj, cfg):
    """traj.scores = {accuracy, format}; traj.reward = accuracy if the format is full, else format - 1."""
    answer = extract_answer(traj.final_text) if traj.finish_reason == "done" else None
    accuracy = float(answer is not None and same_number(answer, traj.sample["answers"][0]))
    fmt = format_score(traj, cfg.reward.require_think)
    traj.scores = {"accuracy": accuracy, "format": fmt}
    traj.reward = accuracy if fmt == 1.0 else fmt - 1.0
    return traj.reward


def demonstration(row, rng, cfg):
    """
    The gold solution as tool use, for a warm start by imitation: each `<<expr=value>>` annotation
    of the solution is a calculator call, one turn each, in order, then `<answer>gold</answer>`. An
    annotation the calculator refuses or fails on (GSM8K's files have none, but a hand-made one
    might: "2^3", "$5*2", "5/0") is left out, so every call runs; a solution without annotations is
    answered directly. The turns have no <think>: imitate them with reward.require_think=false.
    Deterministic (rng unused).
    """
    turns = []
    for annotation in ANNOTATION_RE.findall(row["solution"]):
        expression = annotation.rsplit("=", 1)[0].strip()
        try:
            calculate(expression)
        except Exception:
            # refused (ValueError) or failed ("5/0": ZeroDivisionError): the environment would fail it too
            continue
        call = json.dumps({"name": "calculator", "arguments": {"expression": expression}})
        turns.append(f"<tool_call>\n{call}\n</tool_call>")
    return turns + [f"<answer>{row['answers'][0]}</answer>"]


def prepare(out, train_size=0, val_size=None, seed=0, source=None):
    """OUT/train.parquet: `train_size` problems sampled from GSM8K's train split (0: all 7473);
    OUT/val.parquet: `val_size` from its test split (default: all 1319); `source`: a folder of
    GSM8K's JSONL files instead of the hub."""
    train = sample(load_gsm8k("train", source), train_size, seed, "train")
    val = sample(load_gsm8k("val", source), val_size or 0, seed, "val")
    write_prompts(out, {"train": train, "val": val})
