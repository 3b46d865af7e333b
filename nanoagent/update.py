"""
The update: PPO epochs over mini-batches of a step's kept rows, one optimizer step of the critic and then
of the policy on each. Every loss is a global mean over ranks and micro-batches (of tokens, trajectories or
turns: train.loss_agg), its terms from nanoagent/rl.py; a non-finite loss or gradient skips the step.
"""

import math
import random

import torch

from nanoagent import rl
from nanoagent.batch import micro_steps, unpack
from nanoagent.common import all_reduce
from nanoagent.model import critic_forward, policy_forward


def loss_units(batch, cfg):
    """[R, L] each token's unit in train.loss_agg's mean: its step (step_mean_token_mean), else its
    trajectory."""
    if cfg.train.loss_agg == "step_mean_token_mean":
        return batch["step"]
    return batch["trajectory"][:, None].expand_as(batch["action_mask"])


def get_lr(step, base_lr, cfg):
    """The learning rate at a training step (0-based): a linear warm-up over the first
    cfg.train.warmup_steps, then constant (lr_schedule=constant) or down towards 0 at step cfg.steps,
    in a line or along half a cosine (TRL's linear default, verl's cosine): the last step's is
    base_lr / (steps - warm-up) in a line."""
    warmup, schedule = cfg.train.warmup_steps, cfg.train.lr_schedule
    if step < warmup or schedule == "constant":
        return base_lr * min(1.0, (step + 1) / max(1, warmup))
    left = 1 - (step - warmup) / max(1, cfg.steps - warmup)  # 1 at the first step after the warm-up
    return base_lr * (left if schedule == "linear" else 0.5 * (1 - math.cos(math.pi * left)))


def set_hyperparameters(optimizers, step, cfg):
    """The optimizers' learning rate and weight decay at a step, from the config in effect: a resumed
    optimizer comes back with the values it was saved with."""
    for name, optimizer in optimizers.items():
        base_lr = cfg.train.lr if name == "policy" else cfg.ppo.critic_lr
        for group in optimizer.param_groups:
            group["lr"] = get_lr(step, base_lr, cfg)
            group["weight_decay"] = cfg.train.weight_decay


def optimizer_step(model, optimizer, loss_sum, grad_clip):
    """Clip and step, unless the loss or the gradient norm is not finite on any rank: then the
    gradients are dropped and the step is skipped. Returns (grad_norm, skipped)."""
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    if hasattr(grad_norm, "full_tensor"):  # a DTensor: the norm over every rank's shard
        grad_norm = grad_norm.full_tensor()
    grad_norm = grad_norm.item()
    [loss] = all_reduce([loss_sum])
    finite = math.isfinite(loss) and math.isfinite(grad_norm)
    if finite:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm, float(not finite)


