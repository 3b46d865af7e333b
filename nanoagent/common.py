"""Process-level plumbing shared by the entry scripts: distributed set-up, rank-aware printing,
seeding, the metrics log, timing. It stands one step above the ground floor: of nanoagent it imports
only keys.py (for ConfigError, the one-line error a run ends with), which imports no nanoagent module."""

import importlib
import json
import os
import random
import shlex
import shutil
import signal
import socket
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

from nanoagent.keys import ConfigError


def rank():
    return int(os.environ.get("RANK", "0"))


def world_size():
    """The number of ranks, known before the process group exists (torchrun sets WORLD_SIZE; a plain
    `python train.py` is a world of one)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def print0(*args, **kwargs):
    """print on rank 0 only, flushed (torchrun buffers the other ranks' output into noise)."""
    if rank() == 0:
        print(*args, **kwargs, flush=True)


def process_group_backend(device):
    """
    The one place that decides where collectives run. FSDP's collectives move GPU tensors (NCCL
    on a GPU); everything else that crosses ranks (metrics, loss denominators, flags, the
    micro-batch count) is a few CPU numbers, which gloo serves on every machine. So a GPU run
    gets both backends, each tensor going to the one of its device.
    """
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


def init_distributed():
    """
    One process per GPU (or CPU rank) under torchrun; a plain `python train.py` is a world of one.
    Returns (rank, world_size, device).

    The world of one serves its process group's store on loopback only: PyTorch's TCPStore listens
    on every interface, whatever its host name says, unless it is handed a socket that is already
    listening. Under torchrun the store is torchrun's own (its agent serves it to the workers), and
    torchrun has no setting for the interface: see docs/reliability.md.
    """
    store = None
    if "RANK" not in os.environ:  # not launched by torchrun
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port))
        store = dist.TCPStore("127.0.0.1", port, 1, is_master=True, master_listen_fd=listener.detach())
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group(process_group_backend(device), store=store, rank=rank, world_size=world,
                                device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group(process_group_backend(device), store=store, rank=rank, world_size=world)
    return dist.get_rank(), dist.get_world_size(), device


def all_reduce(values, op="sum"):
    """A list of Python numbers summed (op="sum") or maxed (op="max") over ranks. Always a CPU
    tensor in float64: gloo carries it on a GPU machine too (process_group_backend)."""
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return t.tolist()


def reduce_metrics(sums, maxes):
    """The step's metrics over all ranks, in one place: each value of `sums` is this rank's share
    of a total (added over ranks), each value of `maxes` is maxed over ranks."""
    summed = dict(zip(sums, all_reduce(list(sums.values()))))
    return {**summed, **dict(zip(maxes, all_reduce(list(maxes.values()), "max")))}


def seed_everything(seed):
    """This rank's Python, NumPy and torch generators, from seed + its rank (known before the process
    group exists)."""
    seed += rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class StepLines:
    """
    A JSON Lines file of records that each name their step ("step"), written by rank 0 alone:
    metrics.jsonl, trajectories.jsonl. resumed_step: the step of the checkpoint the run continues from
    (None: a fresh start, which empties the file). The lines written after it by the run before (steps
    it will now do again, a line cut by a kill) are dropped first, so that the file holds each step once;
    the file is rewritten atomically. A write appends whole lines in one call, flushed.
    """

    def __init__(self, path, resumed_step):
        self.path = path
        if rank() == 0:
            self._rewind(resumed_step)

    def _rewind(self, resumed_step):
        kept = []
        if resumed_step is not None and os.path.exists(self.path):
            with open(self.path) as f:
                for line in f:
                    try:
                        if json.loads(line)["step"] <= resumed_step:
                            kept.append(line.rstrip("\n") + "\n")
                    except ValueError:  # the line a kill cut short
                        pass
        with open(self.path + ".tmp", "w") as f:
            f.writelines(kept)
            f.flush()
            os.fsync(f.fileno())
        os.replace(self.path + ".tmp", self.path)

    def write(self, records):
        if rank() != 0 or not records:
            return
        with open(self.path, "a") as f:
            f.write("".join(json.dumps(r) + "\n" for r in records))
            f.flush()


class MetricsLog:
    """One JSON object per step in <run_dir>/metrics.jsonl (StepLines: rank 0, each step once across a
    resume), and when asked for, TensorBoard's event files in <run_dir>/tensorboard (every number of the
    line, by its name) and wandb. TensorBoard is told of a resume too: its purge step hides the events of
    the steps done again in the files the run before wrote."""

    def __init__(self, run_dir, resumed_step, cfg_dict, use_wandb=False, project="nanoagent",
                 tensorboard=False):
        self.lines = StepLines(os.path.join(run_dir, "metrics.jsonl"), resumed_step)
        self.wandb = self.tensorboard = None
        if rank() != 0:
            return
        if tensorboard:  # an optional package (logger_problem said it is there)
            from torch.utils.tensorboard import SummaryWriter
            self.tensorboard = SummaryWriter(os.path.join(run_dir, "tensorboard"),
                                             purge_step=0 if resumed_step is None else resumed_step + 1)
        if use_wandb:
            import wandb
            self.wandb = wandb.init(project=project, config=cfg_dict, dir=run_dir)

    def log(self, metrics):
        if rank() != 0:
            return
        self.lines.write([metrics])
        if self.tensorboard is not None:
            for key, value in metrics.items():
                if key != "step":
                    self.tensorboard.add_scalar(key, value, metrics["step"])
            self.tensorboard.flush()  # a run killed later keeps what it logged
        if self.wandb is not None:
            self.wandb.log(metrics, step=metrics["step"])


def logger_problem(log):
    """Why the loggers log (cfg.log) asks for cannot run here, in one line, or None: their packages are
    optional (wandb is not installed by make install, tensorboard is)."""
    wanted = [(log.wandb, "wandb", "pip install wandb (then wandb login), or log.tensorboard=true for event "
                                   "files that TensorBoard reads, offline"),
              (log.tensorboard, "tensorboard", "make install installs it (or pip install tensorboard)")]
    for asked, package, how in wanted:
        if asked:
            try:
                importlib.import_module(package)
            except ImportError:
                return f"log.{package}=true but the {package} package is not installed: {how}"
    return None


class Stopped(Exception):
    """A run that stopped on a signal at a safe point: str() says when, and what was saved; code is the
    exit status 128 + the signal (143, 130: a run not finished); resumable: whether resume=auto goes on
    from what it left (else nothing of it was written)."""

    def __init__(self, signum, when, saved, resumable=True):
        super().__init__(f"{signal.Signals(signum).name} during {when}: {saved}")
        self.code, self.resumable = 128 + signum, resumable


def command_line(argv, resume=None):
    """This process's command line as one types it (under torchrun: the launch on one node, and on several
    the launch without its rendezvous flags, which a worker cannot know), with resume=<resume> in place of
    any resume= it had."""
    args = [a for a in argv if not (resume and a.startswith("resume="))]
    args += [f"resume={resume}"] if resume else []
    if "TORCHELASTIC_RUN_ID" in os.environ:  # a torchrun worker
        per_node = int(os.environ["LOCAL_WORLD_SIZE"])
        nodes = world_size() // per_node
        launcher = ["torchrun", *([f"--nnodes={nodes}"] if nodes > 1 else []), f"--nproc_per_node={per_node}"]
    elif shutil.which("python") == sys.executable:
        launcher = ["python"]
    else:  # make's .venv/bin/python, or a python that is not the first on PATH
        inside = sys.executable.startswith(os.getcwd() + os.sep)
        launcher = [os.path.relpath(sys.executable) if inside else sys.executable]
    return shlex.join(launcher + [sys.argv[0]] + args)


def run_script(main):
    """Run a script's main() and exit with its code, an early end said in one line: a setting found
    unworkable once the run had started (ConfigError: its data, a resume; exit 2, and under torchrun the
    line ends its failure report), a signal acted on at a safe point (Stopped: what was saved and the
    command that goes on), a second Ctrl-C (at once, without a checkpoint: exit 130)."""
    name = os.path.basename(sys.argv[0])
    try:
        code = main()
    except ConfigError as e:
        line = f"{name}: error: {e}"
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:  # one line in each node's log
            print(line, file=sys.stderr, flush=True)
        if error_file := os.environ.get("TORCHELASTIC_ERROR_FILE"):  # what torchrun's report ends with
            extra = {"py_callstack": line, "timestamp": str(int(time.time()))}
            with open(error_file, "w") as f:
                json.dump({"message": {"message": line, "extraInfo": extra}}, f)
        code = 2
    except Stopped as e:
        print0(f"{e}; to go on: {command_line(sys.argv[1:], 'auto')}" if e.resumable else
               f"{e}; to start again: {command_line(sys.argv[1:])}")
        code = e.code
    except KeyboardInterrupt:
        print0(f"{name}: interrupted; to go on from the last checkpoint, if there is one: "
               f"{command_line(sys.argv[1:], 'auto')}")
        code = 130
    exit_now(code)


def signal_received(stop):
    """The signal (SIGTERM: a preemption, SIGINT: a Ctrl-C) any rank has received (stop_on_signals), else
    0: the same on every rank, so that all of them stop at the same safe point. Collective."""
    return int(all_reduce([stop["signal"]], "max")[0])


def stop_on_signals():
    """
    A SIGTERM (a preemption: torchrun passes it on, and kills 30 s later) or a Ctrl-C (SIGINT, passed on
    by torchrun too) asks the training loop to stop at its next safe point: the returned dict's "signal"
    is the first one received (0: none), said at once in one line. A second Ctrl-C raises
    KeyboardInterrupt, as Ctrl-C does by default.
    """
    stop = {"signal": 0}

    def handler(signum, frame):
        if signum == signal.SIGINT and stop["signal"] == signal.SIGINT:
            raise KeyboardInterrupt
        # a raw write: a print here could land inside the loop's own print
        if not stop["signal"] and rank() == 0:
            again = " (Ctrl-C again to abort)" if signum == signal.SIGINT else ""
            message = (f"{signal.Signals(signum).name}: a checkpoint at the next safe point, "
                       f"then stopping{again}\n")
            os.write(sys.stderr.fileno(), message.encode())
        stop["signal"] = stop["signal"] or signum

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    return stop


def exit_now(code):
    """
    End the process with `code`, without Python's teardown: in a process that has loaded torch,
    transformers and vLLM that is a garbage collection over millions of their objects (~3 s per
    rank on a CPU) and writes nothing. Everything a run writes (metrics, checkpoints, the export)
    is closed and synced before this is called; a wandb run is finished here, as wandb's exit hook
    would. For the normal way out only: an exception ends the process the usual way, traceback and all.
    """
    wandb = sys.modules.get("wandb")
    if wandb is not None and wandb.run is not None:
        wandb.finish(exit_code=code)
    sys.stdout.flush()
    sys.stderr.flush()
    if dist.is_initialized():
        dist.destroy_process_group()
    os._exit(code)
