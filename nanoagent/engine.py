"""
The rollout engine: token ids in, sampled token ids + their logprobs + a finish reason out.

Two implementations of one interface: submit(request_id, prompt_ids, sampling, max_new_tokens,
seed) queues a generation, step() advances the engine and returns the generations that finished,
abort(request_ids) stops generations and returns what they sampled so far (a partial rollout
pauses them), generate() does a whole batch at once; load_weights, sleep, wake.
- VLLMEngine: vLLM in the trainer's own process, one per rank (`external_launcher` under torchrun),
  so the trainer hands it new weights as tensors after every update, without writing a checkpoint
  or crossing a process boundary. On a GPU, sleep()/wake() lend its memory (weights and KV cache)
  to training and take it back.
- HFEngine: our own decode loop over a transformers model with a KV cache, batched with left
  padding, for machines without vLLM; slower. Not transformers' generate: that merges in the
  model's generation_config (Qwen2.5-Instruct ships a repetition penalty and top_k), so it would
  sample from one distribution and report the logprobs of another, and returning logits to compute
  logprobs afterwards keeps [B, V] fp32 per step (tens of GB at Qwen's vocabulary). sleep() moves
  its weights to the CPU, so training does not share the GPU with a second copy of the model.

Token-in/token-out: the sampled ids are kept exactly, so the trainer scores the very tokens that
were sampled (decode -> re-encode is lossy). Logprobs are those of the distribution sampled from:
softmax(logits / T), with top_p < 1 restricted to the nucleus and renormalised. That is the
behaviour distribution truncated importance sampling divides by, and all vLLM reports after
temperature (its processed logprobs); both engines report it. The trainer's old logprobs stay the
full softmax (the policy it trains); engine_logprob_diff compares the engine with the trainer's
logprobs renormalised over the same nucleus (logprobs.nucleus_logprobs).
"""

import gc
import importlib.util
import logging
import os
from dataclasses import dataclass

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from nanoagent.logprobs import nucleus_mask
from nanoagent.tools import CALL_END


@dataclass
class Generation:
    token_ids: list      # sampled ids, in order, including the stop token when one was hit
    logprobs: list       # logprob of each sampled id under the sampling distribution
                         # (top_p < 1: renormalised over the nucleus)
    finish_reason: str   # "stop": hit EOS or a stop token; "length": hit the token budget;
                         # "abort": stopped by abort(), unfinished


@dataclass
class SamplingConfig:
    max_new_tokens: int = 512
    temperature: float = 1.0
    top_p: float = 1.0
    greedy: bool = False


