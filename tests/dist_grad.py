"""
Run under torchrun (gloo): the gradient of one PPO update of the trainer (train.ppo_epochs) on a
fixed batch, with FSDP2 over WORLD_SIZE ranks and micro-batches under `--micro-tokens`, training on
the rows in `--keep` (all by default; rank r holds rows r, r + WORLD_SIZE, ...); rank 0 saves the
full gradient and the logged metrics. tests/test_distributed.py compares them with grad_of, a plain
single-process computation of the same loss.
"""

import argparse
import os
import sys

import torch
import torch.distributed as dist

from nanoagent import rl
from nanoagent.common import exit_now, reduce_metrics
from nanoagent.model import load_causal_lm, pad_rows, policy_forward, shard


def batch(vocab, n=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = [int(x) for x in torch.randint(6, 20, (n,), generator=g)]
    rows = [torch.randint(3, vocab, (L,), generator=g).tolist() for L in lengths]
    masks = [[0] * 3 + (torch.rand(L - 3, generator=g) > 0.3).long().tolist() for L in lengths]
    advantages = [torch.randn(L, generator=g).tolist() for L in lengths]
    return rows, masks, advantages


def grad_of(model, rows, masks, advantages, indices, micro, global_tokens):
    """Reference: the token-mean PPO loss written out directly, unsharded, in micro-batches of rows.
    Accumulates the gradient into the model and returns the loss."""
    total = 0.0
    for s in range(0, len(indices), micro):
        idx = indices[s:s + micro]
        ids = pad_rows([rows[i] for i in idx], 0)
        attn = pad_rows([[1] * len(rows[i]) for i in idx], 0)
        mask = pad_rows([masks[i] for i in idx], 0, torch.float32)
        adv = pad_rows([advantages[i] for i in idx], 0.0, torch.float32)
        logprobs, _ = policy_forward(model, ids, attn)
        loss, _ = rl.ppo_policy_loss(logprobs, logprobs.detach() - 0.1, adv, mask)
        loss = rl.aggregate_loss(loss, mask, "token_mean", global_tokens, None)
        loss.backward()
        total += loss.item()
    return total


def main():
    """The gradient of one policy update through train.ppo_epochs (SGD with lr 1, so the
    parameter change is minus the gradient), with this rank's kept rows and micro-batch token budget."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--micro-tokens", type=int, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--keep", type=int, nargs="*", default=None, help="the rows that train (default: all)")
    args = parser.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import train
    from nanoagent.config import make_config
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = make_config("tiny", ["algo=grpo", f"train.micro_batch_tokens={args.micro_tokens}", "train.grad_clip=1e9"])
    model = load_causal_lm(args.model)
    rows, masks, advantages = batch(model.config.vocab_size)
    ids, attn = pad_rows(rows, 0), pad_rows([[1] * len(r) for r in rows], 0)
    with torch.no_grad():
        old = policy_forward(model, ids, attn)[0] - 0.1  # the same old logprobs grad_of uses
    data = {"input_ids": ids, "attention_mask": attn, "action_mask": pad_rows(masks, 0, torch.float32),
            "advantages": pad_rows(advantages, 0.0, torch.float32), "old_logprobs": old, "lengths": [len(r) for r in rows],
            "trajectory": torch.arange(len(rows))}  # a row per trajectory
    shard(model)
    before = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    kept = [i for i in range(rank, len(rows), world) if args.keep is None or i in args.keep]
    [(shares, _)], _ = train.ppo_epochs({"policy": model}, {"policy": optimizer}, data, kept, cfg, 0, rank, world, torch.device("cpu"))
    grads = {n: before[n] - p.full_tensor() for n, p in model.named_parameters()}
    metrics = reduce_metrics(shares, {})  # what train.py logs
    if rank == 0:
        torch.save({"grads": grads, "metrics": metrics}, args.out)
    dist.barrier()


if __name__ == "__main__":
    main()
    exit_now(0)  # as train.py ends: without the interpreter's teardown, where a rank once died in C++ (terminate called)
