"""
The transformers fallback engine (HFEngine) against the trainer's own forward pass: it samples from
softmax(logits / T) and nothing else (the model's generation_config plays no part), reports the
logprobs the trainer recomputes, keeps no per-step logits, batches left-padded rows exactly like
rows alone, and gives its weights back to the CPU while asleep. Both engines (HFEngine and the real
vLLM CPU engine) stop on the same ids and report the same logprobs under a top_p nucleus.
"""

import gc
import json
import math
import os
import shutil
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers import AutoTokenizer

from padded import load_causal_lm, nucleus_logprobs
from nanoagent.engine import MAX_NUM_SEQS, HFEngine, SamplingConfig, VLLMEngine, cpu_kv_cache_bytes, stop_token_ids
from nanoagent.model import Policy, policy_forward

# logits x 7: the random tiny model's next-token distributions go from near uniform to peaked like a
# trained model's (entropy ~2 nats at T=1, ~5 at T=1.5), so a wrong temperature or filter shows.
SHARPEN = 7.0
EOS_PROMPT = 1  # the seed of the prompt (random_prompts) whose greedy continuation holds model_dir's second eos id


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir, tok, tmp_path_factory):
    """The tiny model, sharpened, shipping a generation_config.json like Qwen2.5-Instruct's but
    extreme: if any of it leaked into sampling, the samples would come from a handful of ids. Like
    Qwen2.5-Instruct's (<|im_end|> and <|endoftext|>) it lists a second eos id: one the model writes
    in its greedy continuation of EOS_PROMPT."""
    path = tmp_path_factory.mktemp("configured_model")
    shutil.copytree(tiny_model_dir, path, dirs_exist_ok=True)
    model = load_causal_lm(tiny_model_dir)
    with torch.no_grad():
        model.model.norm.weight.mul_(SHARPEN)
    model.save_pretrained(path)
    vocab = model.config.vocab_size
    other_eos = greedy_alone(model, random_prompts(1, vocab, seed=EOS_PROMPT)[0], 3, stop_token_ids(tok))[0][-1]
    (path / "generation_config.json").write_text(json.dumps({
        "do_sample": True, "temperature": 0.3, "top_k": 3, "top_p": 0.5, "repetition_penalty": 3.0,
        "suppress_tokens": list(range(8, vocab)),
        "eos_token_id": [model.config.eos_token_id, other_eos], "pad_token_id": model.config.pad_token_id,
    }))
    return str(path)


@pytest.fixture(scope="module")
def vllm_engine(model_dir, tok):
    """The real vLLM CPU engine, in process. It sets up torch.distributed (a world of one) for
    itself; that is torn down with it, so the tests after this module start a process group of
    their own as a training run does. Eager, to start faster (the compiled path: the test below)."""
    engine = VLLMEngine(model_dir, stop_token_ids(tok), max_model_len=128, dtype="float32", seed=0, compile=False)
    yield engine
    del engine
    from vllm.distributed import cleanup_dist_env_and_memory  # here: the GPU machine collects this module without vLLM
    cleanup_dist_env_and_memory()


