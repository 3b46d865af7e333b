"""
Train an LLM agent with end-to-end RL over multi-turn tool use, or any environment: PPO with a
critic and mask-aware GAE, or GRPO, RLOO, REINFORCE or REINFORCE++ without one. One process per GPU
(or CPU rank) under torchrun, FSDP2 for training, and a colocated rollout engine in every rank that
gets the new weights after every update.

    torchrun --nproc_per_node=8 train.py --config=hotpotqa algo=grpo model=Qwen/Qwen2.5-3B-Instruct
    torchrun --nproc_per_node=2 train.py --config=tiny algo=ppo steps=2 run_dir=out/tiny-2ranks   # CPU
    python train.py --config=tiny train.warm_start_steps=400 train.warm_start_lr=3e-3      # one process

The task (nanoagent/tasks/, by data.task) gives the prompts, the tools or environment, the scoring
and demonstrations for a warm start by imitation; everything else here is task-agnostic.

One step, top to bottom:
  1. rollout: every rank rolls out its share of the prompts (G times each), multi-turn in the
     task's environment (tool calls, a game); a turn sees the whole trajectory (one growing token
     row), or with rollout.context=last_k the question and the last K turns, each turn a row; it
     ends when the share of groups has (nanoagent/partial.py: with rollout.max_staleness the groups
     still running pause and go on in the next step; with grpo.refill a group with nothing to train
     on is replaced by another);
  2. rewards: the task scores each trajectory as its group ends; the outcome reward sits on the last
     action token, process rewards (a step's) on the last action token of their turn, (kl_mode=reward)
     -kl_coef * k1; groups without signal (grpo: all outcomes equal, no process reward), trajectories
     whose environment failed and, optionally, those cut by a budget are left out of the update (DAPO;
     nanoagent/batch.py); with several ranks, whole groups move between them so that each trains
     on about as many tokens;
  3. the engine sleeps; the trainer recomputes old logprobs (unless the update is exactly
     on-policy: then they come from its own forward), reference logprobs and values;
  4. advantages (algo): GAE over action tokens, or over turns with ppo.credit=step (ppo); the
     outcome against a baseline plus the process rewards still to come, unnormalised (grpo, rloo,
     reinforce); or REINFORCE++'s returns, whitened over the batch;
  5. PPO epochs over mini-batches (nanoagent/update.py): clipped policy loss, a ratio per token or (GSPO) per
     sequence or step (+ k3 KL loss, entropy bonus, truncated importance weights: with partial rollouts,
     decoupled PPO's weights of the tokens an older policy sampled) and clipped value loss, each a
     global mean across micro-batches and ranks (of tokens, trajectories or turns); a non-finite loss
     or gradient skips the update;
  6. the new weights go into the engine; one line of metrics, and a few of the step's groups token by
     token (trajectories.jsonl: report.py shows them in trajectories.html).
"""

import argparse
import math
import os
import sys
import time
from functools import partial

import torch
from transformers import AutoTokenizer

from nanoagent import rl
from nanoagent.agent import Rollouts
from nanoagent.batch import balance_groups, group_tokens, step_batch
from nanoagent.checkpoint import (check_resume, export_hf, load_latest, resume_checkpoint, save_checkpoint,
                                  start_fresh)
from nanoagent.common import (MetricsLog, StepLines, Stopped, all_reduce, init_distributed, logger_problem,
                              print0, run_script, seed_everything, signal_received, stop_on_signals,
                              world_size)
from nanoagent.config import ConfigError, format_config, make_config, reference, save_config, to_dict
from nanoagent.data import spare_prompts, step_prompts
from nanoagent.engine import SamplingConfig, make_engine, pad_token_id
from nanoagent.hub import resolve_model
from nanoagent.imitation import imitate, progress_dir
from nanoagent.metrics import evaluate, idle_stop, sampled_trajectories, step_line, step_metrics
from nanoagent.model import (build_models, critic_forward, forward_all, full_tensors, old_policy_forward,
                             policy_forward)
