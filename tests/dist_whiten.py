"""
Run under torchrun (gloo): the batch-wide statistics of REINFORCE++'s and PPO's whitening
(rl.whiten) and of the loss's units (rl.unit_counts), each rank holding rows rank, rank + WORLD_SIZE,
...; every rank saves what it computed to OUT.<rank>. tests/test_distributed.py compares them with
one process over the whole batch.
"""

import sys

import torch

from nanoagent import rl
from nanoagent.common import all_reduce, exit_now, init_distributed


def batch(rows=6, width=7):
    g = torch.Generator().manual_seed(0)
    advantages = torch.randn(rows, width, generator=g) * 3 + torch.arange(rows)[:, None]  # rows of different means
    mask = (torch.rand(rows, width, generator=g) > 0.3).float()
    units = torch.randint(0, 4, (rows, width), generator=g) + 4 * torch.arange(rows)[:, None]  # 4 units per row
    return advantages, mask, units


if __name__ == "__main__":
    rank, world, _ = init_distributed()
    advantages, mask, units = batch()
    mine = list(range(rank, len(mask), world))
    tokens, count, unit_tokens = rl.unit_counts(mask, units, mine, all_reduce)
    torch.save({"rows": mine, "whitened": rl.whiten(advantages[mine], mask[mine], all_reduce=all_reduce),
                "tokens": tokens, "units": count, "unit_tokens": unit_tokens[mine]}, f"{sys.argv[1]}.{rank}")
    exit_now(0)  # as train.py ends: without the interpreter's teardown, where a rank once died in C++ (terminate called)