def ppo_epochs(models, optimizers, data, n_mini, policy_moves, on_policy, cfg, step, rank, world, device):
    """
    PPO epochs over n_mini mini-batches of the kept rows (a trajectory's rows stay in one mini-batch): the
    critic's step, then the policy's (policy_moves: not in the critic's warm-up). Every rank takes the
    n_mini optimizer steps (collectives); one with no rows runs zero-weight passes. Returns the policy's
    and the critic's [(shares, globals)], and the on-policy update's own old logprobs (update_policy).
    """
    batch, rows_of = data.batch, {}  # trajectory -> its kept rows
    for row in data.kept:
        rows_of.setdefault(batch["trajectory"][row].item(), []).append(row)
    policy_updates, critic_updates, own_logprobs = [], [], None
    order_rng = random.Random(f"{cfg.seed}-{step}-{rank}")
    for epoch in range(cfg.ppo.epochs):
        order = list(rows_of)
        order_rng.shuffle(order)
        for m in range(n_mini):
            chosen = order[m * len(order) // n_mini:(m + 1) * len(order) // n_mini]
            rows = [row for i in chosen for row in rows_of[i]]
            if "critic" in models:
                critic_updates.append(update_critic(models["critic"], optimizers["critic"], batch, rows, cfg,
                                                    world, device))
            if policy_moves:
                shares, stats, own_logprobs = update_policy(models["policy"], optimizers["policy"], batch,
                                                            rows, on_policy, cfg, world, device)
                policy_updates.append((shares, stats))
    return policy_updates, critic_updates, own_logprobs


def update_policy(policy, optimizer, batch, rows, on_policy, cfg, world, device):
    """
    One optimizer step of the policy on a mini-batch (this rank's rows). Returns (shares, globals,
    own_logprobs): this rank's share of each loss statistic (they add up over ranks), the values every
    rank already agrees on, and on_policy (the step's only update) the old logprobs and nucleus logprobs
    [R, L] of this forward, detached (ratio 1), else None.
    """
    mask_of, budget = batch["action_mask"], cfg.train.micro_batch_tokens
    units = loss_units(batch, cfg)
    global_tokens, global_units, unit_tokens = rl.unit_counts(mask_of, units, rows, all_reduce)
    shares = {"pg_loss": 0.0, "clipfrac": 0.0, "approx_kl": 0.0, "entropy": 0.0, "kl_loss": 0.0}
    own_logprobs = (torch.zeros_like(mask_of), torch.zeros_like(mask_of)) if on_policy else None
    for layout, get in micro_steps({**batch, "unit_tokens": unit_tokens}, rows, budget, device):
        actions = get("action_mask")
        mask = actions * (1.0 if layout.rows else 0.0)
        top_p = cfg.rollout.top_p if on_policy else None
        logprobs, entropy, nucleus = policy_forward(policy, get("input_ids"), get("position_ids"),
                                                    actions > 0, cfg.rollout.temperature, top_p)
        if on_policy:
            old_logprobs = logprobs.detach()
            unpack(old_logprobs, layout, own_logprobs[0])
            unpack(nucleus, layout, own_logprobs[1])
        else:
            old_logprobs = get("old_logprobs")
        # GSPO: one ratio per row (ppo.ratio=sequence) or per step
        segments = None if cfg.ppo.ratio == "token" else get("step" if cfg.ppo.ratio == "step" else "row")
        per_token, pg_stats = rl.ppo_policy_loss(logprobs, old_logprobs, get("advantages"), mask,
                                                 cfg.ppo.clip_low, cfg.ppo.clip_high, cfg.ppo.clip_dual,
                                                 segments)
        if cfg.train.tis:  # the engine sampled from a slightly different distribution than the trainer's
            weights = rl.truncated_is_weights(old_logprobs, get("rollout_logprobs"), mask, cfg.train.tis_cap)
            per_token = per_token * weights
        if cfg.train.kl_mode == "loss":
            kl = rl.kl_penalty(logprobs, get("ref_logprobs"), "k3")
            per_token = per_token + cfg.train.kl_coef * kl
            shares["kl_loss"] += rl.masked_sum(kl.detach(), mask).item() / global_tokens
        if cfg.train.entropy_coef:  # otherwise the entropy is only logged, and no gradient flows through it
            per_token = per_token - cfg.train.entropy_coef * entropy
        loss = rl.aggregate_loss(per_token, mask, cfg.train.loss_agg, global_tokens, global_units,
                                 get("unit_tokens"))
        (loss * world).backward()  # FSDP averages rank gradients; the loss is already a global mean
        n = mask.sum().item() / global_tokens
        shares["pg_loss"] += loss.item()
        shares["clipfrac"] += pg_stats["clipfrac"].item() * n
        shares["approx_kl"] += pg_stats["approx_kl"].item() * n
        shares["entropy"] += rl.masked_sum(entropy.detach(), mask).item() / global_tokens
    grad_norm, skipped = optimizer_step(policy, optimizer, shares["pg_loss"], cfg.train.grad_clip)
    return shares, {"grad_norm": grad_norm, "skipped": skipped}, own_logprobs


def update_critic(critic, optimizer, batch, rows, cfg, world, device):
    """One optimizer step of the critic on a mini-batch: clipped value loss where value_mask is 1 (action
    tokens; with ppo.credit=step each step's first, where its value is read), a global mean. Returns
    (shares, globals)."""
    units = loss_units(batch, cfg)
    global_tokens, global_units, unit_tokens = rl.unit_counts(batch["value_mask"], units, rows, all_reduce)
    shares = {"vf_loss": 0.0, "vf_clipfrac": 0.0}
    for layout, get in micro_steps({**batch, "unit_tokens": unit_tokens}, rows, cfg.train.micro_batch_tokens,
                                   device):
        read = get("value_mask")
        mask = read * (1.0 if layout.rows else 0.0)
        values = critic_forward(critic, get("input_ids"), get("position_ids"), read > 0)
        per_token, vf_stats = rl.clipped_value_loss(values, get("values"), get("returns"), mask,
                                                    cfg.ppo.value_clip)
        loss = rl.aggregate_loss(per_token, mask, cfg.train.loss_agg, global_tokens, global_units,
                                 get("unit_tokens"))
        (loss * world).backward()
        shares["vf_loss"] += loss.item()
        shares["vf_clipfrac"] += vf_stats["vf_clipfrac"].item() * mask.sum().item() / global_tokens
    grad_norm, skipped = optimizer_step(critic, optimizer, shares["vf_loss"], cfg.train.grad_clip)
    return shares, {"vf_grad_norm": grad_norm, "vf_skipped": skipped}
