"""
Loading a DCP checkpoint without running code from it. A checkpoint folder may come from
elsewhere, and unpickling runs code; DCP reads two pickles, its `.metadata` and small non-tensor
values (such as the optimizer's hyperparameters). Each is first unpickled by an allow-list that
refuses anything else: the metadata's own classes, and torch.load's weights_only for the values.
"""

import io
import os
import pickle

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

# The globals of DCP's `.metadata` pickle (torch 2.x): its dataclasses, torch.Size, a dtype, a layout, a path
METADATA_GLOBALS = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
                    ("torch.distributed.checkpoint.filesystem", "_StorageInfo")} | {
    ("torch.distributed.checkpoint.metadata", name)
    for name in ("Metadata", "MetadataIndex", "ChunkStorageMetadata", "TensorStorageMetadata",
                 "BytesStorageMetadata", "TensorProperties", "StorageMeta", "_MEM_FORMAT_ENCODING")}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if ((module, name) in METADATA_GLOBALS
                or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype))):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a checkpoint's .metadata")


class CheckedReader(dcp.FileSystemReader):
    """DCP's reader, with its `.metadata` pickle unpickled first with only the globals it is made of."""

    def read_metadata(self, *args, **kwargs):
        # DCP falls back to a rank's own metadata file when the global one does not load
        rank = kwargs.get("rank")
        with open(os.path.join(self.path, ".metadata" if rank is None else f"__{rank}.metadata"), "rb") as f:
            _MetadataUnpickler(f).load()
        return super().read_metadata(*args, **kwargs)


class CheckedPlanner(DefaultLoadPlanner):
    """DCP's load planner, with each non-tensor value torch.load-ed first with weights_only=True."""

    def load_bytes(self, read_item, value):
        torch.load(io.BytesIO(value.getvalue()), weights_only=True)
        super().load_bytes(read_item, value)
