"""Process-level plumbing shared by the entry scripts: rank-aware printing, model resolution."""

import os


def rank():
    return int(os.environ.get("RANK", "0"))


def print0(*args, **kwargs):
    """print on rank 0 only, flushed (torchrun buffers the other ranks' output into noise)."""
    if rank() == 0:
        print(*args, **kwargs, flush=True)


def resolve_model(name):
    """A model path for transformers and vLLM: 'tiny' builds (once, cached) the tiny test model."""
    if name == "tiny":
        from nanoagent.tiny import ensure_tiny_model
        return ensure_tiny_model()
    return name
