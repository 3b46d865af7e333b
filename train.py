"""
Train an LLM agent with end-to-end RL over multi-turn tool use: PPO with a critic and mask-aware
GAE, or GRPO. One process per GPU (or CPU rank) under torchrun, FSDP2 for training, and a
colocated rollout engine in every rank that gets the new weights after every update.

    torchrun --nproc_per_node=8 train.py --config=hotpotqa algo=grpo model=Qwen/Qwen2.5-3B-Instruct
    torchrun --nproc_per_node=2 train.py --config=tiny algo=ppo steps=2 run_dir=out/tiny   # CPU
    python train.py --config=tiny train.warm_start_steps=400 train.warm_start_lr=3e-3      # one process

The task (nanoagent/tasks/, by data.task) gives the prompts, the tools, the scoring and the
demonstrations for an optional warm start by imitation; everything else here is task-agnostic.

One step, top to bottom:
  1. rollout: every rank rolls out its share of the prompts (G times each), multi-turn with tools;
     a turn sees the whole trajectory (one growing token row), or with rollout.context=last_k the
     question and the last K turns, and each turn is then a token row of its own;
  2. rewards: the task scores each trajectory; the outcome reward sits on the last action token,
     process rewards on the last action token of their turn, and (kl_mode=reward) -kl_coef * k1;
     groups whose rewards are all equal (grpo) and, optionally, trajectories cut by a budget are
     left out of the update (DAPO);
  3. the engine sleeps; the trainer recomputes old logprobs, reference logprobs and values;
  4. advantages: GAE over action tokens, or over turns with ppo.credit=step (ppo), or
     group-normalised scores (grpo);
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
from transformers import AutoTokenizer

from nanoagent import rl
from nanoagent.agent import rollout_metrics, run_agent, scripted_trajectories
from nanoagent.checkpoint import check_resume, export_hf, load_latest, resume_checkpoint, save_checkpoint, start_fresh
from nanoagent.common import MetricsLog, all_reduce, init_distributed, print0, reduce_metrics, seed_everything
from nanoagent.config import ConfigError, format_config, make_config, reference, save_config, to_dict
from nanoagent.data import check_prompts, fit_prompts, step_prompts
from nanoagent.engine import SamplingConfig, make_engine, pad_token_id
from nanoagent.model import (build_critic, build_policy, build_reference, collate, critic_forward, forward_all, full_tensors, micro_steps,
                             policy_forward, read_weights, training_config)
from nanoagent.tasks import load_task
from nanoagent.tiny import resolve_model
from nanoagent.tools import ToolEnv


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
# the task and the rewards

def task_data(task, cfg, tokenizer):
    """(train rows, val rows, tool environment): the task's prompts, made on the spot or read from
    a file, every one checked (well-formed rows, then data.max_prompt_tokens with chat template and
    tool schemas included) when loaded, on every rank, before any collective."""
    env = ToolEnv(task.tools(cfg), tokenizer, cfg.rollout.max_obs_tokens, cfg.rollout.tool_timeout_s, cfg.rollout.context, cfg.rollout.keep_turns)
    rows = {}
    for split in ("train", "val"):
        prompts = check_prompts(task.prompts(cfg, split), cfg.data.bad_prompts, f"{cfg.data.task} {split} prompts")
        lengths = env.prompt_lengths([p["messages"] for p in prompts])
        rows[split] = fit_prompts(prompts, lengths, cfg.data.max_prompt_tokens, cfg.data.bad_prompts, f"{cfg.data.task} {split} prompts")
    return rows["train"], rows["val"], env


def token_rewards(trajs, batch, tool_call_reward):
    """[R, L] rewards on action tokens (of the batch's rows): the outcome on the last action token
    of the trajectory, the process reward on the last action token of each turn whose tool calls
    all succeeded."""
    rewards = torch.zeros_like(batch["action_mask"])
    for t, steps in zip(trajs, batch["steps"]):
        if tool_call_reward:
            for turn, (row, _, end) in enumerate(steps):
                calls = [c for c in t.tool_calls if c.turn == turn]
                if calls and not any(c.error for c in calls) and turn < len(steps) - 1:
                    rewards[row, end - 1] += tool_call_reward
        row, _, end = steps[-1]
        rewards[row, end - 1] += t.reward
    return rewards


def trained_rows(trajs, scores, groups, cfg):
    """
    Which trajectories the update trains on ([B] float, 1 or 0), and how many are left out for
    each reason. DAPO's dynamic sampling (grpo.drop_uniform_groups): a group whose scores are all
    equal has advantages all 0, no signal. DAPO's overlong filtering (train.overlong_filter): a
    trajectory cut by the token or context budget is not trained on (it still counts in its
    group's baseline; it is counted as dropped_overlong when its group is not dropped already).
    scores: [B] returns; groups: [B] group ids.
    """
    uniform = torch.zeros(len(trajs), dtype=torch.bool)
    if cfg.algo == "grpo" and cfg.grpo.drop_uniform_groups:
        uniform = rl.uniform_groups(scores, groups)
    overlong = torch.tensor([cfg.train.overlong_filter and t.finish_reason in ("truncated", "context_budget") for t in trajs])
    return (~uniform & ~overlong).float(), {"dropped_uniform": uniform.sum().item(), "dropped_overlong": (overlong & ~uniform).sum().item()}


def global_counts(batch, rows, key="action_mask"):
    """Tokens and sequences with tokens where batch[key] is 1 (the action tokens; the value loss's
    tokens for the critic) in a mini-batch, over all ranks: the denominators that make every
    micro-batch's loss its share of one global mean."""
    mask = batch[key][rows]
    return all_reduce([mask.sum().item(), (mask.sum(-1) > 0).sum().item()])


# -----------------------------------------------------------------------------
# the update

def get_lr(step, base_lr, warmup_steps):
    """The learning rate at a training step: a linear warm-up over the first warmup_steps, then constant."""
    return base_lr * min(1.0, (step + 1) / max(1, warmup_steps))


def set_hyperparameters(optimizers, step, cfg):
    """The optimizers' learning rate and weight decay at a step, from the config in effect: a resumed
    optimizer comes back with the values it was saved with."""
    for name, optimizer in optimizers.items():
        for group in optimizer.param_groups:
            group["lr"] = get_lr(step, cfg.train.lr if name == "policy" else cfg.ppo.critic_lr, cfg.train.warmup_steps)
            group["weight_decay"] = cfg.train.weight_decay


def optimizer_step(model, optimizer, loss_sum, grad_clip):
    """Clip and step, unless the loss or the gradient norm is not finite on any rank: then the
    gradients are dropped and the step is skipped. Returns (grad_norm, skipped)."""
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    grad_norm = (grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm).item()  # the same on every rank
    [loss] = all_reduce([loss_sum])
    finite = math.isfinite(loss) and math.isfinite(grad_norm)
    if finite:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm, float(not finite)


def ppo_epochs(models, optimizers, batch, kept, cfg, step, rank, world, device):
    """
    PPO epochs over mini-batches of the trajectories that train (kept: this rank's rows; a
    trajectory's rows, one or one per turn, stay in one mini-batch): the critic's step, then the
    policy's (after the critic's warm-up). Every rank takes the same number of optimizer steps,
    ceil(kept trajectories of all ranks / mini_batch_size), because each is a collective: a rank
    left with no rows runs zero-weight passes. Returns the policy's and the critic's
    [(shares, globals)] (see update_policy).
    """
    rows_of = {}  # trajectory -> its kept rows
    for row in kept:
        rows_of.setdefault(batch["trajectory"][row].item(), []).append(row)
    [total] = all_reduce([len(rows_of)])
    n_mini = math.ceil(total / cfg.ppo.mini_batch_size)
    policy_updates, critic_updates = [], []
    order_rng = random.Random(f"{cfg.seed}-{step}-{rank}")
    for epoch in range(cfg.ppo.epochs):
        order = list(rows_of)
        order_rng.shuffle(order)
        for m in range(n_mini):
            rows = [row for i in order[m * len(order) // n_mini:(m + 1) * len(order) // n_mini] for row in rows_of[i]]
            if "critic" in models:
                critic_updates.append(update_critic(models["critic"], optimizers["critic"], batch, rows, cfg, world, device))
            if cfg.algo != "ppo" or step >= cfg.ppo.critic_warmup_steps:
                policy_updates.append(update_policy(models["policy"], optimizers["policy"], batch, rows, cfg, world, device))
    return policy_updates, critic_updates


def update_policy(policy, optimizer, batch, rows, cfg, world, device):
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
    grad_norm, skipped = optimizer_step(policy, optimizer, shares["pg_loss"], cfg.train.grad_clip)
    return shares, {"grad_norm": grad_norm, "skipped": skipped}


def update_critic(critic, optimizer, batch, rows, cfg, world, device):
    """One optimizer step of the critic on a mini-batch: clipped value loss on the tokens where
    value_mask is 1 (the action tokens; the state boundaries with ppo.credit=step), global token
    mean. Returns (shares, globals) like update_policy."""
    global_tokens, global_seqs = global_counts(batch, rows, "value_mask")
    shares = {"vf_loss": 0.0, "vf_clipfrac": 0.0}
    for idx, get in micro_steps(batch, rows, cfg.train.micro_batch_tokens, device):
        mask = get("value_mask") * (1.0 if idx else 0.0)
        values = critic_forward(critic, get("input_ids"), get("attention_mask"))
        per_token, vf_stats = rl.clipped_value_loss(values, get("values"), get("returns"), mask, cfg.ppo.value_clip)
        loss = rl.aggregate_loss(per_token, mask, cfg.train.loss_agg, global_tokens, global_seqs)
        (loss * world).backward()
        shares["vf_loss"] += loss.item()
        shares["vf_clipfrac"] += vf_stats["vf_clipfrac"].item() * mask.sum().item() / global_tokens
    grad_norm, skipped = optimizer_step(critic, optimizer, shares["vf_loss"], cfg.train.grad_clip)
    return shares, {"vf_grad_norm": grad_norm, "vf_skipped": skipped}


def imitate(policy, env, rows, demonstrate, cfg, rank, world, device):
    """
    Warm start by imitation of the task's scripted demonstrations, through the same trajectory
    assembly, forward, mask and loss aggregation as RL: maximise the logprob of the demonstrated
    action tokens (mask = 1), a global token mean. Its own AdamW, so RL's optimizer starts fresh.
    """
    rng = random.Random(f"{cfg.seed}-demos-{rank}")
    mine = rows[rank::world]
    demos = scripted_trajectories(env, mine, [demonstrate(row, rng) for row in mine])
    optimizer = torch.optim.AdamW(policy.parameters(), lr=cfg.train.warm_start_lr, weight_decay=0.0)
    per_rank = cfg.ppo.mini_batch_size // world
    for step in range(cfg.train.warm_start_steps):
        batch = collate([demos[rng.randrange(len(demos))] for _ in range(per_rank)], pad_token_id(env.tokenizer))
        rows = list(range(len(batch["lengths"])))
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


def evaluate(engine, env, task, rows, cfg, rank, world):
    """Greedy rollouts on this rank's share of the held-out prompts; means over all ranks of the
    reward, turns, tool calls and the task's scores, overall and per question type (a row's `type`,
    e.g. eval/2-hop/tool_calls: the behaviour behind a score)."""
    rows = rows[:cfg.eval.num_prompts]
    mine = rows[rank::world]
    trajs = run_agent(engine, env, mine, SamplingConfig(cfg.rollout.max_new_tokens, greedy=True), cfg.rollout.max_turns,
                      cfg.rollout.max_context_tokens)
    for t in trajs:
        task.score(t, cfg)
    fields = ["reward", "turns", "tool_calls", *sorted({k for t in trajs for k in t.scores})]
    types = sorted({str(r["type"]) for r in rows if r.get("type")})  # from every rank's rows: the same keys on all ranks
    groups = {"": trajs, **{f"{ty}/": [t for t, r in zip(trajs, mine) if str(r.get("type")) == ty] for ty in types}}
    sums = {}
    for prefix, members in groups.items():  # rollout_metrics' means, times the count: this rank's share of each total
        means = rollout_metrics(members)
        sums[prefix + "n"] = len(members)
        sums.update({prefix + k: means.get(k, 0.0) * len(members) for k in fields})
    total = reduce_metrics(sums, {})
    return {f"eval/{p}{k}": total[p + k] / max(total[p + "n"], 1) for p in groups for k in fields}


def build_models(cfg, model_path, device):
    """Policy, critic (ppo), frozen reference (with a KL term) and their AdamW optimizers, built
    sharded from rank 0's copy of the weights. bf16 compute means the same on a CPU as on a GPU."""
    compute_dtype = torch.bfloat16 if cfg.train.dtype == "bfloat16" else torch.float32
    config, weights = training_config(model_path), read_weights(model_path)
    models = {"policy": build_policy(config, weights, device, compute_dtype, cfg.train.activation_checkpointing)}
    if cfg.algo == "ppo":
        models["critic"] = build_critic(config, weights, device, compute_dtype, cfg.train.activation_checkpointing)
    ref = build_reference(config, weights, device, compute_dtype) if cfg.train.kl_mode != "none" else None
    optimizers = {name: torch.optim.AdamW(m.parameters(), lr=cfg.train.lr if name == "policy" else cfg.ppo.critic_lr,
                                          weight_decay=cfg.train.weight_decay) for name, m in models.items()}
    return models, ref, optimizers


def step_metrics(step, trajs, dropped, batch, policy_updates, critic_updates, engine_diff, kl):
    """The step's metrics, reduced over ranks once: this rank's shares are summed, the values every
    rank agrees on (grad norms, skips) and the engine/trainer logprob gap are maxed. dropped:
    {reason: trajectories left out of the update}, logged as fractions of all trajectories."""
    per_trajectory = {**rollout_metrics(trajs), **{k: v / len(trajs) for k, v in dropped.items()}}
    policy_shares, policy_globals = mean_over_updates(policy_updates)
    critic_shares, critic_globals = mean_over_updates(critic_updates)
    sums = {**{k: v * len(trajs) for k, v in per_trajectory.items()}, **policy_shares, **critic_shares, "trajectories": len(trajs),
            "action_tokens": float(sum(sum(t.action_mask) for t in trajs)), "trained_tokens": batch["action_mask"].sum().item(),
            "tokens": float(sum(batch["lengths"]))}
    if kl is not None:
        sums["kl"] = kl.sum().item()
    maxes = {**policy_globals, **critic_globals, "engine_logprob_diff": engine_diff}
    total = reduce_metrics(sums, maxes)
    metrics = {"step": step + 1, **{k: total[k] / total["trajectories"] for k in per_trajectory}}
    metrics.update({k: total[k] for k in [*policy_shares, *critic_shares, *maxes, "tokens", "action_tokens"]})
    metrics["policy_updates"] = len(policy_updates)  # 0 when every trajectory was left out: no step taken
    if kl is not None:  # over the tokens that train
        metrics["kl"] = total["kl"] / max(total["trained_tokens"], 1)
    return metrics


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
    # resume=never starts a new run (a used run_dir is moved aside); resume=auto continues from the latest
    # complete checkpoint, with this command line's config where a key may change (checkpoint.CHANGEABLE)
    if cfg.resume == "never" and (aside := start_fresh(cfg.run_dir)):
        print0(f"resume=never: the run in {cfg.run_dir} was moved aside to {aside}")
    checkpoint = resume_checkpoint(cfg.run_dir) if cfg.resume == "auto" else None
    for change in check_resume(checkpoint, cfg) if checkpoint else []:
        print0(f"resume changes {change}")
    os.makedirs(cfg.run_dir, exist_ok=True)
    if rank == 0:
        save_config(cfg, os.path.join(cfg.run_dir, "config.json"))  # the config in effect
    print0(format_config(cfg))

    # the task, the models, the rollout engine (colocated in this process)
    task, tokenizer = load_task(cfg.data.task), AutoTokenizer.from_pretrained(model_path)
    train_rows, val_rows, env = task_data(task, cfg, tokenizer)
    models, ref, optimizers = build_models(cfg, model_path, device)
    policy, critic = models["policy"], models.get("critic")
    engine = make_engine(cfg.rollout.engine, model_path, tokenizer, cfg.rollout.max_context_tokens, cfg.rollout.dtype,
                         cfg.rollout.gpu_memory_utilization, cfg.rollout.tensor_parallel_size, cfg.seed + rank)
    sampling = SamplingConfig(cfg.rollout.max_new_tokens, cfg.rollout.temperature, cfg.rollout.top_p)

    # resume, or warm start by imitation; then the engine gets the policy's weights
    checkpoint, start_step, _ = load_latest(cfg.run_dir, models, optimizers) if cfg.resume == "auto" else (None, 0, None)
    if checkpoint:
        print0(f"resumed from {checkpoint} at step {start_step}")
    elif cfg.train.warm_start_steps:
        if task.demonstration is None:
            raise ConfigError(f"train.warm_start_steps > 0 but data.task={cfg.data.task} has no demonstrations")
        imitate(policy, env, train_rows, task.demonstration, cfg, rank, world, device)
    engine.load_weights(full_tensors(policy))
    log = MetricsLog(cfg.run_dir, start_step if checkpoint else None, to_dict(cfg), cfg.log.wandb, cfg.log.wandb_project)
    if cfg.eval.every and not checkpoint:  # where RL starts from (a checkpoint of step 0, after a SIGTERM, has it logged)
        metrics = {"step": 0, **evaluate(engine, env, task, val_rows, cfg, rank, world)}
        print0("step    0 | " + " | ".join(f"{k} {v:.3f}" for k, v in metrics.items() if k != "step"))
        log.log(metrics)
    # A SIGTERM (a preemption: torchrun passes its own on to every worker and kills them
    # --shutdown-timeout seconds later, 30 by default) is acted on at the next safe point, after the
    # rollout or after the update, on every rank together: checkpoint, then exit 143 so that a
    # scheduler sees a run that did not finish.
    sigterm = {"received": False}
    signal.signal(signal.SIGTERM, lambda *_: sigterm.update(received=True))
    saved_step = start_step if checkpoint else None

    def save(step):
        path = save_checkpoint(cfg.run_dir, step, models, optimizers, {"data_position": step * cfg.rollout.prompts_per_step},
                               to_dict(cfg), cfg.train.keep_last)
        print0(f"checkpoint: {path}")
        return step

    for step in range(start_step, cfg.steps):
        t0 = time.perf_counter()
        set_hyperparameters(optimizers, step, cfg)
        # 1. rollout: G samples of each of this rank's prompts, multi-turn with tools
        prompts = step_prompts(train_rows, step, per_rank, rank, world, cfg.seed, cfg.data.shuffle)
        engine.wake()
        trajs = run_agent(engine, env, [p for p in prompts for _ in range(cfg.rollout.group_size)], sampling, cfg.rollout.max_turns,
                          cfg.rollout.max_context_tokens, seed=cfg.seed * 100_003 + step * world + rank)
        engine.sleep()
        if all_reduce([float(sigterm["received"])])[0]:  # the rollout is dropped; the state this step started from is saved
            print0(f"SIGTERM during step {step + 1}'s rollout: checkpoint of step {step}, stopping")
            if saved_step != step:
                save(step)
            return 143
        # 2. rewards: the task scores each trajectory; rewards sit on action tokens
        for t in trajs:
            task.score(t, cfg)
        # a row per trajectory, or (rollout.context=last_k) per turn; owner: [R] the trajectory of each row
        batch = collate(trajs, pad_token_id(tokenizer))
        owner = batch["trajectory"]
        rewards = token_rewards(trajs, batch, cfg.train.tool_call_reward)  # [R, L]
        scores = torch.zeros(len(trajs)).index_add_(0, owner, rewards.sum(-1))  # [B] each trajectory's return, what GRPO compares
        groups = torch.arange(len(prompts)).repeat_interleave(cfg.rollout.group_size)
        # the trajectories that train (kept: their rows); the others get mask 0, and no forward pass runs over them
        keep, dropped = trained_rows(trajs, scores, groups, cfg)
        kept = keep[owner].nonzero().flatten().tolist()
        mask = batch["action_mask"] = batch["action_mask"] * keep[owner][:, None]
        rewards = rewards * mask
        t1 = time.perf_counter()
        # 3. old logprobs (recomputed by the trainer), reference logprobs and KL
        batch["old_logprobs"] = forward_all(lambda i, a: policy_forward(policy, i, a, cfg.rollout.temperature)[0], batch, kept,
                                            cfg.train.micro_batch_tokens, device) * mask
        engine_diff = ((batch["old_logprobs"] - batch["rollout_logprobs"]).abs() * mask).max().item()
        kl = None
        if ref is not None:
            batch["ref_logprobs"] = forward_all(lambda i, a: policy_forward(ref, i, a, cfg.rollout.temperature)[0], batch, kept,
                                                cfg.train.micro_batch_tokens, device) * mask
            kl = rl.kl_penalty(batch["old_logprobs"], batch["ref_logprobs"], "k1") * mask
            if cfg.train.kl_mode == "reward":  # ppo only (config.validate): k1 on every action token
                rewards = rewards - cfg.train.kl_coef * kl
        t2 = time.perf_counter()
        # 4. advantages: GAE over the critic's values (ppo), per action token or per turn, or group-normalised scores (grpo)
        if cfg.algo == "ppo":
            values = forward_all(lambda i, a: critic_forward(critic, i, a), batch, kept, cfg.train.micro_batch_tokens, device)
            if cfg.ppo.credit == "token":  # a value per action token
                batch["value_mask"], batch["values"] = mask, values * mask
                advantages, batch["returns"] = rl.masked_gae(rewards, batch["values"], mask, cfg.ppo.gamma, cfg.ppo.lam)
            else:  # a value per turn, read at the token before its action
                advantages, batch["returns"], batch["value_mask"] = rl.step_gae(rewards, values, mask, batch["steps"], cfg.ppo.gamma, cfg.ppo.lam)
                batch["values"] = values * batch["value_mask"]
            if cfg.ppo.whiten_advantages:  # over the action tokens of all ranks
                n, s, sq = all_reduce([mask.sum().item(), rl.masked_sum(advantages, mask).item(), rl.masked_sum(advantages ** 2, mask).item()])
                mean = s / max(n, 1)
                var = (sq - n * mean ** 2) / max(n - 1, 1)
                advantages = (advantages - mean) / math.sqrt(var + 1e-8) * mask
        else:
            advantages = rl.grpo_advantages(scores, groups, cfg.grpo.eps, cfg.grpo.scale_by_std)[owner][:, None] * mask
        batch["advantages"] = advantages
        # 5. PPO epochs over mini-batches of the kept trajectories: critic, then policy (after the critic's warm-up)
        policy_updates, critic_updates = ppo_epochs(models, optimizers, batch, kept, cfg, step, rank, world, device)
        t3 = time.perf_counter()
        # 6. the new weights into the engine; one line of metrics
        engine.wake(["weights"])
        engine.load_weights(full_tensors(policy))
        engine.wake(["kv_cache"])
        t4 = time.perf_counter()
        [stopping] = all_reduce([float(sigterm["received"])])
        metrics = step_metrics(step, trajs, dropped, batch, policy_updates, critic_updates, engine_diff, kl)
        metrics.update({"lr": get_lr(step, cfg.train.lr, cfg.train.warmup_steps), "time/rollout": t1 - t0, "time/forward": t2 - t1,
                        "time/update": t3 - t2, "time/push": t4 - t3, "time/step": t4 - t0, "tokens_per_s": metrics.pop("tokens") / (t4 - t0),
                        "action_tokens_per_s": metrics.pop("action_tokens") / (t4 - t0)})
        if cfg.eval.every and ((step + 1) % cfg.eval.every == 0 or step + 1 == cfg.steps) and not stopping:
            metrics.update(evaluate(engine, env, task, val_rows, cfg, rank, world))
        print0(f"step {step + 1:4d}/{cfg.steps} | reward {metrics['reward']:.3f} | turns {metrics['turns']:.2f} | "
               f"resp {metrics['response_tokens']:.0f} | kl {metrics.get('kl', metrics.get('approx_kl', 0)):.4f} | "
               f"clip {metrics.get('clipfrac', 0):.3f} | ent {metrics.get('entropy', 0):.3f} | gnorm {metrics.get('grad_norm', 0):.3f} | "
               f"skip {metrics.get('skipped', 0):.2f} | drop {metrics['dropped_uniform']:.2f}+{metrics['dropped_overlong']:.2f} | rollout {t1 - t0:.1f}s fwd {t2 - t1:.1f}s upd {t3 - t2:.1f}s push {t4 - t3:.2f}s | "
               f"{metrics['tokens_per_s']:.0f} tok/s" + (f" | eval {metrics['eval/reward']:.3f}" if "eval/reward" in metrics else ""))
        log.log(metrics)

        # checkpoints: every save_every steps, at the end, and after a SIGTERM
        if stopping or step + 1 == cfg.steps or (cfg.train.save_every and (step + 1) % cfg.train.save_every == 0):
            saved_step = save(step + 1)
        if stopping:
            print0(f"SIGTERM during step {step + 1}: checkpoint of step {step + 1} written, stopping")
            return 143

    export_dir = os.path.join(cfg.run_dir, "hf")
    export_hf(policy, tokenizer, export_dir, torch.bfloat16 if cfg.train.dtype == "bfloat16" else torch.float32)
    print0(f"exported {export_dir} in {cfg.train.dtype}, every tensor checked against the trainer's")
    return 0


if __name__ == "__main__":
    sys.exit(main())
