"""
The RL math of nanoagent, as pure functions on tensors: no models, no torch.distributed.

A trajectory is one row `prompt | act_1 | obs_1 | ... | act_n`; `mask` is 1 on the tokens the
policy sampled (actions) and 0 on everything else (prompt, tool observations, chat glue, padding).
Everything here respects that mask exactly:
- masked_gae runs the GAE recursion over action tokens only: an observation neither gets an
  advantage nor breaks the recursion (the last action token of turn k bootstraps from the value of
  the first action token of turn k+1, with no discount across the observation);
- step_gae runs it over steps instead (one action = one step, its value read at the state
  boundary before it), and every token of an action shares the step's advantage; a trajectory's
  steps may lie in one row or (each turn with its own context) in a row each;
- grpo_advantages normalises scores within groups of rollouts of the same prompt, rloo_advantages
  compares each with the mean of the others (subset_advantages: over some rows alone);
  outcome_token_advantages puts a trajectory's outcome advantage on its action tokens and adds the
  process rewards unnormalised, and uniform_groups finds the groups whose scores are all equal;
- discounted_returns gives REINFORCE++ its per-token returns over a trajectory's action tokens, and
  whiten normalises advantages with statistics of the whole batch;
- ppo_policy_loss / clipped_value_loss return per-token losses, zero where mask = 0; with segments,
  the policy loss takes one ratio per sequence or step (GSPO);
- aggregate_loss turns per-token losses into this micro-batch's share of one global scalar, so the
  gradient does not depend on how a batch is split into micro-batches and ranks.
Shapes: B = rows (trajectories, or their turns), T = tokens per row, V = vocabulary.
"""

import math

import torch

# exp() of a log-ratio beyond this is inf in fp32 for practical purposes; clamping keeps the
# gradient of a clipped-away branch at 0 instead of 0 * inf = NaN.
LOG_RATIO_CLAMP = 20.0


# -----------------------------------------------------------------------------
# masked reductions

def masked_sum(x, mask, dim=None):
    return (x * mask).sum() if dim is None else (x * mask).sum(dim)


def masked_mean(x, mask, dim=None):
    """Mean of x over mask = 1 (the whole tensor, or along dim). An empty mask gives 0, not NaN."""
    return masked_sum(x, mask, dim) / mask.sum(dim).clamp(min=1)


# -----------------------------------------------------------------------------
# advantages

@torch.no_grad()
def masked_gae(rewards, values, mask, gamma, lam):
    """
    Generalised advantage estimation over action tokens only.
    rewards, values, mask: [B, T] float. Returns (advantages, returns), both [B, T], zero where
    mask = 0; returns = advantages + values on action tokens. No whitening here.
    Rewards must sit on action tokens (a reward on a mask-0 token would be silently dropped).
    """
    assert rewards.shape == values.shape == mask.shape and rewards.dim() == 2, "expect [B, T] tensors"
    mask = mask.to(values.dtype)
    if torch.any((rewards != 0) & (mask == 0)):
        raise ValueError("masked_gae: a non-zero reward sits on a mask-0 token; "
                         "rewards belong on action tokens")
    B, T = values.shape
    advantages = torch.zeros_like(values)
    next_value = values.new_zeros(B)  # value of the next action token in the row (0 after the last)
    next_adv = values.new_zeros(B)    # advantage of the next action token in the row
    for t in reversed(range(T)):
        m = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        adv = delta + gamma * lam * next_adv
        advantages[:, t] = adv * m
        # mask-0 tokens pass the carry through untouched: no discount across observations
        next_value = torch.where(m > 0, values[:, t], next_value)
        next_adv = torch.where(m > 0, adv, next_adv)
    returns = (advantages + values) * mask
    return advantages, returns


def check_steps(mask, steps, name):
    """Refuse steps (see step_gae) that are not [start, end) spans after a row's first token, in order
    within their row, covering every action token of `mask` exactly once."""
    covered = torch.zeros_like(mask)
    for n, trajectory in enumerate(steps):
        for k, (row, start, end) in enumerate(trajectory):
            if not (0 <= row < len(mask) and 1 <= start < end <= mask.shape[1]):
                raise ValueError(f"{name}: trajectory {n}'s step {(row, start, end)} is not a [start, end) "
                                 "span after a row's first token")
            if k and trajectory[k - 1][0] == row and trajectory[k - 1][2] > start:
                raise ValueError(f"{name}: trajectory {n}'s steps {trajectory} are not in order within "
                                 "their row")
            covered[row, start:end] += 1
    if torch.any(covered > 1) or torch.any(mask * (covered == 0) > 0):
        raise ValueError(f"{name}: the steps overlap, or miss action tokens: every action token must be "
                         "in exactly one step")


