"""
DAPO's sampling fixes on hand-built groups: which trajectories batch.trained_rows leaves out of the
update (groups whose advantages are all 0; trajectories cut by a budget; environment failures), and
what a trajectory left out contributes to the advantages of those trained. That a rank left with
no rows still trains in step with the others: test_distributed.py.
"""

import math

import pytest
import torch

import train
from nanoagent import rl
from nanoagent.agent import Trajectory, observe
from nanoagent.batch import counted_in_baseline, step_batch, trained_rows
from nanoagent.config import make_config
from nanoagent.env import ChatEnv
from nanoagent.tools import ToolCalling, ToolRunner

SCORES = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.5, 0.2, 0.2])  # the trajectories' outcomes
GROUPS = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
FINISH = ["done", "truncated", "done", "context_budget", "max_turns", "done", "truncated", "truncated"]
# a row per trajectory: two turns, an action token each; a process reward sits on the first turn's
MASK, STEPS, OWNER = torch.tensor([[0.0, 1, 0, 1]] * 8), [[(n, 1, 2), (n, 3, 4)] for n in range(8)], torch.arange(8)
NO_PROCESS = torch.zeros(8)  # each trajectory's process rewards, summed in absolute value


def trajectories():
    return [Trajectory(sample={"id": str(g)}, prompt_ids=[1, 2], messages=[], finish_reason=f)
            for g, f in zip(GROUPS.tolist(), FINISH)]


def left_out(overrides, trajs=None, process_size=NO_PROCESS):
    """batch.trained_rows on the hand-built groups: (which train, as a list; the counts left out)."""
    trajs = trajs or trajectories()
    cfg = make_config("tiny", overrides)
    keep, counts = trained_rows(trajs, SCORES, process_size, GROUPS, counted_in_baseline(trajs), cfg)
    return keep.tolist(), counts


def dropped(uniform=0, overlong=0, env_error=0):
    return {"dropped_uniform": uniform, "dropped_overlong": overlong, "dropped_env_error": env_error}


def test_uniform_groups_are_dropped_with_grpo_by_default():
    assert left_out(["algo=grpo"]) == ([0, 0, 1, 1, 1, 1, 0, 0], dropped(uniform=4))


def test_overlong_trajectories_are_dropped_when_asked():
    """truncated and context_budget are cuts by a token budget; max_turns is not. A cut trajectory
    in a group with signal is left out, and its group is not (its other members train). Each dropped
    trajectory is counted once: the reasons' fractions and the trained one add up to 1."""
    trained = [0, 0, 1, 0, 1, 1, 0, 0]
    assert left_out(["algo=grpo", "train.overlong_filter=true"]) == (trained, dropped(uniform=4, overlong=1))


def test_nothing_is_dropped_when_off_or_with_ppo():
    for overrides in (["algo=grpo", "grpo.drop_uniform_groups=false"], ["algo=ppo"]):
        assert left_out(overrides) == ([1] * 8, dropped()), overrides
    trained = [1, 0, 1, 0, 1, 1, 0, 0]
    assert left_out(["algo=ppo", "train.overlong_filter=true"]) == (trained, dropped(overlong=4))


def test_trajectories_whose_environment_failed_are_not_trained_on():
    """env_error is left out whatever the algorithm and filters (its reward says nothing of the
    policy), and counted once: as dropped_env_error only when its group is not dropped already. It
    counts nowhere in its group either: group 1's other member is then alone, with no baseline."""
    trajs = trajectories()
    trajs[0].finish_reason = trajs[2].finish_reason = "env_error"  # in a uniform group, and in one with signal
    assert left_out(["algo=grpo"], trajs) == ([0, 0, 0, 0, 1, 1, 0, 0], dropped(uniform=6))
    trajs[4].finish_reason = "env_error"  # in group 2, with a member whose outcome differs
    for overrides in (["algo=grpo", "grpo.drop_uniform_groups=false"], ["algo=ppo"]):
        assert left_out(overrides, trajs) == ([0, 1, 0, 1, 0, 1, 1, 1], dropped(env_error=3)), overrides


def test_a_group_is_dropped_exactly_when_its_advantages_are_all_zero():
    """With process rewards GRPO's advantages (rl.outcome_token_advantages) are the group-normalised
    outcome plus the process rewards still to come: a group of equal outcomes whose trajectories
    earned process rewards has a signal and trains, even when they earned the same (their sums of
    all rewards are then equal too); a group of equal outcomes without any is left out. The groups
    left out are exactly those whose advantages are all 0."""
    process = torch.zeros(8, 4)
    process[4, 1] = process[6, 1] = process[7, 1] = 0.1  # groups 2 and 3; group 3's outcomes are equal
    keep, counts = left_out(["algo=grpo", "train.tool_call_reward=0.1"], process_size=process.abs().sum(-1))
    assert (keep, counts) == ([0, 0, 1, 1, 1, 1, 1, 1], dropped(uniform=2))
    advantages = rl.outcome_token_advantages(rl.grpo_advantages(SCORES, GROUPS), process, MASK, STEPS)
    no_signal = [bool(advantages[GROUPS == g].eq(0).all()) for g in GROUPS.tolist()]
    assert no_signal == [k == 0 for k in keep]


# -----------------------------------------------------------------------------
# what a trajectory left out of the update contributes to the advantages of the others (docs/formulation.md:
# "Dynamic sampling and overlong filtering"): an overlong one, a real sample of the policy, counts in
# its group's baseline with the reward it earned; an env_error one counts nowhere

