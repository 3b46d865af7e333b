"""
A tiny model that has memorised scripted tool-using conversations, so rollout tests can drive
real tool calls (valid, malformed, unknown tool, bad arguments, slow tool, endless calls) through
the real engine with greedy decoding. Built by plain next-token training on the assistant tokens.
"""

import json

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from nanoagent.tiny_pretrain import pretraining_loss


def call(name, arguments, raw=None):
    body = raw if raw is not None else json.dumps({"name": name, "arguments": arguments})
    return f"<tool_call>\n{body}\n</tool_call>"


def user(text):
    return [{"role": "system", "content": "Use tools, then answer in <answer></answer>."}, {"role": "user", "content": text}]


# question -> the assistant turns it should produce (tool results in between come from the real tools)
SCRIPTS = {
    "Compute 12*7.": [call("calculator", {"expression": "12*7"}), "<answer>84</answer>"],
    "Send broken json.": [call(None, None, raw='{"name": "calculator", "arguments": {expression: 2}}'), "<answer>oops</answer>"],
    "Ask the weather.": [call("weather", {"city": "Paris"}), "<answer>unknown</answer>"],
    "Use wrong arguments.": [call("calculator", {"expr": "1+1"}), "<answer>two</answer>"],
    "Wait a long time.": [call("sleep", {"seconds": 30}), "<answer>late</answer>"],
    "Keep calculating.": [call("calculator", {"expression": "1+1"})] * 6,
    "Say hi.": ["<answer>hi</answer>"],
    "Who founded Nanotown?": [call("search", {"query": "founder of Nanotown"}), "<answer>Ada Quill</answer>"],
}

CORPUS = [
    {"id": "1", "title": "Nanotown", "text": "Nanotown is a river city founded by Ada Quill in 1802."},
    {"id": "2", "title": "Ada Quill", "text": "Ada Quill was an engineer born in Lisbon."},
    {"id": "3", "title": "Paris", "text": "Paris is the capital city of France."},
    {"id": "4", "title": "Lisbon", "text": "Lisbon is the largest city of Portugal."},
]


def scripted_conversations(env):
    """Full conversations for each script, with the real tools' results in between as the agent
    loop puts them: each script stepped through an environment of env's, each observation cut to
    its token budget."""
    conversations = []
    for question, turns in SCRIPTS.items():
        environment = env.make()
        messages = list(environment.reset({"messages": user(question)}))
        for content in turns:
            messages.append({"role": "assistant", "content": content})
            observation, _, done, _ = environment.step(content)
            if not done:
                messages += [{**m, "content": env.truncate(m["content"], m["role"])} for m in observation]
        conversations.append(messages)
    return conversations


def memorise(base_dir, out_dir, env, steps=300, lr=3e-3):
    """Train the tiny model at base_dir on the scripted conversations; save to out_dir."""
    tok = AutoTokenizer.from_pretrained(base_dir)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    rows = []
    for messages in scripted_conversations(env):
        ids = env.tokenizer.encode(env.render(messages), add_special_tokens=False)
        mask = [0] * len(ids)
        for k, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            start = len(env.tokenizer.encode(env.render(messages[:k], add_generation_prompt=True), add_special_tokens=False))
            end = len(env.tokenizer.encode(env.render(messages[:k + 1]), add_special_tokens=False)) - 1  # up to <|im_end|>
            mask[start:end] = [1] * (end - start)
        rows.append((ids, mask))
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    for _ in range(steps):
        loss = pretraining_loss(model, rows, tok.pad_token_id)  # every row, each step; the shared system turn read once
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return out_dir, loss.item()
