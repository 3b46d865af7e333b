"""
Run under torchrun (gloo): the gradient of one PPO loss on a fixed batch, computed with FSDP2
over WORLD_SIZE ranks and micro-batches of `--micro` rows; rank 0 saves the full gradient.
Used by tests/test_distributed.py, which compares it with a single-process, unsharded run.
"""

import argparse
import os

import torch
import torch.distributed as dist

from nanoagent import rl
from nanoagent.model import load_causal_lm, pad_rows, policy_forward, shard


def batch(vocab, n=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = [int(x) for x in torch.randint(6, 20, (n,), generator=g)]
    rows = [torch.randint(3, vocab, (L,), generator=g).tolist() for L in lengths]
    masks = [[0] * 3 + (torch.rand(L - 3, generator=g) > 0.3).long().tolist() for L in lengths]
    advantages = [torch.randn(L, generator=g).tolist() for L in lengths]
    return rows, masks, advantages


def grad_of(model, rows, masks, advantages, indices, micro, global_tokens, world=1):
    for s in range(0, len(indices), micro):
        idx = indices[s:s + micro]
        ids = pad_rows([rows[i] for i in idx], 0)
        attn = pad_rows([[1] * len(rows[i]) for i in idx], 0)
        mask = pad_rows([masks[i] for i in idx], 0, torch.float32)
        adv = pad_rows([advantages[i] for i in idx], 0.0, torch.float32)
        logprobs, _ = policy_forward(model, ids, attn)
        loss, _ = rl.ppo_policy_loss(logprobs, logprobs.detach() - 0.1, adv, mask)
        (rl.aggregate_loss(loss, mask, "token_mean", global_tokens, None) * world).backward()  # FSDP averages over ranks


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--micro", type=int, default=2)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = load_causal_lm(args.model)
    rows, masks, advantages = batch(model.config.vocab_size)
    global_tokens = sum(sum(m) for m in masks)
    shard(model)
    grad_of(model, rows, masks, advantages, list(range(rank, len(rows), world)), args.micro, global_tokens, world)
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    if rank == 0:
        torch.save(grads, args.out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
