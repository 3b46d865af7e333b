"""
What tests/test_checkpoint.py kills: processes that save checkpoints and Hugging Face exports over
and over, each starting by checking what the previous one left behind.

    python tests/save_driver.py RUN_DIR MODEL_DIR     then `life STEPS` lines on stdin

Importing torch and transformers takes ~10 s on a small CPU and the test kills 20 processes, so
this script imports once and forks a child for each `life` line: a real process with its own
world-of-one gloo group, which the test SIGKILLs at a moment of its choosing.

Ballast: a real checkpoint is many large files and deleting one takes a while (seconds for a big
sharded checkpoint on a shared filesystem), while the tiny model's folders go in under a
millisecond, a window that kills at random moments would almost never hit. So each folder saved
gets BALLAST_FILES names in `ballast/` (hard links to one empty file: quick to make, and deleted
one by one; DCP and transformers ignore the folder): deleting it then takes ~60 ms, a fair share
of a save, as with a large model.

The state is a deterministic function of the step: step k is the tiny model (sharded with
nanoagent.model.shard) after k AdamW steps with fixed gradients and a learning rate set per step, and the
RNGs seeded with k. So a resumed state can be checked exactly, against a replay from step 0.

A life:
  1. resume from latest_checkpoint, if any (the test kills some loads too), and check that model,
     optimizer, RNGs and extra state are exactly those of its step S (0: nothing to resume);
  2. check that the export, if any, loads and holds the weights of a step <= S (in bf16);
  3. save step S again and export it (replacing complete folders: what rmtree-then-rename lost),
     then step forward STEPS times, saving and exporting each step.

Lines on stdout: `pid P`, `resumed S`, `export hf K` (the step the export holds; `export hf.old K`
when only the copy moved aside is there, `export none`), `begin load|checkpoint|export K`,
`end load|checkpoint|export K SECONDS`, and from this parent process `exit CODE` when the child ends
(CODE -9: killed). A failed check is a traceback and `exit 1`.

One writer: a child writes into a pipe of its own, and this parent relays its output a whole line at
a time, then writes `exit`: the test reads every line whole, in order, however loaded the machine. A
line a kill cut short comes through as `cut <what was written>` (a relayed line could otherwise glue
onto the next: "0.1002exit").
"""

import os
import random
import sys
import time
import traceback

import numpy as np
import torch
import torch.distributed as dist
import transformers
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from nanoagent.checkpoint import export_hf, latest_checkpoint, load_checkpoint, save_checkpoint  # noqa: E402
from nanoagent.model import shard  # noqa: E402


BALLAST_FILES = 5000


def add_ballast(folder):
    ballast = os.path.join(folder, "ballast")
    os.makedirs(ballast)
    open(os.path.join(ballast, "0"), "w").close()
    for i in range(1, BALLAST_FILES):
        os.link(os.path.join(ballast, "0"), os.path.join(ballast, str(i)))


def seed(step):
    random.seed(step)
    np.random.seed(step)
    torch.manual_seed(step)


