"""
Training speed (prints figures; asserts nothing).

    python bench/bench_train.py                 # CPU: the tiny config end to end, time per phase (grpo, ppo, ppo.credit=step,
                                                #   each turn with its own context: rollout.context=last_k)
    python bench/bench_train.py --update-only   # GPU: update tokens/s and MFU, Qwen2.5-1.5B shape

1. End to end (CPU or GPU): runs train.py on the tiny preset for a few steps in a subprocess and
   reports, from its metrics.jsonl, the median time of each phase (rollout, logprob/value
   passes, update, weight push) and tokens/s, skipping the first step (engine warm-up).
2. Update only (GPU): a Qwen2.5-1.5B-shaped model with random weights, FSDP2 on one GPU, bf16
   compute: forward + backward of the policy loss over micro-batches of random tokens; tokens/s
   and MFU = 6 * params * tokens/s / peak bf16 FLOP/s (H100 SXM dense: 989e12).
"""

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def end_to_end(steps, algo, nproc, credit="token", context="full"):
    run_dir = tempfile.mkdtemp()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={port}",
           os.path.join(ROOT, "train.py"), "--config=tiny", f"algo={algo}", f"ppo.credit={credit}", f"steps={steps}", f"run_dir={run_dir}",
           f"rollout.context={context}", "rollout.keep_turns=1",
           "train.warm_start_steps=30", "train.tool_call_reward=0.1",
           "grpo.drop_uniform_groups=false"]  # the tiny model's groups are mostly uniform: time an update that runs
    subprocess.run(cmd, check=True, capture_output=True, cwd=ROOT, timeout=900,
                   env={**os.environ, "OMP_NUM_THREADS": str(max(1, os.cpu_count() // nproc))})
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl")) if '"time/step"' in line][1:]
    med = lambda k: statistics.median(r[k] for r in rows)  # noqa: E731
    total = med("time/step")
    parts = " | ".join(f"{k[5:]} {med(k):.2f}s ({med(k) / total:.0%})" for k in ["time/rollout", "time/forward", "time/update", "time/push"])
    variant = "".join([f" ({credit}-level credit)" if credit != "token" else "", f" (context {context}, K=1)" if context != "full" else ""])
    print(f"tiny {algo}{variant} x{nproc} ranks, median of {len(rows)} steps: step {total:.2f}s | {parts} | "
          f"{med('tokens_per_s'):.0f} tokens/s ({med('action_tokens_per_s'):.0f} action tokens/s), "
          f"{statistics.median(r['tokens_per_s'] * r['time/step'] for r in rows):.0f} tokens per step")


def update_only(micro_tokens=16384, seq_len=2048, steps=5):
    import torch
    import torch.distributed as dist
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from nanoagent import rl
    from nanoagent.common import init_distributed
    from nanoagent.model import policy_forward, shard
    _, world, device = init_distributed()
    config = Qwen2Config(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32768, tie_word_embeddings=True)
    with torch.device(device):
        model = Qwen2ForCausalLM(config)
    n_params = sum(p.numel() for p in model.parameters())
    model = shard(model, torch.bfloat16, activation_checkpointing=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    rows = micro_tokens // seq_len
    ids = torch.randint(0, config.vocab_size, (rows, seq_len), device=device)
    attn = torch.ones_like(ids)
    mask = torch.ones(rows, seq_len, device=device)
    times = []
    for step in range(steps + 1):
        torch.cuda.synchronize()
        t = time.perf_counter()
        logprobs, _ = policy_forward(model, ids, attn)
        loss, _ = rl.ppo_policy_loss(logprobs, logprobs.detach(), torch.randn_like(mask), mask)
        (rl.aggregate_loss(loss, mask, "token_mean", mask.sum(), rows) * world).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if step:
            times.append(time.perf_counter() - t)
    sec = statistics.median(times)
    state_bytes = sum(p.to_local().numel() * p.element_size() * 4 for p in model.parameters())  # fp32 weight, grad, Adam m and v
    tps = rows * seq_len / sec
    peak = torch.cuda.max_memory_allocated()
    print(f"update, Qwen2.5-1.5B shape ({n_params / 1e9:.2f}B params), {rows}x{seq_len} tokens per step, {world} GPU(s), bf16 + "
          f"activation checkpointing: {sec:.3f}s/step, {tps:,.0f} tokens/s per GPU, MFU {6 * n_params * tps / 989e12:.1%} "
          f"(6 x params x tokens/s over the H100 SXM dense bf16 peak of 989 TFLOP/s, the recompute not counted), "
          f"peak memory {peak / 2**30:.1f} GiB ({(peak - state_bytes) / (rows * seq_len) / 2**10:.0f} KiB per micro-batch token "
          f"beyond the {state_bytes / 2**30:.1f} GiB of weights, gradients and optimizer state)")
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--update-only", action="store_true")
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    if args.update_only:
        update_only()
    else:
        for algo, credit, context in (("grpo", "token", "full"), ("grpo", "token", "last_k"), ("ppo", "token", "full"),
                                      ("ppo", "step", "full"), ("ppo", "step", "last_k")):
            for nproc in (1, 2):
                end_to_end(args.steps, algo, nproc, credit, context)