@torch.no_grad()
def step_gae(rewards, values, mask, steps, gamma, lam):
    """
    Generalised advantage estimation over steps (Agent-R1 v0.1's step-level MDP): a step is one
    action, its state everything the policy read before it. steps[n]: trajectory n's steps in order,
    each (row, start, end), the [start, end) positions of its action in that row (start >= 1): all in
    one row (one growing row per trajectory), or each in a row of its own (each turn with its own
    context). values are aligned like the logprobs (model.critic_forward): index t holds the
    critic's output at token t-1, the value of the state that has read tokens [0, t). For step k:
      V(s_k) = values[row_k, start_k], the value of everything the policy read before the action
               (the output at its last token, start_k - 1); V after the last step is 0;
      r_k    = the rewards summed over the action's tokens;
      delta_k = r_k + gamma * V(s_{k+1}) - V(s_k);  A_k = delta_k + gamma * lam * A_{k+1}.
    rewards, values, mask: [B, T] float; values are read at the steps' starts only. Returns
    (advantages, returns, value_mask), all [B, T]: A_k on every action token of step k (zero where
    mask = 0); returns A_k + V(s_k) at index start_k, where value_mask is 1 (a step with an action
    token to train), for a value loss taken where the values were read.
    """
    assert rewards.shape == values.shape == mask.shape and rewards.dim() == 2, "expect [B, T] tensors"
    mask = mask.to(values.dtype)
    if torch.any((rewards != 0) & (mask == 0)):
        raise ValueError("step_gae: a non-zero reward sits on a mask-0 token; "
                         "rewards belong on action tokens")
    check_steps(mask, steps, "step_gae")
    advantages, returns, value_mask = (torch.zeros_like(values) for _ in range(3))
    for trajectory in steps:
        next_value = next_adv = 0.0
        for row, start, end in reversed(trajectory):
            value = values[row, start]
            adv = rewards[row, start:end].sum() + gamma * next_value - value + gamma * lam * next_adv
            advantages[row, start:end] = adv * mask[row, start:end]
            if mask[row, start:end].any():
                returns[row, start], value_mask[row, start] = adv + value, 1.0
            next_value, next_adv = value, adv
    return advantages, returns, value_mask


def group_means(scores, group_ids):
    """(inverse [B]: each row's group, count [G], mean [G]) of scores [B] within groups: group_ids
    [B] integer labels, or a list of hashables."""
    scores = scores.float()
    if not torch.is_tensor(group_ids):
        labels = {g: i for i, g in enumerate(dict.fromkeys(group_ids))}
        group_ids = torch.tensor([labels[g] for g in group_ids], device=scores.device)
    _, inverse = torch.unique(group_ids, return_inverse=True)
    G = int(inverse.max()) + 1
    count = torch.zeros(G, device=scores.device).index_add_(0, inverse, torch.ones_like(scores))
    mean = torch.zeros(G, device=scores.device).index_add_(0, inverse, scores) / count
    return inverse, count, mean


@torch.no_grad()
def grpo_advantages(scores, group_ids, eps=1e-6, scale_by_std=True):
    """
    GRPO (Shao et al. 2024, DeepSeekMath): a trajectory's advantage is (score - group mean) /
    (group std + eps), std unbiased; scale_by_std=False leaves it mean-centred (Dr. GRPO).
    scores: [B] float; group_ids: [B] (any integer labels, or a list of hashables). Returns [B].
    A group of one has no baseline to compare with and gets advantage 0.
    """
    inverse, count, mean = group_means(scores, group_ids)
    centred = scores.float() - mean[inverse]
    sq = torch.zeros_like(mean).index_add_(0, inverse, centred ** 2)
    std = torch.sqrt(sq / (count - 1).clamp(min=1))
    denom = std[inverse] + eps
    # denom is 0 only when eps = 0 and the group's scores are all equal, and then centred is 0 too
    advantages = centred / torch.where(denom > 0, denom, torch.ones_like(denom)) if scale_by_std else centred
    return torch.where(count[inverse] > 1, advantages, torch.zeros_like(advantages))


