"""
The step's batch from its scored trajectories: the rewards on their action tokens, which trajectories
the update trains on, and what each contributes to its group's baseline.

A trajectory left out of the update still counts in its group's baseline when it is a real sample of
the policy (one a budget cut, under train.overlong_filter), with the reward it earned; one whose
environment failed (env_error) counts nowhere, as if it had not been sampled: its reward says nothing
of the policy. README: "Dynamic sampling and overlong filtering".
"""

import torch

from nanoagent import rl
from nanoagent.model import collate


def token_rewards(trajs, batch, tool_call_reward):
    """([R, L] all rewards, [R, L] the process rewards among them) on the batch's action tokens: the
    outcome on the trajectory's last; on each turn's last, its step reward, plus tool_call_reward
    when it is not the last turn and its tool calls all succeeded."""
    rewards, process = torch.zeros_like(batch["action_mask"]), torch.zeros_like(batch["action_mask"])
    for t, steps in zip(trajs, batch["steps"]):
        for turn, (row, _, end) in enumerate(steps):
            calls = [c for c in t.tool_calls if c.turn == turn]
            succeeded = turn < len(steps) - 1 and calls and not any(c.error for c in calls)
            process[row, end - 1] += t.step_rewards[turn] + (tool_call_reward if succeeded else 0.0)
        rewards[steps[-1][0], steps[-1][2] - 1] += t.reward  # (row, start, end) of the last turn
    return rewards + process, process


def counted_in_baseline(trajs):
    """[B] bool: the trajectories that count in their group's baseline (module docstring): all but
    those whose environment failed."""
    return torch.tensor([t.finish_reason != "env_error" for t in trajs], dtype=torch.bool)


def trained_rows(trajs, outcomes, process_size, groups, counted, cfg):
    """
    Which trajectories the update trains on ([B] float, 1 or 0), and how many are left out for each
    reason. DAPO's dynamic sampling (grpo.drop_uniform_groups): a grpo/rloo group whose counted
    outcomes are all equal and which earned no process reward (process_size: [B] the process rewards
    summed in absolute value) has advantages all 0. DAPO's overlong filtering (train.overlong_filter):
    a trajectory that a budget ended is not trained on; nor is one not counted (env_error).
    """
    uniform = torch.zeros(len(trajs), dtype=torch.bool)
    if cfg.algo in ("grpo", "rloo") and cfg.grpo.drop_uniform_groups and counted.any():
        c = counted.nonzero().flatten()
        no_process = rl.uniform_groups(process_size[c], groups[c]) & (process_size[c] == 0)
        uniform[c] = rl.uniform_groups(outcomes[c], groups[c]) & no_process
        uniform = torch.isin(groups, groups[uniform])  # a group's members that do not count go with it
    cut = ("truncated", "context_budget")
    overlong = torch.tensor([cfg.train.overlong_filter and t.finish_reason in cut for t in trajs])
    dropped = {"dropped_uniform": uniform.sum().item(),
               "dropped_overlong": (overlong & ~uniform).sum().item(),
               "dropped_env_error": (~counted & ~uniform & ~overlong).sum().item()}
    return (~uniform & ~overlong & counted).float(), dropped


def step_batch(trajs, pad_id, cfg):
    """
    The step's rows (collate: one per trajectory, or per turn with last_k); rewards and process [R, L]
    on the action tokens that train (the others get mask 0 and no forward pass); scores, [B] per
    trajectory: "outcome", "earned" (its process rewards summed), "group" (group_size consecutive
    trajectories), "counted" (counted_in_baseline), "trained"; kept (the rows that train); dropped.
    """
    batch = collate(trajs, pad_id)
    owner = batch["trajectory"]
    rewards, process = token_rewards(trajs, batch, cfg.train.tool_call_reward)
    earned = torch.zeros(len(trajs)).index_add_(0, owner, process.sum(-1))              # [B]
    process_size = torch.zeros(len(trajs)).index_add_(0, owner, process.abs().sum(-1))  # [B]
    outcomes = torch.tensor([t.reward for t in trajs], dtype=torch.float32)
    groups = torch.arange(len(trajs) // cfg.rollout.group_size).repeat_interleave(cfg.rollout.group_size)
    counted = counted_in_baseline(trajs)
    keep, dropped = trained_rows(trajs, outcomes, process_size, groups, counted, cfg)
    mask = batch["action_mask"] = batch["action_mask"] * keep[owner][:, None]
    scores = {"outcome": outcomes, "earned": earned, "group": groups, "counted": counted,
              "trained": keep > 0}
    return batch, rewards * mask, process * mask, scores, keep[owner].nonzero().flatten().tolist(), dropped
