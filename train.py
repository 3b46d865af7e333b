"""
Train an LLM agent with end-to-end RL over multi-turn tool use: PPO with a critic and mask-aware
GAE, or GRPO. One process per GPU (or CPU rank) under torchrun, FSDP2 for training, and a
colocated rollout engine in every rank that gets the new weights after every update.

    torchrun --nproc_per_node=8 train.py --config=hotpotqa algo=grpo model=Qwen/Qwen2.5-3B-Instruct
    torchrun --nproc_per_node=2 train.py --config=tiny algo=ppo steps=2 run_dir=out/tiny   # CPU
    python train.py --config=tiny train.warm_start_steps=400 train.warm_start_lr=3e-3      # one process

One step, top to bottom:
  1. rollout: every rank rolls out its share of the prompts (G times each), multi-turn with tools;
  2. rewards: the task scores each trajectory; the outcome reward sits on the last action token,
     process rewards on the last action token of their turn, and (kl_mode=reward) -kl_coef * k1;
  3. the engine sleeps; the trainer recomputes old logprobs, reference logprobs and values;
  4. advantages: masked GAE over action tokens (ppo) or group-normalised scores (grpo);
  5. PPO epochs over mini-batches: clipped policy loss (+ k3 KL loss, entropy bonus, truncated
     importance weights) and clipped value loss, each a global token mean across micro-batches
     and ranks; a non-finite loss or gradient skips the update;
  6. the new weights go into the engine; one line of metrics.
"""

import argparse
import math
import os
import random
import signal
import sys
import time

import numpy as np
import torch
from transformers import AutoTokenizer

from nanoagent import rl
from nanoagent.agent import rollout_metrics, run_agent, scripted_trajectory
from nanoagent.checkpoint import export_hf, latest_checkpoint, load_checkpoint, save_checkpoint
from nanoagent.common import MetricsLog, all_reduce, init_distributed, print0, reduce_metrics, resolve_model, seed_everything
from nanoagent.config import ConfigError, format_config, make_config, reference, save_config, to_dict
from nanoagent.data import arithmetic_demonstration, arithmetic_task, fit_prompts, load_prompts
from nanoagent.engine import SamplingConfig, make_engine, pad_token_id
from nanoagent.model import (build_critic, build_policy, build_reference, critic_forward, micro_batches, pad_rows, policy_forward,
                             read_weights, training_config)
from nanoagent.reward import score_trajectory
from nanoagent.synthetic import synthetic_demonstration
from nanoagent.tools import ToolEnv, calculator_tool, make_tools


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, epilog=reference(), formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=None, help="preset name (tiny, demo, hotpotqa); default: the built-in defaults")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, dotted keys")
    args = parser.parse_args(argv)
    try:
        cfg = make_config(args.config, args.overrides)
    except ConfigError as e:
        parser.error(str(e))
    if cfg.rollout.tensor_parallel_size != 1:
        parser.error(f"rollout.tensor_parallel_size={cfg.rollout.tensor_parallel_size}: train.py takes 1 only. vLLM's external "
                     "launcher needs every rank of a tensor-parallel group to submit identical requests, and each rank here "
                     "rolls out its own prompts with its own seeds; use one engine per rank (a 7B model fits one GPU)")
    return cfg


# -----------------------------------------------------------------------------
# the task: prompts, tools, reward

def load_task(cfg, tokenizer):
    """(train rows, val rows, tool environment, demonstration function or None) for
    cfg.data.task, every prompt checked against data.max_prompt_tokens."""
    if cfg.data.task == "arithmetic":
        train, val = arithmetic_task(cfg.data.num_train, cfg.seed, "train"), arithmetic_task(cfg.data.num_val, cfg.seed, "val")
        tools, sources, demonstrate = [calculator_tool()], ("arithmetic train", "arithmetic val"), arithmetic_demonstration
    else:  # synthetic and hotpotqa: prompt files from prepare_data.py, search over an index from build_index.py
        train, val = load_prompts(cfg.data.train_path), load_prompts(cfg.data.val_path)
        tools, sources = make_tools(["search"], cfg.data.index_dir, top_k=cfg.rollout.search_top_k), (cfg.data.train_path, cfg.data.val_path)
        demonstrate = synthetic_demonstration if cfg.data.task == "synthetic" else None
    env = ToolEnv(tools, tokenizer, cfg.rollout.max_obs_tokens, cfg.rollout.tool_timeout_s)
    train, val = (fit_prompts(rows, env.prompt_lengths([r["messages"] for r in rows]), cfg.data.max_prompt_tokens,
                              cfg.data.bad_prompts, source) for rows, source in zip((train, val), sources))
    return train, val, env, demonstrate


