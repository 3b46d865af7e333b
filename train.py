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

import torch
import torch.distributed as dist

from nanoagent import rl
from nanoagent.config import ConfigError, format_config, make_config, reference, save_config, to_dict


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, epilog=reference(), formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=None, help="preset name (tiny, demo, hotpotqa); default: the built-in defaults")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, dotted keys")
    args = parser.parse_args(argv)
    try:
        return make_config(args.config, args.overrides)
    except ConfigError as e:
        parser.error(str(e))


# -----------------------------------------------------------------------------
# the task: prompts, tools, reward

def load_task(cfg):
    """(train rows, val rows, tools, demonstration function or None) for cfg.data.task."""
    from nanoagent.data import arithmetic_demonstration, arithmetic_task, load_prompts
    from nanoagent.synthetic import synthetic_demonstration
    from nanoagent.tools import calculator_tool, make_tools
    if cfg.data.task == "arithmetic":
        return (arithmetic_task(cfg.data.num_train, cfg.seed, "train"), arithmetic_task(cfg.data.num_val, cfg.seed, "val"),
                [calculator_tool()], arithmetic_demonstration)
    # synthetic and hotpotqa: prompt files from prepare_data.py, search over an index from build_index.py
    tools = make_tools(["search"], cfg.data.index_dir, top_k=cfg.rollout.search_top_k)
    return (load_prompts(cfg.data.train_path), load_prompts(cfg.data.val_path), tools,
            synthetic_demonstration if cfg.data.task == "synthetic" else None)


def step_prompts(rows, step, per_rank, rank, world, seed, shuffle):
    """The prompts of one step for one rank: a deterministic function of the step (the data
    position is the step), reshuffled every epoch."""
    per_step = per_rank * world
    start = step * per_step
    out = []
    for k in range(start, start + per_step):
        epoch, i = divmod(k, len(rows))
        order = list(range(len(rows)))
        if shuffle:
            random.Random(f"{seed}-{epoch}").shuffle(order)
        out.append(rows[order[i]])
    return out[rank * per_rank:(rank + 1) * per_rank]


# -----------------------------------------------------------------------------
# trajectories -> padded tensors

def collate(trajs, pad_id):
    """
    Rows `prompt | response` right-padded to [B, L]. action_mask and rollout_logprobs are laid
    over the whole row (0 on the prompt and padding), so every per-token tensor shares one index.
    """
    from nanoagent.model import pad_rows
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


def all_reduce_sum(values, device):
    """Sum a list of floats over ranks."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()


def synced_micro_batches(lengths, token_budget, device):
    """
    micro_batches(), with the same count on every rank: each FSDP forward and backward is a
    collective, so a rank with fewer micro-batches would leave the others waiting forever. Short
    ranks split their largest micro-batches, then add empty ones ([]), which callers run as a
    zero-weight pass over one row.
    """
    from nanoagent.model import micro_batches
    batches = micro_batches(lengths, token_budget)
    count = torch.tensor([len(batches)], device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    while len(batches) < count.item():
        largest = max(range(len(batches)), key=lambda b: len(batches[b]))
        if len(batches[largest]) > 1:
            half = len(batches[largest]) // 2
            batches[largest:largest + 1] = [batches[largest][:half], batches[largest][half:]]
        else:
            batches.append([])
    return batches


def global_counts(batch, rows, device):
    """Action tokens and sequences with action tokens in a mini-batch, over all ranks: the
    denominators that make every micro-batch's loss its share of one global mean."""
    mask = batch["action_mask"][rows]
    return all_reduce_sum([mask.sum().item(), (mask.sum(-1) > 0).sum().item()], device)


def micro_steps(batch, rows, token_budget, device):
    """
    The micro-batches of a mini-batch (this rank's row indices), kept in step across ranks.
    Yields (get, mask): get(key) gives that tensor of the micro-batch on the device, cut to its
    longest row; an empty micro-batch comes as one row with mask 0, so its loss is 0 but its
    collectives still run.
    """
    lengths = [batch["lengths"][i] for i in rows]
    for micro in synced_micro_batches(lengths, token_budget, device):
        idx = [rows[i] for i in micro] or rows[:1]
        width = max(batch["lengths"][i] for i in idx)

        def get(key, idx=idx, width=width):
            return batch[key][idx, :width].to(device)
        yield get, get("action_mask") * (1.0 if micro else 0.0)


