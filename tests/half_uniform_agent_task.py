"""
The openai agent task (nanoagent/tasks/openai_agent.py: an agent written with the openai package, trained
through the endpoint) with a scripted reward, for tests of flows under partial rollouts and dynamic sampling
(grpo.refill): the groups of even-numbered prompts earn 0 for every sample (uniform: left out of the update),
those of odd-numbered ones 1, 0, 1, 0, ... in the order they are scored (non-uniform), whatever the agent
returned.
"""

from collections import Counter

from nanoagent.tasks.openai_agent import (  # noqa: F401 (the task interface, the agent's)
    QUESTION, SYSTEM_PROMPT, Knobs, agent, demonstration, prepare, prompts)

times_scored = Counter()  # prompt id -> how many of its samples this process has scored


def score(traj, cfg):
    times_scored[traj.sample["id"]] += 1
    uniform = int(traj.sample["id"].rsplit("-", 1)[1]) % 2 == 0
    traj.reward = 0.0 if uniform else float(times_scored[traj.sample["id"]] % 2)
    traj.scores = {"returned": traj.outcome if traj.outcome is not None else 0.0}
    return traj.reward