def step_prompts(rows, step, per_rank, rank, world, seed, shuffle):
    """The prompts of one step for one rank: a deterministic function of the step (the data
    position is step x prompts per step), in an order drawn anew every epoch."""
    start = (step * world + rank) * per_rank
    epochs, indices = np.divmod(np.arange(start, start + per_rank), len(rows))
    orders = {e: np.random.default_rng([seed, e]).permutation(len(rows)) if shuffle else np.arange(len(rows)) for e in set(epochs.tolist())}
    return [rows[orders[e][i]] for e, i in zip(epochs.tolist(), indices.tolist())]


# -----------------------------------------------------------------------------
# trajectories -> padded tensors

def collate(trajs, pad_id):
    """
    Rows `prompt | response` right-padded to [B, L]. action_mask and rollout_logprobs are laid
    over the whole row (0 on the prompt and padding), so every per-token tensor shares one index.
    """
    rows = [t.prompt_ids + t.response_ids for t in trajs]
    return {
        "input_ids": pad_rows(rows, pad_id),
        "attention_mask": pad_rows([[1] * len(r) for r in rows], 0),
        "action_mask": pad_rows([[0] * len(t.prompt_ids) + t.action_mask for t in trajs], 0, torch.float32),
        "rollout_logprobs": pad_rows([[0.0] * len(t.prompt_ids) + t.rollout_logprobs for t in trajs], 0.0, torch.float32),
        "lengths": [len(r) for r in rows],
    }


def token_rewards(trajs, batch, tool_call_reward):
    """[B, L] rewards on action tokens: the outcome on the last action token of the trajectory,
    the process reward on the last action token of each turn whose tool calls all succeeded."""
    rewards = torch.zeros_like(batch["action_mask"])
    for i, t in enumerate(trajs):
        P = len(t.prompt_ids)
        if tool_call_reward:
            for turn, (s, e) in enumerate(t.turn_spans):
                calls = [c for c in t.tool_calls if c.turn == turn]
                if calls and not any(c.error for c in calls) and turn < len(t.turn_spans) - 1:
                    rewards[i, P + e - 1] += tool_call_reward
        last = P + t.turn_spans[-1][1] - 1
        rewards[i, last] += t.reward
    return rewards


def synced_micro_batches(lengths, token_budget):
    """
    micro_batches(), with the same count on every rank: each FSDP forward and backward is a
    collective, so a rank with fewer micro-batches would leave the others waiting forever. Short
    ranks split their largest micro-batches, then add empty ones ([]), which callers run as a
    zero-weight pass over one row.
    """
    batches = micro_batches(lengths, token_budget)
    [count] = all_reduce([len(batches)], "max")
    while len(batches) < count:
        largest = max(range(len(batches)), key=lambda b: len(batches[b]))
        if len(batches[largest]) > 1:
            half = len(batches[largest]) // 2
            batches[largest:largest + 1] = [batches[largest][:half], batches[largest][half:]]
        else:
            batches.append([])
    return batches


def global_counts(batch, rows):
    """Action tokens and sequences with action tokens in a mini-batch, over all ranks: the
    denominators that make every micro-batch's loss its share of one global mean."""
    mask = batch["action_mask"][rows]
    return all_reduce([mask.sum().item(), (mask.sum(-1) > 0).sum().item()])


