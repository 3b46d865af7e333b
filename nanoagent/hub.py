"""
What a model name means, before anything is loaded: the path transformers and vLLM load it from.
Two names are packaged, so that a fresh machine trains with no download: `tiny` (the test model,
built once by nanoagent/tiny.py) and `smollm2-135m` (a real chat model, converted once by
nanoagent/smollm2.py). Anything else is a folder or a Hugging Face hub id, checked in seconds: a
name that cannot be loaded is a command-line error, not a minute of retries and a chained traceback.
The trainer, rollout.py and chat.py import this and not the tiny kit.
"""

import os
import sys

from huggingface_hub import constants as hub_constants
from huggingface_hub import get_hf_file_metadata, hf_hub_url, try_to_load_from_cache
from huggingface_hub.errors import (GatedRepoError, HFValidationError, RemoteEntryNotFoundError,
                                    RepositoryNotFoundError)
from huggingface_hub.utils import validate_repo_id

from nanoagent.checkpoint import MARKER, STEP_DIR
from nanoagent.smollm2 import NAME as SMOLLM2
from nanoagent.smollm2 import ensure_smollm2

HUB_TIMEOUT_S = 5  # how long a model name's hub lookup may wait for an answer (resolve_model)


def hub_problem(name):
    """
    Why `name`, which is no folder here, cannot be loaded from the Hugging Face hub now, or None:
    not a hub id (a path that does not exist), not in the local cache while offline
    (HF_HUB_OFFLINE=1), or, when not in the cache, a hub that has no such model or does not answer
    within HUB_TIMEOUT_S. Asked once, for config.json, so that the answer comes in seconds: the
    libraries' own loaders retry for a minute or more without a network, then raise chained tracebacks.
    """
    try:
        validate_repo_id(name)
    except HFValidationError:
        return f"{name!r} does not exist (no such folder, and not a hub id)"
    if isinstance(try_to_load_from_cache(name, "config.json"), str):
        return None
    if hub_constants.HF_HUB_OFFLINE:
        return (f"{name!r} is no folder here, and as a hub id it is not in the local Hugging Face cache, "
                "which is all HF_HUB_OFFLINE=1 allows: download it where there is a network "
                f"(hf download {name}), or pass a folder")
    try:
        get_hf_file_metadata(hf_hub_url(name, "config.json"), timeout=HUB_TIMEOUT_S)
    except GatedRepoError:
        return f"{name!r} is gated on the hub: accept its terms on its page and log in (hf auth login)"
    except RepositoryNotFoundError:
        return (f"{name!r} is no folder here, and the hub has no model of that name "
                "(or a private one: log in with hf auth login)")
    except RemoteEntryNotFoundError:
        return f"the hub's {name!r} has no config.json: it is not a transformers model"
    except Exception as e:
        # no network, no answer in time, the hub's own error: the libraries raise many kinds
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return (f"{name!r} is no folder here, and the hub did not answer for it "
                f"({reason}; waited at most {HUB_TIMEOUT_S} s): "
                "with no network, set HF_HUB_OFFLINE=1 and use a model in the local cache, or pass a folder")
    return None


def model_problem(name):
    """
    Why `name` is not a model that transformers and vLLM can load, or None. A folder must hold a
    model (its config.json); a training run's folder and a checkpoint folder (sharded, for
    resuming: nanoagent/checkpoint.py) are named as such, with the export to pass instead,
    <run_dir>/hf. Anything else must be a hub id that can be loaded now (hub_problem).
    """
    if not os.path.isdir(name):
        return hub_problem(name)
    folder = os.path.normpath(name)
    if STEP_DIR.match(os.path.basename(folder)) or os.path.isfile(os.path.join(folder, MARKER)):
        export = os.path.join(os.path.dirname(os.path.dirname(folder)), "hf")
        return (f"{name!r} is a training checkpoint (sharded, for resuming a run), not a model: "
                f"pass the run's export {export!r}")
    if any(os.path.exists(os.path.join(folder, entry)) for entry in ("hf", "checkpoints", "metrics.jsonl")):
        export = os.path.join(folder, "hf")
        exported = "" if os.path.isdir(export) else " (none yet: train.py writes it when the run ends)"
        return f"{name!r} is a training run's folder, not a model: pass its export {export!r}{exported}"
    if not os.path.isfile(os.path.join(folder, "config.json")):
        return (f"{name!r} is a folder without a model (no config.json); "
                "a training run exports its model to <run_dir>/hf")
    return None


def resolve_model(name, script):
    """
    The path transformers and vLLM load the model `name` from: 'tiny' builds (once, cached) the
    tiny test model, 'smollm2-135m' converts (once, cached) the packaged SmolLM2-135M-Instruct
    (nanoagent/smollm2.py); a folder or a hub id is returned as it is. A name that is no model one can
    load (model_problem) ends the process as a command-line error does, at once: one line,
    "<script>: <why>", on stderr, exit status 2, no traceback. Call it before the process group
    exists: under one, transformers' save_pretrained writes weights on rank 0 only, and another
    rank's build would lack them.
    """
    if name == "tiny":
        from nanoagent.tiny import ensure_tiny_model  # the kit (tokenizers, pretraining): only for it
        return ensure_tiny_model()
    if name == SMOLLM2:
        try:
            return ensure_smollm2()
        except RuntimeError as e:  # the packages are missing, or the conversion does not match the file
            print(f"{script}: {e}", file=sys.stderr)
            sys.exit(2)
    problem = model_problem(name)
    if problem:
        print(f"{script}: {problem}", file=sys.stderr)
        sys.exit(2)
    return name
