"""
Train an LLM agent with end-to-end RL over multi-turn tool use (PPO with a critic, or GRPO).

    torchrun --nproc_per_node=8 train.py --config=hotpotqa algo=grpo model=Qwen/Qwen2.5-3B-Instruct
    python train.py --config=tiny algo=ppo steps=2 run_dir=out/tiny

Status: the configuration is resolved, validated, printed and saved to <run_dir>/config.json; the
RL loop itself (rollout -> rewards -> advantages -> PPO epochs -> weight push) is not built yet
and the script says so and exits with status 3.
"""

import argparse
import os
import sys

from nanoagent.common import print0
from nanoagent.config import ConfigError, format_config, make_config, reference, save_config


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, epilog=reference(), formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=None, help="preset name (tiny, hotpotqa); default: the built-in defaults")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, dotted keys")
    args = parser.parse_args(argv)
    try:
        return make_config(args.config, args.overrides)
    except ConfigError as e:
        parser.error(str(e))


def main(argv=None):
    cfg = parse_args(sys.argv[1:] if argv is None else argv)
    os.makedirs(cfg.run_dir, exist_ok=True)
    save_config(cfg, os.path.join(cfg.run_dir, "config.json"))
    print0(format_config(cfg))
    print0(f"config saved to {os.path.join(cfg.run_dir, 'config.json')}")
    print0("train.py: the RL training loop is not built yet (see the trainer issue); nothing was trained.", file=sys.stderr)
    return 3


if __name__ == "__main__":
    sys.exit(main())