def micro_steps(batch, rows, token_budget, device):
    """
    The micro-batches of `rows` (this rank's row indices into batch), kept in step across ranks:
    the one iterator every forward and backward pass goes through. Yields (idx, get): idx the rows
    of the micro-batch, get(key) that tensor for them on the device, cut to their longest row.
    An empty micro-batch comes as idx [] and get() over one row, so its collectives still run;
    its results must be given weight 0.
    """
    lengths = [batch["lengths"][i] for i in rows]
    for micro in synced_micro_batches(lengths, token_budget):
        idx = [rows[i] for i in micro]
        run = idx or rows[:1]
        width = max(batch["lengths"][i] for i in run)

        def get(key, run=run, width=width):
            return batch[key][run, :width].to(device)
        yield idx, get


@torch.no_grad()
def forward_all(model_fn, batch, micro_batch_tokens, device):
    """A per-token forward function (ids, attention -> [b, l]) over all rows; [B, L] on the CPU."""
    out = torch.zeros(batch["input_ids"].shape)
    for idx, get in micro_steps(batch, list(range(len(batch["lengths"]))), micro_batch_tokens, device):
        result = model_fn(get("input_ids"), get("attention_mask"))
        if idx:
            out[idx, :result.shape[1]] = result.float().cpu()
    return out


# -----------------------------------------------------------------------------
# the update

def optimizer_step(model, optimizer, scheduler, loss_sum, grad_clip):
    """Clip and step, unless the loss or the gradient norm is not finite on any rank: then the
    gradients are dropped and the step is skipped. Returns (grad_norm, skipped)."""
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    grad_norm = (grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm).item()  # the same on every rank
    [loss] = all_reduce([loss_sum])
    finite = math.isfinite(loss) and math.isfinite(grad_norm)
    if finite:
        optimizer.step()
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm, float(not finite)


def update_policy(policy, optimizer, scheduler, batch, rows, cfg, world, device):
    """
    One optimizer step of the policy on a mini-batch (row indices of this rank). Returns
    (shares, globals): this rank's share of each loss statistic (they add up over ranks to the
    mini-batch's value) and the values every rank already agrees on (grad norm, skipped).
    """
    global_tokens, global_seqs = global_counts(batch, rows)
    shares = {"pg_loss": 0.0, "clipfrac": 0.0, "approx_kl": 0.0, "entropy": 0.0, "kl_loss": 0.0}
    for idx, get in micro_steps(batch, rows, cfg.train.micro_batch_tokens, device):
        mask = get("action_mask") * (1.0 if idx else 0.0)
        logprobs, entropy = policy_forward(policy, get("input_ids"), get("attention_mask"), cfg.rollout.temperature)
        per_token, pg_stats = rl.ppo_policy_loss(logprobs, get("old_logprobs"), get("advantages"), mask,
                                                 cfg.ppo.clip_low, cfg.ppo.clip_high, cfg.ppo.clip_dual)
        if cfg.train.tis:  # the engine sampled from a slightly different distribution than the trainer computes
            per_token = per_token * rl.truncated_is_weights(get("old_logprobs"), get("rollout_logprobs"), mask, cfg.train.tis_cap)
        if cfg.train.kl_mode == "loss":
            kl = rl.kl_penalty(logprobs, get("ref_logprobs"), "k3")
            per_token = per_token + cfg.train.kl_coef * kl
            shares["kl_loss"] += rl.masked_sum(kl.detach(), mask).item() / global_tokens
        if cfg.train.entropy_coef:  # otherwise the entropy is only logged, and no gradient flows through it
            per_token = per_token - cfg.train.entropy_coef * entropy
        loss = rl.aggregate_loss(per_token, mask, cfg.train.loss_agg, global_tokens, global_seqs)
        (loss * world).backward()  # FSDP averages rank gradients; the loss is already a global mean
        n = mask.sum().item() / global_tokens
        shares["pg_loss"] += loss.item()
        shares["clipfrac"] += pg_stats["clipfrac"].item() * n
        shares["approx_kl"] += pg_stats["approx_kl"].item() * n
        shares["entropy"] += rl.masked_sum(entropy.detach(), mask).item() / global_tokens
    grad_norm, skipped = optimizer_step(policy, optimizer, scheduler, shares["pg_loss"], cfg.train.grad_clip)
    return shares, {"grad_norm": grad_norm, "skipped": skipped}


