"""
Checkpoints: sharded for exact resume, and a Hugging Face export for chat.py / rollout.py / vLLM.

Sharded: torch.distributed.checkpoint (DCP) writes each rank's shards of the policy, the critic and
their optimizers in parallel; a small per-rank file holds the step, the data position, the
schedulers and the RNG states. A checkpoint is written into a temporary folder and renamed to
`step_XXXXXX` only when complete, so a crash mid-write never leaves a checkpoint that looks whole;
resume=auto takes the highest complete step.

Export: the full policy weights gathered to rank 0, saved with save_pretrained (safetensors), plus
the tokenizer and its chat template.
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

STEP_DIR = re.compile(r"^step_(\d{6})$")


def latest_checkpoint(run_dir):
    """The folder of the highest complete checkpoint in run_dir, or None."""
    folder = os.path.join(run_dir, "checkpoints")
    steps = sorted(int(m.group(1)) for m in map(STEP_DIR.match, os.listdir(folder) if os.path.isdir(folder) else []) if m)
    return os.path.join(folder, f"step_{steps[-1]:06d}") if steps else None


def _rng_state():
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def _set_rng_state(state):
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def save_checkpoint(run_dir, step, models, optimizers, schedulers, extra):
    """
    models / optimizers / schedulers: dicts by name ("policy", "critic"); optimizers[name] belongs
    to models[name]. extra: small picklable state (data position, ...). Collective: all ranks call.
    """
    rank = dist.get_rank()
    folder = os.path.join(run_dir, "checkpoints")
    final = os.path.join(folder, f"step_{step:06d}")
    tmp = os.path.join(folder, f".tmp_step_{step:06d}")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    dist.barrier()
    state = {}
    for name, model in models.items():
        state[f"{name}/model"] = get_model_state_dict(model)
        state[f"{name}/optim"] = get_optimizer_state_dict(model, optimizers[name])
    dcp.save(state, checkpoint_id=tmp)
    torch.save({"step": step, "extra": extra, "rng": _rng_state(),
                "schedulers": {k: s.state_dict() for k, s in schedulers.items()}}, os.path.join(tmp, f"rank{rank}.pt"))
    dist.barrier()
    if rank == 0:
        shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)
    dist.barrier()
    return final


def load_checkpoint(path, models, optimizers, schedulers):
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
    for k, s in schedulers.items():
        s.load_state_dict(saved["schedulers"][k])
    _set_rng_state(saved["rng"])
    return saved["step"], saved["extra"]


def export_hf(model, tokenizer, out_dir):
    """Gather the full policy to rank 0 and write a Hugging Face folder (safetensors, config,
    generation config, tokenizer with its chat template) that transformers and vLLM load. Collective."""
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        from transformers import AutoModelForCausalLM
        with torch.device("meta"):
            clean = AutoModelForCausalLM.from_config(model.config, dtype=next(iter(full.values())).dtype)
        clean.load_state_dict(full, assign=True, strict=False)
        clean.tie_weights()
        clean.generation_config = model.generation_config
        tmp = out_dir.rstrip("/") + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        clean.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        shutil.rmtree(out_dir, ignore_errors=True)
        os.rename(tmp, out_dir)
    dist.barrier()
