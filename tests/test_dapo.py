"""
DAPO's sampling fixes on hand-built groups: which trajectories train.trained_rows leaves out of the
update (groups whose advantages are all 0; trajectories cut by a budget). That a rank left with
no rows still trains in step with the others: test_distributed.py.
"""

import torch

import train
from nanoagent import rl
from nanoagent.agent import Trajectory
from nanoagent.config import make_config

SCORES = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.5, 0.2, 0.2])  # the trajectories' outcomes
GROUPS = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
FINISH = ["done", "truncated", "done", "context_budget", "max_turns", "done", "truncated", "truncated"]
# a row per trajectory: two turns, an action token each; a process reward sits on the first turn's
MASK, STEPS, OWNER = torch.tensor([[0.0, 1, 0, 1]] * 8), [[(n, 1, 2), (n, 3, 4)] for n in range(8)], torch.arange(8)
NO_PROCESS = torch.zeros(8, 4)


def trajectories():
    return [Trajectory(sample={"id": str(g)}, prompt_ids=[1, 2], messages=[], finish_reason=f) for g, f in zip(GROUPS.tolist(), FINISH)]


def test_uniform_groups_are_dropped_with_grpo_by_default():
    keep, dropped = train.trained_rows(trajectories(), SCORES, NO_PROCESS, OWNER, GROUPS, make_config("tiny", ["algo=grpo"]))
    assert keep.tolist() == [0, 0, 1, 1, 1, 1, 0, 0]
    assert dropped == {"dropped_uniform": 4, "dropped_overlong": 0, "dropped_env_error": 0}


def test_overlong_trajectories_are_dropped_when_asked():
    """truncated and context_budget are cuts by a token budget; max_turns is not. A cut trajectory
    in a group with signal is left out, and its group is not (its other members train). Each dropped
    trajectory is counted once: the reasons' fractions and the trained one add up to 1."""
    cfg = make_config("tiny", ["algo=grpo", "train.overlong_filter=true"])
    keep, dropped = train.trained_rows(trajectories(), SCORES, NO_PROCESS, OWNER, GROUPS, cfg)
    assert keep.tolist() == [0, 0, 1, 0, 1, 1, 0, 0]
    assert dropped == {"dropped_uniform": 4, "dropped_overlong": 1, "dropped_env_error": 0}


def test_nothing_is_dropped_when_off_or_with_ppo():
    for overrides in (["algo=grpo", "grpo.drop_uniform_groups=false"], ["algo=ppo"]):
        keep, dropped = train.trained_rows(trajectories(), SCORES, NO_PROCESS, OWNER, GROUPS, make_config("tiny", overrides))
        assert keep.tolist() == [1] * 8 and dropped == {"dropped_uniform": 0, "dropped_overlong": 0, "dropped_env_error": 0}, overrides
    cfg = make_config("tiny", ["algo=ppo", "train.overlong_filter=true"])
    keep, dropped = train.trained_rows(trajectories(), SCORES, NO_PROCESS, OWNER, GROUPS, cfg)
    assert keep.tolist() == [1, 0, 1, 0, 1, 1, 0, 0] and dropped == {"dropped_uniform": 0, "dropped_overlong": 4, "dropped_env_error": 0}


def test_trajectories_whose_environment_failed_are_not_trained_on():
    """env_error is left out whatever the algorithm and filters (its reward says nothing of the
    policy), and counted once: as dropped_env_error only when its group is not dropped already."""
    trajs = trajectories()
    trajs[0].finish_reason = trajs[2].finish_reason = "env_error"  # in a uniform group, and in one with signal
    keep, dropped = train.trained_rows(trajs, SCORES, NO_PROCESS, OWNER, GROUPS, make_config("tiny", ["algo=grpo"]))
    assert keep.tolist() == [0, 0, 0, 1, 1, 1, 0, 0] and dropped == {"dropped_uniform": 4, "dropped_overlong": 0, "dropped_env_error": 1}
    keep, dropped = train.trained_rows(trajs, SCORES, NO_PROCESS, OWNER, GROUPS, make_config("tiny", ["algo=ppo"]))
    assert keep.tolist() == [0, 1, 0, 1, 1, 1, 1, 1] and dropped == {"dropped_uniform": 0, "dropped_overlong": 0, "dropped_env_error": 2}


def test_a_group_is_dropped_exactly_when_its_advantages_are_all_zero():
    """With process rewards GRPO's advantages (rl.outcome_token_advantages) are the group-normalised
    outcome plus the process rewards still to come: a group of equal outcomes whose trajectories
    earned process rewards has a signal and trains, even when they earned the same (their sums of
    all rewards are then equal too); a group of equal outcomes without any is left out. The groups
    left out are exactly those whose advantages are all 0."""
    process = torch.zeros(8, 4)
    process[4, 1] = process[6, 1] = process[7, 1] = 0.1  # groups 2 and 3; group 3's outcomes are equal
    cfg = make_config("tiny", ["algo=grpo", "train.tool_call_reward=0.1"])
    keep, dropped = train.trained_rows(trajectories(), SCORES, process, OWNER, GROUPS, cfg)
    assert keep.tolist() == [0, 0, 1, 1, 1, 1, 1, 1] and dropped == {"dropped_uniform": 2, "dropped_overlong": 0, "dropped_env_error": 0}
    advantages = rl.outcome_token_advantages(rl.grpo_advantages(SCORES, GROUPS), process, MASK, STEPS)  # [8, 4], a row per trajectory
    no_signal = [bool(advantages[GROUPS == g].eq(0).all()) for g in GROUPS.tolist()]
    assert no_signal == (keep == 0).tolist()
