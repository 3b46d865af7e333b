"""
Checkpoints: sharded for exact resume, and a Hugging Face export for chat.py / rollout.py / vLLM.

Sharded: torch.distributed.checkpoint (DCP) writes each rank's shards of the policy, the critic and
their optimizers in parallel; a small per-rank file holds the step, the data position and the RNG
states (the learning rate is a function of the step). resume=auto takes the highest complete step.

Every save (a checkpoint `checkpoints/step_XXXXXX`, the export `hf`) replaces its folder so that a
kill at any instant leaves one complete copy: it is written into `<folder>.tmp`, an existing
`<folder>` is renamed to `<folder>.old`, `<folder>.tmp` is renamed to `<folder>`, and only then is
`<folder>.old` deleted. Rewriting an existing folder is common (every export, every rerun into a
run_dir), and deleting it before the new one is in place would lose it to a kill. A folder cannot
be swapped with another in one portable step, so between the two renames the complete copy is
`<folder>.old`: latest_checkpoint takes it from there, and the next save or export renames it back.
`.tmp` folders are partial (or never checked) and are ignored, then deleted by the next save.

Export: the full policy gathered to rank 0 and cast to the training dtype (the weights the trainer
computes with, not the fp32 master copy), saved with save_pretrained (safetensors) with the
tokenizer and its chat template, then loaded back with transformers and compared tensor by tensor,
bitwise, before it replaces the previous export: an export that loads but holds other weights
must not pass silently.
"""

import os
import random
import re
import shutil

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)
from transformers import AutoModelForCausalLM

STEP_DIR = re.compile(r"^step_(\d{6})(\.old)?$")


def _restore(folder):
    """Clean up after a save of `folder` that was killed: put back a complete copy that was moved
    aside (only when `folder` itself is missing: otherwise `.old` is stale or half deleted), and
    delete partial writes."""
    if os.path.isdir(folder + ".old") and not os.path.exists(folder):
        os.rename(folder + ".old", folder)
    shutil.rmtree(folder + ".old", ignore_errors=True)
    shutil.rmtree(folder + ".tmp", ignore_errors=True)


def _move_into_place(folder):
    """Replace `folder` with the complete `folder.tmp`; the previous `folder` is deleted last."""
    if os.path.exists(folder):
        os.rename(folder, folder + ".old")
    os.rename(folder + ".tmp", folder)
    shutil.rmtree(folder + ".old", ignore_errors=True)


def latest_checkpoint(run_dir):
    """The folder of the highest complete checkpoint in run_dir, or None: `step_N`, or `step_N.old`
    when a save was killed between its two renames (then `step_N` is missing)."""
    folder = os.path.join(run_dir, "checkpoints")
    names = set(os.listdir(folder)) if os.path.isdir(folder) else set()
    complete = []
    for name in names:
        match = STEP_DIR.match(name)
        if match and not (match.group(2) and name.removesuffix(".old") in names):
            complete.append((int(match.group(1)), name))
    return os.path.join(folder, max(complete)[1]) if complete else None


def _rng_state():
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def _set_rng_state(state):
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def save_checkpoint(run_dir, step, models, optimizers, extra):
    """
    models / optimizers: dicts by name ("policy", "critic"); optimizers[name] belongs to
    models[name]. extra: small picklable state (data position, ...). Collective: all ranks call.
    """
    rank = dist.get_rank()
    folder = os.path.join(run_dir, "checkpoints")
    final = os.path.join(folder, f"step_{step:06d}")
    dist.barrier()  # every rank is done reading the checkpoint it resumed from, which rank 0 may rename back below
    if rank == 0:
        os.makedirs(folder, exist_ok=True)
        for name in os.listdir(folder):
            if name.endswith((".tmp", ".old")):
                _restore(os.path.join(folder, os.path.splitext(name)[0]))
        os.makedirs(final + ".tmp")
    dist.barrier()
    state = {}
    for name, model in models.items():
        state[f"{name}/model"] = get_model_state_dict(model)
        state[f"{name}/optim"] = get_optimizer_state_dict(model, optimizers[name])
    dcp.save(state, checkpoint_id=final + ".tmp")
    torch.save({"step": step, "extra": extra, "rng": _rng_state()}, os.path.join(final + ".tmp", f"rank{rank}.pt"))
    dist.barrier()
    if rank == 0:
        _move_into_place(final)
    dist.barrier()
    return final


def load_checkpoint(path, models, optimizers):
    """Restore everything save_checkpoint wrote; returns (step, extra). Collective."""
    state = {}
    for name, model in models.items():
        state[f"{name}/model"] = get_model_state_dict(model)
        state[f"{name}/optim"] = get_optimizer_state_dict(model, optimizers[name])
    dcp.load(state, checkpoint_id=path)
    for name, model in models.items():
        set_model_state_dict(model, state[f"{name}/model"])
        set_optimizer_state_dict(model, optimizers[name], state[f"{name}/optim"])
    rank_file = os.path.join(path, f"rank{dist.get_rank()}.pt")
    if not os.path.exists(rank_file):
        raise RuntimeError(f"{path} was written by fewer ranks than this run has ({rank_file} is missing); resume with the same world size")
    saved = torch.load(rank_file, weights_only=False)
    _set_rng_state(saved["rng"])
    return saved["step"], saved["extra"]


def export_hf(model, tokenizer, out_dir, dtype):
    """
    Gather the full policy to rank 0 and write a Hugging Face folder (safetensors in `dtype`,
    config, generation config, tokenizer with its chat template) that transformers and vLLM load;
    it replaces out_dir only once verify_export has passed. dtype: the trainer's compute dtype
    (torch.bfloat16 or torch.float32). Collective.
    """
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))  # {} on ranks > 0
    out_dir = os.path.normpath(out_dir)
    if dist.get_rank() == 0:
        full = {name: tensor.to(dtype) for name, tensor in full.items()}
        _restore(out_dir)
        with torch.device("meta"):
            clean = AutoModelForCausalLM.from_config(model.config, dtype=dtype)
        clean.load_state_dict(full, assign=True, strict=False)
        clean.tie_weights()
        clean.generation_config = model.generation_config
        clean.save_pretrained(out_dir + ".tmp")
        tokenizer.save_pretrained(out_dir + ".tmp")
    verify_export(full, out_dir + ".tmp", dtype)
    if dist.get_rank() == 0:
        _move_into_place(out_dir)
    dist.barrier()


def _first_difference(full_state_dict, folder, dtype):
    """What first differs between the Hugging Face folder loaded in dtype and the full state dict
    cast to dtype, or None."""
    try:
        exported = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).state_dict()  # tied weights under each name
    except Exception as e:  # a folder that does not load is a failed export too; rank 0 must still share its verdict
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
    Rank 0 loads the exported folder with transformers and compares every tensor with the gathered
    full state dict cast to dtype, exactly: the export is that cast and nothing else, so a correct
    run never fails this. Rank 0's verdict is broadcast, so every rank raises (or returns) together
    instead of one of them waiting in a collective. full_state_dict: the gathered full state dict
    on rank 0 (other ranks: anything). Collective.
    """
    verdict = [_first_difference(full_state_dict, folder, dtype) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(verdict, src=0)
    if verdict[0] is not None:
        raise RuntimeError(f"the export in {folder} does not hold the trainer's weights: {verdict[0]}")
