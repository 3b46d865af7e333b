"""
A tiny Qwen2-style causal LM and a byte-level BPE tokenizer with a Hermes tool-calling chat
template, built on the spot: no downloads. Tests, the `tiny` preset and `make demo` use it, so the
whole loop (vLLM engine, tools, trainer) runs on a CPU on a fresh machine.

The chat template follows Qwen2.5's conventions (`<|im_start|>role\n...<|im_end|>\n`, a tools list
in the system turn, `<tool_call>{json}</tool_call>` in assistant turns, tool results wrapped in
`<tool_response>` inside a user turn) so code that works on the tiny model works on Qwen2.5.
head_dim is 64 because vLLM's CPU attention rejects head_dim 16.
"""

import json
import os
import shutil
import tempfile

import torch

IM_START, IM_END, ENDOFTEXT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
TOOL_TAGS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]

CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if message.content %}{{- message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls | default([], true) %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{%- if message.content or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' + tool_call.name + '\", \"arguments\": ' }}"
    "{%- if tool_call.arguments is string %}{{- tool_call.arguments }}{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Bump when the builder's output changes, so cached copies are rebuilt.
TINY_VERSION = 3


def _tokenizer_corpus():
    """Text the BPE is trained on: chat glue, tool-call JSON, digits and plain English words."""
    words = ("the of and to in is was who what which where when how many capital city country born river "
             "founded director film author book wrote located largest population year answer search calculator "
             "question think result expression query passage title text name arguments function tool call "
             "response user assistant system").split()
    boilerplate = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided "
                   "with function signatures within <tools></tools> XML tags:\n<tools>\n{\"type\": \"function\", "
                   "\"function\": {\"name\": \"search\", \"description\": \"Search\", \"parameters\": {\"type\": "
                   "\"object\", \"properties\": {\"query\": {\"type\": \"string\"}}, \"required\": [\"query\"]}}}\n"
                   "</tools>\n\nFor each function call, return a json object with function name and arguments within "
                   "<tool_call></tool_call> XML tags:")
    lines = [boilerplate, " ".join(words), "0 1 2 3 4 5 6 7 8 9 + - * / ( ) . , : ; ? ! \" ' { } [ ]"]
    for w in words:
        lines.append(f'<tool_call>\n{{"name": "search", "arguments": {{"query": "{w}"}}}}\n</tool_call>')
        lines.append(f"<think>The {w} is</think>\n<answer>{w}</answer>")
    return lines * 4


# Qwen2's pre-tokenizer split: every digit is its own token, so a number copied from a question
# into a tool call, or from a tool result into an answer, is the same tokens in both places.
PRETOKENIZE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def build_tokenizer(vocab_size=1024):
    """A byte-level BPE (every string is encodable) wrapped as a transformers fast tokenizer."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    special = [ENDOFTEXT, IM_START, IM_END]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special + TOOL_TAGS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_tokenizer_corpus(), trainer=trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=IM_END, pad_token=ENDOFTEXT,
                                 additional_special_tokens=TOOL_TAGS)
    hf.chat_template = CHAT_TEMPLATE
    return hf


def build_tiny_model(out_dir, seed=0, hidden_size=128, num_layers=2, dtype=torch.float32):
    """Write a random-weight Qwen2 causal LM + tokenizer to out_dir (loadable by transformers and vLLM)."""
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    tokenizer = build_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=hidden_size // 64, num_key_value_heads=1,
        head_dim=64, max_position_embeddings=4096, tie_word_embeddings=True, dtype=dtype,
        bos_token_id=None, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(dtype)
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    with open(os.path.join(out_dir, "nanoagent_tiny.json"), "w") as f:
        json.dump({"version": TINY_VERSION, "seed": seed, "hidden_size": hidden_size, "num_layers": num_layers}, f)
    return out_dir


def ensure_tiny_model(cache_dir=None, seed=0):
    """
    The tiny model's folder, built once and cached (default ~/.cache/nanoagent). Safe when several
    ranks call it at once: each builds into a temporary folder and the first rename wins.
    """
    cache_dir = cache_dir or os.environ.get("NANOAGENT_CACHE", os.path.expanduser("~/.cache/nanoagent"))
    path = os.path.join(cache_dir, f"tiny-v{TINY_VERSION}-seed{seed}")
    if os.path.exists(os.path.join(path, "nanoagent_tiny.json")):
        return path
    os.makedirs(cache_dir, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tiny-", dir=cache_dir)
    try:
        build_tiny_model(tmp, seed=seed)
        if not os.path.exists(os.path.join(tmp, "model.safetensors")):
            raise RuntimeError("the tiny model was written without its weights: under a process group transformers "
                               "writes them on rank 0 only; build it before torch.distributed is initialised")
        os.rename(tmp, path)
    except OSError:
        if not os.path.exists(os.path.join(path, "nanoagent_tiny.json")):
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path
