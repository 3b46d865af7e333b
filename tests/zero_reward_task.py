"""
The arithmetic task with every reward 0, whatever the model says: every group is uniform, every
trajectory is left out of the update, and the run trains nothing (data.task=tests/zero_reward_task.py).
"""

from nanoagent.tasks import arithmetic

SYSTEM_PROMPT = arithmetic.SYSTEM_PROMPT
QUESTION = arithmetic.QUESTION
tools = arithmetic.tools
prompts = arithmetic.prompts
demonstration = arithmetic.demonstration
prepare = arithmetic.prepare


def score(traj, cfg):
    arithmetic.score(traj, cfg)
    traj.reward = 0.0
    return traj.reward