@torch.no_grad()
def forward_all(model_fn, batch, micro_batch_tokens, device):
    """Run a forward function (ids, attention -> [b, l] per-token tensor or tuple) over all rows
    in micro-batches; returns [B, L] tensors on the CPU."""
    B, L = batch["input_ids"].shape
    out = None
    for idx in synced_micro_batches(batch["lengths"], micro_batch_tokens, device):
        if not idx:  # keep in step with the other ranks' collectives; the result is not used
            model_fn(batch["input_ids"][:1, :1].to(device), batch["attention_mask"][:1, :1].to(device))
            continue
        width = max(batch["lengths"][i] for i in idx)
        ids = batch["input_ids"][idx, :width].to(device)
        attn = batch["attention_mask"][idx, :width].to(device)
        result = model_fn(ids, attn)
        result = result if isinstance(result, tuple) else (result,)
        if out is None:
            out = [torch.zeros(B, L) for _ in result]
        for o, r in zip(out, result):
            o[idx, :width] = r.float().cpu()
    return out if len(out) > 1 else out[0]


# -----------------------------------------------------------------------------
# the update

def optimizer_step(model, optimizer, scheduler, loss_sum, grad_clip, device, force_nan=False):
    """Clip and step, unless the loss or the gradient norm is not finite on any rank: then the
    gradients are dropped and the step is skipped. Returns (grad_norm, skipped)."""
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
    loss = torch.tensor([loss_sum], dtype=torch.float64, device=device)
    dist.all_reduce(loss)
    finite = math.isfinite(loss.item()) and math.isfinite(grad_norm.item()) and not force_nan
    if finite:
        optimizer.step()
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm.item(), not finite


def update_policy(policy, optimizer, scheduler, batch, rows, cfg, world, device, force_nan=False):
    """One optimizer step of the policy on a mini-batch (row indices of this rank)."""
    from nanoagent.model import policy_forward
    global_tokens, global_seqs = global_counts(batch, rows, device)
    stats = {"clipfrac": 0.0, "approx_kl": 0.0, "entropy": 0.0, "kl_loss": 0.0}
    loss_sum = 0.0
    for get, mask in micro_steps(batch, rows, cfg.train.micro_batch_tokens, device):
        logprobs, entropy = policy_forward(policy, get("input_ids"), get("attention_mask"), cfg.rollout.temperature)
        per_token, pg_stats = rl.ppo_policy_loss(logprobs, get("old_logprobs"), get("advantages"), mask,
                                                 cfg.ppo.clip_low, cfg.ppo.clip_high, cfg.ppo.clip_dual)
        if cfg.train.tis:  # the engine sampled from a slightly different distribution than the trainer computes
            per_token = per_token * rl.truncated_is_weights(get("old_logprobs"), get("rollout_logprobs"), mask, cfg.train.tis_cap)
        if cfg.train.kl_mode == "loss":
            kl = rl.kl_penalty(logprobs, get("ref_logprobs"), "k3")
            per_token = per_token + cfg.train.kl_coef * kl
            stats["kl_loss"] += rl.masked_sum(kl.detach(), mask).item() / global_tokens
        if cfg.train.entropy_coef:
            per_token = per_token - cfg.train.entropy_coef * entropy
        loss = rl.aggregate_loss(per_token, mask, cfg.train.loss_agg, global_tokens, global_seqs)
        if force_nan:
            loss = loss * float("nan")
        (loss * world).backward()  # FSDP averages rank gradients; the loss is already a global mean
        loss_sum += loss.item()
        n = mask.sum().item() / global_tokens
        stats["clipfrac"] += pg_stats["clipfrac"].item() * n
        stats["approx_kl"] += pg_stats["approx_kl"].item() * n
        stats["entropy"] += rl.masked_sum(entropy.detach(), mask).item() / global_tokens
    grad_norm, skipped = optimizer_step(policy, optimizer, scheduler, loss_sum, cfg.train.grad_clip, device, force_nan)
    stats = dict(zip(stats, all_reduce_sum(list(stats.values()), device)))
    return {**stats, "pg_loss": loss_sum, "grad_norm": grad_norm, "skipped": float(skipped)}


