"""
LoRA against full fine-tuning at SmolLM2-135M's shape (prints figures; asserts nothing).

    python bench/bench_lora.py            # 1. the trainer's side: full fine-tuning, LoRA ranks 1, 8, 32
    python bench/bench_lora.py --engine   # 2. the engine's side: merged weights pushed, or vLLM's adapters
    python bench/bench_lora.py --estimate # 3. memory on one GPU at Qwen2.5-7B-Instruct's shape (arithmetic)

1. Each variant in a process of its own (a fresh peak resident set), SmolLM2-135M-Instruct in fp32 as
   make demo-smollm2 trains it (build_models with its preset, lora_rank changed), on a batch shaped
   like the demo's: 8 GRPO groups of 4 samples, a 250-token prompt per group and 160 tokens of each
   sample's own (a 40-token search, a 100-token tool result, a 20-token answer; 7,120 tokens computed,
   the prompt once a group), packed in micro-batches of 1,024 tokens. Medians of 3 of: the old-logprob pass, the update (forward and
   backward of the policy loss, then AdamW) and the merged weights gathered for the push; the peak
   resident set of the process and what the optimizer holds. The rollout is the same for every variant
   (the engine runs merged weights, the same model): a step's time is the rollout's plus these.
2. The engine (vLLM's CPU build, fp32), an adapter of rank 8 with B away from 0, in turn: (a) merged
   weights pushed (engine.load_weights, as train.py does), (b) vLLM's own LoRA (enable_lora): the
   adapter written in peft's format and a new LoRARequest, loaded at its first request. For each: the
   push (median of 3), the engine's time for the demo's batch (32 prompts of 250 tokens, 48 new
   tokens each, median of 3) and the largest difference of its logprobs from the trainer's.
3. An estimate, not a measurement (no GPU here): the GPU memory of --config=hotpotqa-7b-lora on one GPU,
   from Qwen2.5-7B-Instruct's shape (its parameters and adapters counted on the meta device) and that
   preset's settings, full fine-tuning beside it. The trainer: the frozen base in bf16 (LoRA) or fp32
   master weights, gradients and AdamW's two moments (full); the adapters in fp32 with theirs; the
   activations of a micro-batch with every layer checkpointed (each layer's bf16 input kept, one layer's
   intermediates recomputed at a time: ~(8 H + 4 I) bytes per token). The engine: its bf16 weights and
   the KV cache that rollout.gpu_memory_utilization leaves it; asleep during the update (vLLM's sleep
   mode frees both on a GPU).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
RANKS = (0, 1, 8, 32)  # 0: full fine-tuning
QWEN_7B = dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
               num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=32768,
               tie_word_embeddings=False)


def demo_batch(vocab, seed=0):
    """(rows, action masks) shaped like make demo-smollm2's batch (see the docstring)."""
    import random
    rng = random.Random(seed)
    ids = lambda n: [rng.randrange(3, vocab) for _ in range(n)]  # noqa: E731
    rows, masks = [], []
    for group in range(8):
        prompt = ids(250)
        for _ in range(4):
            tokens, mask = list(prompt), [0] * 250
            for length, acts in ((40, 1), (100, 0), (20, 1)):
                tokens, mask = tokens + ids(length), mask + [acts] * length
            rows.append(tokens)
            masks.append(mask)
    return rows, masks


def trainer_side(rank):
    """One variant's figures, as a JSON line (run in a process of its own)."""
    import torch

    from bench.bench_memory import rss_now
    from bench.timing import median_time
    from nanoagent import rl
    from nanoagent.batch import micro_batches, pack, packed_layout, pad_rows, shared_prompts
    from nanoagent.common import init_distributed
    from nanoagent.config import make_config
    from nanoagent.model import build_models, forward_all, full_tensors, old_policy_forward, policy_forward
    from nanoagent.smollm2 import ensure_smollm2
    from nanoagent.update import optimizer_step
    path = ensure_smollm2()
    _, _, device = init_distributed()
    cfg = make_config("demo-smollm2", [f"train.lora_rank={rank}", "algo=grpo"])
    models, _, optimizers = build_models(cfg, path, None, device)
    policy, optimizer = models["policy"], optimizers["policy"]
    rows, masks = demo_batch(policy.config.vocab_size)
    batch = {"input_ids": pad_rows(rows, 0), **shared_prompts(rows, masks),
             "action_mask": pad_rows(masks, 0, torch.float32), "lengths": [len(r) for r in rows]}
    budget, every = cfg.train.micro_batch_tokens, list(range(len(rows)))
    prompts = list(zip(batch["prompt"].tolist(), batch["prompt_length"].tolist()))
    actions = batch["action_mask"].sum().item()

    def old_logprobs():
        forward_all(lambda *packed: old_policy_forward(policy, *packed, 1.0, 1.0), batch, every, budget,
                    device, per_token=(2,))

    def update():
        loss_sum = 0.0
        for idx in micro_batches(batch["lengths"], budget, prompts):
            get = lambda key: pack(batch, key, packed_layout(batch, idx), device)  # noqa: E731
            mask = get("action_mask")
            logprobs = policy_forward(policy, get("input_ids"), get("position_ids"), mask > 0)[0]
            loss, _ = rl.ppo_policy_loss(logprobs, logprobs.detach(), torch.randn_like(mask), mask)
            loss = rl.aggregate_loss(loss, mask, "token_mean", actions, None)
            loss.backward()
            loss_sum += loss.item()
        optimizer_step(policy, optimizer, loss_sum, cfg.train.grad_clip)

    def push():
        for _ in full_tensors(policy):
            pass

    figures = {"rank": rank, "old_logprobs_s": median_time(old_logprobs, 3), "update_s": median_time(update, 3),
               "push_s": median_time(push, 3), "peak_rss": rss_now()[1],
               "trained": sum(p.numel() for p in policy.parameters() if p.requires_grad),
               "tokens": int(sum(len(r) for r in rows)), "micro_batches": len(micro_batches(batch["lengths"], budget,
                                                                                            prompts))}
    print(json.dumps(figures), flush=True)


