"""The tiny-model kit: tokenizer and chat template, model files, and the real vLLM CPU engine on them."""

import json
import os

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from nanoagent.tiny import TOOL_TAGS, build_tokenizer, ensure_tiny_model

SEARCH_TOOL = {"type": "function", "function": {
    "name": "search", "description": "Search the corpus.",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}

CONVERSATION = [
    {"role": "system", "content": "Answer with <answer></answer>."},
    {"role": "user", "content": "Who founded the city?"},
    {"role": "assistant", "content": "<think>search</think>\n<tool_call>\n{\"name\": \"search\", \"arguments\": {\"query\": \"city\"}}\n</tool_call>"},
    {"role": "tool", "content": "The city was founded by Ana in 1200."},
    {"role": "assistant", "content": "<answer>Ana</answer>"},
]


def render(tok, messages, **kw):
    return tok.apply_chat_template(messages, tools=[SEARCH_TOOL], tokenize=False, **kw)


def test_tool_tags_are_single_tokens_and_round_trip(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    for tag in TOOL_TAGS + ["<|im_start|>", "<|im_end|>"]:
        assert len(tok.encode(tag, add_special_tokens=False)) == 1, tag
    text = render(tok, CONVERSATION)
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text  # byte-level: lossless, tags kept in the text
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert tok.encode("ünïcode ✓ 東京", add_special_tokens=False) and tok.decode(tok.encode("ünïcode ✓ 東京", add_special_tokens=False)) == "ünïcode ✓ 東京"


def test_chat_template_renders_tools_calls_and_responses(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = render(tok, CONVERSATION)
    assert text.startswith("<|im_start|>system\nAnswer with <answer></answer>.\n\n# Tools")
    assert json.dumps(SEARCH_TOOL) in text
    assert "<|im_start|>user\n<tool_response>\nThe city was founded by Ana in 1200.\n</tool_response><|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n<answer>Ana</answer><|im_end|>\n")
    # structured tool_calls render in the same Hermes format the model is asked to produce
    structured = CONVERSATION[:2] + [{"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "search", "arguments": {"query": "city"}}}]}]
    assert render(tok, structured).endswith('<|im_start|>assistant\n<tool_call>\n{"name": "search", "arguments": {"query": "city"}}\n</tool_call><|im_end|>\n')
    # without tools, a plain system turn
    plain = tok.apply_chat_template(CONVERSATION[:2], tokenize=False, add_generation_prompt=True)
    assert plain == "<|im_start|>system\nAnswer with <answer></answer>.<|im_end|>\n<|im_start|>user\nWho founded the city?<|im_end|>\n<|im_start|>assistant\n"


def test_chat_template_is_prefix_stable(tiny_model_dir):
    """What multi-turn token-in/token-out relies on: a conversation's rendering only ever grows at the end."""
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    for k in range(2, len(CONVERSATION)):
        shorter = render(tok, CONVERSATION[:k], add_generation_prompt=CONVERSATION[k]["role"] == "assistant")
        assert render(tok, CONVERSATION[:k + 1]).startswith(shorter), k


def test_model_files_load_in_transformers(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    cfg = model.config
    assert cfg.model_type == "qwen2" and cfg.head_dim >= 32 and cfg.num_attention_heads * cfg.head_dim == cfg.hidden_size
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert cfg.vocab_size == len(tok) and cfg.eos_token_id == tok.eos_token_id
    with torch.no_grad():
        logits = model(torch.tensor([tok.encode("the capital city", add_special_tokens=False)])).logits
    assert logits.shape[-1] == len(tok) and torch.isfinite(logits).all()


def test_builder_is_deterministic_and_cached(tmp_path):
    a, b = build_tokenizer(), build_tokenizer()
    assert a.get_vocab() == b.get_vocab()
    path = ensure_tiny_model(str(tmp_path), seed=3)
    mtime = os.path.getmtime(os.path.join(path, "model.safetensors"))
    assert ensure_tiny_model(str(tmp_path), seed=3) == path  # second call reuses the cache
    assert os.path.getmtime(os.path.join(path, "model.safetensors")) == mtime
    assert [p for p in os.listdir(tmp_path) if p.startswith(".tiny-")] == []  # no temporary folders left
    other = ensure_tiny_model(str(tmp_path), seed=4)
    w3 = AutoModelForCausalLM.from_pretrained(path).model.embed_tokens.weight
    w4 = AutoModelForCausalLM.from_pretrained(other).model.embed_tokens.weight
    w3_again = AutoModelForCausalLM.from_pretrained(ensure_tiny_model(str(tmp_path / "again"), seed=3)).model.embed_tokens.weight
    assert not torch.equal(w3, w4) and torch.equal(w3, w3_again)


@pytest.mark.slow
def test_vllm_generates_and_logprobs_match_transformers(tiny_model_dir):
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    llm = LLM(model=tiny_model_dir, dtype="float32", enforce_eager=True, seed=0, max_model_len=2048)
    prompts = [tok.encode(render(tok, CONVERSATION[:k], add_generation_prompt=True), add_special_tokens=False) for k in (2, 4)]
    params = SamplingParams(max_tokens=24, temperature=1.0, logprobs=0, seed=0)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    for prompt, out in zip(prompts, outputs):
        sample = out.outputs[0]
        ids = list(sample.token_ids)
        assert len(ids) >= 1 and all(0 <= i < len(tok) for i in ids)
        engine_logprobs = torch.tensor([lp[i].logprob for lp, i in zip(sample.logprobs, ids)])
        with torch.no_grad():
            logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1]
        trainer_logprobs = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(ids)[:, None]).squeeze(-1)
        assert (engine_logprobs - trainer_logprobs).abs().max().item() <= 1e-4
