"""
Speed and memory of the RL math on this machine (prints figures; asserts nothing).

    python bench/bench_rl.py            # CPU; on a GPU machine it runs there

- masked_gae over a [B, T] batch: the Python loop over T is the cost; reported per call.
- logprobs_and_entropy (chunked, fp32 per chunk, recomputing backward) against the naive
  log_softmax over the full [N, V] tensor in fp32: time, and peak memory measured in a fresh
  subprocess per variant (max RSS on CPU, max allocated on CUDA) so the two do not share a peak.
"""

import json
import subprocess
import sys
import time

import torch

sys.path.insert(0, __file__.rsplit("/bench/", 1)[0])
from nanoagent import rl  # noqa: E402
from nanoagent.common import median_time  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def logprob_variant(variant, N, V, dtype):
    """Run one forward+backward of a variant and return (seconds, peak bytes) — in this process."""
    import resource
    torch.manual_seed(0)
    logits = torch.randn(N, V, device=DEVICE, dtype=dtype, requires_grad=True)
    labels = torch.randint(0, V, (N,), device=DEVICE)
    if DEVICE == "cuda":
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if DEVICE == "cuda" else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def step():
        if variant == "chunked":
            lp, h = rl.logprobs_and_entropy(logits, labels)
        else:
            logp = torch.log_softmax(logits.float(), -1)
            lp, h = logp.gather(-1, labels[:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)
        (lp.sum() + h.sum()).backward()
        logits.grad = None

    seconds = median_time(step, repeats=3)
    peak = torch.cuda.max_memory_allocated() if DEVICE == "cuda" else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return seconds, peak - base


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--variant":
        _, _, variant, N, V, dtype = sys.argv
        print(json.dumps(logprob_variant(variant, int(N), int(V), getattr(torch, dtype))))
        return
    print(f"device: {DEVICE}, torch {torch.__version__}, threads {torch.get_num_threads()}")
    for B, T in [(64, 1024), (64, 4096)]:
        rewards = torch.zeros(B, T, device=DEVICE)
        values = torch.randn(B, T, device=DEVICE)
        mask = (torch.rand(B, T, device=DEVICE) > 0.3).float()
        rewards[:, -1] = 1.0
        mask[:, -1] = 1.0
        t = median_time(lambda: rl.masked_gae(rewards, values, mask, 1.0, 1.0))
        print(f"masked_gae B={B} T={T}: {t * 1e3:.1f} ms ({B * T / t / 1e6:.2f} M tokens/s)")
    scores = torch.rand(4096, device=DEVICE)
    groups = torch.arange(4096, device=DEVICE) // 8
    print(f"grpo_advantages B=4096 G=8: {median_time(lambda: rl.grpo_advantages(scores, groups)) * 1e3:.2f} ms")
    N, V = (8192, 151936) if DEVICE == "cuda" else (1024, 151936)
    dtype = "bfloat16"
    results = {}
    for variant in ("naive", "chunked"):
        out = subprocess.run([sys.executable, __file__, "--variant", variant, str(N), str(V), dtype], capture_output=True, text=True, check=True)
        results[variant] = json.loads(out.stdout.strip().splitlines()[-1])
    for variant, (seconds, peak) in results.items():
        print(f"logprobs+entropy fwd+bwd {variant:>7} N={N} V={V} {dtype}: {seconds * 1e3:.0f} ms, peak extra memory {peak / 2**20:.0f} MiB")
    ratio = results["naive"][1] / max(results["chunked"][1], 1)
    print(f"peak memory naive/chunked: {ratio:.2f}x; time chunked/naive: {results['chunked'][0] / results['naive'][0]:.2f}x")


if __name__ == "__main__":
    main()
