"""
Memory of the trainer (prints figures; asserts nothing).

    python bench/bench_memory.py                 # both parts, CPU or GPU
    python bench/bench_memory.py --logprobs      # part 1 only
    python bench/bench_memory.py --loading       # part 2 only (writes a 3 GB checkpoint to a temp folder)

1. Logprobs, per micro-batch token. A random-weight model with Qwen2.5's vocabulary (151,936) and a
   small body, computing in bf16: the peak extra memory of one forward + policy-loss backward
   through nanoagent.model.policy_forward (packed rows, every token but the first of each row an
   action: the most logits there can be; fewer actions, fewer logits), against the textbook way (slice the logits, divide by
   the temperature, fp32 log_softmax, gather, entropy) as a baseline in the same script. Measured
   at two micro-batch sizes in fresh processes (peak RSS on a CPU, max allocated on a GPU); the
   slope is the cost per token, also given in bf16 logits rows (2 x V bytes): the logits
   themselves are one.
2. Loading, peak host memory per rank. A random Qwen2.5-1.5B-shaped checkpoint in bf16 (as Qwen
   ships it), loaded as a GRPO run with a KL term does (policy + reference) by 2 ranks under
   torchrun: nanoagent.model's meta-device build filled by broadcast from rank 0, against every
   rank calling from_pretrained in fp32 and sharding afterwards. On a CPU a rank's own shards live
   in host memory too (on a GPU they would not): the figure beyond them is what loading costs.
"""

import argparse
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from nanoagent import model as nanoagent_model  # noqa: E402

QWEN_VOCAB = 151936
QWEN_1_5B = dict(vocab_size=QWEN_VOCAB, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, max_position_embeddings=32768, tie_word_embeddings=True)