from nanoagent.partial import rollout_step
from nanoagent.presets import PRESETS
from nanoagent.tasks import load_task, task_data
from nanoagent.update import get_lr, ppo_epochs, set_hyperparameters


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, epilog=reference(),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=None, help=f"preset: {', '.join(PRESETS)} (default: none)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, dotted keys")
    args = parser.parse_args(argv)
    try:
        cfg = make_config(args.config, args.overrides)
    except ConfigError as e:
        parser.error(str(e))
    if cfg.rollout.tensor_parallel_size != 1:
        parser.error(f"rollout.tensor_parallel_size={cfg.rollout.tensor_parallel_size}: train.py takes 1 "
                     "only. vLLM's external launcher needs every rank of a tensor-parallel group to submit "
                     "identical requests, and each rank here rolls out its own prompts with its own seeds; "
                     "use one engine per rank (a 7B model fits one GPU)")
    if problem := logger_problem(cfg.log):
        parser.error(problem)
    return cfg


# -----------------------------------------------------------------------------
# the rewards and the logprobs

def balanced_step_data(trajs, pad_id, cfg, world):
    """
    The StepData of the scored trajectories: rows that carry the rewards on the action tokens that train.
    With several ranks, whole groups then move between them so that each trains on about as many tokens,
    and this rank's StepData is made again from the trajectories it holds after the move.
    """
    data = step_batch(trajs, pad_id, cfg)
    if cfg.train.balance_ranks and world > 1:
        costs = group_tokens(data.batch, data.kept, data.scores["group"])
        data = step_batch(balance_groups(trajs, costs, cfg.rollout.group_size), pad_id, cfg)
    return data


def logprobs_before_update(policy, ref, data, on_policy, cfg, device):
    """
    [R, L] each, on the trained rows: the policy's logprobs before the update and the same within the
    rollout's top-p nucleus (as the engine reports them: engine_logprob_diff), zeros when the update is
    exactly on-policy (its own forward gives them, unless nothing trains); the reference's, None without
    a reference.
    """
    batch, kept, budget = data.batch, data.kept, cfg.train.micro_batch_tokens
    temperature, top_p = cfg.rollout.temperature, cfg.rollout.top_p
    zeros = torch.zeros_like(batch["action_mask"])
    old, nucleus, ref_logprobs = zeros, zeros.clone(), None
    if not on_policy:
        both = forward_all(lambda *packed: old_policy_forward(policy, *packed, temperature, top_p),
                           batch, kept, budget, device, per_token=(2,))
        old, nucleus = both.unbind(-1)
    if ref is not None:
        ref_logprobs = forward_all(lambda *packed: policy_forward(ref, *packed, temperature)[0],
                                   batch, kept, budget, device)
    return old, nucleus, ref_logprobs


# -----------------------------------------------------------------------------
# the advantages

def gae_advantages(critic, data, rewards, cfg, device):
    """
    ppo: [R, L] advantages, values, returns and value_mask: GAE over the critic's values, per action token
    or (ppo.credit=step) per turn, whitened over the action tokens or the steps of all ranks.
    """
    batch, mask = data.batch, data.batch["action_mask"]
    if cfg.ppo.credit == "token" and len(batch["trajectory"].unique()) < len(batch["trajectory"]):
        raise ConfigError("a trajectory came in several rows (its environment or flow gave a context that "
                          "does not go on from the last one), and token-level GAE cannot carry a value "
                          "across rows: set ppo.credit=step")
    values = forward_all(lambda *packed: critic_forward(critic, *packed), batch, data.kept,
                         cfg.train.micro_batch_tokens, device)
    if cfg.ppo.credit == "token":  # a value per action token
        value_mask = mask
        advantages, returns = rl.masked_gae(rewards, values * mask, mask, cfg.ppo.gamma, cfg.ppo.lam)
    else:  # a value per turn: the critic's at the last token before the action, aligned at the action's first
        advantages, returns, value_mask = rl.step_gae(rewards, values, mask, batch["steps"], cfg.ppo.gamma,
                                                      cfg.ppo.lam)
    if cfg.ppo.whiten_advantages:
        over = value_mask if cfg.ppo.whiten_over == "steps" else mask
        advantages = rl.whiten(advantages, mask, over, all_reduce)
    return advantages, values * value_mask, returns, value_mask


def critic_free_advantages(data, rewards, cfg):
    """
    [R, L] the advantages of the estimators without a critic, on the trained action tokens (the step's
    rewards, with -kl_coef * k1 in them under kl_mode=reward, and its process rewards): the outcome
    against a baseline of the counted trajectories (grpo: its group's mean and std; rloo: the mean of its
    group's others; reinforce: the batch mean) plus the process rewards still to come; REINFORCE++:
    discounted token returns, or every reward of the trajectory minus its group's mean, whitened over the
    trained tokens.
    """
    mask, owner, steps = data.batch["action_mask"], data.batch["trajectory"], data.batch["steps"]
    scores, process = data.scores, data.process
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
# the run

