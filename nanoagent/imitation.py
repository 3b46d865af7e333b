"""
Warm start by imitation, before RL: a tiny or small model rarely earns a reward by chance, and
without rewards that vary GRPO and PPO have nothing to learn from. The task's scripted
demonstrations are imitated through the same trajectory assembly, forward passes, mask and loss
aggregation as RL, so what the warm start trains is exactly what RL will score.

Demonstrations of one task share their system prompt and tools, about half their tokens on the synthetic
task: the packed passes compute them once a micro-batch (batch.share_prefix). A warm start can still take
a while (SmolLM2's first stage, 80 steps: ~30 minutes on one busy core), so a SIGTERM or a Ctrl-C during
it stops at the next step boundary with a checkpoint (the policy and this AdamW's state, in
run_dir/warm_start_progress, as checkpoint.py writes RL's), and resume=auto goes on from that step. Its
batches are drawn up front from a seeded stream, so the resumed warm start is the one that would have
run: the same batches, the same optimizer state, the same weights in the end.
"""

import random
import shutil
import time

import torch

from nanoagent import rl
from nanoagent.agent import scripted_trajectories
from nanoagent.batch import collate, micro_steps, share_prefix
from nanoagent.checkpoint import export_hf, load_latest, save_checkpoint
from nanoagent.common import Stopped, all_reduce, print0, signal_received
from nanoagent.config import to_dict
from nanoagent.engine import pad_token_id
from nanoagent.metrics import duration
from nanoagent.model import load_reference, merge_adapters, policy_forward


def progress_dir(warm_dir):
    """Where an unfinished warm start's checkpoint is kept (a run_dir for save_checkpoint): beside warm_dir,
    and deleted once warm_dir is written."""
    return warm_dir + "_progress"


def imitate(policy, env, rows, demonstrate, warm_dir, cfg, rank, world, device, stop, summarize=None):
    """
    Warm start by imitation of the task's scripted demonstrations, through the same trajectory
    assembly, forward, mask and loss aggregation as RL: maximise the logprob of the demonstrated
    action tokens (mask = 1), a global token mean. Its own AdamW, so RL's optimizer starts fresh.
    The warm-started policy, where RL starts, is written to warm_dir (a resume reads it back); returns
    the KL reference read from it (None without a KL term). With LoRA the adapters are trained, then
    merged into the base (model.merge_adapters): RL's adapters start from B = 0 on the warm-started
    policy, which is also their base and the KL reference. stop: common.stop_on_signals'; a signal
    stops it at the next step boundary with a checkpoint of that step (raises common.Stopped), which
    resume=auto continues from. summarize: the task's, for the summary turns of rollout.context=summary
    (scripted_trajectories).
    """
    rng = random.Random(f"{cfg.seed}-demos-{rank}")
    mine = rows[rank::world]
    scripts = [demonstrate(row, rng, cfg) for row in mine]
    per_rank = (cfg.train.warm_start_batch_size or cfg.ppo.mini_batch_size) // world
    draws = [[rng.randrange(len(mine)) for _ in range(per_rank)]
             for _ in range(cfg.train.warm_start_steps)]                                   # [steps][per_rank]
    # only the demonstrations drawn are assembled (tokenised, their tool calls run), each once
    drawn = sorted({i for d in draws for i in d})
    demos = dict(zip(drawn, scripted_trajectories(env, [mine[i] for i in drawn],
                                                  [scripts[i] for i in drawn], summarize)))
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=cfg.train.warm_start_lr,
                                  weight_decay=0.0)
    models, optimizers, progress = {"policy": policy}, {"policy": optimizer}, progress_dir(warm_dir)
    path, start, _ = load_latest(progress, models, optimizers) if cfg.resume == "auto" else (None, 0, None)
    if path:
        for group in optimizer.param_groups:  # a resume may change it (check_resume printed so)
            group["lr"] = cfg.train.warm_start_lr
        print0(f"warm start resumed from {path} at step {start}")
    steps, begun = cfg.train.warm_start_steps, time.perf_counter()
    for step in range(start, steps):
        if signum := signal_received(stop):
            save_checkpoint(progress, step, models, optimizers, {}, to_dict(cfg), keep_last=1)
            raise Stopped(signum, "the warm start", f"checkpoint of its step {step}/{steps} written")
        batch = share_prefix(collate([demos[i] for i in draws[step]], pad_token_id(env.tokenizer)))
        rows = list(range(len(batch["lengths"])))
        # over all ranks: the loss is one global token mean
        [global_tokens] = all_reduce([batch["action_mask"].sum().item()])
        loss_sum = 0.0
        for layout, get in micro_steps(batch, rows, cfg.train.micro_batch_tokens, device):
            actions = get("action_mask")
            logprobs = policy_forward(policy, get("input_ids"), get("position_ids"), actions > 0)[0]
            loss = rl.aggregate_loss(-logprobs, actions * (1.0 if layout.rows else 0.0), "token_mean",
                                     global_tokens, None)
            (loss * world).backward()
            loss_sum += loss.item()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), cfg.train.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        [loss_sum, batch_size] = all_reduce([loss_sum, len(rows)])
        elapsed = time.perf_counter() - begun
        eta = elapsed / (step + 1 - start) * (steps - step - 1)
        print0(f"warm start {step + 1:4d}/{steps} | nll {loss_sum:.4f} | {batch_size:.0f} demonstrations | "
               f"elapsed {duration(elapsed)} eta {duration(eta)}")
    if policy.lora_config is not None:
        merge_adapters(policy)
    export_hf(policy, env.tokenizer, warm_dir, getattr(torch, cfg.train.dtype))
    if rank == 0:  # warm_dir holds the result now
        shutil.rmtree(progress, ignore_errors=True)
    return load_reference(cfg, warm_dir, policy, device)
