"""
The arithmetic task with a scripted reward, for tests of dynamic sampling (grpo.refill): the groups of
even-numbered prompts earn 0 for every sample (uniform: left out of the update), those of odd-numbered
ones 1, 0, 1, 0, ... in the order they are scored (non-uniform), whatever a tiny model says.
"""

from collections import Counter

from nanoagent.tasks import arithmetic
from nanoagent.tasks.arithmetic import (  # noqa: F401 (the task interface, arithmetic's)
    QUESTION, SYSTEM_PROMPT, Knobs, demonstration, prepare, prompts, tools)

times_scored = Counter()  # prompt id -> how many of its samples this process has scored


def score(traj, cfg):
    arithmetic.score(traj, cfg)
    times_scored[traj.sample["id"]] += 1
    uniform = int(traj.sample["id"].rsplit("-", 1)[1]) % 2 == 0
    traj.reward = 0.0 if uniform else float(times_scored[traj.sample["id"]] % 2)
    return traj.reward