def update_critic(critic, optimizer, scheduler, batch, rows, cfg, world, device):
    """One optimizer step of the critic on a mini-batch: clipped value loss, global token mean."""
    from nanoagent.model import critic_forward
    global_tokens, global_seqs = global_counts(batch, rows, device)
    loss_sum, clipfrac = 0.0, 0.0
    for get, mask in micro_steps(batch, rows, cfg.train.micro_batch_tokens, device):
        values = critic_forward(critic, get("input_ids"), get("attention_mask"))
        per_token, vf_stats = rl.clipped_value_loss(values, get("values"), get("returns"), mask, cfg.ppo.value_clip)
        loss = rl.aggregate_loss(per_token, mask, cfg.train.loss_agg, global_tokens, global_seqs)
        (loss * world).backward()
        loss_sum += loss.item()
        clipfrac += vf_stats["vf_clipfrac"].item() * mask.sum().item() / global_tokens
    grad_norm, skipped = optimizer_step(critic, optimizer, scheduler, loss_sum, cfg.train.grad_clip, device)
    [clipfrac] = all_reduce_sum([clipfrac], device)
    return {"vf_loss": loss_sum, "vf_clipfrac": clipfrac, "vf_grad_norm": grad_norm, "vf_skipped": float(skipped)}


def imitate(policy, env, rows, demonstrate, cfg, rank, world, device):
    """
    Warm start by imitation of the task's scripted demonstrations, through the same trajectory
    assembly, forward, mask and loss aggregation as RL: maximise the logprob of the demonstrated
    action tokens (mask = 1), a global token mean. Its own AdamW, so RL's optimizer starts fresh.
    """
    from nanoagent.agent import scripted_trajectory
    from nanoagent.common import print0
    from nanoagent.model import policy_forward
    rng = random.Random(f"{cfg.seed}-demos-{rank}")
    demos = [scripted_trajectory(env, row, demonstrate(row, rng)) for row in rows[rank::world]]
    optimizer = torch.optim.AdamW(policy.parameters(), lr=cfg.train.warm_start_lr, weight_decay=0.0)
    per_rank = cfg.ppo.mini_batch_size // world
    for step in range(cfg.train.warm_start_steps):
        batch = collate([demos[rng.randrange(len(demos))] for _ in range(per_rank)], env.tokenizer.pad_token_id)
        rows = list(range(per_rank))
        global_tokens, _ = global_counts(batch, rows, device)
        loss_sum = 0.0
        for get, mask in micro_steps(batch, rows, cfg.train.micro_batch_tokens, device):
            logprobs, _ = policy_forward(policy, get("input_ids"), get("attention_mask"))
            loss = rl.aggregate_loss(-logprobs, mask, "token_mean", global_tokens, None)
            (loss * world).backward()
            loss_sum += loss.item()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), cfg.train.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        [loss_sum] = all_reduce_sum([loss_sum], device)
        if step % 20 == 0 or step == cfg.train.warm_start_steps - 1:
            print0(f"warm start {step + 1:4d}/{cfg.train.warm_start_steps} | nll {loss_sum:.4f}")


def full_tensors(model):
    """(name, full tensor) for every parameter, all-gathered one at a time: every rank's engine
    gets the whole model without any rank holding a second full copy at once. Tied parameters
    are sent under each of their names: vLLM's CPU backend keeps a repacked copy of the LM head
    that is not updated through the embedding."""
    for name, param in model.named_parameters(remove_duplicate=False):
        yield name, param.full_tensor() if hasattr(param, "full_tensor") else param.data


def evaluate(engine, env, rows, cfg, rank, world, device):
    """Greedy rollouts on this rank's share of the held-out prompts; metrics summed over ranks."""
    from nanoagent.agent import run_agent
    from nanoagent.engine import SamplingConfig
    from nanoagent.reward import score_trajectory
    mine = rows[:cfg.eval.num_prompts][rank::world]
    trajs = run_agent(engine, env, mine, SamplingConfig(cfg.rollout.max_new_tokens, greedy=True), cfg.rollout.max_turns, cfg.rollout.max_context_tokens)
    for t in trajs:
        score_trajectory(t, cfg.reward)
    keys = ["reward", "em", "substring_em", "f1", "turns"]
    sums = [sum(t.reward for t in trajs)] + [sum(t.scores[k] for t in trajs) for k in keys[1:4]] + [sum(len(t.turn_spans) for t in trajs)]
    totals = all_reduce_sum(sums + [len(trajs)], device)
    return {f"eval/{k}": v / max(totals[-1], 1) for k, v in zip(keys, totals[:-1])}


