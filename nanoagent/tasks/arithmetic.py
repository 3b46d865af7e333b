"""
Arithmetic: an offline task whose answer needs a tool, for the tiny preset and the learning test.

"What is a * b?" / "Compute a * b." with a, b in 3..9: a tiny model cannot multiply, the calculator
can. The reward (strict EM by default) needs a calculator call with the question's numbers and the
result copied into the answer. A quarter of the 49 operand pairs is held out for validation, so
held-out questions are ones the model never trained on. Prompts are made on the spot from
(task.num_train, task.num_val, seed): nothing to prepare.
"""

import json
import random
from dataclasses import dataclass

from nanoagent.keys import opt
from nanoagent.reward import score_trajectory
from nanoagent.tools import calculator_tool

SYSTEM_PROMPT = "Use the calculator, then give the final answer as <answer>number</answer>."
QUESTION = "{}"
PHRASINGS = ("What is {a} * {b}?", "Compute {a} * {b}.")  # the numbers at the same place from the end
prepare = None


@dataclass
class Knobs:
    num_train: int = opt(2048, "generated training prompts", low=1, fixed=True)
    num_val: int = opt(64, "generated held-out prompts", low=1)


def tools(cfg):
    return [calculator_tool()]


def operand_pairs(seed, split):
    """The operand pairs of a split: a, b in 3..9, a quarter of the 49 pairs held out for "val"."""
    pairs = [(a, b) for a in range(3, 10) for b in range(3, 10)]
    random.Random(f"arithmetic-{seed}").shuffle(pairs)
    held_out = len(pairs) // 4
    return pairs[:held_out] if split == "val" else pairs[held_out:]


def make_prompts(n, seed=0, split="train"):
    """n prompts "multiply two numbers", deterministic in (seed, split)."""
    pairs = operand_pairs(seed, split)
    rng = random.Random(f"arithmetic-{seed}-{split}")
    rows = []
    for i in range(n):
        a, b = pairs[rng.randrange(len(pairs))]
        phrasing = i % len(PHRASINGS)
        question = PHRASINGS[phrasing].format(a=a, b=b)
        rows.append({"id": f"{split}-{i}", "answers": [str(a * b)], "a": a, "b": b, "phrasing": phrasing,
                     "messages": [{"role": "system", "content": SYSTEM_PROMPT},
                                  {"role": "user", "content": QUESTION.format(question)}]})
    return rows


def prompts(cfg, split):
    return make_prompts(cfg.task.num_train if split == "train" else cfg.task.num_val, cfg.seed, split)


def score(traj, cfg):
    return score_trajectory(traj, cfg.reward)


def demonstration(row, rng, cfg):
    """
    Scripted assistant turns for a warm start by imitation, deliberately imperfect so RL has room:
    the demonstrator uses the calculator on 90% of the first phrasing and 20% of the second, and
    otherwise guesses without a tool: a + b, never the product for a, b >= 3. Imitation leaves a
    greedy policy that calls the calculator on the first phrasing and guesses on the second; RL has
    to learn that the calculator pays on both. (At 60%, the first token's choice on the first
    phrasing was close to even, and which way the greedy policy went changed with seed and CPU.)
    """
    use_tool = rng.random() < (0.9 if row["phrasing"] == 0 else 0.2)
    if not use_tool:
        return [f"<answer>{row['a'] + row['b']}</answer>"]
    call = json.dumps({"name": "calculator", "arguments": {"expression": f"{row['a']} * {row['b']}"}})
    return [f"<tool_call>\n{call}\n</tool_call>", f"<answer>{row['a'] * row['b']}</answer>"]
