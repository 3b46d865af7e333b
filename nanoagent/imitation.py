"""
Warm start by imitation, before RL: a tiny or small model rarely earns a reward by chance, and
without rewards that vary GRPO and PPO have nothing to learn from. The task's scripted
demonstrations are imitated through the same trajectory assembly, forward passes, mask and loss
aggregation as RL, so what the warm start trains is exactly what RL will score.
"""

import random

import torch

from nanoagent import rl
from nanoagent.agent import scripted_trajectories
from nanoagent.batch import collate, micro_steps
from nanoagent.checkpoint import export_hf
from nanoagent.common import all_reduce, print0
from nanoagent.engine import pad_token_id
from nanoagent.model import load_reference, merge_adapters, policy_forward


def imitate(policy, env, rows, demonstrate, warm_dir, cfg, rank, world, device, summarize=None):
    """
    Warm start by imitation of the task's scripted demonstrations, through the same trajectory
    assembly, forward, mask and loss aggregation as RL: maximise the logprob of the demonstrated
    action tokens (mask = 1), a global token mean. Its own AdamW, so RL's optimizer starts fresh.
    The warm-started policy, where RL starts, is written to warm_dir (a resume reads it back); returns
    the KL reference read from it (None without a KL term). With LoRA the adapters are trained, then
    merged into the base (model.merge_adapters): RL's adapters start from B = 0 on the warm-started
    policy, which is also their base and the KL reference. summarize: the task's, for the summary turns
    of rollout.context=summary (scripted_trajectories).
    """
    rng = random.Random(f"{cfg.seed}-demos-{rank}")
    mine = rows[rank::world]
    scripts = [demonstrate(row, rng) for row in mine]
    per_rank = (cfg.train.warm_start_batch_size or cfg.ppo.mini_batch_size) // world
    draws = [[rng.randrange(len(mine)) for _ in range(per_rank)]
             for _ in range(cfg.train.warm_start_steps)]                                   # [steps][per_rank]
    # only the demonstrations drawn are assembled (tokenised, their tool calls run), each once
    drawn = sorted({i for d in draws for i in d})
    demos = dict(zip(drawn, scripted_trajectories(env, [mine[i] for i in drawn],
                                                  [scripts[i] for i in drawn], summarize)))
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=cfg.train.warm_start_lr,
                                  weight_decay=0.0)
    for step in range(cfg.train.warm_start_steps):
        batch = collate([demos[i] for i in draws[step]], pad_token_id(env.tokenizer))
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
        if step % 20 == 0 or step == cfg.train.warm_start_steps - 1:
            print0(f"warm start {step + 1:4d}/{cfg.train.warm_start_steps} | nll {loss_sum:.4f} | "
                   f"{batch_size:.0f} demonstrations")
    if policy.lora_config is not None:
        merge_adapters(policy)
    export_hf(policy, env.tokenizer, warm_dir, getattr(torch, cfg.train.dtype))
    return load_reference(cfg, warm_dir, policy, device)