@pytest.fixture(scope="module")
def trainer_model(model_dir):
    return load_causal_lm(model_dir)


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def random_prompts(n, vocab, seed=0):
    """n prompts of different lengths (3..10 tokens), so a batch is left-padded."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, vocab, (3 + i % 8,), generator=g).tolist() for i in range(n)]


@torch.no_grad()
def trainer_view(model, prompts, gens, temperature):
    """policy_forward over prompt + sampled ids (packed, as in training): per row, the trainer's
    logprobs and entropies of the sampled tokens, and the logits that chose them."""
    rows = [p + g.token_ids for p, g in zip(prompts, gens)]
    ids, positions = torch.tensor([sum(rows, [])]), torch.tensor([[t for r in rows for t in range(len(r))]])   # [1, T]
    sampled = torch.tensor([[t >= len(p) for p, r in zip(prompts, rows) for t in range(len(r))]])
    logprobs, entropy, _ = policy_forward(Policy(model), ids, positions, sampled, temperature)   # [1, T]
    logits = model(input_ids=ids, position_ids=positions).logits[0]                                      # [T, V]
    out, start = [], 0
    for i, (p, g) in enumerate(zip(prompts, gens)):
        span = slice(start + len(p), start + len(p) + len(g.token_ids))
        out.append((logprobs[0, span], entropy[0, span], logits[span.start - 1:span.stop - 1]))
        start += len(rows[i])
    return out


@torch.no_grad()
def greedy_alone(model, prompt, budget, stop_ids):
    """Reference greedy decoding of one unpadded row: a full forward per token, argmax of the raw logits."""
    ids = list(prompt)
    for _ in range(budget):
        ids.append(model(torch.tensor([ids])).logits[0, -1].argmax().item())
        if ids[-1] in stop_ids:
            return ids[len(prompt):], "stop"
    return ids[len(prompt):], "length"


@pytest.mark.slow
def test_a_vllm_engine_starting_keeps_no_garbage_forever(tiny_model_dir, tok):
    """VLLMEngine freezes what is alive when it starts (vLLM's start-up gc passes then skip it); what
    is garbage at that moment, here a reference cycle, is collected first and not frozen for good."""
    class Node:
        pass
    cycle = Node()
    cycle.self = cycle
    gone = weakref.ref(cycle)
    del cycle  # garbage that only a gc pass frees; no automatic pass may free it before the engine starts
    gc.disable()
    try:
        engine = VLLMEngine(tiny_model_dir, stop_token_ids(tok), max_model_len=128, dtype="float32", seed=0, compile=False)
    finally:
        gc.enable()
    gc.collect()
    assert gone() is None
    del engine
    from vllm.distributed import cleanup_dist_env_and_memory
    cleanup_dist_env_and_memory()


@pytest.mark.slow
def test_a_cpu_engine_allocates_the_kv_cache_its_sequences_can_fill(tiny_model_dir, tok, monkeypatch):
    """Without VLLM_CPU_KVCACHE_SPACE, the CPU engine's KV cache (zero-filled, so all of it resident
    from the start) holds what the sequences it runs at once (at most max_model_len of them) can fill:
    16 MiB for the tiny model at 128 tokens, not the 1 GiB (a million tokens) it always took."""
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    engine = VLLMEngine(tiny_model_dir, stop_token_ids(tok), max_model_len=128, dtype="float32", seed=0, compile=False)
    cache = engine.llm.llm_engine.vllm_config.cache_config
    seqs = engine.llm.llm_engine.vllm_config.scheduler_config.max_num_seqs
    assert seqs == min(MAX_NUM_SEQS, 128)
    assert cpu_kv_cache_bytes(tiny_model_dir, "float32", 128) == 2 * 2 * 64 * 4 * 128 * seqs  # 2 layers, 1 KV head
    assert seqs * 128 <= cache.num_gpu_blocks * cache.block_size <= 2 * seqs * 128
    prompt = tok.encode("hello there")
    [gen] = engine.generate([prompt], SamplingConfig(max_new_tokens=8, greedy=True))
    assert len(gen.token_ids) >= 1
    del engine
    from vllm.distributed import cleanup_dist_env_and_memory
    cleanup_dist_env_and_memory()


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("TORCH_COMPILE_DISABLE") == "1",
    reason="torch.compile is off in this process (docs/recipes.md: Installing and testing)",
)
def test_a_compiled_vllm_engine_generates_with_the_weights_it_is_given(tiny_model_dir, tok):
    """rollout.compile (the default; on a GPU with CUDA graphs) runs vLLM's torch.compile of the model:
    here, the same compiled path on the CPU. Its greedy tokens and logprobs are the trainer's, before
    and after a weight reload (compiled code that had kept the weights it was built with would go on
    generating the old model's tokens)."""
    from vllm.config import CompilationMode
    prompts, greedy = random_prompts(4, len(tok), seed=7), SamplingConfig(max_new_tokens=8, greedy=True)
    engine = VLLMEngine(tiny_model_dir, [], max_model_len=128, dtype="float32", seed=0, compile=True)
    assert engine.llm.llm_engine.vllm_config.compilation_config.mode != CompilationMode.NONE  # the CPU: DYNAMO_TRACE_ONCE
    base, new = load_causal_lm(tiny_model_dir), load_causal_lm(tiny_model_dir)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(0.5 * torch.randn(p.shape, generator=g))
    for model in (base, new):
        engine.load_weights(model.named_parameters(remove_duplicate=False))  # as train.py sends them (model.full_tensors)
        gens = engine.generate(prompts, greedy)
        for prompt, gen, (logprobs, _, _) in zip(prompts, gens, trainer_view(model, prompts, gens, 1.0)):
            assert gen.token_ids == greedy_alone(model, prompt, 8, [])[0]
            torch.testing.assert_close(torch.tensor(gen.logprobs), logprobs, atol=1e-4, rtol=0)
    assert [g.token_ids for g in gens] != [greedy_alone(base, p, 8, [])[0] for p in prompts]  # the reload changed the tokens
    del engine
    from vllm.distributed import cleanup_dist_env_and_memory
    cleanup_dist_env_and_memory()


def test_samples_follow_softmax_over_temperature_and_logprobs_match_the_trainer(model_dir, trainer_model, tok):
    T = 1.5
    engine = HFEngine(model_dir, stop_token_ids(tok), tok.pad_token_id, dtype="float32", seed=3)
    prompts = random_prompts(6, trainer_model.config.vocab_size) * 20
    gens = engine.generate(prompts, SamplingConfig(max_new_tokens=8, temperature=T))
    sampled, reported, excess = set(), [], []
    for gen, (logprobs, entropy, _) in zip(gens, trainer_view(trainer_model, prompts, gens, T)):
        sampled.update(gen.token_ids)
        reported.append(torch.tensor(gen.logprobs))
        torch.testing.assert_close(reported[-1], logprobs, atol=1e-5, rtol=0)
        excess.append(logprobs + entropy)  # log p(x) + H(p): mean 0 when x ~ p
    # the configuration's top_k=3 and 8 unsuppressed ids would allow at most 8 distinct ids
    assert len(sampled) > 100, f"only {len(sampled)} distinct ids sampled"
    excess = torch.cat(excess)
    z = excess.mean() / (excess.std() / math.sqrt(len(excess)))
    assert abs(z) < 4, f"sampled logprobs are off the sampling distribution's -entropy by {z:.1f} standard errors"


def test_greedy_is_the_argmax_of_the_raw_logits(model_dir, trainer_model, tok):
    engine = HFEngine(model_dir, stop_token_ids(tok), tok.pad_token_id, dtype="float32")
    prompts = random_prompts(8, trainer_model.config.vocab_size, seed=1)
    gens = engine.generate(prompts, SamplingConfig(max_new_tokens=12, greedy=True))
    for gen, (logprobs, _, logits) in zip(gens, trainer_view(trainer_model, prompts, gens, 1.0)):
        assert gen.token_ids == logits.argmax(-1).tolist()
        torch.testing.assert_close(torch.tensor(gen.logprobs), logprobs, atol=1e-5, rtol=0)


class PeakMemory(TorchDispatchMode):
    """The most bytes held at once by the storages that torch ops allocate while active: a storage
    counts from the op that made it until it is freed (an output in an input's memory, a view or
    an in-place result, is not an allocation)."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0

    def freed(self, nbytes):
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        counted = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in counted:
                storage = t.untyped_storage()
                counted.add(storage.data_ptr())
                self.live += storage.nbytes()
                weakref.finalize(storage, self.freed, storage.nbytes())
        self.peak = max(self.peak, self.live)
        return out


def test_memory_does_not_grow_by_a_vocabulary_row_per_step(tiny_model_dir, tok):
    rows, vocab = 4, len(tok)
    engine = HFEngine(tiny_model_dir, [], tok.pad_token_id, dtype="float32")  # no stop ids: every row runs all steps
    peak = {}
    for steps in (32, 64):
        with PeakMemory() as memory:
            gens = engine.generate(random_prompts(rows, vocab), SamplingConfig(max_new_tokens=steps, temperature=1.0))
        assert all(len(g.token_ids) == steps and g.finish_reason == "length" for g in gens)
        peak[steps] = memory.peak
    # Per step and row the KV cache grows by 2 layers x (k, v) x 64 floats = 1 KiB; keeping the
    # step's [rows, V] logits (or logprobs) would add a vocabulary row of fp32, 4 x V bytes, more.
    growth = (peak[64] - peak[32]) / (rows * 32)
    assert growth < 4 * vocab, f"{growth:.0f} bytes more per row and step; a vocabulary row is {4 * vocab}"


@pytest.mark.parametrize("kind", ["hf", pytest.param("vllm", marks=pytest.mark.slow)])
def test_top_p_samples_lie_in_the_nucleus_and_both_engines_report_its_logprobs(kind, model_dir, trainer_model, tok, request):
    """With top_p < 1 each engine samples from the nucleus of softmax(logits / T) (vLLM's rule, for
    both) and reports the sampled token's logprob renormalised over it: the distribution it sampled
    from, which is what the trainer's logprobs.nucleus_logprobs computes from its own logits."""
    T, top_p = 1.2, 0.9
    engine = (HFEngine(model_dir, stop_token_ids(tok), tok.pad_token_id, dtype="float32", seed=5) if kind == "hf"
              else request.getfixturevalue("vllm_engine"))
    prompts = random_prompts(8, trainer_model.config.vocab_size, seed=2) * 8
    gens = engine.generate(prompts, SamplingConfig(max_new_tokens=6, temperature=T, top_p=top_p), seeds=list(range(len(prompts))))
    sampled_outside_the_argmax = renormalised = 0
    for gen, (logprobs, _, logits) in zip(gens, trainer_view(trainer_model, prompts, gens, T)):
        ids = torch.tensor(gen.token_ids)
        nucleus = nucleus_logprobs(logits, ids, T, top_p)                                # [n]
        torch.testing.assert_close(torch.tensor(gen.logprobs), nucleus, atol=1e-4, rtol=0)
        probs, order = torch.softmax(logits / T, -1).sort(-1, descending=True)          # [n, V]
        nucleus_size = ((probs.cumsum(-1) - probs) < top_p).sum(-1)                     # [n]: mass before a token < top_p
        rank = (order == ids[:, None]).int().argmax(-1)                                 # [n]: where each sample sits
        assert torch.all(rank < nucleus_size), f"sampled ranks {rank.tolist()}, nucleus sizes {nucleus_size.tolist()}"
        sampled_outside_the_argmax += int((rank > 0).sum())
        renormalised += int(((nucleus - logprobs).abs() > 1e-3).sum())
    assert sampled_outside_the_argmax > 20  # it did sample, not just take the top token
    assert renormalised > 20  # the nucleus left out mass: renormalised and full logprobs differ


@pytest.mark.parametrize("kind", ["hf", pytest.param("vllm", marks=pytest.mark.slow)])
def test_both_engines_stop_on_the_stop_ids_only(kind, model_dir, trainer_model, tok, request):
    """model_dir's generation_config.json lists a second eos id, as Qwen2.5-Instruct's lists
    <|endoftext|> besides <|im_end|>, which the chat template never ends a turn with: neither engine
    stops there. Both stop on stop_token_ids (EOS, </tool_call>) and nothing else."""
    engine = (HFEngine(model_dir, stop_token_ids(tok), tok.pad_token_id, dtype="float32") if kind == "hf"
              else request.getfixturevalue("vllm_engine"))
    other_eos = json.loads(open(f"{model_dir}/generation_config.json").read())["eos_token_id"][1]
    prompt = random_prompts(1, trainer_model.config.vocab_size, seed=EOS_PROMPT)[0]
    expected, reason = greedy_alone(trainer_model, prompt, 8, stop_token_ids(tok))
    assert other_eos in expected[:-1] and other_eos not in stop_token_ids(tok)
    [gen] = engine.generate([prompt], SamplingConfig(max_new_tokens=8, greedy=True))
    assert (gen.token_ids, gen.finish_reason) == (expected, reason)


def test_batched_greedy_equals_each_row_alone_and_rows_stop_on_their_own(model_dir, trainer_model, tok):
    prompts = random_prompts(5, trainer_model.config.vocab_size, seed=4)
    budgets = [10, 2, 7, 10, 4]
    # stop at the 3rd token of row 0's greedy continuation, so at least row 0 stops on a stop id
    stop_id = greedy_alone(trainer_model, prompts[0], 3, [])[0][2]
    engine = HFEngine(model_dir, [stop_id], tok.pad_token_id, dtype="float32")
    greedy = SamplingConfig(max_new_tokens=10, greedy=True)
    batched = engine.generate(prompts, greedy, max_new_tokens=budgets)
    for prompt, budget, gen in zip(prompts, budgets, batched):
        ids, reason = greedy_alone(trainer_model, prompt, budget, [stop_id])
        assert (gen.token_ids, gen.finish_reason) == (ids, reason)
        [alone] = engine.generate([prompt], greedy, max_new_tokens=[budget])
        assert alone.token_ids == gen.token_ids and alone.finish_reason == gen.finish_reason
        torch.testing.assert_close(torch.tensor(alone.logprobs), torch.tensor(gen.logprobs), atol=1e-5, rtol=0)
    assert {g.finish_reason for g in batched} == {"stop", "length"}


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))])
def test_sleep_gives_the_weights_to_the_cpu_and_load_weights_works_asleep_or_awake(tiny_model_dir, tok, device):
    prompt, greedy = random_prompts(1, len(tok), seed=6)[0], SamplingConfig(max_new_tokens=8, greedy=True)
    engine = HFEngine(tiny_model_dir, [], tok.pad_token_id, dtype="float32", device=device)
    [before] = engine.generate([prompt], greedy)
    new = load_causal_lm(tiny_model_dir)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(0.5 * torch.randn(p.shape, generator=g))
    expected, _ = greedy_alone(new, prompt, 8, [])
    assert expected != before.token_ids

    engine.sleep()
    assert all(p.device.type == "cpu" for p in engine.model.parameters())
    engine.load_weights(new.named_parameters())  # asleep
    engine.wake(["kv_cache"])
    assert all(p.device.type == "cpu" for p in engine.model.parameters())  # the weights sleep on
    engine.wake()
    assert all(p.device.type == torch.device(device).type for p in engine.model.parameters())
    [after] = engine.generate([prompt], greedy)
    assert after.token_ids == expected

    engine.wake(["weights"])  # train.py's order: weights, load, then the KV cache
    engine.load_weights(load_causal_lm(tiny_model_dir).named_parameters())  # awake
    engine.wake(["kv_cache"])
    [back] = engine.generate([prompt], greedy)
    assert back.token_ids == before.token_ids
