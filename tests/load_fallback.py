"""
Run under torchrun (gloo, 2 ranks) by tests/test_checkpoint.py: save two checkpoints of the tiny
model sharded over the ranks, cut rank 1's state file of the newer one short, then load_latest.
Every rank must fall back to the older one together: a rank that moved on alone would leave the
other waiting in DCP's collectives. Each rank prints `rank R resumed STEP`.

    torchrun --nproc_per_node=2 tests/load_fallback.py RUN_DIR MODEL_DIR
"""

import os
import sys

import torch.distributed as dist
from save_driver import advance, build

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from nanoagent.checkpoint import load_latest, save_checkpoint  # noqa: E402
from nanoagent.common import exit_now  # noqa: E402


def main():
    run_dir, model_dir = sys.argv[1:3]
    dist.init_process_group("gloo")
    model, optimizer = build(model_dir)
    for step in (1, 2):
        advance(model, optimizer, step)
        save_checkpoint(run_dir, step, {"policy": model}, {"policy": optimizer}, {"step": step}, {})
    if dist.get_rank() == 1:
        with open(os.path.join(run_dir, "checkpoints", "step_000002", "rank1.json"), "r+") as f:
            f.truncate(10)
    dist.barrier()
    advance(model, optimizer, 3)
    _, step, extra = load_latest(run_dir, {"policy": model}, {"policy": optimizer})
    print(f"rank {dist.get_rank()} resumed {step} {extra}", flush=True)


if __name__ == "__main__":
    main()
    exit_now(0)  # as train.py ends: without the interpreter's teardown, where a rank once died in C++ (terminate called)