def peak_bytes():
    """The peak memory so far: GPU allocations, or this process's peak resident set on a CPU."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def unfused_logprobs(model, ids, attn, temperature):
    """The textbook way, for comparison: every line below copies the [B, L, V] logits."""
    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1] / temperature
    logp = torch.log_softmax(logits.float(), -1)
    return logp.gather(-1, ids[:, 1:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


def logprob_peak(variant, rows, width):
    """Peak extra bytes of one forward + backward of the policy loss on a [rows, width] micro-batch."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    device = "cuda" if torch.cuda.is_available() else "cpu"
    config = Qwen2Config(vocab_size=QWEN_VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=64, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM._from_config(config, attn_implementation=nanoagent_model.PACKED if variant == "nanoagent" else "sdpa")
    model = model.to(device=device, dtype=torch.bfloat16).train()

    def step(ids):
        if variant == "nanoagent":  # the rows packed, every token but each row's first an action (the most logits there can be)
            positions = torch.arange(ids.shape[1], device=device).repeat(ids.shape[0])[None]
            logprobs = nanoagent_model.policy_forward(model, ids.flatten()[None], positions, positions > 0, 0.7)[0]
        else:
            logprobs, _ = unfused_logprobs(model, ids, torch.ones_like(ids), 0.7)
        (-logprobs.sum()).backward()  # entropy_coef = 0: the entropy is only logged
        model.zero_grad(set_to_none=True)
    step(torch.randint(0, QWEN_VOCAB, (1, 8), device=device))  # kernels, allocator and gradients warmed on a tiny batch
    before = peak_bytes()
    step(torch.randint(0, QWEN_VOCAB, (rows, width), device=device))
    return peak_bytes() - before


def measure_logprobs():
    print(f"1. logprobs: peak extra memory per micro-batch token, V={QWEN_VOCAB}, bf16 "
          f"({'GPU' if torch.cuda.is_available() else 'CPU, peak RSS'}); one bf16 logits row = {2 * QWEN_VOCAB / 2**10:.0f} KiB")
    shapes = [(2, 512), (4, 512)]
    for variant in ("unfused", "nanoagent"):
        peaks = []
        for rows, width in shapes:
            out = subprocess.run([sys.executable, __file__, "--logprob-run", variant, str(rows), str(width)],
                                 capture_output=True, text=True, check=True)
            peaks.append(int(out.stdout.strip().splitlines()[-1]))
        tokens = [r * w for r, w in shapes]
        per_token = (peaks[1] - peaks[0]) / (tokens[1] - tokens[0])
        print(f"   {variant:>9}: {peaks[0] / 2**20:7.0f} MiB at {tokens[0]} tokens, {peaks[1] / 2**20:7.0f} MiB at {tokens[1]}: "
              f"{per_token / 2**10:6.0f} KiB per token = {per_token / (2 * QWEN_VOCAB):.2f} bf16 logits rows")


def loading_peak(variant, path):
    """Under torchrun: build policy + reference the way `variant` does; print this rank's peak RSS."""
    import torch.distributed as dist
    dist.init_process_group("gloo")
    device = torch.device("cpu")
    if variant == "nanoagent":
        config, weights = nanoagent_model.training_config(path), nanoagent_model.read_weights(path)
        models = [nanoagent_model.build_policy(config, weights, device, torch.bfloat16, activation_checkpointing=True),
                  nanoagent_model.build_reference(config, weights, device, torch.bfloat16)]
    else:  # every rank: the whole model in fp32 on the host, then sharded (what train.py did before)
        models = [nanoagent_model.shard(nanoagent_model.load_causal_lm(path).to(device), torch.bfloat16, True),
                  nanoagent_model.shard(nanoagent_model.load_causal_lm(path).to(device), torch.bfloat16).requires_grad_(False)]
    shards = sum(p.to_local().numel() * p.element_size() for m in models for p in m.parameters())
    print(json.dumps({"rank": dist.get_rank(), "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "shards": shards}),
          flush=True)
    dist.destroy_process_group()


def measure_loading():
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM
    from nanoagent.tiny import ensure_tiny_model
    with tempfile.TemporaryDirectory() as path:
        torch.manual_seed(0)
        with torch.device("meta"):
            shape = Qwen2ForCausalLM(Qwen2Config(**QWEN_1_5B))
        n_params = sum(p.numel() for p in shape.parameters())
        model = Qwen2ForCausalLM(Qwen2Config(**QWEN_1_5B, dtype=torch.bfloat16)).to(torch.bfloat16)
        model.save_pretrained(path)
        AutoTokenizer.from_pretrained(ensure_tiny_model()).save_pretrained(path)
        del model
        print(f"2. loading policy + reference, Qwen2.5-1.5B shape ({n_params / 1e9:.2f}B parameters, bf16 checkpoint "
              f"{n_params * 2 / 2**30:.1f} GiB), 2 ranks under torchrun (gloo): peak host memory per rank")
        for variant in ("from_pretrained", "nanoagent"):
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={port}",
                                  __file__, "--loading-run", variant, path], capture_output=True, text=True, check=True,
                                 env={**os.environ, "OMP_NUM_THREADS": "1"})
            peaks = sorted((json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")), key=lambda r: r["rank"])
            per_rank = ", ".join(f"rank {r['rank']} {r['peak_rss'] / 2**30:.1f} GiB ({(r['peak_rss'] - r['shards']) / 2**30:.1f} beyond "
                                 f"its own {r['shards'] / 2**30:.1f} GiB of shards)" for r in peaks)
            print(f"   {variant:>15}: {per_rank}; median {statistics.median(r['peak_rss'] for r in peaks) / 2**30:.1f} GiB")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--logprobs", action="store_true")
    parser.add_argument("--loading", action="store_true")
    parser.add_argument("--logprob-run", nargs=3, metavar=("VARIANT", "ROWS", "WIDTH"), help=argparse.SUPPRESS)
    parser.add_argument("--loading-run", nargs=2, metavar=("VARIANT", "PATH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.logprob_run:
        variant, rows, width = args.logprob_run
        print(logprob_peak(variant, int(rows), int(width)))
    elif args.loading_run:
        loading_peak(*args.loading_run)
    else:
        if args.logprobs or not args.loading:
            measure_logprobs()
        if args.loading or not args.logprobs:
            measure_loading()
