"""Process-level plumbing shared by the entry scripts: distributed set-up, rank-aware printing,
seeding, the metrics log, and model resolution."""

import json
import os
import random
import socket
import statistics
import time

import numpy as np
import torch
import torch.distributed as dist


def rank():
    return int(os.environ.get("RANK", "0"))


def print0(*args, **kwargs):
    """print on rank 0 only, flushed (torchrun buffers the other ranks' output into noise)."""
    if rank() == 0:
        print(*args, **kwargs, flush=True)


def init_distributed():
    """
    One process per GPU (or CPU rank) under torchrun; a plain `python train.py` is a world of one.
    NCCL on GPUs, gloo on the CPU. Returns (rank, world_size, device).
    """
    if "RANK" not in os.environ:  # not launched by torchrun
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size(), device


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class MetricsLog:
    """One JSON object per line in <run_dir>/metrics.jsonl (rank 0), and wandb when asked for."""

    def __init__(self, run_dir, cfg_dict, use_wandb=False, project="nanoagent"):
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self.wandb = None
        if use_wandb and rank() == 0:
            try:
                import wandb
            except ImportError:
                print0("log.wandb=true but wandb is not installed; logging to metrics.jsonl only")
            else:
                self.wandb = wandb.init(project=project, config=cfg_dict, dir=run_dir)

    def log(self, metrics):
        if rank() != 0:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(metrics) + "\n")
        if self.wandb is not None:
            self.wandb.log(metrics, step=metrics["step"])


def resolve_model(name):
    """A model path for transformers and vLLM: 'tiny' builds (once, cached) the tiny test model."""
    if name == "tiny":
        from nanoagent.tiny import ensure_tiny_model
        return ensure_tiny_model()
    return name


def median_time(fn, repeats=5):
    """Median wall time of fn() over repeats runs, GPU work included (bench/ scripts: these
    machines are noisy)."""
    times = []
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)
