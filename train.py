"""
Train an LLM agent with end-to-end RL over multi-turn tool use, or any environment: PPO with a
critic and mask-aware GAE, or GRPO, RLOO, REINFORCE or REINFORCE++ without one. One process per GPU
(or CPU rank) under torchrun, FSDP2 for training, and a colocated rollout engine in every rank that
gets the new weights after every update.

    torchrun --nproc_per_node=8 train.py --config=hotpotqa algo=grpo model=Qwen/Qwen2.5-3B-Instruct
    torchrun --nproc_per_node=2 train.py --config=tiny algo=ppo steps=2 run_dir=out/tiny   # CPU
    python train.py --config=tiny train.warm_start_steps=400 train.warm_start_lr=3e-3      # one process

The task (nanoagent/tasks/, by data.task) gives the prompts, the tools or environment, the scoring
and demonstrations for a warm start by imitation; everything else here is task-agnostic.

One step, top to bottom:
  1. rollout: every rank rolls out its share of the prompts (G times each), multi-turn in the
     task's environment (tool calls, a game); a turn sees the whole trajectory (one growing token
     row), or with rollout.context=last_k the question and the last K turns, each turn a row;
  2. rewards: the task scores each trajectory; the outcome reward sits on the last action token,
     process rewards (a step's) on the last action token of their turn, (kl_mode=reward) -kl_coef * k1;
     groups without signal (grpo: all outcomes equal, no process reward), trajectories whose
     environment failed and, optionally, those cut by a budget are left out of the update (DAPO;
     nanoagent/batch.py); with several ranks, whole groups move between them so that each trains
     on about as many tokens;
  3. the engine sleeps; the trainer recomputes old logprobs (unless the update is exactly
     on-policy: then they come from its own forward), reference logprobs and values;
  4. advantages (algo): GAE over action tokens, or over turns with ppo.credit=step (ppo); the
     outcome against a baseline plus the process rewards still to come, unnormalised (grpo, rloo,
     reinforce); or REINFORCE++'s returns, whitened over the batch;
  5. PPO epochs over mini-batches: clipped policy loss, with a ratio per token or (GSPO) per
     sequence or step (+ k3 KL loss, entropy bonus, truncated importance weights) and clipped
     value loss, each a global mean across micro-batches and ranks (of tokens, trajectories or
     turns); a non-finite loss or gradient skips the update;
  6. the new weights go into the engine; one line of metrics.
"""

import argparse
import math
import os
import random
import signal
import sys
import time
from functools import partial

import torch
from transformers import AutoTokenizer

from nanoagent import rl
from nanoagent.agent import run_agent
from nanoagent.batch import balance_groups, group_tokens, micro_steps, step_batch, unpack
from nanoagent.checkpoint import check_resume, export_hf, load_latest, resume_checkpoint, save_checkpoint, start_fresh
from nanoagent.common import (MetricsLog, all_reduce, exit_now, init_distributed, print0, seed_everything,
                              stop_on_signals)
from nanoagent.config import PRESETS, ConfigError, format_config, make_config, reference, save_config, to_dict
from nanoagent.data import step_prompts
from nanoagent.engine import SamplingConfig, make_engine, pad_token_id
from nanoagent.hub import resolve_model
from nanoagent.imitation import imitate
from nanoagent.metrics import evaluate, idle_stop, step_line, step_metrics
from nanoagent.model import (build_models, critic_forward, forward_all, full_tensors, old_policy_forward,
                             policy_forward)
from nanoagent.tasks import load_task, task_data


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, epilog=reference(), formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=None, help=f"preset: {', '.join(PRESETS)} (default: none)")
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
# the advantages

