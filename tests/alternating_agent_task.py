"""
The openai agent task (nanoagent/tasks/openai_agent.py) with tests/alternating_task.py's scripted reward: the
samples of each prompt earn 1, 0, 1, 0, ... in the order they are scored, whatever the agent returned, so every
group varies and trains on every machine (data.task=tests/alternating_agent_task.py).
"""

from collections import Counter

from nanoagent.tasks import openai_agent

SYSTEM_PROMPT = openai_agent.SYSTEM_PROMPT
QUESTION = openai_agent.QUESTION
Knobs = openai_agent.Knobs
agent = openai_agent.agent
prompts = openai_agent.prompts
demonstration = openai_agent.demonstration
prepare = openai_agent.prepare

times_scored = Counter()  # prompt id -> how many of its samples this process has scored


def score(traj, cfg):
    times_scored[traj.sample["id"]] += 1
    traj.reward = float(times_scored[traj.sample["id"]] % 2)
    traj.scores = {"returned": traj.outcome if traj.outcome is not None else 0.0}
    return traj.reward
