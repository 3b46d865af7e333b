"""
The arithmetic task with prompts of two lengths, for tests of how ranks share the update
(train.balance_ranks): the first half of the training prompts open with a long preamble, so that
with data.shuffle=false the first ranks roll out longer rows than the others. Scored as
tests/alternating_task.py scores (1, 0, 1, 0, ... within each prompt's samples), so that no group
is left out of the update, whatever a tiny model samples.
"""

from collections import Counter

from nanoagent.tasks import arithmetic

SYSTEM_PROMPT = arithmetic.SYSTEM_PROMPT
QUESTION = arithmetic.QUESTION
Knobs = arithmetic.Knobs
tools = arithmetic.tools
demonstration = arithmetic.demonstration
prepare = arithmetic.prepare
PREAMBLE = "Read the question, then use the calculator. " * 20

times_scored = Counter()  # prompt id -> how many of its samples this process has scored


def prompts(cfg, split):
    rows = arithmetic.prompts(cfg, split)
    for row in rows[:len(rows) // 2] if split == "train" else []:
        row["messages"][-1]["content"] = PREAMBLE + row["messages"][-1]["content"]
    return rows


def score(traj, cfg):
    arithmetic.score(traj, cfg)
    times_scored[traj.sample["id"]] += 1
    traj.reward = float(times_scored[traj.sample["id"]] % 2)
    return traj.reward