@torch.no_grad()
def rloo_advantages(scores, group_ids):
    """
    RLOO (Kool et al. 2019; Ahmadian et al. 2024, "Back to Basics"): each trajectory's baseline is
    the mean of the *other* trajectories of its group, so it does not depend on its own score:
      A_i = s_i - (sum_g - s_i) / (n_g - 1) = n_g / (n_g - 1) * (s_i - mean_g).
    scores: [B] float; group_ids: [B]. Returns [B]. A group of one has no other trajectory and
    gets 0 (as verl's rloo_vectorized; its loop version gives the raw score).
    """
    inverse, count, mean = group_means(scores, group_ids)
    n = count[inverse]
    loo = n / (n - 1).clamp(min=1) * (scores.float() - mean[inverse])
    return torch.where(n > 1, loo, torch.zeros_like(n))


@torch.no_grad()
def outcome_token_advantages(outcome_advantages, process_rewards, mask, steps):
    """
    Advantages of the estimators that compare outcomes (grpo, rloo, reinforce): on the action
    tokens of step k of trajectory n, its outcome advantage outcome_advantages[n] plus the process
    rewards of steps k, k+1, ... of trajectory n, undiscounted and not normalised (as token-level
    rewards-to-go are, verl-style). Normalising the outcome and the process rewards together would
    blow a small process reward up to a full-size advantage: under GRPO two trajectories of one
    outcome, one of them 0.1 richer in process rewards, would get +-0.71. Without process rewards
    this is the outcome advantage on every action token of the trajectory. outcome_advantages:
    [N] per trajectory; process_rewards, mask: [B, T] over rows, with steps as in step_gae (a
    trajectory's steps in one row or a row each). Returns [B, T], zero where mask = 0.
    """
    mask = mask.to(process_rewards.dtype)
    if torch.any((process_rewards != 0) & (mask == 0)):
        raise ValueError("outcome_token_advantages: a non-zero process reward sits on a mask-0 token; "
                         "rewards belong on action tokens")
    check_steps(mask, steps, "outcome_token_advantages")
    advantages = torch.zeros_like(mask)
    for n, trajectory in enumerate(steps):
        to_go = 0.0  # the process rewards of this step and the ones after it
        for row, start, end in reversed(trajectory):
            to_go = to_go + process_rewards[row, start:end].sum()
            advantages[row, start:end] = (outcome_advantages[n] + to_go) * mask[row, start:end]
    return advantages


@torch.no_grad()
def discounted_returns(rewards, mask, steps, gamma):
    """
    REINFORCE++'s return (Hu 2025; verl's compute_reinforce_plus_plus_outcome_advantage) of every
    action token t of a trajectory: G_t = sum over its action tokens k >= t of gamma^(k - t) r_k.
    The tokens between turns (tool results, chat glue) are skipped, not discounted and not a
    boundary: a trajectory's actions, in one row or a row each (steps as in step_gae), are one
    sequence, so an outcome reward on the last turn reaches the first. (verl resets the return at
    every mask-0 token, which in a multi-turn row would leave the earlier turns with only their KL
    penalties.) rewards, mask: [B, T] (rewards on action tokens: the outcome, process rewards, and
    -kl_coef * k1 with kl in the reward). Returns [B, T], zero where mask = 0.
    """
    check_steps(mask, steps, "discounted_returns")
    r, m = rewards.tolist(), mask.tolist()
    returns = [[0.0] * len(row) for row in r]
    for trajectory in steps:
        running = 0.0
        for row, start, end in reversed(trajectory):
            for t in reversed(range(start, end)):
                if m[row][t]:
                    running = r[row][t] + gamma * running
                    returns[row][t] = running
    return torch.tensor(returns, dtype=rewards.dtype, device=rewards.device)


@torch.no_grad()
def whiten(advantages, mask, stats_mask=None, all_reduce=None):
    """
    (advantages - mean) / std on the tokens where mask is 1 (0 elsewhere), mean and unbiased std
    taken over the tokens where stats_mask (default mask) is 1: every action token, or (step-level
    whitening: stats_mask 1 at one token per step) every step once, however long it is. all_reduce:
    sums a list of floats over ranks (common.all_reduce), so that the statistics are the whole
    batch's, not one rank's share of it. advantages, mask, stats_mask: [B, T].
    """
    stats_mask = mask if stats_mask is None else stats_mask
    sums = [stats_mask.sum().item(), masked_sum(advantages, stats_mask).item(),
            masked_sum(advantages ** 2, stats_mask).item()]
    n, s, sq = all_reduce(sums) if all_reduce else sums
    mean = s / max(n, 1)
    var = (sq - n * mean ** 2) / max(n - 1, 1)
    return (advantages - mean) / math.sqrt(var + 1e-8) * mask