def update_critic(critic, optimizer, scheduler, batch, rows, cfg, world, device):
    """One optimizer step of the critic on a mini-batch: clipped value loss, global token mean.
    Returns (shares, globals) like update_policy."""
    global_tokens, global_seqs = global_counts(batch, rows)
    shares = {"vf_loss": 0.0, "vf_clipfrac": 0.0}
    for idx, get in micro_steps(batch, rows, cfg.train.micro_batch_tokens, device):
        mask = get("action_mask") * (1.0 if idx else 0.0)
        values = critic_forward(critic, get("input_ids"), get("attention_mask"))
        per_token, vf_stats = rl.clipped_value_loss(values, get("values"), get("returns"), mask, cfg.ppo.value_clip)
        loss = rl.aggregate_loss(per_token, mask, cfg.train.loss_agg, global_tokens, global_seqs)
        (loss * world).backward()
        shares["vf_loss"] += loss.item()
        shares["vf_clipfrac"] += vf_stats["vf_clipfrac"].item() * mask.sum().item() / global_tokens
    grad_norm, skipped = optimizer_step(critic, optimizer, scheduler, shares["vf_loss"], cfg.train.grad_clip)
    return shares, {"vf_grad_norm": grad_norm, "vf_skipped": skipped}


def imitate(policy, env, rows, demonstrate, cfg, rank, world, device):
    """
    Warm start by imitation of the task's scripted demonstrations, through the same trajectory
    assembly, forward, mask and loss aggregation as RL: maximise the logprob of the demonstrated
    action tokens (mask = 1), a global token mean. Its own AdamW, so RL's optimizer starts fresh.
    """
    rng = random.Random(f"{cfg.seed}-demos-{rank}")
    demos = [scripted_trajectory(env, row, demonstrate(row, rng)) for row in rows[rank::world]]
    optimizer = torch.optim.AdamW(policy.parameters(), lr=cfg.train.warm_start_lr, weight_decay=0.0)
    per_rank = cfg.ppo.mini_batch_size // world
    for step in range(cfg.train.warm_start_steps):
        batch = collate([demos[rng.randrange(len(demos))] for _ in range(per_rank)], pad_token_id(env.tokenizer))
        rows = list(range(per_rank))
        global_tokens, _ = global_counts(batch, rows)
        loss_sum = 0.0
        for idx, get in micro_steps(batch, rows, cfg.train.micro_batch_tokens, device):
            logprobs, _ = policy_forward(policy, get("input_ids"), get("attention_mask"))
            loss = rl.aggregate_loss(-logprobs, get("action_mask") * (1.0 if idx else 0.0), "token_mean", global_tokens, None)
            (loss * world).backward()
            loss_sum += loss.item()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), cfg.train.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        [loss_sum] = all_reduce([loss_sum])
        if step % 20 == 0 or step == cfg.train.warm_start_steps - 1:
            print0(f"warm start {step + 1:4d}/{cfg.train.warm_start_steps} | nll {loss_sum:.4f}")


def full_tensors(model):
    """(name, full tensor) for every parameter, all-gathered one at a time: every rank's engine
    gets the whole model without any rank holding a second full copy at once. Tied parameters
    are sent under each of their names: vLLM's CPU backend keeps a repacked copy of the LM head
    that is not updated through the embedding."""
    for name, param in model.named_parameters(remove_duplicate=False):
        yield name, param.full_tensor() if hasattr(param, "full_tensor") else param.data


def evaluate(engine, env, rows, cfg, rank, world):
    """Greedy rollouts on this rank's share of the held-out prompts; means over all ranks."""
    mine = rows[:cfg.eval.num_prompts][rank::world]
    trajs = run_agent(engine, env, mine, SamplingConfig(cfg.rollout.max_new_tokens, greedy=True), cfg.rollout.max_turns, cfg.rollout.max_context_tokens)
    for t in trajs:
        score_trajectory(t, cfg.reward)
    keys = ["reward", "em", "substring_em", "f1", "turns"]
    sums = [sum(t.reward for t in trajs)] + [sum(t.scores[k] for t in trajs) for k in keys[1:4]] + [sum(len(t.turn_spans) for t in trajs)]
    totals = all_reduce(sums + [len(trajs)])
    return {f"eval/{k}": v / max(totals[-1], 1) for k, v in zip(keys, totals[:-1])}