def check_run(cfg, world):
    """The checks a run makes before it builds anything, on every rank alike: the batch sizes against the
    ranks, and with resume=auto the latest complete checkpoint (returned, or None), or else an unfinished
    warm start's, against this config: the keys a resume may change are applied and printed, a change of
    a fixed one is refused."""
    sizes = (cfg.rollout.prompts_per_step, cfg.ppo.mini_batch_size, cfg.train.warm_start_batch_size)
    if any(n % world for n in sizes):
        raise ConfigError(f"rollout.prompts_per_step, ppo.mini_batch_size and train.warm_start_batch_size "
                          f"{sizes} must each be a multiple of the number of ranks ({world})")
    checkpoint = resume_checkpoint(cfg.run_dir) if cfg.resume == "auto" else None
    warm = None
    if cfg.resume == "auto" and not checkpoint and cfg.train.warm_start_steps:
        warm = resume_checkpoint(progress_dir(os.path.join(cfg.run_dir, "warm_start")))
    for path, steps_key in [(checkpoint, "steps"), (warm, "train.warm_start_steps")]:
        for change in check_resume(path, cfg, steps_key) if path else []:
            print0(f"resume changes {change}")
    print0(format_config(cfg))
    return checkpoint


def resume_or_warm_start(cfg, task, env, train_rows, models, optimizers, ref, rank, world, device, stop):
    """Resume from the latest complete checkpoint (resume=auto), else warm-start the policy by imitation of
    the task's demonstrations (train.warm_start_steps; an unfinished one goes on where it stopped), saved
    to run_dir/warm_start, which becomes the KL reference. Returns (the checkpoint or None, the step to
    start from, the reference)."""
    resumed = load_latest(cfg.run_dir, models, optimizers) if cfg.resume == "auto" else (None, 0, None)
    checkpoint, start_step, _ = resumed
    if checkpoint:
        print0(f"resumed from {checkpoint} at step {start_step}")
    elif cfg.train.warm_start_steps:
        if task.demonstration is None:
            raise ConfigError(f"train.warm_start_steps > 0 but data.task={cfg.data.task} has no "
                              "demonstrations")
        warm_dir = os.path.join(cfg.run_dir, "warm_start")
        ref = imitate(models["policy"], env, train_rows, task.demonstration, warm_dir, cfg, rank, world,
                      device, stop, getattr(task, "summarize", None))
    return checkpoint, start_step, ref


def checkpoint_and_stop(signum, when, step, saved_step, save):
    """The checkpoint of `step` (unless it is saved already), then common.Stopped, which run_script says in
    one line with the command that goes on."""
    if saved_step != step:
        save(step)
    raise Stopped(signum, when, f"checkpoint of step {step} written")