def two_token_trajectories(rewards, finish):
    """One trajectory per reward: a 2-token prompt and one turn of 2 action tokens."""
    return [Trajectory(sample={"id": str(n)}, prompt_ids=[1, 2], messages=[], response_ids=[5, 6],
                       action_mask=[1, 1], rollout_logprobs=[0.0, 0.0], versions=[0, 0], turn_spans=[(0, 2)],
                       step_rewards=[0.0], reward=r, finish_reason=f)
            for n, (r, f) in enumerate(zip(rewards, finish))]


def advantages(trajs, overrides):
    """Each trajectory's advantage (on its first action token) as train.py computes it, with groups of 4
    (the batch statistics are summed over a world of one: the process_group fixture)."""
    cfg = make_config("tiny", ["rollout.group_size=4", *overrides])
    step = step_batch(trajs, 0, cfg)
    return train.critic_free_advantages(step, step.rewards, cfg)[:, 2].tolist()


def whitened(centred):
    """Each trajectory's centred total, whitened over the batch's action tokens (2 a trajectory)."""
    tokens = [x for x in centred for _ in range(2)]
    mean = sum(tokens) / len(tokens)
    std = math.sqrt(sum((x - mean) ** 2 for x in tokens) / (len(tokens) - 1) + 1e-8)
    return [(x - mean) / std for x in centred]


def test_an_overlong_trajectory_counts_in_its_groups_baseline_with_its_reward(process_group):
    """Two groups with rewards [1, 1, 0, 0], the first trajectory cut and filtered: the same winning
    trajectory gets the same advantage in both groups (each group's mean 0.5), for reinforce++-baseline
    too (its totals summed from the rewards of the trained tokens once made a left-out one's total 0:
    group means 0.25 and 0.5, advantages 1.406 and 0.914)."""
    trajs = two_token_trajectories([1, 1, 0, 0, 1, 1, 0, 0], ["truncated"] + ["done"] * 7)
    expected = whitened([0.5, -0.5, -0.5, 0.5, 0.5, -0.5, -0.5])[0]  # the trained ones' rewards, centred
    assert expected == pytest.approx(1.113, abs=1e-3)
    adv = advantages(trajs, ["algo=reinforce_plus_plus_baseline", "train.overlong_filter=true"])
    assert adv[0] == 0 and adv[1] == pytest.approx(expected, abs=1e-5) == adv[4]
    adv = advantages(trajs, ["algo=grpo", "train.overlong_filter=true"])  # (1 - 0.5) / std of [1, 1, 0, 0]
    assert adv[0] == 0 and adv[1] == pytest.approx(adv[4])
    assert adv[1] == pytest.approx(0.5 / math.sqrt(1 / 3), abs=1e-5)


@pytest.mark.parametrize("algo", ["grpo", "rloo", "reinforce", "reinforce_plus_plus_baseline"])
def test_an_env_error_trajectory_changes_no_advantage(algo, process_group):
    """Whatever reward an env_error trajectory carries, the others' advantages are the same: it is
    neither trained nor in a baseline. GRPO on [env_error, 1, 1, 0]: the kept rows get [0.577, 0.577,
    -1.155], as from a group of [1, 1, 0] (with it in the baseline: [0.866, 0.866, -0.866])."""
    finish = ["env_error"] + ["done"] * 7
    first, *others = [advantages(two_token_trajectories([r, 1, 1, 0, 1, 0, 0, 0], finish), [f"algo={algo}"])
                      for r in (0.0, 1.0, 7.0)]
    assert first[0] == 0 and all(first == pytest.approx(other, abs=1e-6) for other in others)
    if algo == "grpo":
        assert first[1:4] == pytest.approx([1 / math.sqrt(3), 1 / math.sqrt(3), -2 / math.sqrt(3)], abs=1e-5)
    if algo == "reinforce_plus_plus_baseline":  # group means 2/3 (not 1/2, as with it counted as 0) and 1/4
        expected = whitened([1 / 3, 1 / 3, -2 / 3, 0.75, -0.25, -0.25, -0.25])
        assert first[1:] == pytest.approx(expected, abs=1e-5)


def test_a_cut_turn_that_the_environment_ended_is_done_unless_the_environment_read_the_cut():
    """A game reads the first line of a reply: a reply cut after it was judged whole, and a won game
    ends "done" and trains under train.overlong_filter (it used to end "truncated" and be left out). A
    tool task reads the whole reply: an answer cut by the budget ends "truncated" (DAPO's overlong case)."""

    class FirstLine:  # done on any command; won when it is "win"; says whether it read the reply to its end
        def reset(self, row):
            return []

        def step(self, action):
            line, _, rest = action.strip().partition("\n")
            return "", float(line == "win"), True, {"read_to_end": not rest.strip()}

    cases = [(FirstLine, "win\nand then I", "done"), (FirstLine, "wi", "truncated"),
             (lambda: ToolCalling(ToolRunner([])), "<answer>Par", "truncated")]
    for make, reply, finish in cases:
        env = ChatEnv(make, tokenizer=None)
        t = Trajectory(sample={"id": reply}, prompt_ids=[1], messages=[], env=make())
        step = env.start(t.env, reply)
        observe(t, env, step, reply, ended_with_eos=False, last_turn=False, cut="truncated",
                max_context_tokens=100)
        assert t.finish_reason == finish, reply
    trajs = trajectories()
    trajs[2].finish_reason = "done"  # group 1, [0, 1]: a won game whose reply was cut after its command
    assert left_out(["train.overlong_filter=true"], trajs)[0][2] == 1
