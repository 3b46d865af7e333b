"""
Checkpoints: sharded for exact resume, and a Hugging Face export for chat.py / rollout.py / vLLM.

Sharded: torch.distributed.checkpoint (DCP) writes each rank's shards of the policy, the critic and
their optimizers in parallel; a per-rank JSON file holds the step, the data position and the RNG
states (the learning rate is a function of the step), and `config.json` the run's config, so a
resume can say what changed. A checkpoint folder may come from elsewhere and unpickling runs code,
so loading reads only plain data: our files are JSON, and DCP's pickles pass allow-lists first
(nanoagent/safe_load.py).

A checkpoint is complete when it holds its marker `COMPLETE` (its step and world size), written
only after every file of it was fsynced, and when the marker and config.json read as written:
neither a machine crash that loses unsynced data, nor a damaged disk or a hand edit, can leave a
folder that looks complete. resume=auto says which step folders it does not use, and why, rather
than resume from an older step without a word. A complete checkpoint can still fail to load (a
corrupt shard): load_latest falls back to the previous one, on every rank alike (loading is
collective). Only the `train.keep_last` newest are kept (a 3B model with AdamW in fp32 is ~36 GB
per model per checkpoint); older ones are deleted only once the new one is complete.

Every save (a checkpoint `checkpoints/step_XXXXXX`, the export `hf`) replaces its folder so that a
kill at any instant leaves one complete copy (rewriting is common: every export, every rerun into
a run_dir): write `<folder>.tmp`, rename `<folder>` to `<folder>.old` and `<folder>.tmp` to
`<folder>`, and only then delete `<folder>.old`. Folders cannot be swapped in one portable step, so
between the two renames the complete copy is `<folder>.old`: latest_checkpoint takes it from there,
and the next save renames it back. `.tmp` folders (partial, unverified or being pruned) are
ignored, then deleted by the next save.

A fresh start (resume=never) into a run_dir that holds a run moves it aside to
`<run_dir>.old-<time>` rather than refusing or deleting it: no later resume=auto adopts any of it,
rerunning a command just works (make demo), and the old run, maybe days of GPU time, is kept.

Export: the full policy gathered to rank 0 and cast to the training dtype (the weights the trainer
computes with, not the fp32 master copy), saved with save_pretrained (safetensors) with the
tokenizer and its chat template, then loaded back with transformers and compared bitwise, tensor
by tensor, before it replaces the previous export: an export that loads but holds other weights
must not pass silently.

LoRA: checkpoints hold what trains (the adapters, a critic's value head) and its optimizer state,
megabytes where a full AdamW state is gigabytes; the base is the model, or the warm start's export.
The export is the merged model, with the adapter in peft's format in its folder `adapter/`
(PeftModel.from_pretrained over the base it names).
"""

import copy
import json
import os
import random
import re
import shutil
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)
from transformers import AutoModelForCausalLM

from nanoagent.common import print0, world_size
from nanoagent.config import ConfigError, flatten, saved_keys, to_dict
from nanoagent.keys import fixed_keys
from nanoagent.model import merged_state_dict
from nanoagent.safe_load import CheckedPlanner, CheckedReader

STEP_DIR = re.compile(r"^step_(\d{6})(\.old|\.tmp)?$")
MARKER = "COMPLETE"


def trained_state_dict(model):
    """What a checkpoint holds of a model: its state dict's parameters that train (all of them, but
    for LoRA's frozen base). Filtered by name: get_model_state_dict's ignore_frozen_params keeps a
    frozen tied weight under its second name (lm_head.weight)."""
    trained = {name for name, p in model.named_parameters(remove_duplicate=False) if p.requires_grad}
    return {name: t for name, t in get_model_state_dict(model).items() if name in trained}


class CheckpointError(RuntimeError):
    """A complete checkpoint that cannot be loaded (a corrupt or truncated file)."""


