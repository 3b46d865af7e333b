"""
What an agent's own code costs the rollout (prints figures; asserts nothing).

    python bench/bench_flow.py [--trajectories 64] [--turns 4]

One loop, three ways, on the tiny model, in one process, the same trajectories (seeded per trajectory
and turn; checked token for token): a turn, then a user message, for --turns turns.
- environment: an environment in env.py's sense (reset/step), appended to by the loop;
- flow: the same loop as a task's flow(client, row), its own code calling client.chat (nanoagent/flow.py);
- agent over HTTP: the same loop written with the openai package against the endpoint on loopback
  (nanoagent/endpoint.py), one shared client, its base URL per trajectory (with_options).
Medians of several runs, taken in turn; the overhead per model call against the environment.
"""

import argparse
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from openai import OpenAI  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from nanoagent.agent import run_agent  # noqa: E402
from nanoagent.endpoint import Endpoint  # noqa: E402
from nanoagent.engine import SamplingConfig, VLLMEngine, stop_token_ids  # noqa: E402
from nanoagent.env import ChatEnv  # noqa: E402
from nanoagent.flow import flow_env  # noqa: E402
from nanoagent.tiny import build_tiny_model  # noqa: E402

SYSTEM = {"role": "system", "content": "Count with the user."}
SAMPLING = SamplingConfig(max_new_tokens=16, temperature=1.0)
MAX_CONTEXT, REPEATS = 2048, 5


def user(n):
    return {"role": "user", "content": f"Count {n}: go on."}


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trajectories", type=int, default=64)
    parser.add_argument("--turns", type=int, default=4)
    args = parser.parse_args()
    turns = args.turns

    class Counting:  # the environment
        def reset(self, row):
            self.n = 0
            return [SYSTEM, user(0)]

        def step(self, action):
            self.n += 1
            return [user(self.n)], 0.0, self.n == turns, {}

    def flow(client, row):
        messages = [SYSTEM, user(0)]
        for n in range(1, turns + 1):
            messages += [client.chat(messages).message, user(n)]
        return 0.0

    shared = OpenAI(base_url="http://unused", api_key="unused")

    def agent(base_url, row):
        client = shared.with_options(base_url=base_url)
        messages = [SYSTEM, user(0)]
        for n in range(1, turns + 1):
            reply = client.chat.completions.create(model="tiny", messages=messages).choices[0].message
            messages += [reply.model_dump(exclude_none=True), user(n)]
        return 0.0

    model_dir = build_tiny_model(tempfile.mkdtemp())
    tok = AutoTokenizer.from_pretrained(model_dir)
    engine = VLLMEngine(model_dir, stop_token_ids(tok), MAX_CONTEXT, dtype="float32", seed=0, compile=False)
    endpoint = Endpoint("tiny", SAMPLING.temperature, SAMPLING.top_p, SAMPLING.max_new_tokens)
    envs = {"environment": ChatEnv(Counting, tok), "flow": ChatEnv(flow_env(flow, 60.0), tok),
            "agent over HTTP": ChatEnv(endpoint.agent_env(agent, 60.0), tok)}
    rows = [{"id": i, "messages": [SYSTEM, user(0)], "answers": []} for i in range(args.trajectories)]
    times, rolled = {name: [] for name in envs}, {}
    for repeat in range(REPEATS + 1):  # the first round warms up
        for name, env in envs.items():
            start = time.perf_counter()
            trajs = run_agent(engine, env, rows, SAMPLING, turns + 1, MAX_CONTEXT, seed=repeat)
            if repeat:
                times[name].append(time.perf_counter() - start)
            rolled[name] = [[row[:2] for row in t.sequences()] for t in trajs]  # each row's ids and mask
        assert rolled["flow"] == rolled["environment"] == rolled["agent over HTTP"]
    endpoint.stop()
    calls = args.trajectories * turns
    base = statistics.median(times["environment"])
    print(f"{args.trajectories} trajectories x {turns} model calls, tiny model, vLLM CPU, medians of "
          f"{REPEATS}; every way rolled out the same ids")
    for name, seconds in times.items():
        median = statistics.median(seconds)
        print(f"  {name:16s} {median:6.2f} s  {median / base:5.2f}x  "
              f"{1000 * (median - base) / calls:+6.2f} ms per call against the environment")


if __name__ == "__main__":
    main()