def subset_advantages(fn, scores, group_ids, keep):
    """fn(scores, group_ids) (grpo_advantages, rloo_advantages) over the rows where keep [B] bool is True
    alone, as if the others had not been sampled; 0 on the others. Returns [B]."""
    out, kept = torch.zeros_like(scores, dtype=torch.float32), keep.nonzero().flatten()
    if len(kept):
        out[kept] = fn(scores[kept], group_ids[kept])
    return out


def uniform_groups(scores, group_ids, tol=1e-6):
    """
    DAPO's dynamic sampling: [B] bool, True on the rows of groups whose scores all lie within tol
    of each other (a group of one included). Their grpo_advantages are all 0; a group whose outcomes
    are uniform and that earned no process reward carries no policy-gradient signal, and kept in
    the update it would only dilute a token-mean loss's denominator and add KL and entropy terms
    with no reward behind them. scores: [B]; group_ids: [B] integers.
    """
    _, inverse = torch.unique(group_ids, return_inverse=True)
    G = int(inverse.max()) + 1
    high = scores.new_full((G,), -float("inf")).scatter_reduce(0, inverse, scores, "amax")
    low = scores.new_full((G,), float("inf")).scatter_reduce(0, inverse, scores, "amin")
    return (high - low)[inverse] <= tol


# -----------------------------------------------------------------------------
# losses (per token, not reduced)

def segment_mean(x, mask, segments):
    """The mean of x over the mask-1 tokens of each token's segment: [B, T] in and out. segments:
    [B, T] non-negative integer ids (a row, or a step), unique over the tensor."""
    ids = segments.flatten()
    size = int(ids.max()) + 1
    sums = x.new_zeros(size).index_add_(0, ids, (x * mask).flatten())
    counts = x.new_zeros(size).index_add_(0, ids, mask.flatten().to(x.dtype))
    return (sums / counts.clamp(min=1))[ids].view_as(x)


def ppo_policy_loss(logprobs, old_logprobs, advantages, mask, clip_low=0.2, clip_high=0.2, clip_dual=3.0,
                    segments=None):
    """
    Clipped PPO surrogate per token: max(-A*r, -A*clip(r, 1-clip_low, 1+clip_high)), and for A < 0
    the dual clip min(that, -A*clip_dual) bounds the loss when r explodes. r = exp(logp - old_logp).
    With segments ([B, T] ids, see segment_mean) the ratio is GSPO's (Zheng et al. 2025, "Group
    Sequence Policy Optimization"; verl's compute_policy_loss_gspo): one per segment (a sequence,
    or a step), the geometric mean of its tokens' ratios, s = exp(mean over its action tokens of
    logp - old_logp), clipped as a whole; in its token form, r_t = sg(s) * pi(y_t) / sg(pi(y_t)),
    whose value is s and whose gradient is s * grad logp(y_t). GSPO has no dual clip.
    All [B, T]. Returns (per_token_loss zero where mask = 0, stats of detached scalars).
    """
    log_ratio = logprobs - old_logprobs
    if segments is not None:
        log_ratio = logprobs - logprobs.detach() + segment_mean(log_ratio.detach(), mask, segments)
    ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss_ppo = torch.maximum(loss_unclipped, loss_clipped)
    if segments is None:
        dual = (advantages < 0) & (loss_ppo > -advantages * clip_dual)
    else:
        dual = torch.zeros_like(mask, dtype=torch.bool)
    per_token_loss = torch.where(dual, -advantages * clip_dual, loss_ppo) * mask
    with torch.no_grad():
        stats = {
            "clipfrac": masked_mean((loss_clipped > loss_unclipped).float(), mask),
            "dual_clipfrac": masked_mean(dual.float(), mask),
            "approx_kl": masked_mean(kl_penalty(old_logprobs, logprobs, "k3"), mask),  # KL(old || new)
        }
    return per_token_loss, stats