def critic_free_advantages(batch, rewards, process, scores, cfg):
    """
    [R, L] the advantages of the estimators without a critic, on the trained action tokens (step_batch's
    rewards, with -kl_coef * k1 in them under kl_mode=reward, and process): the outcome against a baseline
    of the counted trajectories (grpo: its group's mean and std; rloo: the mean of its group's others;
    reinforce: the batch mean) plus the process rewards still to come; REINFORCE++: discounted token
    returns, or every reward of the trajectory minus its group's mean, whitened over the trained tokens.
    """
    mask, owner, steps = batch["action_mask"], batch["trajectory"], batch["steps"]
    outcomes, groups, counted = scores["outcome"], scores["group"], scores["counted"]
    if cfg.algo == "reinforce_plus_plus":
        returns = rl.discounted_returns(rewards, mask, steps, cfg.ppo.gamma)
        return rl.whiten(returns, mask, all_reduce=all_reduce)
    if cfg.algo == "reinforce_plus_plus_baseline":
        # a trained trajectory's rewards as the update sees them, KL penalty included; a left-out one's
        # outcome and process rewards (no logprobs were computed for it: no KL)
        trained_totals = torch.zeros(len(counted)).index_add_(0, owner, rewards.sum(-1))
        totals = torch.where(scores["trained"], trained_totals, outcomes + scores["earned"])
        centre = partial(rl.grpo_advantages, scale_by_std=False)
        centred = rl.subset_advantages(centre, totals, groups, counted)
        return rl.whiten(centred[owner][:, None] * mask, mask, all_reduce=all_reduce)
    if cfg.algo == "grpo":
        grpo = partial(rl.grpo_advantages, eps=cfg.grpo.eps, scale_by_std=cfg.grpo.scale_by_std)
        advantages = rl.subset_advantages(grpo, outcomes, groups, counted)
    elif cfg.algo == "rloo":
        advantages = rl.subset_advantages(rl.rloo_advantages, outcomes, groups, counted)
    else:  # reinforce
        total, count = all_reduce([outcomes[counted].sum().item(), counted.sum().item()])
        advantages = outcomes - total / max(count, 1)
    return rl.outcome_token_advantages(advantages, process, mask, steps)


# -----------------------------------------------------------------------------
# the update

def loss_units(batch, cfg):
    """[R, L] each token's unit in train.loss_agg's mean: its step (step_mean_token_mean), else its trajectory."""
    return batch["step"] if cfg.train.loss_agg == "step_mean_token_mean" else batch["trajectory"][:, None].expand_as(batch["action_mask"])


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


