"""
DAPO's sampling fixes on hand-built groups: which trajectories train.trained_rows leaves out of the
update (groups whose rewards are all equal; trajectories cut by a budget). That a rank left with
no rows still trains in step with the others: test_distributed.py.
"""

import torch

import train
from nanoagent.agent import Trajectory
from nanoagent.config import make_config

SCORES = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.5, 0.2, 0.2])
GROUPS = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
FINISH = ["answer", "truncated", "answer", "context_budget", "max_turns", "answer", "truncated", "truncated"]


def trajectories():
    return [Trajectory(sample={"id": str(g)}, prompt_ids=[1, 2], messages=[], finish_reason=f) for g, f in zip(GROUPS.tolist(), FINISH)]


def test_uniform_groups_are_dropped_with_grpo_by_default():
    keep, dropped = train.trained_rows(trajectories(), SCORES, GROUPS, make_config("tiny", ["algo=grpo"]))
    assert keep.tolist() == [0, 0, 1, 1, 1, 1, 0, 0]
    assert dropped == {"dropped_uniform": 4, "dropped_overlong": 0}


def test_overlong_trajectories_are_dropped_when_asked():
    """truncated and context_budget are cuts by a token budget; max_turns is not. A cut trajectory
    in a group with signal is left out, and its group is not (its other members train). Each dropped
    trajectory is counted once: the reasons' fractions and the trained one add up to 1."""
    keep, dropped = train.trained_rows(trajectories(), SCORES, GROUPS, make_config("tiny", ["algo=grpo", "train.overlong_filter=true"]))
    assert keep.tolist() == [0, 0, 1, 0, 1, 1, 0, 0]
    assert dropped == {"dropped_uniform": 4, "dropped_overlong": 1}


def test_nothing_is_dropped_when_off_or_with_ppo():
    for overrides in (["algo=grpo", "grpo.drop_uniform_groups=false"], ["algo=ppo"]):
        keep, dropped = train.trained_rows(trajectories(), SCORES, GROUPS, make_config("tiny", overrides))
        assert keep.tolist() == [1] * 8 and dropped == {"dropped_uniform": 0, "dropped_overlong": 0}, overrides
    keep, dropped = train.trained_rows(trajectories(), SCORES, GROUPS, make_config("tiny", ["algo=ppo", "train.overlong_filter=true"]))
    assert keep.tolist() == [1, 0, 1, 0, 1, 1, 0, 0] and dropped == {"dropped_uniform": 0, "dropped_overlong": 4}
