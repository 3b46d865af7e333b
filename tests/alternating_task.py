"""
The arithmetic task with a scripted reward, for tests whose premise is "the rewards of a group
vary, so the policy moves" (data.task=tests/alternating_task.py). What a tiny model samples, and so
what it earns, depends on the CPU's bf16 rounding: on some machines every group of a step earned
one reward for all, DAPO left them all out, and no update ran. Here the samples of each prompt earn
1, 0, 1, 0, ... in the order they are scored, whatever they say: every group of two or more is
non-uniform, on every machine. The arithmetic scores (em, f1, format) are still computed and logged.
"""

from collections import Counter

from nanoagent.tasks import arithmetic

SYSTEM_PROMPT = arithmetic.SYSTEM_PROMPT
QUESTION = arithmetic.QUESTION
Knobs = arithmetic.Knobs
tools = arithmetic.tools
prompts = arithmetic.prompts
demonstration = arithmetic.demonstration
prepare = arithmetic.prepare

times_scored = Counter()  # prompt id -> how many of its samples this process has scored


def score(traj, cfg):
    arithmetic.score(traj, cfg)
    times_scored[traj.sample["id"]] += 1
    traj.reward = float(times_scored[traj.sample["id"]] % 2)
    return traj.reward