def clipped_value_loss(values, old_values, returns, mask, clip_range=0.2):
    """
    PPO value loss per token: 0.5 * max((v - R)^2, (old_v + clip(v - old_v, -c, c) - R)^2).
    All [B, T]. Returns (per_token_loss zero where mask = 0, stats).
    """
    values_clipped = old_values + (values - old_values).clamp(-clip_range, clip_range)
    loss_unclipped = (values - returns) ** 2
    loss_clipped = (values_clipped - returns) ** 2
    per_token_loss = 0.5 * torch.maximum(loss_unclipped, loss_clipped) * mask
    with torch.no_grad():
        stats = {"vf_clipfrac": masked_mean((loss_clipped > loss_unclipped).float(), mask)}
    return per_token_loss, stats


def kl_penalty(logprobs, ref_logprobs, estimator="k3"):
    """
    Per-token estimators of KL(pi || pi_ref) from samples of pi (Schulman, "Approximating KL"):
    k1 = log(pi/ref) (unbiased, high variance, can be negative; PPO's penalty in the reward),
    k3 = ref/pi - 1 - log(ref/pi) (unbiased, always >= 0; GRPO's loss term); the log-ratio is
    clamped before exp.
    """
    log_ratio = logprobs - ref_logprobs
    if estimator == "k1":
        return log_ratio
    if estimator == "k3":
        neg = (-log_ratio).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        return torch.exp(neg) - 1.0 - neg
    raise ValueError(f"unknown KL estimator {estimator!r}; valid: k1, k3")


def truncated_is_weights(trainer_logprobs, rollout_logprobs, mask, cap=2.0):
    """
    Truncated importance-sampling weights min(pi_trainer / pi_engine, cap) per token: the engine
    (vLLM, other kernels, other precision) samples from a slightly different distribution than the
    trainer computes; multiplying the per-token loss by these weights corrects for it (detached).
    """
    log_ratio = (trainer_logprobs - rollout_logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return (torch.exp(log_ratio).clamp(max=cap) * mask).detach()


# -----------------------------------------------------------------------------
# from per-token losses to one scalar

def unit_counts(mask, units, rows, all_reduce=None):
    """
    The denominators that make every micro-batch's loss its share of one global mean (see
    aggregate_loss), over the tokens where mask [B, T] is 1 in the rows `rows` (a mini-batch's on
    this rank): (tokens, units with such tokens, unit_tokens [B, T]: on every token, its unit's
    count of them), the first two summed over ranks by all_reduce. units: [B, T] each token's unit,
    a non-negative id (its trajectory, or its step); a unit's tokens must all be on one rank.
    """
    per_unit = torch.zeros(int(units.max()) + 1).index_add_(0, units[rows].flatten(), mask[rows].flatten())
    sums = [per_unit.sum().item(), (per_unit > 0).sum().item()]
    tokens, count = all_reduce(sums) if all_reduce else sums
    return tokens, count, per_unit[units]


LOSS_AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "step_mean_token_mean")


def aggregate_loss(per_token_loss, mask, mode, global_tokens, global_units, unit_tokens=None):
    """
    This micro-batch's share of the loss of the whole global batch; summing the shares over all
    micro-batches and ranks gives the global loss, so the gradient does not depend on the split.
    per_token_loss, mask: [B, T]. global_tokens / global_units: the number of action tokens / of
    units (sequences, or steps) with at least one action token in the global (mini-)batch, over all
    micro-batches and ranks.
      token_mean:           sum of all action-token losses / global_tokens (every token weighs the same).
      seq_mean_token_mean:  mean over tokens within each sequence (a trajectory), then sum / global_units
                            (every trajectory weighs the same, whatever its length);
      step_mean_token_mean: the same with a step (a turn) as the unit: every turn weighs the same
                            (StepPO's seq-mean-token-mean, whose rows are steps).
    The unit of a token may span several rows (a trajectory with a row per turn) or part of one (a
    turn of a full-context row): unit_tokens ([B, T], or [B, 1]) gives each token its unit's
    action-token count, so that the shares of a unit's tokens add up to its mean; by default each
    row is a unit of its own. verl's names (its agg_loss) with the unit said.
    """
    if mode == "token_mean":
        return masked_sum(per_token_loss, mask) / global_tokens
    if mode in LOSS_AGGREGATIONS:
        unit_tokens = mask.sum(-1, keepdim=True) if unit_tokens is None else unit_tokens
        return masked_sum(per_token_loss / unit_tokens.clamp(min=1), mask) / global_units
    raise ValueError(f"unknown loss aggregation {mode!r}; valid: {', '.join(LOSS_AGGREGATIONS)}")