def ppo_epochs(models, optimizers, batch, kept, n_mini, policy_moves, on_policy, cfg, step, rank, world, device):
    """
    PPO epochs over n_mini mini-batches of the kept rows (a trajectory's rows stay in one mini-batch): the
    critic's step, then the policy's (policy_moves: not in the critic's warm-up). Every rank takes the n_mini
    optimizer steps (collectives); one with no rows runs zero-weight passes. Returns [(shares, globals)] each.
    """
    rows_of = {}  # trajectory -> its kept rows
    for row in kept:
        rows_of.setdefault(batch["trajectory"][row].item(), []).append(row)
    policy_updates, critic_updates = [], []
    order_rng = random.Random(f"{cfg.seed}-{step}-{rank}")
    for epoch in range(cfg.ppo.epochs):
        order = list(rows_of)
        order_rng.shuffle(order)
        for m in range(n_mini):
            rows = [row for i in order[m * len(order) // n_mini:(m + 1) * len(order) // n_mini] for row in rows_of[i]]
            if "critic" in models:
                critic_updates.append(update_critic(models["critic"], optimizers["critic"], batch, rows, cfg, world, device))
            if policy_moves:
                policy_updates.append(update_policy(models["policy"], optimizers["policy"], batch, rows, on_policy, cfg, world, device))
    return policy_updates, critic_updates


def update_policy(policy, optimizer, batch, rows, on_policy, cfg, world, device):
    """One optimizer step of the policy on a mini-batch (this rank's rows). on_policy: the step's only update, so the old
    logprobs are this forward's, detached (ratio 1), and written into the batch. Returns (shares, globals): this rank's
    share of each loss statistic (they add up over ranks) and the values every rank already agrees on."""
    global_tokens, global_units, unit_tokens = rl.unit_counts(batch["action_mask"], loss_units(batch, cfg), rows, all_reduce)
    shares = {"pg_loss": 0.0, "clipfrac": 0.0, "approx_kl": 0.0, "entropy": 0.0, "kl_loss": 0.0}
    for layout, get in micro_steps({**batch, "unit_tokens": unit_tokens}, rows, cfg.train.micro_batch_tokens, device):
        actions = get("action_mask")
        mask = actions * (1.0 if layout.rows else 0.0)
        logprobs, entropy, nucleus = policy_forward(policy, get("input_ids"), get("position_ids"), actions > 0, cfg.rollout.temperature,
                                                    cfg.rollout.top_p if on_policy else None)
        if on_policy:
            old_logprobs = logprobs.detach()
            unpack(old_logprobs, layout, batch["old_logprobs"])
            unpack(nucleus, layout, batch["nucleus_logprobs"])
        else:
            old_logprobs = get("old_logprobs")
        # GSPO: one ratio per row (ppo.ratio=sequence) or per step
        segments = None if cfg.ppo.ratio == "token" else get("step") if cfg.ppo.ratio == "step" else get("row")
        per_token, pg_stats = rl.ppo_policy_loss(logprobs, old_logprobs, get("advantages"), mask, cfg.ppo.clip_low,
                                                 cfg.ppo.clip_high, cfg.ppo.clip_dual, segments)
        if cfg.train.tis:  # the engine sampled from a slightly different distribution than the trainer computes
            per_token = per_token * rl.truncated_is_weights(old_logprobs, get("rollout_logprobs"), mask, cfg.train.tis_cap)
        if cfg.train.kl_mode == "loss":
            kl = rl.kl_penalty(logprobs, get("ref_logprobs"), "k3")
            per_token = per_token + cfg.train.kl_coef * kl
            shares["kl_loss"] += rl.masked_sum(kl.detach(), mask).item() / global_tokens
        if cfg.train.entropy_coef:  # otherwise the entropy is only logged, and no gradient flows through it
            per_token = per_token - cfg.train.entropy_coef * entropy
        loss = rl.aggregate_loss(per_token, mask, cfg.train.loss_agg, global_tokens, global_units, get("unit_tokens"))
        (loss * world).backward()  # FSDP averages rank gradients; the loss is already a global mean
        n = mask.sum().item() / global_tokens
        shares["pg_loss"] += loss.item()
        shares["clipfrac"] += pg_stats["clipfrac"].item() * n
        shares["approx_kl"] += pg_stats["approx_kl"].item() * n
        shares["entropy"] += rl.masked_sum(entropy.detach(), mask).item() / global_tokens
    grad_norm, skipped = optimizer_step(policy, optimizer, shares["pg_loss"], cfg.train.grad_clip)
    return shares, {"grad_norm": grad_norm, "skipped": skipped}


def update_critic(critic, optimizer, batch, rows, cfg, world, device):
    """One optimizer step of the critic on a mini-batch: clipped value loss where value_mask is 1 (action tokens; with
    ppo.credit=step each step's first, where its value is read), a global mean. Returns (shares, globals)."""
    global_tokens, global_units, unit_tokens = rl.unit_counts(batch["value_mask"], loss_units(batch, cfg), rows, all_reduce)
    shares = {"vf_loss": 0.0, "vf_clipfrac": 0.0}
    for layout, get in micro_steps({**batch, "unit_tokens": unit_tokens}, rows, cfg.train.micro_batch_tokens, device):
        read = get("value_mask")
        mask = read * (1.0 if layout.rows else 0.0)
        values = critic_forward(critic, get("input_ids"), get("position_ids"), read > 0)
        per_token, vf_stats = rl.clipped_value_loss(values, get("values"), get("returns"), mask, cfg.ppo.value_clip)
        loss = rl.aggregate_loss(per_token, mask, cfg.train.loss_agg, global_tokens, global_units, get("unit_tokens"))
        (loss * world).backward()
        shares["vf_loss"] += loss.item()
        shares["vf_clipfrac"] += vf_stats["vf_clipfrac"].item() * mask.sum().item() / global_tokens
    grad_norm, skipped = optimizer_step(critic, optimizer, shares["vf_loss"], cfg.train.grad_clip)
    return shares, {"vf_grad_norm": grad_norm, "vf_skipped": skipped}


# -----------------------------------------------------------------------------

def main(argv=None):
    cfg = parse_args(sys.argv[1:] if argv is None else argv)
    model_path = resolve_model(cfg.model, "train.py")  # before the process group: see resolve_model
    rank, world, device = init_distributed()
    seed_everything(cfg.seed + rank)
    per_rank = cfg.rollout.prompts_per_step // world
    sizes = (cfg.rollout.prompts_per_step, cfg.ppo.mini_batch_size, cfg.train.warm_start_batch_size)
    if any(n % world for n in sizes):
        raise ConfigError(f"rollout.prompts_per_step, ppo.mini_batch_size and train.warm_start_batch_size "
                          f"{sizes} must each be a multiple of the number of ranks ({world})")
    # resume=auto continues from the latest complete checkpoint, with this command line's config where a key
    # may change (checkpoint.CHANGEABLE); resume=never starts anew (the old run moved aside once all is built)
    checkpoint = resume_checkpoint(cfg.run_dir) if cfg.resume == "auto" else None
    for change in check_resume(checkpoint, cfg) if checkpoint else []:
        print0(f"resume changes {change}")
    print0(format_config(cfg))

    # the task, the models, the rollout engine (colocated in this process)
    task, tokenizer = load_task(cfg.data.task), AutoTokenizer.from_pretrained(model_path)
    train_rows, val_rows, env = task_data(task, cfg, tokenizer)
    warm_dir = os.path.join(cfg.run_dir, "warm_start")  # the warm-started policy: RL's start and KL reference
    models, ref, optimizers = build_models(cfg, model_path, warm_dir if checkpoint else None, device)
    policy, critic = models["policy"], models.get("critic")
    engine = make_engine(cfg.rollout.engine, model_path, tokenizer, cfg.rollout.max_context_tokens, cfg.rollout.dtype,
                         cfg.rollout.gpu_memory_utilization, cfg.rollout.tensor_parallel_size, cfg.seed + rank, cfg.rollout.compile)
    sampling = SamplingConfig(cfg.rollout.max_new_tokens, cfg.rollout.temperature, cfg.rollout.top_p)
    # everything is built: only now is the run folder touched (a start that failed leaves it as it was)
    if cfg.resume == "never" and (aside := start_fresh(cfg.run_dir)):
        print0(f"resume=never: the run in {cfg.run_dir} was moved aside to {aside}")
    os.makedirs(cfg.run_dir, exist_ok=True)
    if rank == 0:
        save_config(cfg, os.path.join(cfg.run_dir, "config.json"))  # the config in effect

    # resume, or warm start by imitation; then the engine gets the policy's weights
    checkpoint, start_step, _ = load_latest(cfg.run_dir, models, optimizers) if cfg.resume == "auto" else (None, 0, None)
    if checkpoint:
        print0(f"resumed from {checkpoint} at step {start_step}")
    elif cfg.train.warm_start_steps:
        if task.demonstration is None:
            raise ConfigError(f"train.warm_start_steps > 0 but data.task={cfg.data.task} has no demonstrations")
        ref = imitate(policy, env, train_rows, task.demonstration, warm_dir, cfg, rank, world, device)
    engine.load_weights(full_tensors(policy))
    log = MetricsLog(cfg.run_dir, start_step if checkpoint else None, to_dict(cfg), cfg.log.wandb, cfg.log.wandb_project)
    if cfg.eval.every and not checkpoint:  # where RL starts from (a checkpoint of step 0, after a SIGTERM, has it logged)
        metrics = {"step": 0, **evaluate(engine, env, task, val_rows, cfg, rank, world)}
        print0("step    0 | " + " | ".join(f"{k} {v:.3f}" for k, v in metrics.items() if k != "step"))
        log.log(metrics)
    # A SIGTERM (a preemption) or a Ctrl-C is acted on at the next safe point, after the rollout or the
    # update, on every rank together: checkpoint, then exit 128 + the signal (143, 130: a run not finished)
    stop = stop_on_signals()
    saved_step, idle = start_step if checkpoint else None, 0  # idle: steps in a row that trained nothing

    def save(step):
        path = save_checkpoint(cfg.run_dir, step, models, optimizers, {"data_position": step * cfg.rollout.prompts_per_step},
                               to_dict(cfg), cfg.train.keep_last)
        print0(f"checkpoint: {path}")
        return step

    loop_start = time.perf_counter()  # for the step line's elapsed time and ETA
    for step in range(start_step, cfg.steps):
        t0 = time.perf_counter()
        set_hyperparameters(optimizers, step, cfg)
        # 1. rollout: G samples of each of this rank's prompts, multi-turn in the task's environment
        prompts = step_prompts(train_rows, step, per_rank, rank, world, cfg.seed, cfg.data.shuffle)
        engine.wake()
        trajs = run_agent(engine, env, [p for p in prompts for _ in range(cfg.rollout.group_size)], sampling, cfg.rollout.max_turns,
                          cfg.rollout.max_context_tokens, seed=cfg.seed * 100_003 + step * world + rank)
        engine.sleep()
        # a SIGTERM or Ctrl-C: the rollout is dropped, and the state this step started from is saved
        if (stopping := int(all_reduce([stop["signal"]], "max")[0])):
            name = signal.Signals(stopping).name
            print0(f"{name} during step {step + 1}'s rollout: checkpoint of step {step}, stopping")
            if saved_step != step:
                save(step)
            return 128 + stopping
        # 2. rewards: the task scores each trajectory (its outcome); rewards sit on action tokens
        for t in trajs:
            task.score(t, cfg)
        batch, rewards, process, scores, kept, dropped = step_batch(trajs, pad_token_id(tokenizer), cfg)
        if cfg.train.balance_ranks and world > 1:  # whole groups move between ranks so that each trains on
            # about as many tokens; the batch is then made again from the trajectories this rank now holds
            trajs = balance_groups(trajs, group_tokens(batch, kept, scores["group"]), cfg.rollout.group_size)
            batch, rewards, process, scores, kept, dropped = step_batch(trajs, pad_token_id(tokenizer), cfg)
        owner, mask = batch["trajectory"], batch["action_mask"]
        t1 = time.perf_counter()
        # 3. old logprobs (and renormalised over the top_p nucleus, as the engine reports them: engine_logprob_diff), unless the
        # update is exactly on-policy (one epoch of one mini-batch, no KL in the reward): then its own forward gives them
        [trained] = all_reduce([len({owner[row].item() for row in kept})])  # trajectories, all ranks
        n_mini = math.ceil(trained / cfg.ppo.mini_batch_size)
        policy_moves = cfg.algo != "ppo" or step >= cfg.ppo.critic_warmup_steps
        on_policy = cfg.ppo.epochs == 1 and n_mini <= 1 and cfg.train.kl_mode != "reward" and policy_moves
        batch["old_logprobs"], batch["nucleus_logprobs"] = torch.zeros_like(mask), torch.zeros_like(mask)  # the update's, on-policy
        if not on_policy:
            old = forward_all(lambda *packed: old_policy_forward(policy, *packed, cfg.rollout.temperature, cfg.rollout.top_p), batch, kept,
                              cfg.train.micro_batch_tokens, device, per_token=(2,))
            batch["old_logprobs"], batch["nucleus_logprobs"] = old.unbind(-1)
        if ref is not None:
            batch["ref_logprobs"] = forward_all(lambda *packed: policy_forward(ref, *packed, cfg.rollout.temperature)[0], batch, kept,
                                                cfg.train.micro_batch_tokens, device)
        if cfg.train.kl_mode == "reward":  # ppo and reinforce_plus_plus(_baseline) only (config.validate): k1 on every action token
            rewards = rewards - cfg.train.kl_coef * rl.kl_penalty(batch["old_logprobs"], batch["ref_logprobs"], "k1") * mask
        t2 = time.perf_counter()
        # 4. advantages (algo): GAE over the critic's values, per action token or per turn (ppo); without a
        # critic, the outcome against a baseline of the trajectories that count in it (an env_error counts
        # nowhere) plus the process rewards still to come, or REINFORCE++'s returns (critic_free_advantages)
        if cfg.algo == "ppo":
            values = forward_all(lambda *packed: critic_forward(critic, *packed), batch, kept, cfg.train.micro_batch_tokens, device)
            if cfg.ppo.credit == "token":  # a value per action token
                batch["value_mask"], batch["values"] = mask, values * mask
                advantages, batch["returns"] = rl.masked_gae(rewards, batch["values"], mask, cfg.ppo.gamma, cfg.ppo.lam)
            else:  # a value per turn: the critic's at the last token before the action, aligned at the action's first
                advantages, batch["returns"], batch["value_mask"] = rl.step_gae(rewards, values, mask, batch["steps"], cfg.ppo.gamma, cfg.ppo.lam)
                batch["values"] = values * batch["value_mask"]
            if cfg.ppo.whiten_advantages:  # over the action tokens, or the steps, of all ranks
                advantages = rl.whiten(advantages, mask, batch["value_mask"] if cfg.ppo.whiten_over == "steps" else mask, all_reduce)
        else:
            advantages = critic_free_advantages(batch, rewards, process, scores, cfg)
        batch["advantages"] = advantages
        # 5. PPO epochs over mini-batches of the kept trajectories: critic, then policy (after the critic's warm-up)
        policy_updates, critic_updates = ppo_epochs(models, optimizers, batch, kept, n_mini, policy_moves, on_policy, cfg, step, rank, world, device)
        kl = rl.kl_penalty(batch["old_logprobs"], batch["ref_logprobs"], "k1") * mask if ref is not None else None  # logged
        t3 = time.perf_counter()
        # 6. the new weights into the engine; one line of metrics
        engine.wake(["weights"])
        engine.load_weights(full_tensors(policy))
        engine.wake(["kv_cache"])
        t4 = time.perf_counter()
        stopping = int(all_reduce([stop["signal"]], "max")[0])
        metrics = step_metrics(step, trajs, dropped, batch, policy_updates, critic_updates, kl, [t0, t1, t2, t3, t4])
        metrics["lr"] = get_lr(step, cfg.train.lr, cfg.train.warmup_steps)
        metrics["trained"] = trained / (cfg.rollout.prompts_per_step * cfg.rollout.group_size)  # a fraction
        if cfg.eval.every and ((step + 1) % cfg.eval.every == 0 or step + 1 == cfg.steps) and not stopping:
            metrics.update(evaluate(engine, env, task, val_rows, cfg, rank, world))
        print0(step_line(metrics, cfg, start_step, time.perf_counter() - loop_start))
        log.log(metrics)

        # checkpoints: every save_every steps, at the end, after a SIGTERM or a Ctrl-C, and when the run stops
        # because it has trained nothing for train.max_idle_steps steps (every trajectory left out)
        idle = idle + 1 if trained == 0 else 0
        idle_out = cfg.train.max_idle_steps and idle >= cfg.train.max_idle_steps
        every = cfg.train.save_every and (step + 1) % cfg.train.save_every == 0
        if stopping or idle_out or step + 1 == cfg.steps or every:
            saved_step = save(step + 1)
        if idle_out:
            raise ConfigError(idle_stop(metrics, idle))
        if stopping:
            name = signal.Signals(stopping).name
            print0(f"{name} during step {step + 1}: checkpoint of step {step + 1} written, stopping")
            return 128 + stopping

    export_dir = os.path.join(cfg.run_dir, "hf")
    export_hf(policy, tokenizer, export_dir, torch.bfloat16 if cfg.train.dtype == "bfloat16" else torch.float32)
    print0(f"exported {export_dir} in {cfg.train.dtype}, every tensor checked against the trainer's")
    return 0


if __name__ == "__main__":
    try:
        code = main()
    except ConfigError as e:  # a setting found unworkable once the run had started (its data, a resume):
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:  # one line in each node's log
            print(f"train.py: error: {e}", file=sys.stderr, flush=True)
        code = 2
    except KeyboardInterrupt:  # a Ctrl-C before the loop (nothing to save yet), or the second one
        print0("train.py: interrupted; resume=auto goes on from the last checkpoint, if there is one")
        code = 130
    exit_now(code)