def _fsync(path):
    """Flush a file, or a folder's entries, to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _read_json(path):
    with open(path) as f:
        return json.load(f)


def _restore(folder):
    """After a killed save of `folder`: put back a complete copy moved aside (only when `folder` is
    missing: otherwise `.old` is stale or half deleted), and delete partial writes."""
    if os.path.isdir(folder + ".old") and not os.path.exists(folder):
        os.rename(folder + ".old", folder)
    shutil.rmtree(folder + ".old", ignore_errors=True)
    shutil.rmtree(folder + ".tmp", ignore_errors=True)


def _move_into_place(folder):
    """Replace `folder` with the complete (and synced) `folder.tmp`; the previous `folder` is deleted last."""
    if os.path.exists(folder):
        os.rename(folder, folder + ".old")
    os.rename(folder + ".tmp", folder)
    _fsync(os.path.dirname(folder))
    shutil.rmtree(folder + ".old", ignore_errors=True)


def _unusable(path, step):
    """Why the step folder `path` (of `step`) cannot be resumed from, or None. A damaged or hand-edited
    marker or config.json (check_resume reads both) must make the run fall back, not stop."""
    if not os.path.exists(os.path.join(path, MARKER)):
        return (f"it has no {MARKER} marker (a save that did not finish, "
                "or a checkpoint of an older nanoagent)")
    try:
        marker, config = _read_json(os.path.join(path, MARKER)), _read_json(os.path.join(path, "config.json"))
    except (OSError, ValueError) as e:
        return f"it does not read ({_reason(e)})"
    if not (isinstance(marker, dict) and marker.get("step") == step
            and type(marker.get("world_size")) is int):
        return f"its {MARKER} marker is {str(marker)[:100]!r}, not {{'step': {step}, 'world_size': <ranks>}}"
    if not isinstance(config, dict):
        return f"its config.json holds a {type(config).__name__}, not a config"
    return None


def scan_checkpoints(run_dir):
    """(complete, unused): the checkpoints in run_dir that can be resumed from, newest first
    (`step_N`, or `step_N.old` when `step_N` is missing), and (folder, why) of every other one."""
    folder = os.path.join(run_dir, "checkpoints")
    names = set(os.listdir(folder)) if os.path.isdir(folder) else set()
    complete, unused = [], []
    for name in sorted(names):
        match, path = STEP_DIR.match(name), os.path.join(folder, name)
        if not match:
            continue
        if match.group(2) == ".tmp":
            unused.append((path, "a save or a deletion that did not finish (the next save deletes it)"))
        elif match.group(2) == ".old" and name.removesuffix(".old") in names:
            unused.append((path, "the copy a save replaced, not yet deleted (the next save deletes it)"))
        elif why := _unusable(path, int(match.group(1))):
            unused.append((path, why))
        else:
            complete.append((int(match.group(1)), path))
    return [path for _, path in sorted(complete, reverse=True)], unused


def complete_checkpoints(run_dir):
    """The checkpoints in run_dir that can be resumed from, newest first (see scan_checkpoints)."""
    return scan_checkpoints(run_dir)[0]


def latest_checkpoint(run_dir):
    """The folder of the highest complete checkpoint in run_dir, or None."""
    return next(iter(complete_checkpoints(run_dir)), None)


def resume_checkpoint(run_dir):
    """resume=auto: latest_checkpoint, once rank 0 said which step folders it does not use and why
    (the same on every rank: they read the same files)."""
    complete, unused = scan_checkpoints(run_dir)
    for path, why in unused:
        print0(f"resume=auto: not using {path}: {why}")
    return next(iter(complete), None)


def _prune(run_dir, keep_last):
    """Delete all but the keep_last newest complete checkpoints (0: keep all), each renamed to
    `.tmp` first so that a kill mid-deletion leaves no folder that looks complete."""
    for path in complete_checkpoints(run_dir)[keep_last:] if keep_last else []:
        os.rename(path, path.removesuffix(".old") + ".tmp")
        shutil.rmtree(path.removesuffix(".old") + ".tmp")


def start_fresh(run_dir):
    """resume=never: rank 0 moves a non-empty run_dir aside to `<run_dir>.old-<time>` (see the
    module docstring); returns where to, or None. Collective."""
    run_dir, aside = os.path.normpath(run_dir), None
    if dist.get_rank() == 0 and os.path.isdir(run_dir) and os.listdir(run_dir):
        stamp, n = time.strftime("%Y%m%d-%H%M%S"), 0
        aside = f"{run_dir}.old-{stamp}"
        while os.path.exists(aside):
            n += 1
            aside = f"{run_dir}.old-{stamp}-{n}"
        os.rename(run_dir, aside)
    dist.barrier()
    return aside


def _rng_state():
    """The RNG states as plain JSON data."""
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {"python": [version, list(internal), gauss],
            "numpy": [name, keys.tolist(), pos, has_gauss, cached],
            "torch": torch.get_rng_state().tolist()}


def _set_rng_state(state):
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))


def save_checkpoint(run_dir, step, models, optimizers, extra, config, keep_last=0):
    """
    models / optimizers: dicts by name ("policy", "critic"), optimizers[name] that of models[name].
    extra: small JSON-able state (data position, ...). config: the run's config (to_dict), kept so
    that a resume can compare. keep_last: complete checkpoints kept (0: all). Collective.
    """
    rank = dist.get_rank()
    folder = os.path.join(run_dir, "checkpoints")
    final = os.path.join(folder, f"step_{step:06d}")
    # every rank is done reading the checkpoint it resumed from, which rank 0 may rename back below
    dist.barrier()
    if rank == 0:
        os.makedirs(folder, exist_ok=True)
        for name in os.listdir(folder):
            if name.endswith((".tmp", ".old")):
                _restore(os.path.join(folder, os.path.splitext(name)[0]))
        os.makedirs(final + ".tmp")
    dist.barrier()
    state, fresh = {}, []
    for name, model in models.items():
        state[f"{name}/model"] = trained_state_dict(model)
        if optimizers[name].state:
            state[f"{name}/optim"] = get_optimizer_state_dict(model, optimizers[name])
        else:  # not stepped yet (a save at step 0): get_optimizer_state_dict would give it a first step
            fresh.append(name)
    # each rank fsyncs the files it writes (DCP's sync_files)
    dcp.save(state, checkpoint_id=final + ".tmp")
    _write_json(os.path.join(final + ".tmp", f"rank{rank}.json"),
                {"step": step, "extra": extra, "rng": _rng_state(), "fresh_optimizers": fresh})
    dist.barrier()
    # a run_dir on each node's own disk would leave rank 0 marking complete a folder without the
    # other nodes' shards
    unseen = [r for r in range(dist.get_world_size())
              if not os.path.exists(os.path.join(final + ".tmp", f"rank{r}.json"))]
    if error := _agree(f"does not see the files of rank(s) {unseen}" if unseen else None):
        raise ConfigError(f"run_dir={run_dir}: {error} in {final}.tmp; run_dir must be one folder "
                          "that every node shares (a shared filesystem), not a folder of that name "
                          "on each node's own disk")
    if rank == 0:
        _write_json(os.path.join(final + ".tmp", "config.json"), config)
        _fsync(final + ".tmp")  # every file's entry, before the marker says they are there
        _write_json(os.path.join(final + ".tmp", MARKER), {"step": step, "world_size": dist.get_world_size()})
        _fsync(final + ".tmp")
        _move_into_place(final)
        _prune(run_dir, keep_last)
    dist.barrier()
    return final


def check_resume(path, cfg, steps_key="steps"):
    """
    Before resuming from `path` with cfg: refuse (ConfigError) a checkpoint beyond cfg's `steps_key`
    (steps; train.warm_start_steps for an unfinished warm start's), another world size, or a change of
    a key declared fixed (nanoagent/keys.py), naming them all; return the changes that apply, as
    "key: old -> new" lines. Reads files and the environment only: train.py calls it before the
    process group exists.
    """
    marker, last = _read_json(os.path.join(path, MARKER)), flatten(to_dict(cfg))[steps_key]
    if marker["step"] > last:
        raise ConfigError(f"{path} is at step {marker['step']}, beyond {steps_key}={last}: resume with "
                          f"{steps_key} >= {marker['step']}, or start a new run with resume=never (the old "
                          f"one is moved aside) or another run_dir")
    if marker["world_size"] != world_size():
        raise ConfigError(f"{path} was written by {marker['world_size']} ranks and this run has "
                          f"{world_size()}: the data position and the RNG states are per rank; "
                          f"resume on {marker['world_size']} ranks (torchrun's nnodes x nproc_per_node), "
                          "or start a new run with resume=never (the old one is moved aside) "
                          "or another run_dir")
    saved, current = saved_keys(_read_json(os.path.join(path, "config.json"))), flatten(to_dict(cfg))
    changes = [(key, saved.get(key), value) for key, value in current.items() if saved.get(key) != value]
    fixed_now = fixed_keys(cfg)
    fixed = [f"{key}: {old!r} -> {new!r}" for key, old, new in changes if key in fixed_now]
    if fixed:
        raise ConfigError(f"{path} cannot be resumed with these changes: {'; '.join(fixed)}. The "
                          "checkpoint's weights, optimizer state and data position belong to its model, "
                          "algorithm, data and batch shapes; start a new run (resume=never moves the old "
                          "one aside, or another run_dir)")
    return [f"{key}: {old!r} -> {new!r}" for key, old, new in changes]


def _reason(e):
    """An exception in one line: DCP's carries the failing ranks' tracebacks, whose last line says
    what failed."""
    return f"{type(e).__name__}: {e}".strip().splitlines()[-1]


def _agree(error):
    """Every rank's error (None: none) -> the first, on every rank: a load that fails on one rank
    fails on all, so that none waits in a collective that the others have left."""
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    return next((f"rank {r}: {e}" for r, e in enumerate(errors) if e), None)


def load_checkpoint(path, models, optimizers):
    """Restore everything save_checkpoint wrote; returns (step, extra). Raises CheckpointError on
    every rank when a file of it cannot be read on any rank. Collective."""
    saved, error = None, None
    try:
        saved = _read_json(os.path.join(path, f"rank{dist.get_rank()}.json"))
    except (OSError, ValueError) as e:
        error = _reason(e)
    if error := _agree(error):
        raise CheckpointError(f"{path} does not load: {error}")
    state, fresh = {}, saved.get("fresh_optimizers", [])
    for name, model in models.items():
        state[f"{name}/model"] = trained_state_dict(model)
        if name not in fresh:
            state[f"{name}/optim"] = get_optimizer_state_dict(model, optimizers[name])
    try:
        dcp.load(state, storage_reader=CheckedReader(path), planner=CheckedPlanner())
    # whatever a damaged or unsafe file raises (DCP's is a BaseException)
    except (Exception, dcp.CheckpointException) as e:
        error = _reason(e)
    if error := _agree(error):
        raise CheckpointError(f"{path} does not load: {error}")
    for name, model in models.items():
        set_model_state_dict(model, state[f"{name}/model"], options=StateDictOptions(strict=False))
        if name not in fresh:
            set_optimizer_state_dict(model, optimizers[name], state[f"{name}/optim"])
    _set_rng_state(saved["rng"])
    return saved["step"], saved["extra"]


def load_latest(run_dir, models, optimizers):
    """The newest complete checkpoint of run_dir that loads, falling back (and saying why) past
    those that do not: (path, step, extra), or (None, 0, None) when there is none; raises when
    none of them loads. Collective."""
    paths, failures = complete_checkpoints(run_dir), []
    for i, path in enumerate(paths):
        try:
            step, extra = load_checkpoint(path, models, optimizers)
        except CheckpointError as e:
            failures.append(str(e))
            if i + 1 < len(paths):
                print0(f"{e}; falling back to the previous complete checkpoint, {paths[i + 1]}")
            continue
        return path, step, extra
    if failures:
        raise CheckpointError(f"no complete checkpoint in {run_dir} loads: " + "; ".join(failures))
    return None, 0, None


def save_adapter(full, lora, base, folder):
    """The LoRA adapter of a full state dict in peft's format: adapter_config.json (base: the model it
    adapts) and adapter_model.safetensors, under PeftModel's names."""
    adapter = {"base_model.model." + name.replace(".default.", "."): tensor.contiguous()
               for name, tensor in full.items() if ".lora_" in name}
    os.makedirs(folder)
    save_file(adapter, os.path.join(folder, "adapter_model.safetensors"))
    config = copy.copy(lora)
    config.base_model_name_or_path, config.task_type = base, "CAUSAL_LM"
    config.save_pretrained(folder)


