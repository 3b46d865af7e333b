"""
Where a search-world policy decides how many times to search (prints figures; asserts nothing).

    python bench/bench_decisions.py out/demo-smollm2/run/warm_start out/demo-smollm2/run/hf
    python bench/bench_decisions.py --config=demo PATH ...     # the tiny demo's checkpoints

For each checkpoint (a Hugging Face folder: a run's warm_start/ or hf/), the held-out questions of
the synthetic task (eval.num_prompts of them) are played by the perfect demonstrator (search each
evidence passage in turn, then answer), with the real search tool, and the policy's probability of
each decision is read off one forward pass: at the first assistant turn, searching (`<tool_call>`)
against answering (`<answer>`), and after the first search result the same again. The two texts
are compared over their tokens up to the first that differs. A policy that has learned what a
2-hop question needs searches again after the first result on 2-hop questions and answers on 1-hop
ones; one that has not shows the same probability for both kinds, and its greedy evaluation searches
once or twice for every question alike.
"""

import argparse
import random

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from nanoagent.agent import scripted_trajectories
from nanoagent.config import make_config
from nanoagent.tasks import synthetic, task_data


def decisions(path, rows, trajs, call, answer):
    """{kind: ([P(search first)], [P(search again)])}: each question's probability of searching at each."""
    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    out = {}
    for row, t in zip(rows, trajs):
        ids = t.prompt_ids + t.response_ids
        with torch.no_grad():
            logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)  # [L, V]
        for turn in (0, 1):
            start = len(t.prompt_ids) + t.turn_spans[turn][0]  # the turn's first token
            search, reply = (sum(logprobs[start - 1 + i, token].item() for i, token in enumerate(text))
                             for text in (call, answer))
            p_search = torch.tensor([search, reply]).softmax(0)[0].item()  # of the two, normalised
            out.setdefault(row["type"], ([], []))[turn].append(p_search)
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="demo-smollm2", help="the preset whose questions are used")
    parser.add_argument("checkpoints", nargs="+", help="Hugging Face folders, all with the same tokenizer")
    args = parser.parse_args()
    cfg = make_config(args.config, [])
    tokenizer = AutoTokenizer.from_pretrained(args.checkpoints[0])
    _, rows, env = task_data(synthetic, cfg, tokenizer)
    rows = rows[:cfg.eval.num_prompts]
    perfect = [synthetic.scripted_turns(row, random.Random(0), guess=0.0, skip_second_hop=0.0, extra_hop=0.0)
               for row in rows]
    trajs = scripted_trajectories(env, rows, perfect)
    call, answer = (tokenizer.encode(text, add_special_tokens=False) for text in ("<tool_call>", "<answer>"))
    first = next(i for i, (a, b) in enumerate(zip(call, answer)) if a != b)  # to the first token that differs
    call, answer = call[:first + 1], answer[:first + 1]
    for path in args.checkpoints:
        line = []
        for kind, (first_turn, after_one) in sorted(decisions(path, rows, trajs, call, answer).items()):
            line.append(f"{kind} ({len(after_one)}): "
                        f"P(search first) {sum(first_turn) / len(first_turn):.2f}, "
                        f"P(search again) {sum(after_one) / len(after_one):.2f}, "
                        f"> 0.5 on {sum(p > 0.5 for p in after_one)}")
        print(f"{path} | " + " | ".join(line), flush=True)


if __name__ == "__main__":
    main()
