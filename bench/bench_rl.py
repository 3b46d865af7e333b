"""
Speed of the RL math on this machine (prints figures; asserts nothing).

    python bench/bench_rl.py            # CPU; on a GPU machine it runs there

- masked_gae over a [B, T] batch: the Python loop over T is the cost; reported per call.
- step_gae (ppo.credit=step) over the same batch cut into 4 turns per row: a loop over rows and turns.
- grpo_advantages over a large batch.
(The memory of logprobs and entropy over Qwen's vocabulary: bench/bench_memory.py.)
"""

import sys

import torch

sys.path.insert(0, __file__.rsplit("/bench/", 1)[0])
from nanoagent import rl  # noqa: E402
from bench.timing import median_time  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def main():
    print(f"device: {DEVICE}, torch {torch.__version__}, threads {torch.get_num_threads()}")
    for B, T in [(64, 1024), (64, 4096)]:
        rewards = torch.zeros(B, T, device=DEVICE)
        values = torch.randn(B, T, device=DEVICE)
        mask = (torch.rand(B, T, device=DEVICE) > 0.3).float()
        rewards[:, -1] = 1.0
        mask[:, -1] = 1.0
        t = median_time(lambda: rl.masked_gae(rewards, values, mask, 1.0, 1.0))
        print(f"masked_gae B={B} T={T}: {t * 1e3:.1f} ms ({B * T / t / 1e6:.2f} M tokens/s)")
        turns = T // 5  # prompt, then 4 turns of action (3/4 of the turn) and observation
        spans = [(turns * (k + 1), turns * (k + 1) + 3 * turns // 4) for k in range(4)]
        steps = [[(b, start, end) for start, end in spans] for b in range(B)]
        step_mask = torch.zeros(B, T, device=DEVICE)
        for start, end in spans:
            step_mask[:, start:end] = 1.0
        step_rewards = torch.zeros(B, T, device=DEVICE)
        step_rewards[:, spans[-1][1] - 1] = 1.0
        ts = median_time(lambda: rl.step_gae(step_rewards, values, step_mask, steps, 1.0, 1.0))
        print(f"step_gae B={B} T={T}, 4 turns per row: {ts * 1e3:.1f} ms ({ts / t:.2f}x masked_gae)")
    scores = torch.rand(4096, device=DEVICE)
    groups = torch.arange(4096, device=DEVICE) // 8
    print(f"grpo_advantages B=4096 G=8: "
          f"{median_time(lambda: rl.grpo_advantages(scores, groups)) * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