def build(model_dir):
    model = shard(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, optimizer


def advance(model, optimizer, step):
    """From the state of step-1 to the state of step."""
    for param in model.parameters():
        param.grad = torch.cos(param.detach() * step)  # fixed gradients that differ from step to step
    for group in optimizer.param_groups:
        group["lr"] = 1e-2 / step  # as train.py sets get_lr(step) before each step
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    seed(step)


def full_state(model, optimizer):
    options = StateDictOptions(full_state_dict=True)
    return {"model": get_model_state_dict(model, options=options),
            "optimizer": get_optimizer_state_dict(model, optimizer, options=options)}


def first_difference(a, b, where=""):
    """Where two nested states first differ (tensors exactly, dtype included), or None."""
    if isinstance(a, torch.Tensor):
        same = isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    elif isinstance(a, dict):
        if not isinstance(b, dict) or a.keys() != b.keys():
            return where or "keys"
        return next((d for k in a if (d := first_difference(a[k], b[k], f"{where}/{k}"))), None)
    elif isinstance(a, (list, tuple)):
        if not isinstance(b, (list, tuple)) or len(a) != len(b):
            return where or "length"
        return next((d for i, (x, y) in enumerate(zip(a, b)) if (d := first_difference(x, y, f"{where}/{i}"))), None)
    else:
        same = a == b
    return None if same else where or "value"


def check_resume(run_dir, model_dir, model, optimizer):
    """Steps 1 and 2 of a life; returns the step resumed from (0: none)."""
    checkpoint = latest_checkpoint(run_dir)
    start = 0
    if checkpoint:
        print(f"begin load {os.path.basename(checkpoint)}", flush=True)
        t0 = time.perf_counter()
        start, extra = load_checkpoint(checkpoint, {"policy": model}, {"policy": optimizer})
        print(f"end load {start} {time.perf_counter() - t0:.4f}", flush=True)
        draws = (random.random(), np.random.rand(), torch.rand(1).item())
        seed(start)
        if draws != (random.random(), np.random.rand(), torch.rand(1).item()) or extra != {"step": start}:
            raise AssertionError(f"{checkpoint}: RNG states or extra state are not those of step {start} ({extra})")
    replay = build(model_dir)
    exports = {}  # step -> the weights its export holds
    for step in range(1, start + 1):
        advance(*replay, step)
        exports[step] = {name: tensor.to(torch.bfloat16) for name, tensor in full_state(*replay)["model"].items()}
    if checkpoint:
        where = first_difference(full_state(model, optimizer), full_state(*replay))
        if where:
            raise AssertionError(f"{checkpoint} does not hold the state of step {start}: {where} differs")
    print(f"resumed {start}", flush=True)

    hf = os.path.join(run_dir, "hf")
    found = hf if os.path.isdir(hf) else hf + ".old" if os.path.isdir(hf + ".old") else None
    if found is None:
        print("export none", flush=True)
    else:
        exported = AutoModelForCausalLM.from_pretrained(found, dtype=torch.bfloat16).state_dict()
        steps = [step for step, weights in exports.items() if first_difference(exported, weights) is None]
        if not steps:
            raise AssertionError(f"{found} does not hold the weights of any step up to {start}")
        print(f"export {os.path.basename(found)} {steps[-1]}", flush=True)
    return start


def life(run_dir, model_dir, steps):
    print(f"pid {os.getpid()}", flush=True)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model, optimizer = build(model_dir)
    start = check_resume(run_dir, model_dir, model, optimizer)
    seed(start)
    for step in ([start] if start else []) + list(range(start + 1, start + 1 + steps)):
        if step > start:
            advance(model, optimizer, step)
        print(f"begin checkpoint {step}", flush=True)
        t0 = time.perf_counter()
        checkpoint = save_checkpoint(run_dir, step, {"policy": model}, {"policy": optimizer}, {"step": step}, {"driver": "save_driver"})
        print(f"end checkpoint {step} {time.perf_counter() - t0:.4f}", flush=True)
        add_ballast(checkpoint)
        print(f"begin export {step}", flush=True)
        t0 = time.perf_counter()
        export_hf(model, tokenizer, os.path.join(run_dir, "hf"), torch.bfloat16)
        print(f"end export {step} {time.perf_counter() - t0:.4f}", flush=True)
        add_ballast(os.path.join(run_dir, "hf"))


def main():
    run_dir, model_dir = sys.argv[1:3]
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    for line in sys.stdin:
        steps = int(line.split()[1])
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read_end)
            os.dup2(write_end, 1)  # the child's stdout and stderr: its pipe
            os.dup2(write_end, 2)
            code = 0
            try:
                life(run_dir, model_dir, steps)
            except BaseException:
                traceback.print_exc()
                code = 1
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)  # the child must not go on with this loop or the parent's exit handlers
        os.close(write_end)
        with os.fdopen(read_end, errors="replace") as child:
            for relayed in child:  # until the child's end closes its pipe (a kill included)
                sys.stdout.write(relayed if relayed.endswith("\n") else f"cut {relayed}\n")
                sys.stdout.flush()
        _, status = os.waitpid(pid, 0)
        print(f"exit {os.waitstatus_to_exitcode(status)}", flush=True)


if __name__ == "__main__":
    main()