def trainer_table():
    print("1. the trainer's side, SmolLM2-135M-Instruct fp32, make demo-smollm2's batch (8 groups x 4 samples, "
          "a shared 250-token prompt and 160 tokens each, micro-batches of 1,024 tokens), 1 CPU rank, "
          "each variant in a process of its own, medians of 3", flush=True)
    results = []
    for rank in RANKS:
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), f"--variant={rank}"], capture_output=True,
                              text=True, cwd=ROOT)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        if proc.returncode or not lines:
            print(f"rank {rank}: failed\n{proc.stderr[-2000:]}")
            continue
        results.append(json.loads(lines[-1]))
    full = results[0]
    for r in results:
        name = "full fine-tuning" if r["rank"] == 0 else f"LoRA rank {r['rank']:>2}"
        print(f"  {name:<17} trains {r['trained'] / 1e6:7.3f}M params | old logprobs {r['old_logprobs_s']:.2f}s | "
              f"update {r['update_s']:.2f}s ({full['update_s'] / r['update_s']:.2f}x full's speed) | "
              f"push gather {r['push_s']:.3f}s | trainer per step {r['old_logprobs_s'] + r['update_s'] + r['push_s']:.2f}s | "
              f"peak RSS {r['peak_rss'] / 2**30:.2f} GiB | {r['tokens']} tokens, {r['micro_batches']} micro-batches",
              flush=True)


