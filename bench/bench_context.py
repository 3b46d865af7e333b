"""
What a context per step (rollout.context=last_k) costs the trainer against the one growing row
(full), by number of turns (prints figures; asserts nothing).

    python bench/bench_context.py          # CPU: the tiny model; on a GPU machine it runs there

Trajectories of random tokens shaped like a search agent's (a 256-token prompt, 64-token actions,
256-token tool observations) go through the trainer's own collate; for each number of turns the
bench counts the tokens the trainer scores and the longest row, and times the policy's forward and
backward over them (packed micro-batches of train.micro_batch_tokens, the median of several passes).
With the full context a trajectory is one row of P + n (a + o) tokens; with last_k each turn is a
row of its own, P + min(k, K) (a + o) + a tokens, so every turn scores its prompt and kept turns
again: more tokens, in exchange for a row (and an engine context) that stops growing after K turns.
"""

import random
import sys

import torch
from transformers import AutoModelForCausalLM

sys.path.insert(0, __file__.rsplit("/bench/", 1)[0])
from nanoagent import rl  # noqa: E402
from nanoagent.agent import Trajectory  # noqa: E402
from bench.timing import median_time  # noqa: E402
from nanoagent.batch import collate, micro_batches, pack, packed_layout  # noqa: E402
from nanoagent.model import PACKED, Policy, policy_forward  # noqa: E402
from nanoagent.tiny import ensure_tiny_model  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
PROMPT, ACTION, OBSERVATION, KEEP = 256, 64, 256, 2
TRAJECTORIES, MICRO_BATCH_TOKENS = 8, 8192


def trajectory(turns, context, rng, vocab):
    """A trajectory of random ids with the shape above, laid out as run_agent lays it out."""
    ids = lambda n: [rng.randrange(3, vocab) for _ in range(n)]  # noqa: E731
    t = Trajectory(sample={}, prompt_ids=ids(PROMPT), messages=[])
    for k in range(turns):
        if context == "last_k":  # the prompt rendered for turn k: the question and the last KEEP turns
            t.step_prompts.append(t.prompt_ids + ids(min(k, KEEP) * (ACTION + OBSERVATION)))
        start = len(t.response_ids)
        t.append(ids(ACTION), 1, [0.0] * ACTION)
        t.turn_spans.append((start, len(t.response_ids)))
        if context == "full" and k < turns - 1:
            t.append(ids(OBSERVATION), 0)
    return t


def update_time(model, batch):
    """Forward and backward of the policy loss over the batch's rows, micro-batch by micro-batch."""
    def run():
        for idx in micro_batches(batch["lengths"], MICRO_BATCH_TOKENS):
            get = lambda key: pack(batch, key, packed_layout(batch, idx), DEVICE)  # noqa: E731
            mask = get("action_mask")
            logprobs, _, _ = policy_forward(model, get("input_ids"), get("position_ids"), mask > 0)
            loss, _ = rl.ppo_policy_loss(logprobs, logprobs.detach(), torch.ones_like(mask), mask)
            rl.aggregate_loss(loss, mask, "token_mean", batch["action_mask"].sum(), None).backward()
        model.zero_grad(set_to_none=True)
    return median_time(run)


def main():
    model = Policy(AutoModelForCausalLM.from_pretrained(ensure_tiny_model(), attn_implementation=PACKED))
    model = model.to(DEVICE).train()
    vocab = model.config.vocab_size
    print(f"device: {DEVICE}, tiny model, {TRAJECTORIES} trajectories, prompt {PROMPT}, action {ACTION}, "
          f"observation {OBSERVATION}, last_k with K={KEEP}")
    for turns in (2, 4, 8, 16):
        figures = {}
        for context in ("full", "last_k"):
            rng = random.Random(turns)
            batch = collate([trajectory(turns, context, rng, vocab) for _ in range(TRAJECTORIES)], 0)
            figures[context] = (sum(batch["lengths"]) / TRAJECTORIES, max(batch["lengths"]),
                                update_time(model, batch))
        (full_tokens, full_row, full_s), (k_tokens, k_row, k_s) = figures["full"], figures["last_k"]
        print(f"{turns:2d} turns | tokens per trajectory: full {full_tokens:.0f}, last_k {k_tokens:.0f} "
              f"({k_tokens / full_tokens:.2f}x) | longest row: full {full_row}, last_k {k_row} | "
              f"forward+backward: full {full_s * 1e3:.0f} ms, last_k {k_s * 1e3:.0f} ms "
              f"({k_s / full_s:.2f}x)")


if __name__ == "__main__":
    main()
