"""
Roll an agent out over a task's prompts with the task's tools: write the trajectories as JSONL
and print the mean reward and the task's scores (EM / substring EM / F1 for the QA tasks), turns
per trajectory, response tokens, finish reasons and tokens/s.

    python rollout.py --model out/run/hf --data data/hotpotqa/val.parquet --index data/hotpotqa/index --greedy
    python rollout.py --model out/tiny/hf --greedy                         # the task's held-out prompts
    python rollout.py --model tiny --data prompts.jsonl --tools calculator --config tiny rollout.max_turns=2

The task (data.task), its prompts, tools and scoring, and the sampling, budgets and reward recipe
come from a config: the run's own, which training saved beside its export (<run_dir>/config.json
next to <run_dir>/hf), so that a trained model is evaluated with the settings it was trained with;
a preset with --config; the defaults for a model that is no run's export. key=value overrides go
on top, as in train.py (rollout.engine, rollout.max_turns, task.search_top_k, reward.metric, ...).
The first line printed says which config it is.
"""

import argparse
import json
import os
import sys
import time

from tqdm import tqdm
from transformers import AutoTokenizer

from nanoagent.agent import rollout_metrics, run_agent
from nanoagent.common import exit_now
from nanoagent.config import ConfigError, load_run_config, reference
from nanoagent.data import check_prompts, load_prompts
from nanoagent.engine import SamplingConfig, make_engine
from nanoagent.tasks import load_task, named_tools, task_env
from nanoagent.hub import resolve_model


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, epilog=reference(),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="exported checkpoint folder, hub id, or 'tiny'")
    parser.add_argument("--data", default=None,
                        help="prompts: parquet from prepare_data.py, or JSONL with id, messages, answers "
                             "(default: the task's held-out prompts)")
    parser.add_argument("--out", default="out/rollouts.jsonl", help="trajectories, one JSON object per line")
    parser.add_argument("--tools", default=None,
                        help="comma-separated built-in tools: search, calculator, or empty for none "
                             "(default: the task's)")
    parser.add_argument("--index", default=None,
                        help="search: index folder from build_index.py (default: the task's task.index_dir)")
    parser.add_argument("--limit", type=int, default=0, help="roll out only the first N prompts (0: all)")
    parser.add_argument("--batch-size", type=int, default=64, help="prompts rolled out together")
    parser.add_argument("--greedy", action="store_true", help="greedy decoding (evaluation)")
    parser.add_argument("--config", default=None,
                        help="preset to use (default: the run's config.json, else the defaults)")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="config overrides, e.g. rollout.max_turns=4")
    args = parser.parse_args(argv)
    try:
        cfg, source = load_run_config(args.model, args.config, args.overrides + [f"model={args.model}"])
    except ConfigError as e:
        parser.error(str(e))
    if args.index and hasattr(cfg.task, "index_dir"):  # the task's own search, too
        cfg.task.index_dir = args.index
    return args, cfg, source


def main(argv=None):
    args, cfg, source = parse_args(sys.argv[1:] if argv is None else argv)
    print(f"rollout.py: config {source}" + (f", with {' '.join(args.overrides)}" if args.overrides else ""))
    model_path = resolve_model(cfg.model, "rollout.py")
    task = load_task(cfg.data.task)
    try:
        if args.data:
            samples = load_prompts(args.data, args.limit, cfg.data.bad_prompts)
        else:
            samples = check_prompts(task.prompts(cfg, "val"), cfg.data.bad_prompts,
                                    f"{cfg.data.task} val prompts")[:args.limit or None]
    except ConfigError as e:  # a prompt file that is missing or does not read, a bad row: one line
        print(f"rollout.py: {e}", file=sys.stderr)
        return 2
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    tools = None if args.tools is None else named_tools([t for t in args.tools.split(",") if t], cfg,
                                                        args.index)
    try:
        env = task_env(task, cfg, tokenizer, tools)
    # a chat template or tokenizer a rollout would fail on (ChatEnv.check)
    except ConfigError as e:
        print(f"rollout.py: {model_path}: {e}", file=sys.stderr)
        return 2
    engine = make_engine(cfg.rollout.engine, model_path, tokenizer, cfg.rollout.max_context_tokens,
                         cfg.rollout.dtype, cfg.rollout.gpu_memory_utilization,
                         cfg.rollout.tensor_parallel_size, cfg.seed, cfg.rollout.compile)
    sampling = SamplingConfig(cfg.rollout.max_new_tokens, cfg.rollout.temperature, cfg.rollout.top_p,
                              args.greedy)

    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    trajs, start = [], time.perf_counter()
    with open(args.out, "w") as f, tqdm(total=len(samples), desc="rollout", unit="prompt") as bar:
        for i in range(0, len(samples), args.batch_size):
            batch = run_agent(engine, env, samples[i:i + args.batch_size], sampling, cfg.rollout.max_turns,
                              cfg.rollout.max_context_tokens)
            for t in batch:
                task.score(t, cfg)
                f.write(json.dumps(t.to_json(tokenizer)) + "\n")
            trajs += batch
            bar.update(len(batch))
            bar.set_postfix(reward=f"{sum(t.reward for t in trajs) / len(trajs):.3f}")
    metrics = rollout_metrics(trajs, time.perf_counter() - start)
    print(" | ".join(f"{k} {v:.4g}" for k, v in metrics.items()))
    print(f"wrote {len(trajs)} trajectories to {args.out}")
    env.close()
    return 0


if __name__ == "__main__":
    exit_now(main())
