"""
A long-tailed agent workload for bench/bench_partial.py (data.task=bench/longtail_task.py). How long an
episode lasts is the prompt's, whatever the model says: most prompts' episodes last 1 or 2 turns, one in
ten 8 to 10, and every environment step takes 0-500 ms (a tool's latency, drawn per step from a seeded
stream). The samples of a prompt earn 1, 0, 1, 0, ... in the order they are scored, so every group
trains and each step's update costs what a real one does.
"""

import itertools
import random
import time
from collections import Counter

SYSTEM_PROMPT = "Reply with anything; the environment says when the episode ends."
QUESTION = "{}"
demonstration = None
EPISODES = itertools.count()  # numbers the episodes of this process: each draws its own latencies


def prepare(out, train_size=0, val_size=None, seed=0, source=None):
    return None  # prompts are made on the spot


def turns_of(i):
    """The turns prompt i's episodes last: 8-10 for one prompt in ten, else 1-2."""
    rng = random.Random(i)
    return rng.randint(8, 10) if rng.random() < 0.1 else rng.randint(1, 2)


def prompts(cfg, split):
    first, count = (0, 1024) if split == "train" else (100_000, 32)
    return [{"id": f"{split}-{i}", "turns": turns_of(i), "answers": [],
             "messages": [{"role": "system", "content": SYSTEM_PROMPT},
                          {"role": "user", "content": f"Episode {i}: go."}]}
            for i in range(first, first + count)]


class Episode:
    def reset(self, row):
        self.turns, self.n = row["turns"], 0
        self.rng = random.Random(f"{row['id']}/{next(EPISODES)}")
        return row["messages"]

    def step(self, action):
        self.n += 1
        time.sleep(self.rng.uniform(0.0, 0.5))
        return f"Step {self.n} of {self.turns} done.", 0.0, self.n >= self.turns, {}


def environment(cfg):
    return Episode


times_scored = Counter()  # prompt id -> how many of its samples this process has scored


def score(traj, cfg):
    times_scored[traj.sample["id"]] += 1
    traj.reward = float(times_scored[traj.sample["id"]] % 2)
    return traj.reward
