"""
The arithmetic task with every reward 0, whatever the model says: every group is uniform, every
trajectory is left out of the update, and the run trains nothing (data.task=tests/zero_reward_task.py).
"""

from nanoagent.tasks import arithmetic
from nanoagent.tasks.arithmetic import (  # noqa: F401 (the task interface, arithmetic's)
    QUESTION, SYSTEM_PROMPT, Knobs, demonstration, prepare, prompts, tools)


def score(traj, cfg):
    arithmetic.score(traj, cfg)
    traj.reward = 0.0
    return traj.reward
