"""
What many TextWorld games cost next to generation (prints figures; asserts nothing).

    python bench/bench_textworld.py [--games 16] [--trajectories 64] [--repeats 3]

Generates --games easy games, then (medians of --repeats):
1. a game alone: reset (textworld.start + reset) and one step, over the walkthroughs' commands;
2. the agent loop over --trajectories trajectories (the games repeated) with the tiny model on the
   vLLM CPU engine, 4 turns of up to 16 tokens: the rollout's wall time, the time in engine steps,
   and the time with nothing to generate because every trajectory waited for its game (idle).
"""

import argparse
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from transformers import AutoTokenizer  # noqa: E402

from nanoagent.agent import run_agent  # noqa: E402
from nanoagent.engine import SamplingConfig, VLLMEngine, stop_token_ids  # noqa: E402
from nanoagent.env import ChatEnv  # noqa: E402
from nanoagent.tasks import textworld  # noqa: E402
from nanoagent.tiny import ensure_tiny_model  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--games", type=int, default=16)
    parser.add_argument("--trajectories", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    out = tempfile.mkdtemp()
    start = time.perf_counter()
    rows = [textworld.make_one((out, "val", "easy", i, 500 + i)) for i in range(args.games)]
    print(f"generated {args.games} games in {time.perf_counter() - start:.1f}s "
          f"({(time.perf_counter() - start) / args.games:.2f}s a game, one core)")

    resets, steps = [], []
    for row in rows:
        game = textworld.Game(out)
        t = time.perf_counter()
        game.reset(row)
        resets.append(time.perf_counter() - t)
        for cmd in row["walkthrough"]:
            t = time.perf_counter()
            game.step(cmd)
            steps.append(time.perf_counter() - t)
    print(f"a game alone: reset {statistics.median(resets) * 1e3:.1f} ms, "
          f"step {statistics.median(steps) * 1e3:.2f} ms (medians)")

    tok = AutoTokenizer.from_pretrained(ensure_tiny_model())
    # as the demo preset
    engine = VLLMEngine(ensure_tiny_model(), stop_token_ids(tok), 4096, dtype="float32", seed=0,
                        compile=False)
    env = ChatEnv(lambda: textworld.Game(out), tok, max_obs_tokens=256)
    samples = [rows[i % len(rows)] for i in range(args.trajectories)]
    sampling = SamplingConfig(max_new_tokens=16, temperature=1.0)
    results = []
    for r in range(args.repeats + 1):  # the first is the engine's warm-up
        timing, t = {}, time.perf_counter()
        trajs = run_agent(engine, env, samples, sampling, max_turns=4, max_context_tokens=4096, seed=r,
                          timing=timing)
        results.append((time.perf_counter() - t, timing["engine_s"], timing["idle_s"],
                        sum(len(t.turn_spans) for t in trajs)))
    wall, engine_s, idle_s, turns = (statistics.median(x[i] for x in results[1:]) for i in range(4))
    print(f"{args.trajectories} trajectories x 4 turns, tiny model on vLLM (CPU): rollout {wall:.2f}s, "
          f"in engine steps {engine_s:.2f}s, idle waiting for games {idle_s:.3f}s ({idle_s / wall:.1%}); "
          f"{turns:.0f} game steps, {turns * statistics.median(steps) * 1e3:.0f} ms of game time in all, "
          f"run in threads beside the engine")


if __name__ == "__main__":
    main()