def export_hf(model, tokenizer, out_dir, dtype, base=None):
    """
    Write the full policy to a Hugging Face folder that transformers and vLLM load (safetensors in
    `dtype`, the trainer's compute dtype; configs; tokenizer with its chat template), replacing
    out_dir only once verify_export has passed; with LoRA, merged, and with base (the model the adapter
    adapts) the adapter in `adapter/`. Collective.
    """
    # the full state dict on rank 0 (in CPU memory), {} on the other ranks
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    out_dir = os.path.normpath(out_dir)
    if dist.get_rank() == 0:
        _restore(out_dir)
        lora = getattr(model, "lora_config", None)  # a Policy's (a plain LM has none)
        if lora is not None and base is not None:
            save_adapter(full, lora, base, os.path.join(out_dir + ".tmp", "adapter"))
        if lora is not None:
            full = merged_state_dict(full, lora)
        full = {name: tensor.to(dtype) for name, tensor in full.items()}
        with torch.device("meta"):
            clean = AutoModelForCausalLM.from_config(model.config, dtype=dtype)
        clean.load_state_dict(full, assign=True, strict=False)
        clean.tie_weights()
        clean.generation_config = model.generation_config
        clean.save_pretrained(out_dir + ".tmp")
        tokenizer.save_pretrained(out_dir + ".tmp")
    verify_export(full, out_dir + ".tmp", dtype)
    if dist.get_rank() == 0:
        for folder, _, names in os.walk(out_dir + ".tmp", topdown=False):
            for name in names:
                _fsync(os.path.join(folder, name))
            _fsync(folder)
        _move_into_place(out_dir)
    dist.barrier()