def engine_side(rank=8, repeats=3):
    import torch
    from peft import inject_adapter_in_model
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    from nanoagent.checkpoint import save_adapter
    from nanoagent.config import make_config
    from nanoagent.engine import SamplingConfig, VLLMEngine, stop_token_ids
    from nanoagent.model import PACKED, Policy, full_tensors, lora_config, policy_forward
    from nanoagent.smollm2 import ensure_smollm2
    path = ensure_smollm2()
    tok = AutoTokenizer.from_pretrained(path)
    lora = lora_config(make_config("demo-smollm2", [f"train.lora_rank={rank}"]).train)
    lm = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=PACKED)
    inject_adapter_in_model(lora, lm.model)
    policy = Policy(lm, lora).eval()
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, 0.01)
    rows, _ = demo_batch(policy.config.vocab_size)
    prompts = [r[:250] for r in rows]
    sampling = SamplingConfig(max_new_tokens=48, temperature=1.0)

    def diff(gens):  # the largest |engine - trainer| logprob over the sampled tokens
        worst = 0.0
        for prompt, gen in zip(prompts, gens):
            ids = torch.tensor(prompt + list(gen.token_ids))[None]
            positions = torch.arange(ids.shape[1])[None]
            with torch.no_grad():
                trainer = policy_forward(policy, ids, positions, positions >= len(prompt))[0][0, len(prompt):]
            worst = max(worst, (torch.tensor(gen.logprobs) - trainer).abs().max().item())
        return worst

    def timed(fn):
        start = time.perf_counter()
        out = fn()
        return time.perf_counter() - start, out

    engine = VLLMEngine(path, stop_token_ids(tok), max_model_len=1024, dtype="float32", seed=0, compile=False)
    pushes = [timed(lambda: engine.load_weights(full_tensors(policy)))[0] for _ in range(repeats)]
    runs = [timed(lambda: engine.generate(prompts, sampling, seeds=list(range(len(prompts))))) for _ in range(repeats)]
    merged = (statistics.median(pushes), statistics.median(t for t, _ in runs), diff(runs[-1][1]))

    # vLLM's own adapters: the same LLM settings, enable_lora
    llm = engine.llm
    del engine, llm
    from vllm import LLM
    from vllm.distributed import cleanup_dist_env_and_memory
    cleanup_dist_env_and_memory()
    llm = LLM(model=path, dtype="float32", seed=0, max_model_len=1024, enforce_eager=True, logprobs_mode="processed_logprobs",
              enable_prefix_caching=True, enable_chunked_prefill=False, max_num_batched_tokens=1024,
              kv_cache_memory_bytes=512 * 2**20, enable_lora=True, max_lora_rank=rank, max_loras=1)
    params = [SamplingParams(max_tokens=48, temperature=1.0, logprobs=0, seed=i, stop_token_ids=stop_token_ids(tok))
              for i in range(len(prompts))]
    full = {name: p.detach() for name, p in policy.named_parameters()}
    with tempfile.TemporaryDirectory() as tmp:
        pushes, requests = [], []
        for i in range(repeats):  # a push: the adapter written, a new request id, loaded at its first request
            folder = os.path.join(tmp, f"v{i}")
            start = time.perf_counter()
            save_adapter(full, lora, path, folder)
            request = LoRARequest(f"v{i}", i + 1, folder)
            llm.generate([TokensPrompt(prompt_token_ids=prompts[0][:8])], SamplingParams(max_tokens=1),
                         lora_request=request, use_tqdm=False)
            pushes.append(time.perf_counter() - start)
            requests.append(request)
        tokens = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        runs = [timed(lambda: llm.generate(tokens, params, lora_request=requests[-1], use_tqdm=False))
                for _ in range(repeats)]
    gens = [type("Gen", (), {"token_ids": list(o.outputs[0].token_ids),
                             "logprobs": [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]})
            for o in runs[-1][1]]
    adapters = (statistics.median(pushes), statistics.median(t for t, _ in runs), diff(gens))
    print(f"2. the engine's side, SmolLM2-135M-Instruct fp32, LoRA rank {rank}, vLLM {__import__('vllm').__version__} "
          f"CPU, 32 prompts of 250 tokens x 48 new tokens, medians of {repeats}", flush=True)
    for name, (push, run, worst) in (("merged weights pushed", merged), ("vLLM's LoRA (enable_lora)", adapters)):
        print(f"  {name:<26} push {push:.3f}s | engine {run:.2f}s for the batch | "
              f"max |engine - trainer| logprob {worst:.1e}", flush=True)


def estimate(gpu_bytes=80e9):
    import torch
    from transformers import Qwen2Config

    from nanoagent.config import make_config
    from nanoagent.model import empty_lm, lora_config
    cfg = make_config("hotpotqa-7b-lora", [])
    config = Qwen2Config(**QWEN_7B)
    lm = empty_lm(config, torch.float32, lora_config(cfg.train))
    adapters = sum(p.numel() for n, p in lm.named_parameters() if ".lora_" in n)
    base = sum(p.numel() for n, p in lm.named_parameters() if ".lora_" not in n)
    H, I, L = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    tokens = cfg.train.micro_batch_tokens
    activations = tokens * (L * H * 2 + 8 * H + 4 * I)
    engine = cfg.rollout.gpu_memory_utilization * gpu_bytes
    kv_per_token = 2 * L * config.num_key_value_heads * (H // config.num_attention_heads) * 2
    GB = 1e9
    print(f"3. an estimate (arithmetic, no GPU here): --config=hotpotqa-7b-lora on one {gpu_bytes / GB:.0f} GB GPU, "
          f"Qwen2.5-7B-Instruct's shape ({base / 1e9:.2f}B parameters), LoRA rank {cfg.train.lora_rank} on every "
          f"linear layer of attention and MLP ({adapters / 1e6:.1f}M parameters)")
    for name, weights in (("LoRA", base * 2 + adapters * 16), ("full fine-tuning", base * 16)):
        rollout = weights + engine
        update = weights + activations
        print(f"  {name:<17} trainer state {weights / GB:6.1f} GB | + engine (weights {base * 2 / GB:.1f} GB, KV cache "
              f"{(engine - base * 2) / GB:.1f} GB = {(engine - base * 2) / kv_per_token / 1e3:.0f}k tokens) in the "
              f"rollout: {rollout / GB:.1f} GB | + activations ({tokens} tokens a micro-batch, every layer "
              f"checkpointed, {activations / GB:.1f} GB) in the update: {update / GB:.1f} GB | "
              f"{'fits' if max(rollout, update) < gpu_bytes else 'does not fit'}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", action="store_true", help="the engine's side (2.)")
    parser.add_argument("--estimate", action="store_true", help="memory at Qwen2.5-7B's shape (3.)")
    parser.add_argument("--variant", type=int, default=None, help=argparse.SUPPRESS)  # one variant, in its process
    args = parser.parse_args()
    if args.variant is not None:
        trainer_side(args.variant)
    elif args.engine:
        engine_side()
    elif args.estimate:
        estimate()
    else:
        trainer_table()
