"""
Pretraining of the tiny model (nanoagent/tiny.py) on a task's text, and the readers of that text.
A real base model comes to RL knowing how text is written, how to copy a name it has just read and
how a tool is called; a random tiny one learns that here, in CPU minutes. `python -m nanoagent.tiny
--pretrain` runs it (make demo); like tiny.py it is part of the kit the trainer does not import.
"""

import json
import random

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from nanoagent.batch import pad_rows
from nanoagent.data import load_prompts
from nanoagent.retriever import iter_corpus
from nanoagent.tools import format_passages, parse_tool_calls


def pretraining_loss(model, batch, pad_token_id):
    """
    Mean next-token loss over the learned tokens of batch, a list of (token ids, loss mask) rows.
    Every conversation of a batch begins with the same system turn and tool list (about two thirds
    of its tokens, none of them learned): that shared prefix is read once, as a batch of one, and
    its keys and values are repeated for every row; logits are computed only where the next token
    is learned. The same loss and gradient as one padded forward over the rows, from a third of the
    tokens.
    """
    # prefix tokens all rows share and whose logits nothing learns from (a mask of 1 at t is learned
    # from t-1)
    shared = 0
    shortest = min(len(ids) for ids, _ in batch)
    while (shared < shortest - 1 and len({ids[shared] for ids, _ in batch}) == 1
           and not any(mask[shared + 1] for _, mask in batch)):
        shared += 1
    input_ids = pad_rows([ids[shared:] for ids, _ in batch], pad_token_id)  # [B, L - shared]
    loss_mask = pad_rows([mask[shared:] for _, mask in batch], 0)  # [B, L - shared], 0 on padding
    attention_mask = pad_rows([[1] * len(ids) for ids, _ in batch], 0)  # [B, L]
    cache = None
    if shared:
        cache = model.model(input_ids=torch.tensor([batch[0][0][:shared]]), use_cache=True).past_key_values
        cache.batch_repeat_interleave(len(batch))
    hidden = model.model(input_ids=input_ids, attention_mask=attention_mask,
                         past_key_values=cache).last_hidden_state
    learned = loss_mask[:, 1:].bool()  # [B, L - shared - 1]
    logits = model.lm_head(hidden[:, :-1][learned])  # [N, V]
    return torch.nn.functional.cross_entropy(logits.float(), input_ids[:, 1:][learned])


def pretrain(model_dir, rows, steps, batch_size=32, lr=3e-3, seed=0, warmdown=0.3):
    """
    Pretrain the tiny model in model_dir, in place: next-token loss on the tokens of rows drawn at
    random where their loss mask is 1, AdamW at lr, constant and then down to 0 over the last
    `warmdown` of the steps. rows: (token ids, loss mask) pairs, as pretraining_rows makes them.
    The text should hold none of the task's facts (make demo: the synthetic world's passages and
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
        for group in optimizer.param_groups:  # constant, then linearly down to 0
            group["lr"] = lr * min(1.0, (steps - step) / max(1.0, warmdown * steps))
        loss = pretraining_loss(model, [rows[rng.randrange(len(rows))] for _ in range(batch_size)],
                                tokenizer.pad_token_id)
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
        return [(ids + [tokenizer.eos_token_id], [1] * (len(ids) + 1))
                for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            conversation = json.loads(line)
            messages, tools = conversation.get("messages"), conversation.get("tools")
            if (not isinstance(messages, list)
                    or not all(isinstance(m, dict) and {"role", "content"} <= set(m) for m in messages)):
                raise ValueError(f"{path}:{n}: a conversation needs a list of messages with a role and a "
                                 "content")
            text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
            # (start, end) characters of each assistant turn, and of the EOS that ends it when it calls
            # no tool
            spans = []
            for i, m in enumerate(messages):
                if m["role"] == "assistant":
                    start = len(tokenizer.apply_chat_template(messages[:i], tools=tools, tokenize=False,
                                                              add_generation_prompt=True))
                    if not text.startswith(m["content"] + tokenizer.eos_token, start):
                        raise ValueError(f"{path}:{n}: the chat template does not render assistant turns "
                                         "verbatim, closed by EOS")
                    spans.append((start, start + len(m["content"])
                                  + (0 if parse_tool_calls(m["content"]) else len(tokenizer.eos_token))))
            encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
            rows.append((encoded["input_ids"],
                         [int(any(a <= lo < b for a, b in spans)) for lo, _ in encoded["offset_mapping"]]))
    return rows