# -----------------------------------------------------------------------------

def main(argv=None):
    cfg = parse_args(sys.argv[1:] if argv is None else argv)
    from transformers import AutoTokenizer

    from nanoagent.agent import rollout_metrics, run_agent
    from nanoagent.checkpoint import export_hf, latest_checkpoint, load_checkpoint, save_checkpoint
    from nanoagent.common import MetricsLog, init_distributed, print0, resolve_model, seed_everything
    from nanoagent.engine import SamplingConfig, make_engine
    from nanoagent.model import Critic, critic_forward, load_causal_lm, policy_forward, shard
    from nanoagent.reward import score_trajectory
    from nanoagent.tools import ToolEnv

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

    # the task and the tool environment
    model_path = resolve_model(cfg.model)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    train_rows, val_rows, tools, demonstrate = load_task(cfg)
    env = ToolEnv(tools, tokenizer, cfg.rollout.max_obs_tokens, cfg.rollout.tool_timeout_s)

    # the models: policy, critic (ppo), frozen reference (only when a KL term is used)
    bf16 = cfg.train.dtype == "bfloat16" and device.type == "cuda"
    ac = cfg.train.activation_checkpointing
    policy = shard(load_causal_lm(model_path).to(device), bf16, ac)
    opt_policy = torch.optim.AdamW(policy.parameters(), lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)
    warmup = lambda i: min(1.0, (i + 1) / max(1, cfg.train.warmup_steps))  # noqa: E731
    models, optimizers = {"policy": policy}, {"policy": opt_policy}
    schedulers = {"policy": torch.optim.lr_scheduler.LambdaLR(opt_policy, warmup)}
    critic = ref = None
    if cfg.algo == "ppo":
        critic = shard(Critic(load_causal_lm(model_path)).to(device), bf16, ac)
        models["critic"] = critic
        optimizers["critic"] = torch.optim.AdamW(critic.parameters(), lr=cfg.ppo.critic_lr, weight_decay=cfg.train.weight_decay)
        schedulers["critic"] = torch.optim.lr_scheduler.LambdaLR(optimizers["critic"], warmup)
    if cfg.train.kl_mode != "none":
        ref = shard(load_causal_lm(model_path).to(device), bf16).requires_grad_(False)

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
        metrics = {"step": 0, **evaluate(engine, env, val_rows, cfg, rank, world, device)}
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
        batch = collate(trajs, tokenizer.pad_token_id)
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
            if cfg.train.kl_mode == "reward":
                rewards = rewards - cfg.train.kl_coef * kl
        t2 = time.perf_counter()
        # 4. advantages
        if cfg.algo == "ppo":
            batch["values"] = forward_all(lambda i, a: critic_forward(critic, i, a), batch, cfg.train.micro_batch_tokens, device) * mask
            advantages, batch["returns"] = rl.masked_gae(rewards, batch["values"], mask, cfg.ppo.gamma, cfg.ppo.lam)
            if cfg.ppo.whiten_advantages:  # over the action tokens of all ranks
                n, s, sq = all_reduce_sum([mask.sum().item(), rl.masked_sum(advantages, mask).item(),
                                           rl.masked_sum(advantages ** 2, mask).item()], device)
                mean = s / max(n, 1)
                var = (sq - n * mean ** 2) / max(n - 1, 1)
                advantages = (advantages - mean) / math.sqrt(var + 1e-8) * mask
        else:
            scores = rewards.sum(-1)  # outcome + process rewards (+ KL penalty) of each trajectory
            groups = torch.arange(len(prompts)).repeat_interleave(cfg.rollout.group_size)
            advantages = rl.grpo_advantages(scores, groups, cfg.grpo.eps, cfg.grpo.scale_by_std)[:, None] * mask
        batch["advantages"] = advantages
        # 5. PPO epochs over mini-batches
        stats = []
        rows_per_mini = cfg.ppo.mini_batch_size // world
        order_rng = random.Random(f"{cfg.seed}-{step}-{rank}")
        for epoch in range(cfg.ppo.epochs):
            order = list(range(len(trajs)))
            order_rng.shuffle(order)
            for s in range(0, len(order), rows_per_mini):
                rows = order[s:s + rows_per_mini]
                mini = {}
                if critic is not None:
                    mini.update(update_critic(critic, optimizers["critic"], schedulers["critic"], batch, rows, cfg, world, device))
                if cfg.algo != "ppo" or step >= cfg.ppo.critic_warmup_steps:
                    mini.update(update_policy(policy, opt_policy, schedulers["policy"], batch, rows, cfg, world, device,
                                              force_nan=step == cfg.train.debug_nan_step))
                stats.append(mini)
        t3 = time.perf_counter()
        # 6. the new weights into the engine
        engine.wake(["weights"])
        engine.load_weights(full_tensors(policy))
        engine.wake(["kv_cache"])
        t4 = time.perf_counter()

        # metrics: rollout summary summed over ranks, update statistics averaged over mini-batches
        local = rollout_metrics(trajs)
        keys = [k for k in local if not k.startswith("finish/")] + [k for k in local if k.startswith("finish/")]
        totals = all_reduce_sum([local[k] * len(trajs) for k in keys] + [len(trajs), mask.sum().item(), float(sum(batch["lengths"]))], device)
        n_traj, n_action, n_tokens = totals[-3:]
        metrics = {"step": step + 1, **{k: v / n_traj for k, v in zip(keys, totals)}}
        for k in sorted({k for s in stats for k in s}):
            values = [s[k] for s in stats if k in s]
            metrics[k] = sum(values) if k.endswith("skipped") else sum(values) / len(values)
        diff = torch.tensor(engine_diff)
        dist.all_reduce(diff, op=dist.ReduceOp.MAX)
        metrics["engine_logprob_diff"] = diff.item()  # trainer vs engine logprobs of the sampled tokens, max over ranks
        if ref is not None:
            [kl_sum] = all_reduce_sum([kl.sum().item()], device)
            metrics["kl"] = kl_sum / max(n_action, 1)
        metrics.update({"lr": schedulers["policy"].get_last_lr()[0], "time/rollout": t1 - t0, "time/forward": t2 - t1,
                        "time/update": t3 - t2, "time/push": t4 - t3, "time/step": t4 - t0,
                        "tokens_per_s": n_tokens / (t4 - t0), "action_tokens_per_s": n_action / (t4 - t0)})
        if cfg.eval.every and ((step + 1) % cfg.eval.every == 0 or step + 1 == cfg.steps):
            metrics.update(evaluate(engine, env, val_rows, cfg, rank, world, device))
        print0(f"step {step + 1:4d}/{cfg.steps} | reward {metrics['reward']:.3f} | em {metrics.get('em', 0):.3f} | "
               f"turns {metrics['turns']:.2f} | resp {metrics['response_tokens']:.0f} | kl {metrics.get('kl', metrics.get('approx_kl', 0)):.4f} | "
               f"clip {metrics.get('clipfrac', 0):.3f} | ent {metrics.get('entropy', 0):.3f} | gnorm {metrics.get('grad_norm', 0):.3f} | "
               f"skip {metrics.get('skipped', 0):.0f} | rollout {t1 - t0:.1f}s fwd {t2 - t1:.1f}s upd {t3 - t2:.1f}s push {t4 - t3:.2f}s | "
               f"{metrics['tokens_per_s']:.0f} tok/s" + (f" | eval {metrics['eval/reward']:.3f}" if "eval/reward" in metrics else ""))
        log.log(metrics)

        # checkpoints: every save_every steps, at the end, and when asked to stop (SIGTERM on any rank)
        [sigterm] = all_reduce_sum([float(stop["sigterm"])], device)
        last = step + 1 == cfg.steps
        if sigterm or last or (cfg.train.save_every and (step + 1) % cfg.train.save_every == 0):
            path = save_checkpoint(cfg.run_dir, step + 1, models, optimizers, schedulers, {"data_position": (step + 1) * cfg.rollout.prompts_per_step})
            print0(f"checkpoint: {path}")
        if sigterm:
            print0("SIGTERM: checkpoint written, stopping")
            break

    export_dir = os.path.join(cfg.run_dir, "hf")
    export_hf(policy, tokenizer, export_dir, torch.bfloat16 if cfg.train.dtype == "bfloat16" else torch.float32)
    print0(f"exported {export_dir} ({cfg.train.dtype}, loaded back and checked tensor by tensor)")
    dist.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
