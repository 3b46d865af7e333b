"""
nanoagent's GRPO step beside TRL's GRPOTrainer, on this machine and the same configuration (prints
figures; asserts nothing). TRL is not a dependency of nanoagent: install it into a folder of its own.

    pip install --no-deps --target=out/trl trl==1.16.0  # its dependencies are nanoagent's already
    python bench/bench_trl.py --trl-dir=out/trl          # 3 sittings of 8 steps each, ~9 minutes on 2 cores

The configuration: the tiny model (random weights, `model=tiny`), the arithmetic task's prompts
rendered through its chat template with the calculator's schema (TRL is given the same rendered text),
8 prompts x 8 samples, 64 new tokens at temperature 1, one turn, one optimizer step a step (the 64
samples are one mini-batch), lr 1e-4, fp32, no KL, no activation checkpointing, every group trained
(grpo.drop_uniform_groups=false: with random weights every reward is 0). TRL generates with
transformers (its vLLM colocate mode needs a GPU build of vLLM); nanoagent with its vLLM engine,
compiled (rollout.compile, the default that the tiny preset turns off for the tests' start-up). A
random model seldom ends a sample early, so both sides generate and train on ~64 x 60 tokens a step.

Each sitting runs nanoagent's train.py, then TRL, each in a fresh process, one after the other; a
side's figure is the median of its steps 2..N-1 (the first warms caches and compiles). nanoagent's step
is its `time/step` (rollout, old-logprob pass when it runs, update, weights into the engine); TRL's
the time between the ends of consecutive optimizer steps (generation, its logprob pass, update), and
of that its generation. Last, the floor under both: the same samples generated with no agent loop
and no training, by vLLM as nanoagent drives it and by nanoagent's transformers engine.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from transformers import AutoTokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bench.timing import median_time  # noqa: E402
from nanoagent.config import make_config  # noqa: E402
from nanoagent.engine import HFEngine, SamplingConfig, VLLMEngine, pad_token_id, stop_token_ids  # noqa: E402
from nanoagent.tasks import load_task, task_data  # noqa: E402
from nanoagent.tiny import ensure_tiny_model  # noqa: E402

PROMPTS, GROUP, NEW_TOKENS, LR = 8, 8, 64, 1e-4
OVERRIDES = ["model=tiny", "algo=grpo", "rollout.max_turns=1", f"rollout.prompts_per_step={PROMPTS}",
             f"rollout.group_size={GROUP}", f"rollout.max_new_tokens={NEW_TOKENS}",
             f"ppo.mini_batch_size={PROMPTS * GROUP}", "grpo.drop_uniform_groups=false",
             f"train.lr={LR}", "train.warmup_steps=0", "eval.every=0", "resume=never", "rollout.compile=true"]


def nanoagent_steps(steps, run_dir):
    """The metrics of each step of train.py under the configuration."""
    subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "--config=tiny", *OVERRIDES,
                    f"steps={steps}", f"run_dir={run_dir}"],
                   check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def task_prompts():
    """(config, model path, tokenizer, the arithmetic training rows, their ChatEnv) of the configuration."""
    cfg, model = make_config("tiny", OVERRIDES), ensure_tiny_model()
    tokenizer = AutoTokenizer.from_pretrained(model)
    train_rows, _, env = task_data(load_task(cfg.data.task), cfg, tokenizer)
    return cfg, model, tokenizer, train_rows, env


def generation_floor():
    """Seconds to generate a step's samples with no agent loop and no training: vLLM as nanoagent
    drives it (per-request seeds, the sampled tokens' logprobs), compiled and eager, and the
    transformers fallback engine. Each call takes the next prompts, as a training step does."""
    _, model, tokenizer, train_rows, env = task_prompts()
    steps = iter(range(len(train_rows) // PROMPTS))
    # the next step's, as the engine gets them: fresh prompts, nothing in the prefix cache yet
    def step_prompts():
        step = next(steps)
        return [env.prompt_ids(row["messages"]) for row in train_rows[step * PROMPTS:(step + 1) * PROMPTS]
                for _ in range(GROUP)]
    sampling = SamplingConfig(max_new_tokens=NEW_TOKENS)
    seeds = list(range(PROMPTS * GROUP))
    figures = {}
    for name, engine in (("vllm", lambda: VLLMEngine(model, stop_token_ids(tokenizer), 1536, "float32")),
                         ("vllm_eager", lambda: VLLMEngine(model, stop_token_ids(tokenizer), 1536, "float32",
                                                           compile=False)),
                         ("hf", lambda: HFEngine(model, stop_token_ids(tokenizer), pad_token_id(tokenizer),
                                                 "float32"))):
        engine = engine()
        engine.generate(step_prompts(), sampling, seeds=seeds)  # warm-up
        figures[name] = median_time(lambda: engine.generate(step_prompts(), sampling, seeds=seeds))
        del engine
    return figures


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trl-dir", default=os.path.join(ROOT, "out", "trl"),
                        help="the folder TRL was installed into (pip --target)")
    parser.add_argument("--sittings", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    if not os.path.isdir(os.path.join(args.trl_dir, "trl")):
        sys.exit(f"no TRL in {args.trl_dir}: pip install --no-deps --target={args.trl_dir} trl==1.16.0")
    ensure_tiny_model()
    print(f"{PROMPTS} prompts x {GROUP} samples, {NEW_TOKENS} new tokens, one optimizer step a step; "
          f"median s/step of steps 2..{args.steps - 1}")
    ratios = []
    for sitting in range(args.sittings):
        with tempfile.TemporaryDirectory() as run_dir:
            metrics = nanoagent_steps(args.steps, run_dir)[1:-1]
        ours, rollout, update, response = (statistics.median(m[k] for m in metrics)
                                           for k in ("time/step", "time/rollout", "time/update",
                                                     "response_tokens"))
        out = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "trl_grpo.py"),
                              f"--steps={args.steps}"], check=True, capture_output=True, text=True,
                             env={**os.environ, "PYTHONPATH": args.trl_dir}).stdout
        trl = json.loads(out.split("TRL_STEPS", 1)[1])
        theirs, generation = (statistics.median(trl[k][1:-1]) for k in ("step", "generation"))
        ratios.append(theirs / ours)
        print(f"sitting {sitting + 1}: nanoagent {ours:.3f} s/step "
              f"(rollout {rollout:.3f}, update {update:.3f}; {response:.0f} tokens a sample) | "
              f"TRL GRPOTrainer {theirs:.3f} s/step "
              f"(generation {generation:.3f}) | nanoagent {theirs / ours:.2f}x faster")
    print(f"median over {args.sittings} sittings: nanoagent {statistics.median(ratios):.2f}x TRL's speed")
    floor = generation_floor()
    print(f"generation alone, a step's {PROMPTS * GROUP} samples (median of 5): "
          f"vLLM as nanoagent drives it {floor['vllm']:.3f} s (eager: {floor['vllm_eager']:.3f} s), "
          f"nanoagent's transformers engine {floor['hf']:.3f} s")


if __name__ == "__main__":
    main()
