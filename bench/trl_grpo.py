"""
The peer of bench/bench_trl.py: TRL's GRPOTrainer on bench_trl's configuration, in a process of its own
with TRL on its path (bench_trl runs it as PYTHONPATH=TRL_DIR python bench/trl_grpo.py). Prints
TRL_STEPS and, as JSON, the seconds of each optimizer step (the time between the ends of consecutive
steps: generation with transformers, TRL's logprob pass, the update) and of each step's generation
(GRPOTrainer._generate, timed from outside).
"""

import argparse
import json
import os
import re
import sys
import tempfile
import time

import torch
from datasets import Dataset
from transformers import TrainerCallback
from trl import GRPOConfig, GRPOTrainer

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.bench_trl import GROUP, LR, NEW_TOKENS, PROMPTS, task_prompts  # noqa: E402

ANSWER = re.compile(r"<answer>\s*(-?\d+)\s*</answer>")


def reward(completions, answer, **_):
    """The arithmetic task's strict EM on the completion's <answer>."""
    return [float(bool(m := ANSWER.search(c)) and m.group(1) == a) for c, a in zip(completions, answer)]


class StepTimes(TrainerCallback):
    def __init__(self):
        self.ends = []

    def on_train_begin(self, args, state, control, **kwargs):
        self.ends.append(time.perf_counter())

    def on_step_end(self, args, state, control, **kwargs):
        self.ends.append(time.perf_counter())


def timed(fn, seconds):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        seconds.append(time.perf_counter() - start)
        return out
    return wrapper


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    steps = parser.parse_args().steps
    cfg, model, tokenizer, train_rows, env = task_prompts()
    # the text nanoagent's engine is prompted with: chat template, calculator schema, generation prompt
    dataset = Dataset.from_dict({"prompt": [env.render(row["messages"], add_generation_prompt=True)
                                            for row in train_rows],
                                 "answer": [row["answers"][0] for row in train_rows]})
    times, generation = StepTimes(), []
    with tempfile.TemporaryDirectory() as out:
        args = GRPOConfig(output_dir=out, max_steps=steps, per_device_train_batch_size=PROMPTS * GROUP,
                          num_generations=GROUP, gradient_accumulation_steps=1,
                          max_completion_length=NEW_TOKENS, temperature=1.0, learning_rate=LR,
                          lr_scheduler_type="constant", warmup_steps=0, beta=0.0, num_iterations=1,
                          use_cpu=True, bf16=False, gradient_checkpointing=False,
                          model_init_kwargs={"dtype": torch.float32}, logging_steps=1,
                          save_strategy="no", report_to=[], seed=cfg.seed)
        trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=dataset,
                              processing_class=tokenizer, callbacks=[times])
        trainer._generate = timed(trainer._generate, generation)
        trainer.train()
    print("TRL_STEPS", json.dumps({"step": [b - a for a, b in zip(times.ends, times.ends[1:])],
                                   "generation": generation}))


if __name__ == "__main__":
    main()