def pad_token_id(tokenizer):
    """The id rows are padded with (padding is always masked out): the pad token, else EOS, which
    tokenizers without a pad token (many base models) still have."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def stop_token_ids(tokenizer, stop_tags=(CALL_END,)):
    """EOS plus every stop tag that is a single token in this tokenizer (the tiny and Qwen2.5 ones: all)."""
    ids = {tokenizer.eos_token_id}
    for tag in stop_tags:
        tag_ids = tokenizer.encode(tag, add_special_tokens=False)
        if len(tag_ids) == 1:
            ids.add(tag_ids[0])
    return sorted(i for i in ids if i is not None)


def stop_strings(tokenizer, stop_tags=(CALL_END,)):
    """The stop tags that are several tokens in this tokenizer (SmolLM2's </tool_call>: five). A turn stops
    at the token that completes one in the text sampled so far, in both engines; its ids are the ones
    sampled, whichever way the model spelled the tag, and that token's text may go on past the tag."""
    return [tag for tag in stop_tags if len(tokenizer.encode(tag, add_special_tokens=False)) > 1]


# On every weight push vLLM's reload_weights warns "<layer class>: Failed to load weights" for each
# layer with tensors that none of the pushed weights went to, and puts that layer's own tensors back
# (vllm/model_executor/model_loader/reload/layerwise.py).
RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
RELOAD_FAILED = "%s: Failed to load weights"
PARAMETERLESS_LAYERS = set()  # the class names of the engines' layers that hold buffers and no parameters


def parameterless_layers(model):
    """The class names of the model's layers whose tensors are all buffers (a RotaryEmbedding's cos/sin table,
    computed from the config); a name that a layer with parameters also has is not one."""
    with_parameters = {type(m).__name__ for m in model.modules()
                       if next(m.parameters(recurse=False), None) is not None}
    with_buffers = {type(m).__name__ for m in model.modules()
                    if next(m.buffers(recurse=False), None) is not None}
    return with_buffers - with_parameters


def keep_reload_warning(record):
    """Drops vLLM's "Failed to load weights" for a layer without parameters: the trainer sends parameters
    only, so such a layer never gets one and keeps its buffers, which training does not change; on every
    push the warning said nothing. A layer with parameters still warns: it would go on generating with
    stale weights."""
    return not (record.msg == RELOAD_FAILED and record.args and record.args[0] in PARAMETERLESS_LAYERS)


MAX_NUM_SEQS = 256  # vLLM's default for LLM() on a CPU, lowered to max_num_batched_tokens where that is less
CPU_BLOCK_TOKENS = 128  # vLLM's KV block on a CPU


def cpu_kv_cache_bytes(model_path, dtype, max_model_len, cap=2**30):
    """
    The KV cache vLLM allocates on a CPU (all of it resident at start: it is zero-filled): what the
    most sequences the engine runs at once (MAX_NUM_SEQS, at most max_model_len: VLLMEngine's
    max_num_batched_tokens) can fill at max_model_len tokens each, and at most `cap` (1 GiB, the size
    it always had). More would hold nothing but older prefixes of finished turns, which the trainer's
    weight push resets anyway. The tiny test model (2 layers, 1 KV head of 64, fp32: 1 KiB a token)
    needs 384 MiB at 1,536 tokens; SmolLM2-135M (30 layers, 3 KV heads, fp32: 45 KiB a token) the
    whole GiB (23k tokens).
    """
    config = AutoConfig.from_pretrained(model_path)
    config = getattr(config, "text_config", config)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    per_token = 2 * config.num_hidden_layers * kv_heads * head_dim * getattr(torch, dtype).itemsize
    blocks = -(-max_model_len // CPU_BLOCK_TOKENS)  # a sequence's blocks, its last one partly filled
    return min(cap, per_token * CPU_BLOCK_TOKENS * blocks * min(MAX_NUM_SEQS, max_model_len))


class VLLMEngine:
    # a request may join while others are decoding (run_agent schedules each trajectory on its own)
    continuous_batching = True

    def __init__(self, model_path, stop_ids, max_model_len, dtype="bfloat16", gpu_memory_utilization=0.5,
                 tensor_parallel_size=1, seed=0, compile=True, stop_strings=()):
        # In-process engine core: the weights must be reachable from this process for reloads.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        # stdout is the program's own (chat.py --question | ...)
        os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
        from vllm import LLM
        # vLLM's start-up runs gc.collect() several times, each a full pass over every object of the
        # modules loaded so far (~0.2 s each on a CPU). Those live as long as the process: collect what
        # is garbage now (an earlier engine's cycles would be kept forever), then freeze the rest.
        gc.collect()
        gc.freeze()
        on_gpu = torch.cuda.is_available()
        distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
        # CPU: a KV cache of the size the engine can fill, unless VLLM_CPU_KVCACHE_SPACE (GiB) sets one
        # (in vLLM the variable wins over kv_cache_memory_bytes)
        sized = on_gpu or os.environ.get("VLLM_CPU_KVCACHE_SPACE")
        kv_cache = None if sized else cpu_kv_cache_bytes(model_path, dtype, max_model_len)
        self.llm = LLM(
            model=model_path, dtype=dtype, seed=seed, max_model_len=max_model_len,
            tensor_parallel_size=tensor_parallel_size,
            distributed_executor_backend="external_launcher" if distributed else None,
            gpu_memory_utilization=gpu_memory_utilization,
            enforce_eager=not compile,  # compile: torch.compile of the model, on a GPU with CUDA graphs
            enable_sleep_mode=on_gpu,
            logprobs_mode="processed_logprobs",  # logprobs after temperature: the distribution sampled from
            enable_prefix_caching=True,  # turn k+1's prompt is turn k's sequence: its KV is reused
            # CPU: a prompt split over two steps rewinds its seeded sampler's offset, which torch's CPU
            # generator does not have ("CPU Generator does not use offset"): prefill whole prompts.
            enable_chunked_prefill=on_gpu,
            max_num_batched_tokens=None if on_gpu else max_model_len,
            kv_cache_memory_bytes=kv_cache,
        )
        self.stop_ids, self.stop_strings = list(stop_ids), list(stop_strings)
        self.asleep = False
        self.sampled = {}  # request id -> (ids, logprobs) sampled so far (vLLM reports each step's)
        PARAMETERLESS_LAYERS.update(*self.llm.apply_model(parameterless_layers))
        # once: the same function is not added twice
        logging.getLogger(RELOAD_LOGGER).addFilter(keep_reload_warning)

    def submit(self, request_id, prompt_ids, sampling, max_new_tokens, seed=None):
        """Queue one generation (a trajectory's turn) in the engine; step() returns it when done.
        seed: a per-request sampling seed, which makes the sample independent of what else the
        engine generates alongside (exact resume, timing-independent rollouts)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind
        # ignore_eos: stop on exactly self.stop_ids (the tokenizer's EOS among them), as HFEngine does.
        # vLLM would also stop on the eos ids of the model's generation_config.json (Qwen2.5-Instruct:
        # <|endoftext|> too), which the chat template never closes a turn with; generation_config="vllm"
        # does not drop them. Stop strings need the text: vLLM then detokenises as it samples, and keeps
        # every sampled id.
        params = SamplingParams(
            max_tokens=max_new_tokens, temperature=0.0 if sampling.greedy else sampling.temperature,
            top_p=1.0 if sampling.greedy else sampling.top_p, stop_token_ids=self.stop_ids, ignore_eos=True,
            seed=seed, stop=self.stop_strings, include_stop_str_in_output=True,
            detokenize=bool(self.stop_strings), logprobs=0, skip_special_tokens=False,
            output_kind=RequestOutputKind.DELTA)  # each step's new tokens: abort() keeps what was sampled
        self.llm.llm_engine.add_request(request_id, TokensPrompt(prompt_token_ids=prompt_ids), params)
        self.sampled[request_id] = ([], [])

    def step(self):
        """One engine step (a decode iteration over every running request, prefills of new ones);
        returns [(request_id, Generation)] of the requests that finished in it."""
        done = []
        for out in self.llm.llm_engine.step():
            sample = out.outputs[0]
            ids, logprobs = self.sampled[out.request_id]
            ids += sample.token_ids
            logprobs += [lp[i].logprob for lp, i in zip(sample.logprobs, sample.token_ids)]
            if out.finished:
                del self.sampled[out.request_id]
                done.append((out.request_id, Generation(
                    ids, logprobs, "length" if sample.finish_reason == "length" else "stop")))
        return done

    def abort(self, request_ids):
        """Stop these generations; returns {request_id: Generation} of what each had sampled (finish
        reason "abort")."""
        self.llm.llm_engine.abort_request(list(request_ids))
        return {r: Generation(*self.sampled.pop(r), "abort") for r in request_ids}

    def generate(self, prompts, sampling, max_new_tokens=None, seeds=None):
        """A batch at once: prompts, token-id lists; max_new_tokens and seeds, optional per-prompt
        lists. Returns the Generations in the order of prompts."""
        budgets = max_new_tokens or [sampling.max_new_tokens] * len(prompts)
        for i, (prompt, budget, seed) in enumerate(zip(prompts, budgets, seeds or [None] * len(prompts))):
            self.submit(f"generate-{i}", prompt, sampling, budget, seed)
        done = {}
        while len(done) < len(prompts):
            done.update(self.step())
        return [done[f"generate-{i}"] for i in range(len(prompts))]

    def load_weights(self, named_tensors):
        """Generate with these weights from now on. One call hands vLLM an iterator over all the
        (hf_name, tensor) pairs; vLLM's loader maps names, fuses qkv/gate_up and repacks in place."""
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(named_tensors)})
        self.llm.reset_prefix_cache()  # cached KV was computed with the old weights

    def sleep(self):
        """Free the GPU for training: drop weights and KV cache (new weights come after the update)."""
        if torch.cuda.is_available() and not self.asleep:
            self.llm.sleep(level=2)
            self.asleep = True

    def wake(self, tags=None):
        """Take the GPU back. tags=["weights"] first, load_weights, then ["kv_cache"], keeps the
        peak low; None wakes both."""
        if torch.cuda.is_available() and self.asleep:
            self.llm.wake_up(tags=tags)
            self.asleep = tags is not None and "kv_cache" not in tags


