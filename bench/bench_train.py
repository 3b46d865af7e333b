"""
Training speed (prints figures; asserts nothing).

    python bench/bench_train.py                 # CPU: the tiny config end to end, time per phase (grpo, ppo,
                                                #   ppo.credit=step, each turn with its own context:
                                                #   rollout.context=last_k)
    python bench/bench_train.py --packing       # CPU or GPU: the update's tokens/s, packed against padded,
                                                #   in one process
    python bench/bench_train.py --packing --shape=qwen2.5-1.5b   # GPU: the same at Qwen2.5-1.5B's shape, bf16
    python bench/bench_train.py --update-only   # GPU: update tokens/s and MFU, Qwen2.5-1.5B shape, each lever
    python bench/bench_train.py --update-only --shape=tiny   # CPU: the same code on a small body (a dry run)
    python bench/bench_train.py --head          # CPU or GPU: the fused LM head + logprob against the
                                                #   textbook way
    python bench/bench_train.py --balance       # CPU: 2 ranks rolling out unevenly, with and without
                                                #   train.balance_ranks

1. End to end (CPU or GPU): runs train.py on the tiny preset for a few steps in a subprocess and
   reports, from its metrics.jsonl, the median time of each phase (rollout, logprob/value
   passes, update, weight push) and tokens/s, skipping the first step (engine warm-up).
2. Packing: the policy's forward + backward over a batch of rows, the trainer's way (packed
   micro-batches, the LM head on the action tokens only: nanoagent.model) against the way it was
   before (rows right-padded to the longest of micro-batches of rows x longest <= the budget, the
   LM head and log-softmax over every position, transformers' sdpa attention with a padding mask),
   the same weights, the median of 3 passes each, taken in turn. Three batches: (a) shaped like the tiny
   preset's trajectories (prompt 200-260 tokens, 1-3 turns of a 20-48-token action and a 60-128-token
   tool result), (b) a long-tailed multi-turn mix (a median row of ~400 tokens, one row in ten 8x
   that, 60% of the tokens observations), (c) GRPO groups as TRL's GRPOTrainer is compared on (8
   samples of a prompt of 230-270 tokens, answers of 40-64 tokens: a group's prompt is computed once).
   Each with the tiny model's own vocabulary and with Qwen2.5's (151,936 rows: there the LM head is
   most of the work), or (--shape=qwen2.5-1.5b, for a GPU) with a random model of Qwen2.5-1.5B's shape
   in bf16. Reports the rows' tokens per second (a shared prompt counted once per row, as
   the padded rows compute it), the padding fraction (padded positions computed / real tokens) and
   the ratio.
3. Balance (CPU, 2 ranks of one thread each): train.py with GRPO on tests/uneven_task.py (half the
   prompts open with a 320-token preamble; with data.shuffle=false rank 0 gets those), 16 prompts x 4
   samples a step, one mini-batch, with train.balance_ranks off and on, in turn: the median of each
   phase's time and of rank_imbalance (the busiest rank's trainer tokens over the mean rank's),
   skipping the first step. The moves are made before the forward passes, in the rollout's time.
4. Update only (GPU): a Qwen2.5-1.5B-shaped model with random weights, FSDP2 on one GPU, bf16
   compute: forward + backward of the policy loss over packed micro-batches of random tokens (8 rows
   x 2,048, every token's logprob), then AdamW; tokens/s, MFU = 6 * params * tokens/s / peak bf16
   FLOP/s (H100 and H200 SXM dense: 989e12) and peak memory, for each lever in turn in one process:
   activation checkpointing of every layer, every other one or none, the layers' norms and MLPs
   compiled (train.compile) or eager.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from functools import partial

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
QWEN_1_5B = dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                 num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32768,
                 tie_word_embeddings=True)


def train_steps(nproc, overrides, threads):
    """The metrics of each step of train.py on the tiny preset under torchrun, after the first (engine
    warm-up)."""
    run_dir = tempfile.mkdtemp()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           os.path.join(ROOT, "train.py"), "--config=tiny", f"run_dir={run_dir}", *overrides]
    subprocess.run(cmd, check=True, capture_output=True, cwd=ROOT, timeout=1800,
                   env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    return [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))
            if '"time/step"' in line][1:]


def end_to_end(steps, algo, nproc, credit="token", context="full"):
    rows = train_steps(nproc, [f"algo={algo}", f"ppo.credit={credit}", f"steps={steps}",
                               f"rollout.context={context}", "rollout.keep_turns=1",
                               "train.warm_start_steps=30", "train.tool_call_reward=0.1",
                               # the tiny model's groups are mostly uniform: time an update that runs
                               "grpo.drop_uniform_groups=false"],
                       max(1, os.cpu_count() // nproc))
    med = lambda k: statistics.median(r[k] for r in rows)  # noqa: E731
    total = med("time/step")
    parts = " | ".join(f"{k[5:]} {med(k):.2f}s ({med(k) / total:.0%})"
                       for k in ["time/rollout", "time/forward", "time/update", "time/push"])
    variant = "".join([f" ({credit}-level credit)" if credit != "token" else "",
                       f" (context {context}, K=1)" if context != "full" else ""])
    print(f"tiny {algo}{variant} x{nproc} ranks, median of {len(rows)} steps: step {total:.2f}s | {parts} | "
          f"{med('tokens_per_s'):.0f} tokens/s ({med('action_tokens_per_s'):.0f} action tokens/s), "
          f"{statistics.median(r['tokens_per_s'] * r['time/step'] for r in rows):.0f} tokens per step")


def shaped_batch(kind, rows, vocab, seed=0):
    """(token rows, action masks) of a batch shaped as in the docstring: (a) "tiny" or (b) "long_tail"."""
    import random
    rng = random.Random(seed)
    ids = lambda n: [rng.randrange(3, vocab) for _ in range(n)]  # noqa: E731
    out = []
    for r in range(rows):
        if kind == "tiny":
            tokens, mask = ids(rng.randint(200, 260)), None
            mask = [0] * len(tokens)
            for turn in range(rng.randint(1, 3)):
                action = rng.randint(20, 48)
                tokens, mask = tokens + ids(action), mask + [1] * action
                if turn < 2:
                    observation = rng.randint(60, 128)
                    tokens, mask = tokens + ids(observation), mask + [0] * observation
        # GRPO groups of 8 samples of one prompt: 230-270 prompt tokens, a 40-64-token answer
        elif kind == "groups":
            if r % 8 == 0:
                prompt = ids(rng.randint(230, 270))
            answer = rng.randint(40, 64)
            tokens, mask = prompt + ids(answer), [0] * len(prompt) + [1] * answer
        else:  # a prompt, then turns of 40% action, 60% observation; one row in ten 8x as long
            length = rng.randint(300, 500) * (8 if r % 10 == 9 else 1)
            tokens, mask = ids(60), [0] * 60
            while len(tokens) < length:
                tokens, mask = tokens + ids(40) + ids(60), mask + [1] * 40 + [0] * 60
        out.append((tokens, mask))
    return [t for t, _ in out], [m for _, m in out]


def packing(shape, budget=8192):
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

    from bench.timing import median_time
    from nanoagent.batch import micro_batches, pack, packed_layout, pad_rows, shared_prompts
    from nanoagent.logprobs import head_logprobs
    from nanoagent.model import PACKED, Policy, policy_forward
    from nanoagent.tiny import build_tiny_model
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    def padded_micro_batches(lengths):  # before packing: rows x longest <= budget, longest first
        order, batches, current = sorted(range(len(lengths)), key=lambda i: -lengths[i]), [], []
        for i in order:
            if current and (len(current) + 1) * lengths[current[0]] > budget:
                batches.append(current)
                current = []
            current.append(i)
        return batches + [current]

    def padded_pass(model, rows, masks):
        for idx in padded_micro_batches([len(r) for r in rows]):
            ids = pad_rows([rows[i] for i in idx], 0).to(device)
            attention = pad_rows([[1] * len(rows[i]) for i in idx], 0).to(device)
            mask = pad_rows([masks[i] for i in idx], 0, torch.float32).to(device)
            hidden = model.model(input_ids=ids, attention_mask=attention,
                                 use_cache=False).last_hidden_state[:, :-1]                # [b, l - 1, H]
            # the same fused LM head and logprob as the packed pass, here over every position
            logprobs, _, _ = head_logprobs(hidden.flatten(0, 1), model.lm_head.weight, ids[:, 1:].flatten())
            logprobs = torch.cat([logprobs.new_zeros(len(idx), 1), logprobs.view(len(idx), -1)], 1)
            (-(logprobs * mask).sum() / mask.sum()).backward()
        model.zero_grad(set_to_none=True)

    def packed_pass(model, batch):
        prompts = list(zip(batch["prompt"].tolist(), batch["prompt_length"].tolist()))
        for idx in micro_batches(batch["lengths"], budget, prompts):
            get = lambda key: pack(batch, key, packed_layout(batch, idx), device)  # noqa: E731
            mask = get("action_mask")
            logprobs = policy_forward(model, get("input_ids"), get("position_ids"), mask > 0)[0]
            (-(logprobs * mask).sum() / mask.sum()).backward()
        model.zero_grad(set_to_none=True)

    def models(tmp):  # (name, padded model, packed model with the same weights, rows a batch)
        if shape == "qwen2.5-1.5b":
            torch.manual_seed(0)
            with torch.device(device):
                padded = Qwen2ForCausalLM._from_config(Qwen2Config(**QWEN_1_5B), attn_implementation="sdpa",
                                                       dtype=torch.bfloat16)
                packed = Qwen2ForCausalLM._from_config(Qwen2Config(**QWEN_1_5B), attn_implementation=PACKED,
                                                       dtype=torch.bfloat16)
            packed.load_state_dict(padded.state_dict())
            yield "Qwen2.5-1.5B shape, bf16, vocab", padded.train(), Policy(packed).train(), 32
            return
        for vocab, n_rows in (("tiny", 64), ("qwen", 16)):
            path = build_tiny_model(os.path.join(tmp, vocab), vocab=vocab)
            padded = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa").to(device).train()
            packed = AutoModelForCausalLM.from_pretrained(path, attn_implementation=PACKED)
            packed = Policy(packed).to(device).train()
            yield f"vocab {vocab}", padded, packed, n_rows

    with tempfile.TemporaryDirectory() as tmp:
        for name, padded, packed, n_rows in models(tmp):
            for kind in ("tiny", "long_tail", "groups"):
                rows, masks = shaped_batch(kind, n_rows, padded.config.vocab_size)
                lengths = [len(r) for r in rows]
                batch = {"input_ids": pad_rows(rows, 0), **shared_prompts(rows, masks),
                         "action_mask": pad_rows(masks, 0, torch.float32), "lengths": lengths}
                tokens = sum(lengths)
                computed = sum(len(b) * lengths[b[0]] for b in padded_micro_batches(lengths))
                pairs = [(median_time(lambda: padded_pass(padded, rows, masks), 1),
                          median_time(lambda: packed_pass(packed, batch), 1))
                         for _ in range(3)]  # in turn, so that the machine's load drifts over both alike
                before, after = statistics.median(b for b, _ in pairs), statistics.median(a for _, a in pairs)
                print(f"{kind:>9} batch, {name} ({padded.config.vocab_size}), {n_rows} rows, {tokens} tokens "
                      f"({sum(map(sum, masks)) / tokens:.0%} actions, longest {max(lengths)}), "
                      f"budget {budget}: padded {tokens / before:,.0f} tokens/s "
                      f"(padding {computed / tokens - 1:.0%}), packed {tokens / after:,.0f} tokens/s "
                      f"(padding 0%): {before / after:.2f}x",
                      flush=True)


def update_only(shape, steps=5):
    """The update alone, each lever in turn in this process (a fresh model for each): activation
    checkpointing of every layer, every other one (train.checkpoint_every=2) or none, the layers' norms
    and MLPs compiled (train.compile) or not. The LM head is always fused with the logprob
    (logprobs.head_logprobs). On a CPU, --shape=tiny runs the same code on a small body as a dry run
    (no memory figures)."""
    import torch
    import torch.distributed as dist
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from bench.timing import median_time
    from nanoagent import rl
    from nanoagent.common import init_distributed
    from nanoagent.model import PACKED, Policy, policy_forward, shard
    _, world, device = init_distributed()
    gpu = device.type == "cuda"
    if shape == "qwen2.5-1.5b":
        config, micro_tokens, seq_len = Qwen2Config(**QWEN_1_5B), 16384, 2048
    else:  # Qwen's vocabulary on a small body
        small = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                     num_key_value_heads=1)
        config, micro_tokens, seq_len = Qwen2Config(**{**QWEN_1_5B, **small}), 1024, 256
    rows = micro_tokens // seq_len
    ids = torch.randint(0, config.vocab_size, (1, rows * seq_len), device=device)   # rows packed end to end
    positions = torch.arange(seq_len, device=device).repeat(rows)[None]
    mask = (positions > 0).float()  # every token an action but each row's first: the LM head on all of them

    def update_step(model, opt):
        logprobs = policy_forward(model, ids, positions, mask > 0)[0]
        loss, _ = rl.ppo_policy_loss(logprobs, logprobs.detach(), torch.randn_like(mask), mask)
        (rl.aggregate_loss(loss, mask, "token_mean", mask.sum(), rows) * world).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for checkpointing, compile_layers in ((1, False), (1, True), (2, True), (0, False), (0, True)):
        lever = (f"activation checkpointing {('off', 'every layer', 'every other layer')[checkpointing]}, "
                 f"{'compiled' if compile_layers else 'eager'} norms and MLP")
        torch.manual_seed(0)
        with torch.device(device):
            model = Policy(Qwen2ForCausalLM._from_config(config, attn_implementation=PACKED))
        n_params = sum(p.numel() for p in model.parameters())
        model = shard(model, torch.bfloat16, checkpointing, compile_layers)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
        if gpu:
            torch.cuda.reset_peak_memory_stats()
        try:
            update_step(model, opt)  # warms up (and compiles)
            sec = median_time(partial(update_step, model, opt), steps)
        except torch.OutOfMemoryError:
            print(f"update, {lever}: out of memory", flush=True)
        else:
            # fp32 weight, grad, Adam m and v
            state_bytes = sum(p.to_local().numel() * p.element_size() * 4 for p in model.parameters())
            tps = rows * seq_len / sec
            peak = torch.cuda.max_memory_allocated() if gpu else float("nan")
            print(f"update, {shape} shape ({n_params / 1e9:.2f}B params), {rows}x{seq_len} tokens per step, "
                  f"{world} {'GPU' if gpu else 'CPU rank'}(s), bf16, {lever}: {sec:.3f}s/step, "
                  f"{tps:,.0f} tokens/s per GPU, MFU {6 * n_params * tps / 989e12:.1%} "
                  f"(6 x params x tokens/s over the H100/H200 SXM dense bf16 peak of 989 TFLOP/s, "
                  f"recompute not counted), peak memory {peak / 2**30:.1f} GiB "
                  f"({(peak - state_bytes) / (rows * seq_len) / 2**10:.0f} KiB per micro-batch token "
                  f"beyond the {state_bytes / 2**30:.1f} GiB of weights, gradients and optimizer state)",
                  flush=True)
        del model, opt
        if gpu:
            torch.cuda.empty_cache()
    dist.destroy_process_group()


def head(repeats=5):
    """The LM head and the logprob and entropy of every row, forward + backward: fused
    (logprobs.head_logprobs) against the textbook way (the [N, V] logits, their fp32 log-softmax,
    autograd), taken in turn in this process; the median of each."""
    import torch
    import torch.nn.functional as F

    from bench.timing import median_time
    from nanoagent.logprobs import head_logprobs
    gpu = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if gpu else ("cpu", torch.float32)

    def textbook(hidden, weight, labels):
        logp = torch.log_softmax(F.linear(hidden, weight).float(), -1)                    # [N, V]
        return logp.gather(-1, labels[:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)

    def fused(hidden, weight, labels):
        return head_logprobs(hidden, weight, labels)[:2]

    def forward_backward(fn, hidden, weight, labels):
        logprobs, entropy = fn(hidden, weight, labels)
        (logprobs.sum() + 0.1 * entropy.sum()).backward()
        hidden.grad = weight.grad = None

    shapes = [(16384, 1536, 151936)] if gpu else [(1024, 256, 652), (2048, 576, 49152), (1024, 1536, 151936)]
    for N, H, V in shapes:
        g = torch.Generator().manual_seed(0)
        hidden = torch.randn(N, H, generator=g).to(device, dtype).requires_grad_(True)
        weight = (torch.randn(V, H, generator=g) * 0.05).to(device, dtype).requires_grad_(True)
        labels = torch.randint(0, V, (N,), generator=g).to(device)
        # in turn, so that the machine's load drifts over both alike; the first pair warms up
        pairs = [[median_time(partial(forward_backward, fn, hidden, weight, labels), 1)
                  for fn in (textbook, fused)] for _ in range(repeats + 1)][1:]
        before, after = (statistics.median(times) for times in zip(*pairs))
        print(f"LM head + logprob + entropy, forward + backward, N={N} tokens, H={H}, V={V}, {dtype}: "
              f"textbook {before * 1000:.0f} ms, fused {after * 1000:.0f} ms "
              f"({after / before:.2f}x the time)",
              flush=True)


def balance(steps, sittings=2):
    task = os.path.join(ROOT, "tests", "uneven_task.py")
    for sitting in range(sittings):
        for on in ("false", "true"):
            rows = train_steps(2, ["algo=grpo", f"steps={steps}", f"data.task={task}", "data.shuffle=false",
                                   "task.num_train=16", "rollout.prompts_per_step=16", "rollout.group_size=4",
                                   "ppo.mini_batch_size=64", f"train.balance_ranks={on}"], 1)
            med = lambda k: statistics.median(r[k] for r in rows)  # noqa: E731
            print(f"sitting {sitting + 1}, balance_ranks={on:5s}: "
                  f"rank_imbalance {med('rank_imbalance'):.2f} | step {med('time/step'):.2f}s | "
                  f"rollout {med('time/rollout'):.2f}s | update {med('time/update'):.2f}s | "
                  f"{med('tokens_per_s'):.0f} tokens/s (median of {len(rows)} steps)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--update-only", action="store_true")
    parser.add_argument("--packing", action="store_true")
    parser.add_argument("--shape", choices=["tiny", "qwen2.5-1.5b"], default=None,
                        help="the model's shape: --packing (default tiny), --update-only "
                             "(default qwen2.5-1.5b)")
    parser.add_argument("--balance", action="store_true")
    parser.add_argument("--head", action="store_true")
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    if args.update_only:
        update_only(args.shape or "qwen2.5-1.5b", args.steps)
    elif args.head:
        head()
    elif args.balance:
        balance(args.steps)
    elif args.packing:
        packing(args.shape or "tiny")
    else:
        for algo, credit, context in (("grpo", "token", "full"), ("grpo", "token", "last_k"),
                                      ("ppo", "token", "full"), ("ppo", "step", "full"),
                                      ("ppo", "step", "last_k")):
            for nproc in (1, 2):
                end_to_end(args.steps, algo, nproc, credit, context)