def _first_difference(full_state_dict, folder, dtype):
    """What first differs between the exported folder loaded in dtype and the full state dict cast
    to dtype, or None."""
    try:
        # tied weights under each name
        exported = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).state_dict()
    # a folder that does not load is a failed export too; rank 0 must still share its verdict
    except Exception as e:
        return f"it does not load ({type(e).__name__}: {e})"
    for name, tensor in exported.items():
        if name not in full_state_dict:
            return f"{name} is not in the trainer's state dict"
        expected = full_state_dict[name].to(dtype)
        if not torch.equal(tensor, expected):
            differing = (tensor != expected).sum().item() if tensor.shape == expected.shape else "shape"
            return f"{name} differs ({differing} of {expected.numel()} elements)"
    missing = [name for name in full_state_dict if name not in exported]
    return f"{missing[0]} is missing" if missing else None


def verify_export(full_state_dict, folder, dtype):
    """
    Rank 0 loads the exported folder and compares every tensor with full_state_dict (the gathered
    one on rank 0, anything elsewhere) cast to dtype, exactly: the export is that cast and nothing
    else, so a correct run never fails this. The verdict is broadcast, so that every rank raises or
    returns together rather than one waiting in a collective. Collective.
    """
    verdict = [_first_difference(full_state_dict, folder, dtype) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(verdict, src=0)
    if verdict[0] is not None:
        raise RuntimeError(f"the export in {folder} does not hold the trainer's weights: {verdict[0]}")