def main(argv=None):
    cfg = parse_args(sys.argv[1:] if argv is None else argv)
    # a SIGTERM (a preemption) or a Ctrl-C from here on is acted on at the next safe point, on every rank
    stop = stop_on_signals()
    model_path = resolve_model(cfg.model, "train.py")  # before the process group: see resolve_model
    seed_everything(cfg.seed)  # + this rank's: before the task's data, which may draw
    # what may refuse the run (a resume, the data) is checked on every rank before the process group
    # exists: each rank is refused alike, rank 0 says why, and none is left waiting for another to connect
    checkpoint = check_run(cfg, world_size())
    task, tokenizer = load_task(cfg.data.task), AutoTokenizer.from_pretrained(model_path)
    train_rows, val_rows, env = task_data(task, cfg, tokenizer)

    # the models, the rollout engine (colocated in this process)
    rank, world, device = init_distributed()
    warm_dir = os.path.join(cfg.run_dir, "warm_start")  # the warm-started policy: RL's start and KL reference
    models, ref, optimizers = build_models(cfg, model_path, warm_dir if checkpoint else None, device)
    policy, critic, r = models["policy"], models.get("critic"), cfg.rollout
    engine = make_engine(r.engine, model_path, tokenizer, r.max_context_tokens, r.dtype,
                         r.gpu_memory_utilization, r.tensor_parallel_size, cfg.seed + rank, r.compile)
    rollouts = Rollouts(engine, env, SamplingConfig(r.max_new_tokens, r.temperature, r.top_p), r.max_turns,
                        r.max_context_tokens)
    # everything is built: only now is the run folder touched (a start that failed leaves it as it was)
    if signum := signal_received(stop):
        raise Stopped(signum, "the start", "nothing to save (the run folder is as it was)", resumable=False)
    if cfg.resume == "never" and (aside := start_fresh(cfg.run_dir)):
        print0(f"resume=never: the run in {cfg.run_dir} was moved aside to {aside}")
    os.makedirs(cfg.run_dir, exist_ok=True)
    if rank == 0:
        save_config(cfg, os.path.join(cfg.run_dir, "config.json"))  # the config in effect

    # resume, or warm start by imitation; then the engine gets the policy's weights
    checkpoint, start_step, ref = resume_or_warm_start(cfg, task, env, train_rows, models, optimizers, ref,
                                                       rank, world, device, stop)
    engine.load_weights(full_tensors(policy))
    log = MetricsLog(cfg.run_dir, start_step if checkpoint else None, to_dict(cfg), cfg.log.wandb,
                     cfg.log.wandb_project, cfg.log.tensorboard)
    samples = StepLines(os.path.join(cfg.run_dir, "trajectories.jsonl"), start_step if checkpoint else None)
    evaluated = cfg.eval.every and not checkpoint  # RL's start (a checkpoint of step 0 has it logged)
    if evaluated:
        metrics = {"step": 0, **evaluate(engine, env, task, val_rows, cfg, rank, world)}
        print0("step    0 | " + " | ".join(f"{k} {v:.3f}" for k, v in metrics.items() if k != "step"))
        log.log(metrics)
    saved_step, idle = start_step if checkpoint else None, 0  # idle: steps in a row that trained nothing
    carried = []  # the groups a partial rollout paused, to go on in the next step (a resume starts without)
    pad_id = pad_token_id(tokenizer)
    score = lambda t: task.score(t, cfg)  # noqa: E731
    trains = lambda group: bool(step_batch(group, pad_id, cfg).kept)  # noqa: E731

    def save(step):
        position = {"data_position": step * r.prompts_per_step}
        path = save_checkpoint(cfg.run_dir, step, models, optimizers, position, to_dict(cfg),
                               cfg.train.keep_last)
        print0(f"checkpoint: {path}")
        return step

    # a signal during the warm start's last step or the evaluation: RL's start is saved (the warm start kept)
    if signum := signal_received(stop):
        checkpoint_and_stop(signum, "the evaluation at step 0" if evaluated else "the start", start_step,
                            saved_step, save)
    loop_start = time.perf_counter()  # for the step line's elapsed time and ETA
    for step in range(start_step, cfg.steps):
        t0 = time.perf_counter()
        set_hyperparameters(optimizers, step, cfg)
        # 1. rollout: G samples of each of this rank's prompts, multi-turn in the task's environment, until
        # enough groups have ended (all of them, unless partial rollouts or dynamic sampling: partial.py);
        # the task scores each trajectory as its group ends
        prompts = step_prompts(train_rows, step, r.prompts_per_step // world, rank, world, cfg.seed,
                               cfg.data.shuffle, cfg.data.balance_by)
        engine.wake()
        spares = spare_prompts(train_rows, step, rank, cfg.seed)
        seed = cfg.seed * 100_003 + step * world + rank  # this rank's sampling seed of the step
        groups, carried, counts = rollout_step(rollouts, carried, prompts, spares, step, seed, score, trains,
                                               cfg, world)
        trajs = [t for g in groups for t in g]
        engine.sleep()
        # a SIGTERM or Ctrl-C: the rollout is dropped, and the state this step started from is saved
        if (signum := signal_received(stop)):
            checkpoint_and_stop(signum, f"step {step + 1}'s rollout", step, saved_step, save)
        # 2. rewards: on the action tokens that train
        data = balanced_step_data(trajs, pad_id, cfg, world)
        batch, mask, rewards = data.batch, data.batch["action_mask"], data.rewards
        t1 = time.perf_counter()
        # 3. logprobs before the update, unless it is exactly on-policy (one epoch of one mini-batch, no KL in
        # the reward, no token sampled by an older policy: then its own forward gives them); the reference's
        stale = (step - batch["version"])[mask > 0].max().item() if mask.any() else 0
        [trained] = all_reduce([len({batch["trajectory"][row].item() for row in data.kept})])  # all ranks
        [stalest] = all_reduce([stale], "max")
        n_mini = math.ceil(trained / cfg.ppo.mini_batch_size)
        policy_moves = cfg.algo != "ppo" or step >= cfg.ppo.critic_warmup_steps
        on_policy = (cfg.ppo.epochs == 1 and n_mini <= 1 and cfg.train.kl_mode != "reward" and policy_moves
                     and stalest == 0)
        old, nucleus, ref_logprobs = logprobs_before_update(policy, ref, data, on_policy, cfg, device)
        batch["old_logprobs"], batch["nucleus_logprobs"], batch["ref_logprobs"] = old, nucleus, ref_logprobs
        if cfg.train.kl_mode == "reward":  # ppo, reinforce_plus_plus(_baseline): k1 on every action token
            rewards = rewards - cfg.train.kl_coef * rl.kl_penalty(old, batch["ref_logprobs"], "k1") * mask
        t2 = time.perf_counter()
        # 4. advantages (algo): GAE over the critic's values (ppo); without a critic, the outcome against a
        # baseline of the trajectories that count in it plus the process rewards still to come, or REINFORCE++
        if cfg.algo == "ppo":
            advantages, batch["values"], batch["returns"], batch["value_mask"] = gae_advantages(
                critic, data, rewards, cfg, device)
        else:
            advantages = critic_free_advantages(data, rewards, cfg)
        batch["advantages"] = advantages
        # 5. PPO epochs over mini-batches of the kept trajectories: critic, then policy (after its warm-up)
        policy_updates, critic_updates, own_logprobs = ppo_epochs(
            models, optimizers, data, n_mini, policy_moves, on_policy, cfg, step, rank, world, device)
        if own_logprobs is not None:  # on-policy: the update's own forward gave the logprobs before it
            batch["old_logprobs"], batch["nucleus_logprobs"] = own_logprobs
        kl = None if ref is None else rl.kl_penalty(batch["old_logprobs"], ref_logprobs, "k1") * mask
        t3 = time.perf_counter()
        # 6. the new weights into the engine; one line of metrics, a few of the step's groups
        engine.wake(["weights"])
        engine.load_weights(full_tensors(policy))
        engine.wake(["kv_cache"])
        t4 = time.perf_counter()
        stopping = signal_received(stop)
        metrics = step_metrics(step, data.trajs, data.dropped, batch, policy_updates, critic_updates, kl,
                               counts, [t0, t1, t2, t3, t4])
        metrics["lr"] = get_lr(step, cfg.train.lr, cfg)
        metrics["trained"] = trained / (r.prompts_per_step * r.group_size)  # a fraction
        if cfg.eval.every and ((step + 1) % cfg.eval.every == 0 or step + 1 == cfg.steps) and not stopping:
            metrics.update(evaluate(engine, env, task, val_rows, cfg, rank, world))
        print0(step_line(metrics, cfg, start_step, time.perf_counter() - loop_start))
        log.log(metrics)
        if rank == 0:  # a few of the step's groups, token by token, for report.py's trajectory viewer
            samples.write(sampled_trajectories(data, step, tokenizer, cfg.log.trajectories_per_step))

        # checkpoints: every save_every steps, at the end, after a SIGTERM or a Ctrl-C, and when the run stops
        # because it has trained nothing for train.max_idle_steps steps (every trajectory left out)
        idle = idle + 1 if trained == 0 else 0
        idle_out = cfg.train.max_idle_steps and idle >= cfg.train.max_idle_steps
        every = cfg.train.save_every and (step + 1) % cfg.train.save_every == 0
        if idle_out or step + 1 == cfg.steps or every:
            saved_step = save(step + 1)
        if idle_out:
            raise ConfigError(idle_stop(metrics, idle))
        if stopping:
            checkpoint_and_stop(stopping, f"step {step + 1}", step + 1, saved_step, save)

    export_dir = os.path.join(cfg.run_dir, "hf")
    dtype = torch.bfloat16 if cfg.train.dtype == "bfloat16" else torch.float32
    export_hf(policy, tokenizer, export_dir, dtype, base=warm_dir if os.path.isdir(warm_dir) else model_path)
    print0(f"exported {export_dir} in {cfg.train.dtype}, every tensor checked against the trainer's")
    env.close()
    return 0


if __name__ == "__main__":
    run_script(main)