def mean_over_updates(results):
    """[(shares, globals)] of one model's optimizer steps in this step -> their means."""
    mean = lambda dicts: {k: sum(d[k] for d in dicts) / len(dicts) for k in dicts[0]} if dicts else {}  # noqa: E731
    return mean([r[0] for r in results]), mean([r[1] for r in results])


# -----------------------------------------------------------------------------

def main(argv=None):
    cfg = parse_args(sys.argv[1:] if argv is None else argv)
    model_path = resolve_model(cfg.model)  # before the process group: see resolve_model
    rank, world, device = init_distributed()
    seed_everything(cfg.seed + rank)
    per_rank = cfg.rollout.prompts_per_step // world
    if per_rank * world != cfg.rollout.prompts_per_step or cfg.ppo.mini_batch_size % world:
        raise ConfigError(f"rollout.prompts_per_step ({cfg.rollout.prompts_per_step}) and ppo.mini_batch_size "
                          f"({cfg.ppo.mini_batch_size}) must be multiples of the number of ranks ({world})")
    os.makedirs(cfg.run_dir, exist_ok=True)
    if rank == 0:
        save_config(cfg, os.path.join(cfg.run_dir, "config.json"))
    print0(format_config(cfg))
    log = MetricsLog(cfg.run_dir, to_dict(cfg), cfg.log.wandb, cfg.log.wandb_project)

    # the task: prompts (checked here, before any collective), tools, demonstrations
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    train_rows, val_rows, env, demonstrate = load_task(cfg, tokenizer)

    # the models, built sharded from rank 0's copy of the weights: policy, critic (ppo), frozen
    # reference (only with a KL term). bf16 compute means the same on a CPU as on a GPU.
    compute_dtype = torch.bfloat16 if cfg.train.dtype == "bfloat16" else torch.float32
    config, weights = training_config(model_path), read_weights(model_path)
    policy = build_policy(config, weights, device, compute_dtype, cfg.train.activation_checkpointing)
    opt_policy = torch.optim.AdamW(policy.parameters(), lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)
    warmup = lambda i: min(1.0, (i + 1) / max(1, cfg.train.warmup_steps))  # noqa: E731
    models, optimizers = {"policy": policy}, {"policy": opt_policy}
    schedulers = {"policy": torch.optim.lr_scheduler.LambdaLR(opt_policy, warmup)}
    critic = ref = None
    if cfg.algo == "ppo":
        critic = build_critic(config, weights, device, compute_dtype, cfg.train.activation_checkpointing)
        models["critic"] = critic
        optimizers["critic"] = torch.optim.AdamW(critic.parameters(), lr=cfg.ppo.critic_lr, weight_decay=cfg.train.weight_decay)
        schedulers["critic"] = torch.optim.lr_scheduler.LambdaLR(optimizers["critic"], warmup)
    if cfg.train.kl_mode != "none":
        ref = build_reference(config, weights, device, compute_dtype)
    del weights

    # the rollout engine, colocated in this process
    engine = make_engine(cfg.rollout.engine, model_path, tokenizer, cfg.rollout.max_context_tokens, cfg.rollout.dtype,
                         cfg.rollout.gpu_memory_utilization, cfg.rollout.tensor_parallel_size, cfg.seed + rank)
    sampling = SamplingConfig(cfg.rollout.max_new_tokens, cfg.rollout.temperature, cfg.rollout.top_p)

    # resume, or warm start
    start_step = 0
    checkpoint = latest_checkpoint(cfg.run_dir) if cfg.resume == "auto" else None
    if checkpoint:
        start_step, _ = load_checkpoint(checkpoint, models, optimizers, schedulers)
        print0(f"resumed from {checkpoint} at step {start_step}")
    elif cfg.train.warm_start_steps:
        if demonstrate is None:
            raise ConfigError(f"train.warm_start_steps > 0 but data.task={cfg.data.task} has no demonstrations")
        imitate(policy, env, train_rows, demonstrate, cfg, rank, world, device)
    engine.load_weights(full_tensors(policy))

    if cfg.eval.every and start_step == 0:  # where RL starts from
        metrics = {"step": 0, **evaluate(engine, env, val_rows, cfg, rank, world)}
        print0(" | ".join(f"{k} {v:.3f}" for k, v in metrics.items()))
        log.log(metrics)

    stop = {"sigterm": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(sigterm=True))

    for step in range(start_step, cfg.steps):
        t0 = time.perf_counter()
        # 1. rollout: G samples of each of this rank's prompts, multi-turn with tools
        prompts = step_prompts(train_rows, step, per_rank, rank, world, cfg.seed, cfg.data.shuffle)
        samples = [p for p in prompts for _ in range(cfg.rollout.group_size)]
        engine.wake()
        trajs = run_agent(engine, env, samples, sampling, cfg.rollout.max_turns, cfg.rollout.max_context_tokens,
                          seed=cfg.seed * 100_003 + step * world + rank)
        engine.sleep()
        # 2. rewards
        for t in trajs:
            score_trajectory(t, cfg.reward)
        batch = collate(trajs, pad_token_id(tokenizer))
        mask = batch["action_mask"]
        rewards = token_rewards(trajs, batch, cfg.train.tool_call_reward)
        t1 = time.perf_counter()
        # 3. old logprobs (recomputed by the trainer), reference logprobs, values
        batch["old_logprobs"] = forward_all(lambda i, a: policy_forward(policy, i, a, cfg.rollout.temperature)[0], batch,
                                            cfg.train.micro_batch_tokens, device) * mask
        engine_diff = ((batch["old_logprobs"] - batch["rollout_logprobs"]).abs() * mask).max().item()
        if ref is not None:
            batch["ref_logprobs"] = forward_all(lambda i, a: policy_forward(ref, i, a, cfg.rollout.temperature)[0], batch,
                                                cfg.train.micro_batch_tokens, device) * mask
            kl = rl.kl_penalty(batch["old_logprobs"], batch["ref_logprobs"], "k1") * mask
            if cfg.train.kl_mode == "reward":  # ppo only (config.validate): k1 on every action token
                rewards = rewards - cfg.train.kl_coef * kl
        t2 = time.perf_counter()
        # 4. advantages
        if cfg.algo == "ppo":
            batch["values"] = forward_all(lambda i, a: critic_forward(critic, i, a), batch, cfg.train.micro_batch_tokens, device) * mask
            advantages, batch["returns"] = rl.masked_gae(rewards, batch["values"], mask, cfg.ppo.gamma, cfg.ppo.lam)
            if cfg.ppo.whiten_advantages:  # over the action tokens of all ranks
                n, s, sq = all_reduce([mask.sum().item(), rl.masked_sum(advantages, mask).item(), rl.masked_sum(advantages ** 2, mask).item()])
                mean = s / max(n, 1)
                var = (sq - n * mean ** 2) / max(n - 1, 1)
                advantages = (advantages - mean) / math.sqrt(var + 1e-8) * mask
        else:
            scores = rewards.sum(-1)  # outcome + process rewards of each trajectory
            groups = torch.arange(len(prompts)).repeat_interleave(cfg.rollout.group_size)
            advantages = rl.grpo_advantages(scores, groups, cfg.grpo.eps, cfg.grpo.scale_by_std)[:, None] * mask
        batch["advantages"] = advantages
        # 5. PPO epochs over mini-batches
        policy_updates, critic_updates = [], []
        rows_per_mini = cfg.ppo.mini_batch_size // world
        order_rng = random.Random(f"{cfg.seed}-{step}-{rank}")
        for epoch in range(cfg.ppo.epochs):
            order = list(range(len(trajs)))
            order_rng.shuffle(order)
            for s in range(0, len(order), rows_per_mini):
                rows = order[s:s + rows_per_mini]
                if critic is not None:
                    critic_updates.append(update_critic(critic, optimizers["critic"], schedulers["critic"], batch, rows, cfg, world, device))
                if cfg.algo != "ppo" or step >= cfg.ppo.critic_warmup_steps:
                    policy_updates.append(update_policy(policy, opt_policy, schedulers["policy"], batch, rows, cfg, world, device))
        t3 = time.perf_counter()
        # 6. the new weights into the engine
        engine.wake(["weights"])
        engine.load_weights(full_tensors(policy))
        engine.wake(["kv_cache"])
        t4 = time.perf_counter()

        # metrics, reduced over ranks once: sums of this rank's shares, and maxes
        rollout = rollout_metrics(trajs)
        policy_shares, policy_globals = mean_over_updates(policy_updates)
        critic_shares, critic_globals = mean_over_updates(critic_updates)
        sums = {**{k: v * len(trajs) for k, v in rollout.items()}, **policy_shares, **critic_shares,
                "trajectories": len(trajs), "action_tokens": mask.sum().item(), "tokens": float(sum(batch["lengths"]))}
        if ref is not None:
            sums["kl"] = kl.sum().item()
        maxes = {**policy_globals, **critic_globals, "engine_logprob_diff": engine_diff}  # globals: the same on every rank
        total = reduce_metrics(sums, maxes)
        metrics = {"step": step + 1, **{k: total[k] / total["trajectories"] for k in rollout}}
        metrics.update({k: total[k] for k in [*policy_shares, *critic_shares, *maxes]})
        if ref is not None:
            metrics["kl"] = total["kl"] / max(total["action_tokens"], 1)
        metrics.update({"lr": schedulers["policy"].get_last_lr()[0], "time/rollout": t1 - t0, "time/forward": t2 - t1,
                        "time/update": t3 - t2, "time/push": t4 - t3, "time/step": t4 - t0,
                        "tokens_per_s": total["tokens"] / (t4 - t0), "action_tokens_per_s": total["action_tokens"] / (t4 - t0)})
        if cfg.eval.every and ((step + 1) % cfg.eval.every == 0 or step + 1 == cfg.steps):
            metrics.update(evaluate(engine, env, val_rows, cfg, rank, world))
        print0(f"step {step + 1:4d}/{cfg.steps} | reward {metrics['reward']:.3f} | em {metrics.get('em', 0):.3f} | "
               f"turns {metrics['turns']:.2f} | resp {metrics['response_tokens']:.0f} | kl {metrics.get('kl', metrics.get('approx_kl', 0)):.4f} | "
               f"clip {metrics.get('clipfrac', 0):.3f} | ent {metrics.get('entropy', 0):.3f} | gnorm {metrics.get('grad_norm', 0):.3f} | "
               f"skip {metrics.get('skipped', 0):.2f} | rollout {t1 - t0:.1f}s fwd {t2 - t1:.1f}s upd {t3 - t2:.1f}s push {t4 - t3:.2f}s | "
               f"{metrics['tokens_per_s']:.0f} tok/s" + (f" | eval {metrics['eval/reward']:.3f}" if "eval/reward" in metrics else ""))
        log.log(metrics)

        # checkpoints: every save_every steps, at the end, and when asked to stop (SIGTERM on any rank)
        [sigterm] = all_reduce([float(stop["sigterm"])])
        last = step + 1 == cfg.steps
        if sigterm or last or (cfg.train.save_every and (step + 1) % cfg.train.save_every == 0):
            path = save_checkpoint(cfg.run_dir, step + 1, models, optimizers, schedulers, {"data_position": (step + 1) * cfg.rollout.prompts_per_step})
            print0(f"checkpoint: {path}")
        if sigterm:
            print0("SIGTERM: checkpoint written, stopping")
            break

    export_dir = os.path.join(cfg.run_dir, "hf")
    export_hf(policy, tokenizer, export_dir, compute_dtype)
    print0(f"exported {export_dir} in {cfg.train.dtype}, every tensor checked against the trainer's")
    torch.distributed.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