class HFEngine:
    """Our own decode loop over a transformers causal LM with a KV cache, batched with left padding.
    Holds its own copy of the weights, which sleep() moves to the CPU while the trainer updates."""

    # one generate call per step: run_agent gathers a turn's requests before stepping
    continuous_batching = False

    def __init__(self, model_path, stop_ids, pad_id, dtype="bfloat16", device=None, seed=0, stop_strings=(),
                 tokenizer=None):
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.model = (AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype))
                      .to(self.device).eval())
        self.stop_ids, self.stop_strings = list(stop_ids), list(stop_strings)
        self.tokenizer = tokenizer  # decodes the tail of each row for the stop strings
        self.pad_id = pad_id
        self.generator_seed = seed
        self.queued = []  # (request_id, prompt_ids, sampling, max_new_tokens, seed) waiting for step()

    def submit(self, request_id, prompt_ids, sampling, max_new_tokens, seed=None):
        """Queue one generation; the next step() generates everything queued as one batch."""
        self.queued.append((request_id, prompt_ids, sampling, max_new_tokens, seed))

    def abort(self, request_ids):
        """Drop these queued generations (step() runs a batch to its end: nothing is ever half-sampled);
        returns {request_id: an empty Generation}."""
        self.queued = [q for q in self.queued if q[0] not in request_ids]
        return {r: Generation([], [], "abort") for r in request_ids}

    def step(self):
        """Generate every queued request together (they share the first one's sampling settings
        and seed, see generate); returns [(request_id, Generation)] of all of them."""
        # by id: the batch does not depend on arrival order
        batch, self.queued = sorted(self.queued, key=lambda r: r[0]), []
        if not batch:
            return []
        _, prompts, samplings, budgets, seeds = zip(*batch)
        gens = self.generate(list(prompts), samplings[0], list(budgets),
                             None if seeds[0] is None else list(seeds))
        return [(request_id, gen) for (request_id, *_), gen in zip(batch, gens)]

    @torch.no_grad()
    def generate(self, prompts, sampling, max_new_tokens=None, seeds=None):
        """
        As VLLMEngine.generate. Each step samples from softmax(logits / T), restricted to the top_p
        nucleus (logprobs.nucleus_mask, vLLM's rule) and renormalised when top_p < 1 (greedy: the
        argmax), and keeps the chosen token's logprob under that distribution in fp32 (greedy: softmax
        of the raw logits), as vLLM reports it. The model's generation_config (repetition penalty,
        top_k, eos ids, ...) plays no part. One generator samples the whole batch: seeded by seeds[0]
        when seeds are given, else by the engine's counter (seed, seed + 1, ... one per call); so,
        unlike vLLM's per-row seeds, a row's sample depends on the batch it is in.
        """
        budgets = max_new_tokens or [sampling.max_new_tokens] * len(prompts)
        temperature = 1.0 if sampling.greedy else sampling.temperature
        generator = torch.Generator(self.device)
        if seeds:
            generator.manual_seed(seeds[0])
        else:
            generator.manual_seed(self.generator_seed)
            self.generator_seed += 1
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        for i, p in enumerate(prompts):
            input_ids[i, width - len(p):] = torch.tensor(p)
            attention_mask[i, width - len(p):] = 1
        input_ids, attention_mask = input_ids.to(self.device), attention_mask.to(self.device)  # [B, W]
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # [B, W]: from each row's first token
        rows = [[] for _ in prompts]    # each row's sampled ids, up to where it stopped
        finish = [None] * len(prompts)  # and why it stopped
        # the most tokens a stop string's characters span
        tail = max(map(len, self.stop_strings), default=0) + 1
        cache, new_logprobs = None, []                                # per step: [B]
        for step in range(max(budgets)):
            # The model makes a DynamicCache on the first call (the prompts); each later call feeds
            # one token per row and the cache grows by one position. Only the last position's logits.
            out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             past_key_values=cache, use_cache=True, logits_to_keep=1)
            cache = out.past_key_values
            logprobs = torch.log_softmax(out.logits[:, -1].float() / temperature, -1)   # [B, V]
            # the nucleus, renormalised: the distribution sampled from
            if not sampling.greedy and sampling.top_p < 1.0:
                logprobs = torch.log_softmax(
                    logprobs.masked_fill(~nucleus_mask(logprobs.exp(), sampling.top_p), -torch.inf), -1)
            if sampling.greedy:
                next_ids = logprobs.argmax(-1)                                          # [B]
            else:
                next_ids = torch.multinomial(logprobs.exp(), 1, generator=generator).squeeze(-1)
            new_logprobs.append(logprobs.gather(-1, next_ids[:, None]).squeeze(-1))
            # A finished row keeps decoding (its extra tokens are dropped) until every row is done.
            for i, token in enumerate(next_ids.tolist()):
                if finish[i] is None:
                    rows[i].append(token)
                    text = self.tokenizer.decode(rows[i][-tail:]) if self.stop_strings else ""
                    if token in self.stop_ids or any(tag in text for tag in self.stop_strings):
                        finish[i] = "stop"
                    elif step + 1 >= budgets[i]:
                        finish[i] = "length"
            if all(finish):
                break
            input_ids = next_ids[:, None]                                               # [B, 1]
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones(len(prompts), 1)], -1)
            position_ids = position_ids[:, -1:] + 1
        new_logprobs = torch.stack(new_logprobs, 1).tolist()                            # [B, S]
        return [Generation(ids, lps[:len(ids)], why) for ids, lps, why in zip(rows, new_logprobs, finish)]

    @torch.no_grad()
    def load_weights(self, named_tensors):
        """Copy the trainer's tensors into the weights, wherever they are (asleep: the CPU)."""
        params = dict(self.model.named_parameters())
        for name, tensor in named_tensors:
            if name not in params:
                if name == "lm_head.weight" and self.model.config.tie_word_embeddings:
                    continue
                raise KeyError(f"HFEngine.load_weights: unknown parameter {name!r}")
            params[name].copy_(tensor.to(params[name].device, params[name].dtype))

    def sleep(self):
        """Give the device to training: the weights wait on the CPU (the KV cache only lives in generate)."""
        self.model.to("cpu")

    def wake(self, tags=None):
        """Weights back on the device when tags is None or names "weights" (no KV cache outside generate)."""
        if tags is None or "weights" in tags:
            self.model.to(self.device)


def make_engine(kind, model_path, tokenizer, max_model_len, dtype="bfloat16", gpu_memory_utilization=0.5,
                tensor_parallel_size=1, seed=0, compile=True):
    """The engine the config asks for. 'auto' is vLLM where it is installed, else the fallback;
    'vllm' refuses clearly when vLLM is not installed. compile: vLLM's (the fallback runs eager)."""
    stop_ids, strings = stop_token_ids(tokenizer), stop_strings(tokenizer)
    has_vllm = importlib.util.find_spec("vllm") is not None
    if kind == "auto":
        kind = "vllm" if has_vllm else "hf"
    if kind == "vllm":
        if not has_vllm:
            raise RuntimeError("rollout.engine=vllm but vLLM is not installed here; use rollout.engine=hf")
        return VLLMEngine(model_path, stop_ids, max_model_len, dtype, gpu_memory_utilization,
                          tensor_parallel_size, seed, compile, strings)
    if kind == "hf":
        return HFEngine(model_path, stop_ids, pad_token_id(tokenizer), dtype, seed=seed, stop_strings=strings,
                        tokenizer=tokenizer)
    raise ValueError(f"unknown engine {kind!r}; valid: auto, vllm, hf")
