"""
Memory of the trainer (prints figures; asserts nothing).

    python bench/bench_memory.py                 # both parts, CPU or GPU
    python bench/bench_memory.py --logprobs      # part 1 only
    python bench/bench_memory.py --loading       # part 2 only (writes a 3 GB checkpoint to a temp folder)
    python bench/bench_memory.py --train         # part 3: a SmolLM2 train.py run by stage (~8 min, 2 cores)
    python bench/bench_memory.py --train rollout.group_size=8    # ... with more overrides of its command line
    python bench/bench_memory.py --tokens        # part 4: SmolLM2's update per token (8 processes, ~15 min)

1. Logprobs, per micro-batch token. A random-weight model with Qwen2.5's vocabulary (151,936) and a
   small body, computing in bf16: the peak extra memory of one forward + policy-loss backward
   through nanoagent.model.policy_forward (packed rows, every token but the first of each row an
   action: the most logits there can be; fewer actions, fewer logits), against the textbook way (slice
   the logits, divide by the temperature, fp32 log_softmax, gather, entropy) as a baseline in the same
   script. Measured at two micro-batch sizes in fresh processes (peak RSS on a CPU, max allocated on a
   GPU); the slope is the cost per token, also given in bf16 logits rows (2 x V bytes): the logits
   themselves are one.
2. Loading, peak host memory per rank. A random Qwen2.5-1.5B-shaped checkpoint in bf16 (as Qwen
   ships it), loaded as a GRPO run with a KL term does (policy + reference) by 2 ranks under
   torchrun: nanoagent.model's meta-device build filled by broadcast from rank 0, against every
   rank calling from_pretrained in fp32 and sharding afterwards. On a CPU a rank's own shards live
   in host memory too (on a GPU they would not): the figure beyond them is what loading costs.
3. A CPU run of the real model, stage by stage: train.py's main in this process (--config=tiny
   model=smollm2-135m steps=2 rollout.prompts_per_step=4 rollout.max_new_tokens=64: fp32 training
   and the vLLM CPU engine, as the tiny preset runs), the resident set taken as each stage ends (and
   its peak within the stage: /proc/self/status VmHWM, reset through clear_refs) by wrappers around
   what train.py calls. The task's reward is scripted (every other trajectory earns 1), so every
   group trains: SmolLM2 gets the arithmetic all wrong, and a run that trains nothing would never
   show the update's memory.
4. The update's forward + backward per micro-batch token, SmolLM2-135M in fp32 (vocabulary 49,152):
   the peak resident set beyond the gradients at two micro-batch sizes in fresh processes, with one
   action a row (the slope: activations per token) and every token an action (the difference:
   logits and logprobs per action token), with activation checkpointing off (the tiny preset) and on.
   Peak RSS includes what the allocator keeps of freed blocks: the figures are the process's cost,
   an upper bound on the tensors' own.
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile

import torch
from transformers import AutoModelForCausalLM

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from nanoagent import model as nanoagent_model  # noqa: E402

QWEN_VOCAB = 151936
QWEN_1_5B = dict(vocab_size=QWEN_VOCAB, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                 num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32768,
                 tie_word_embeddings=True)


def packed_lm(path):
    """The whole model in fp32 with the trainer's packed attention, as train.py loaded it before build_*."""
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                attn_implementation=nanoagent_model.PACKED)


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
    config = Qwen2Config(vocab_size=QWEN_VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=64, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM._from_config(
        config, attn_implementation=nanoagent_model.PACKED if variant == "nanoagent" else "sdpa")
    model = model.to(device=device, dtype=torch.bfloat16).train()

    def step(ids):
        # the rows packed, every token but each row's first an action (the most logits there can be)
        if variant == "nanoagent":
            positions = torch.arange(ids.shape[1], device=device).repeat(ids.shape[0])[None]
            logprobs = nanoagent_model.policy_forward(nanoagent_model.Policy(model), ids.flatten()[None],
                                                      positions, positions > 0, 0.7)[0]
        else:
            logprobs, _ = unfused_logprobs(model, ids, torch.ones_like(ids), 0.7)
        (-logprobs.sum()).backward()  # entropy_coef = 0: the entropy is only logged
        model.zero_grad(set_to_none=True)
    # kernels, allocator and gradients warmed on a tiny batch
    step(torch.randint(0, QWEN_VOCAB, (1, 8), device=device))
    before = peak_bytes()
    step(torch.randint(0, QWEN_VOCAB, (rows, width), device=device))
    return peak_bytes() - before


def measure_logprobs():
    print(f"1. logprobs: peak extra memory per micro-batch token, V={QWEN_VOCAB}, bf16 "
          f"({'GPU' if torch.cuda.is_available() else 'CPU, peak RSS'}); "
          f"one bf16 logits row = {2 * QWEN_VOCAB / 2**10:.0f} KiB")
    shapes = [(2, 512), (4, 512)]
    for variant in ("unfused", "nanoagent"):
        peaks = []
        for rows, width in shapes:
            out = subprocess.run([sys.executable, __file__, "--logprob-run", variant, str(rows), str(width)],
                                 capture_output=True, text=True, check=True)
            peaks.append(int(out.stdout.strip().splitlines()[-1]))
        tokens = [r * w for r, w in shapes]
        per_token = (peaks[1] - peaks[0]) / (tokens[1] - tokens[0])
        print(f"   {variant:>9}: {peaks[0] / 2**20:7.0f} MiB at {tokens[0]} tokens, "
              f"{peaks[1] / 2**20:7.0f} MiB at {tokens[1]}: {per_token / 2**10:6.0f} KiB per token = "
              f"{per_token / (2 * QWEN_VOCAB):.2f} bf16 logits rows")


def loading_peak(variant, path):
    """Under torchrun: build policy + reference the way `variant` does; print this rank's peak RSS."""
    import torch.distributed as dist
    dist.init_process_group("gloo")
    device = torch.device("cpu")
    if variant == "nanoagent":
        config, weights = nanoagent_model.training_config(path), nanoagent_model.read_weights(path)
        models = [nanoagent_model.build_policy(config, weights, device, torch.bfloat16,
                                               activation_checkpointing=True),
                  nanoagent_model.build_reference(config, weights, device, torch.bfloat16)]
    else:  # every rank: the whole model in fp32 on the host, then sharded (what train.py did before)
        models = [nanoagent_model.shard(packed_lm(path).to(device), torch.bfloat16, True),
                  nanoagent_model.shard(packed_lm(path).to(device), torch.bfloat16).requires_grad_(False)]
    shards = sum(p.to_local().numel() * p.element_size() for m in models for p in m.parameters())
    print(json.dumps({"rank": dist.get_rank(),
                      "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                      "shards": shards}),
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
        print(f"2. loading policy + reference, Qwen2.5-1.5B shape ({n_params / 1e9:.2f}B parameters, "
              f"bf16 checkpoint {n_params * 2 / 2**30:.1f} GiB), 2 ranks under torchrun (gloo): "
              f"peak host memory per rank")
        for variant in ("from_pretrained", "nanoagent"):
            out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                  "--nproc_per_node=2", __file__, "--loading-run", variant, path],
                                 capture_output=True, text=True, check=True,
                                 env={**os.environ, "OMP_NUM_THREADS": "1"})
            peaks = sorted((json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")),
                           key=lambda r: r["rank"])
            per_rank = ", ".join(f"rank {r['rank']} {r['peak_rss'] / 2**30:.1f} GiB "
                                 f"({(r['peak_rss'] - r['shards']) / 2**30:.1f} beyond "
                                 f"its own {r['shards'] / 2**30:.1f} GiB of shards)" for r in peaks)
            print(f"   {variant:>15}: {per_rank}; "
                  f"median {statistics.median(r['peak_rss'] for r in peaks) / 2**30:.1f} GiB")


# -----------------------------------------------------------------------------
# 3. a train.py run, stage by stage (SmolLM2 on a CPU)

TRAIN_ARGS = ["--config=tiny", "model=smollm2-135m", "steps=2", "rollout.prompts_per_step=4",
              "rollout.max_new_tokens=64", "resume=never"]


def rss_now():
    """(resident set, its peak since the last reset_peak) of this process, bytes (Linux /proc)."""
    with open("/proc/self/status") as f:
        status = dict(line.split(":", 1) for line in f)
    return int(status["VmRSS"].split()[0]) * 1024, int(status["VmHWM"].split()[0]) * 1024


def reset_peak():
    """Start a new peak resident set here (Linux: 5 into clear_refs resets VmHWM)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def train_stages(run_dir, overrides):
    """
    train.py's main in this process, the resident set taken as each stage ends (and its peak within the
    stage) through wrappers around the functions train.py calls. The task's reward is replaced by a
    scripted one (every other trajectory of a group earns 1), so that every group trains: SmolLM2 gets
    the arithmetic task's outcomes all wrong, every group uniform, and nothing would be trained.
    """
    stages = []

    def mark(name):
        now, peak = rss_now()
        stages.append((name, now, peak))
        reset_peak()

    mark("python, torch")
    import train
    from nanoagent import update
    import vllm  # noqa: F401  (train.py imports it when the engine starts: counted here, not in the engine)
    mark("imports (train.py, transformers, vLLM)")

    def wrap(name, label, after=True):
        inner = getattr(train, name)

        def wrapped(*args, **kwargs):
            if not after:
                mark(label)
            out = inner(*args, **kwargs)
            if after:
                mark(label)
            return out
        setattr(train, name, wrapped)

    load_task = train.load_task

    def scripted_task(name):
        task = load_task(name)
        score, count = task.score, iter(range(10**9))

        def scripted(traj, cfg):
            score(traj, cfg)
            traj.reward = float(next(count) % 2)
        task.score = scripted
        return task
    train.load_task = scripted_task
    make_engine = train.make_engine

    def engine_with_marks(*args, **kwargs):
        engine = make_engine(*args, **kwargs)
        mark("engine started (vLLM: weights, KV cache)")
        load_weights = engine.load_weights

        def marked(named_tensors):
            load_weights(named_tensors)
            mark("weights pushed into the engine")
        engine.load_weights = marked
        return engine
    train.make_engine = engine_with_marks
    wrap("build_models", "models and optimizers built (policy; critic, reference when used)")
    wrap("run_agent", "rollout")
    optimizer_step = update.optimizer_step

    def step_with_marks(*args, **kwargs):
        mark("update: forward and backward of every micro-batch")
        out = optimizer_step(*args, **kwargs)
        mark("update: optimizer step (AdamW state on the first)")
        return out
    update.optimizer_step = step_with_marks
    wrap("export_hf", "export (the HF folder)")
    code = train.main(TRAIN_ARGS + [f"run_dir={run_dir}"] + overrides)
    return code, stages


def measure_train(overrides):
    with tempfile.TemporaryDirectory() as run_dir:
        out = subprocess.run([sys.executable, __file__, "--train-run", run_dir, *overrides],
                             capture_output=True, text=True)
    if out.returncode:
        sys.exit(f"train run failed ({out.returncode}):\n{out.stderr[-3000:]}")
    lines = [line for line in out.stdout.splitlines() if line.startswith("step ")]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"3. train.py {' '.join(TRAIN_ARGS + overrides)} (scripted reward: every group trains), "
          "one process, resident set after each stage (peak within it), GiB")
    for line in lines:
        print(f"   {line}")
    previous = 0
    for name, now, peak in result["stages"]:
        print(f"   {now / 2**30:6.2f} ({peak / 2**30:5.2f} peak) {(now - previous) / 2**30:+6.2f}  {name}")
        previous = now
    print(f"   peak resident set of the run: {max(p for _, _, p in result['stages']) / 2**30:.2f} GiB")


# -----------------------------------------------------------------------------
# 4. the update's memory per token, SmolLM2 (real vocabulary), fp32 as the tiny preset trains

def smollm2_peak(tokens, actions, checkpointing):
    """Peak resident set beyond the start of one forward + policy-loss backward of SmolLM2 (fp32) on a
    packed micro-batch of rows of 256 tokens; actions: 'all' (every token but each row's first) or
    'one' (each row's last). Gradients are allocated by a warm-up pass first: the figure is the
    micro-batch's own."""
    from nanoagent.smollm2 import ensure_smollm2
    model = nanoagent_model.Policy(packed_lm(ensure_smollm2())).train()
    if checkpointing:
        model.model.gradient_checkpointing_enable()

    def step(n):
        torch.manual_seed(0)
        ids = torch.randint(0, model.config.vocab_size, (1, n))
        positions = torch.arange(n).remainder(256)[None]
        last = torch.cat([positions[:, 1:] == 0, torch.ones(1, 1, dtype=torch.bool)], 1)  # each row's last
        needed = positions > 0 if actions == "all" else last
        logprobs = nanoagent_model.policy_forward(model, ids, positions, needed, 0.7)[0]
        (-logprobs.sum()).backward()
        model.zero_grad(set_to_none=False)  # the gradients stay: the next pass's peak is its own
    step(16)
    before, _ = rss_now()
    reset_peak()
    step(tokens)
    return rss_now()[1] - before, sum(p.numel() for p in model.parameters()) * 4


def measure_tokens():
    print("4. the update's forward + backward, per micro-batch token: SmolLM2-135M (fp32, vocabulary "
          "49,152), packed rows of 256 tokens, peak resident set beyond the gradients; "
          "one fp32 logits row = 192 KiB")
    shapes = (768, 1536)  # 765 and 1,530 action tokens: both past head_logprobs' chunk of 682 rows
    for checkpointing in (False, True):
        slopes = {}
        for actions in ("one", "all"):
            peaks = []
            for n in shapes:
                out = subprocess.run([sys.executable, __file__, "--token-run", str(n), actions,
                                      str(int(checkpointing))], capture_output=True, text=True, check=True)
                peak, grads = json.loads(out.stdout.strip().splitlines()[-1])
                peaks.append(peak)
            slopes[actions] = (peaks[1] - peaks[0]) / (shapes[1] - shapes[0])
            label = "on " if checkpointing else "off"
            print(f"   checkpointing {label}, {actions:>3} action(s) a row: {peaks[0] / 2**20:6.0f} MiB at "
                  f"{shapes[0]} tokens, {peaks[1] / 2**20:6.0f} MiB at {shapes[1]}: "
                  f"{slopes[actions] / 2**10:6.0f} KiB per token")
        extra = (slopes["all"] - slopes["one"]) * 256 / 255
        print(f"   checkpointing {label}: {slopes['one'] / 2**10:.0f} KiB per token (activations), "
              f"+{extra / 2**10:.0f} KiB per action token (logits and logprobs: "
              f"{extra / (4 * 49152):.2f} fp32 logits rows); "
              f"gradients {grads / 2**20:.0f} MiB")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--logprobs", action="store_true")
    parser.add_argument("--loading", action="store_true")
    parser.add_argument("--logprob-run", nargs=3, metavar=("VARIANT", "ROWS", "WIDTH"),
                        help=argparse.SUPPRESS)
    parser.add_argument("--loading-run", nargs=2, metavar=("VARIANT", "PATH"), help=argparse.SUPPRESS)
    parser.add_argument("--train", nargs="*", metavar="key=value", default=None,
                        help="part 3 only, with these overrides of train.py's command line")
    parser.add_argument("--tokens", action="store_true", help="part 4 only")
    parser.add_argument("--train-run", nargs="+", metavar=("RUN_DIR", "OVERRIDES"), help=argparse.SUPPRESS)
    parser.add_argument("--token-run", nargs=3, metavar=("TOKENS", "ACTIONS", "CHECKPOINTING"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.logprob_run:
        variant, rows, width = args.logprob_run
        print(logprob_peak(variant, int(rows), int(width)))
    elif args.loading_run:
        loading_peak(*args.loading_run)
    elif args.train_run:
        code, stages = train_stages(args.train_run[0], args.train_run[1:])
        print(json.dumps({"code": code, "stages": stages}), flush=True)
        os._exit(code)
    elif args.token_run:
        tokens, actions, checkpointing = args.token_run
        print(json.dumps(smollm2_peak(int(tokens), actions, checkpointing == "1")), flush=True)
    elif args.train is not None or args.tokens:
        if args.train is not None:
            measure_train(args.train)
        if args.tokens:
            measure_tokens()
    else:
        if args.logprobs or not args.loading:
            measure_logprobs()
        if args.loading or not args.logprobs:
            measure_loading()
