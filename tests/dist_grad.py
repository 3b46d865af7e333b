"""
Run under torchrun (gloo): the gradient of one PPO update of the trainer (nanoagent.update.ppo_epochs) on a
fixed batch, with FSDP2 over WORLD_SIZE ranks and packed micro-batches under `--micro-tokens`,
training on the rows in `--keep` (all by default; rank r holds rows r, r + WORLD_SIZE, ...); with
`--on-policy` the old logprobs come from the update's own forward. Rank 0 saves the full gradient,
the logged metrics and the old logprobs. tests/test_distributed.py compares them with grad_of, the
same loss computed as before packing (tests/padded.py: padded rows, logits everywhere), unsharded.
"""

import argparse
import os
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist

import padded
from nanoagent import rl
from nanoagent.batch import pad_rows
from nanoagent.common import exit_now, reduce_metrics
from nanoagent.model import shard


def batch(vocab, n=8, seed=0):
    """n rows of 4-60 tokens; the first half share a 12-token prompt and the second half a 20-token one,
    as two GRPO groups do (each rank then holds two rows of each)."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, vocab, (12,), generator=g).tolist(), torch.randint(3, vocab, (20,), generator=g).tolist()]
    rows, masks = [], []
    for i in range(n):
        prompt, own = prompts[2 * i // n], int(torch.randint(4, 40, (1,), generator=g))
        rows.append(prompt + torch.randint(3, vocab, (own,), generator=g).tolist())
        masks.append([0] * len(prompt) + [1] + (torch.rand(own - 1, generator=g) > 0.3).long().tolist())
    advantages = [torch.randn(len(r), generator=g).tolist() for r in rows]
    return rows, masks, advantages


def old_logprobs(logprobs, on_policy):
    """The old logprobs of the update: the current ones (on-policy: ratio 1), or 0.1 below them."""
    return logprobs.detach() if on_policy else logprobs.detach() - 0.1


def grad_of(plain, rows, masks, advantages, indices, global_tokens, on_policy=False):
    """Reference: the token-mean PPO loss of the rows `indices` written out directly over padded
    rows, unsharded. Accumulates the gradient into the plain model and returns the loss."""
    logprobs = padded.logprobs(plain, [rows[i] for i in indices])[0]
    mask = pad_rows([masks[i] for i in indices], 0, torch.float32)
    loss, _ = rl.ppo_policy_loss(logprobs, old_logprobs(logprobs, on_policy), pad_rows([advantages[i] for i in indices], 0.0, torch.float32), mask)
    loss = rl.aggregate_loss(loss, mask, "token_mean", global_tokens, None)
    loss.backward()
    return loss.item()


def main():
    """The gradient of one policy update through update.ppo_epochs (SGD with lr 1, so the
    parameter change is minus the gradient), with this rank's kept rows and micro-batch token budget."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--micro-tokens", type=int, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--keep", type=int, nargs="*", default=None, help="the rows that train (default: all)")
    parser.add_argument("--on-policy", action="store_true")
    args = parser.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from nanoagent import update
    from nanoagent.config import make_config
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = make_config("tiny", ["algo=grpo", f"train.micro_batch_tokens={args.micro_tokens}", "train.grad_clip=1e9"])
    model = padded.load_policy(args.model)
    rows, masks, advantages = batch(model.config.vocab_size)
    data = {**padded.batch_of(rows, masks), "advantages": pad_rows(advantages, 0.0, torch.float32)}  # a row per trajectory
    zeros = torch.zeros_like(data["action_mask"])
    with torch.no_grad():
        data["old_logprobs"] = zeros.clone() if args.on_policy else old_logprobs(padded.logprobs(padded.plain_lm(args.model), rows)[0], False)
    data["nucleus_logprobs"] = zeros.clone()
    shard(model)
    before = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    kept = [i for i in range(rank, len(rows), world) if args.keep is None or i in args.keep]
    step = SimpleNamespace(batch=data, kept=kept)  # what ppo_epochs reads of a StepData
    [(shares, _)], _, own = update.ppo_epochs({"policy": model}, {"policy": optimizer}, step, 1, True,
                                             args.on_policy, cfg, 0, rank, world, torch.device("cpu"))
    grads = {n: before[n] - p.full_tensor() for n, p in model.named_parameters()}
    metrics = reduce_metrics(shares, {})  # what train.py logs
    old = (own[0] if args.on_policy else data["old_logprobs"]).clone()
    dist.all_reduce(old)  # each rank has its own rows' (on-policy)
    if rank == 0:
        torch.save({"grads": grads, "metrics": metrics, "old_logprobs": old}, args.out)
    dist.barrier()


if __name__ == "__main__":
    main()
    exit_now(0)  # as train.py ends: without the interpreter's teardown, where a rank once died in C++ (terminate called)
