"""
<tool_call> and </tool_call> as added tokens, against SmolLM2's vocabulary as it is (prints
figures; asserts nothing).

    NANOAGENT_CACHE=/tmp/nc python bench/bench_tool_tags.py                      # a, b, c in turn
    NANOAGENT_CACHE=/tmp/nc python bench/bench_tool_tags.py --variants=b --threads=1   # one of them

Each variant is a separate model and run: --variants=a, =b, =c in three processes give the same
figures as one process (every draw is seeded; the table at the end lists the variants run).

In SmolLM2-135M-Instruct's vocabulary each tag is 5 tokens (`<`/`</`, `tool`, `_`, `call`, `>`).
nanoagent keeps the vocabulary and stops generation on the end tag by its text (engine.py:
stop_strings). The alternative is to add both tags as tokens (the embeddings resized; SmolLM2 ties
input and output embeddings). Three variants, each from the same converted checkpoint:
  (a) the vocabulary as it is (nanoagent's choice);
  (b) the two tags added, each initialised as the mean of its pieces' embeddings;
  (c) the two tags added at transformers' default init (resize_token_embeddings' default: in
      transformers >= 4.46 mean_resizing, the mean of the whole vocabulary's embeddings plus a
      1e-9-scaled covariance draw, i.e. both tags start as the same "average token").
The data is the arithmetic task's demonstrations (tasks/arithmetic.py), rendered through the
product's environment (env.tool_env with the calculator, agent.scripted_trajectories: prompt ids,
response ids and action mask exactly as training sees them); with added tokens the tokenizer has
them first, so the same path renders the tags (in the system prompt's tool instructions too) as
single tokens. Each variant gets the same warm start by imitation: cross-entropy on the action
tokens only, a token mean, AdamW (weight decay 0), fp32, grad clip 1.0, --lr (1e-3,
train.warm_start_lr's default), --steps steps of --batch demonstrations (10 x 4 by default) drawn
with one seed from 64 training rows. Reported before and after, on --held-out (16) held-out
demonstrations (operand pairs never trained on):
  - the mean NLL per action token;
  - the NLL of the closing tag (summed over its 5 pieces in (a), its one token in (b)/(c)) and of
    the opening tag, mean over the demonstrations' calls;
  - greedy decoding from the held-out prompts whose demonstration calls the tool (at most
    60 new tokens, stopping at the closing tag's text or EOS, as the engines do): the fractions
    that open a call, that write a well-formed call (tools.parse_tool_calls finds a call, none in
    error), and in (b)/(c) that close it with the added token (not with the 5 pieces); then the
    same from the prompts followed by the opening tag (the call forced open: does the model write
    the call and close it, whether or not it would have chosen to call).
The forward pass computes the prefix a batch's rows share (the ~220-token system turn) once and
the rest of each row on its KV cache: the same logprobs as whole rows (checked to 2e-5), and the
same gradients, for fewer tokens.
"""

import argparse
import os
import random
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from nanoagent.agent import scripted_trajectories  # noqa: E402
from nanoagent.config import make_config  # noqa: E402
from nanoagent.env import tool_env  # noqa: E402
from nanoagent.smollm2 import ensure_smollm2  # noqa: E402
from nanoagent.tasks.arithmetic import demonstration, make_prompts  # noqa: E402
from nanoagent.tools import CALL_END, calculator_tool, parse_tool_calls  # noqa: E402

CALL_START = "<tool_call>"
GRAD_CLIP, SEED, TRAIN_ROWS, MAX_NEW = 1.0, 0, 64, 60
VARIANTS = {"a": "vocabulary as it is", "b": "tags added, mean of pieces", "c": "tags added, default init"}


def load(variant, path):
    """(model, tokenizer) of a variant: the tags added to the tokenizer first, then to the model."""
    torch.manual_seed(SEED)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if variant == "a":
        return model, tokenizer
    pieces = {tag: tokenizer.encode(tag, add_special_tokens=False) for tag in (CALL_START, CALL_END)}
    tokenizer.add_tokens([CALL_START, CALL_END])
    model.resize_token_embeddings(len(tokenizer))  # transformers' default init of the new rows
    embeddings = model.get_input_embeddings().weight
    assert model.get_output_embeddings().weight is embeddings  # tied: the new rows are the output rows too
    if variant == "b":
        with torch.no_grad():
            for tag, ids in pieces.items():
                embeddings[tokenizer.convert_tokens_to_ids(tag)] = embeddings[ids].mean(0)
    return model, tokenizer


def demos(tokenizer, rows, scripts):
    """The demonstrations as training sees them (the product's tool environment renders them)."""
    return scripted_trajectories(tool_env([calculator_tool()], tokenizer), rows, scripts)


def action_logprobs(model, trajs):
    """Per trajectory, the logprob of each action token, [(response index, logprob tensor)], in one
    forward: the longest prefix the rows share once, then the rest of every row on its KV cache."""
    rows = [t.prompt_ids + t.response_ids for t in trajs]
    shared = min(len(t.prompt_ids) for t in trajs) - 1  # every row keeps a prompt token after the prefix
    for i in range(shared):
        if any(r[i] != rows[0][i] for r in rows):
            shared = i
            break
    cache = model.model(input_ids=torch.tensor([rows[0][:shared]]), use_cache=True).past_key_values
    cache.batch_repeat_interleave(len(rows))
    width = max(map(len, rows)) - shared
    ids = torch.tensor([r[shared:] + [0] * (width - len(r) + shared) for r in rows])
    attention = torch.tensor([[1] * len(r) + [0] * (width - len(r) + shared) for r in rows])
    positions = torch.arange(shared, shared + width)[None].expand(len(rows), -1)
    hidden = model.model(input_ids=ids, attention_mask=attention, past_key_values=cache, use_cache=True,
                         position_ids=positions).last_hidden_state
    at = [[j for j, m in enumerate(t.action_mask) if m] for t in trajs]  # action tokens' response indices
    # the hidden state at row position p predicts token p + 1; response index j is row position P + j
    rows_at = torch.tensor([i for i, js in enumerate(at) for _ in js])
    cols_at = torch.tensor([len(t.prompt_ids) + j - 1 - shared for t, js in zip(trajs, at) for j in js])
    targets = torch.tensor([t.response_ids[j] for t, js in zip(trajs, at) for j in js])
    logits = model.lm_head(hidden[rows_at, cols_at])
    logprobs = torch.log_softmax(logits, -1).gather(-1, targets[:, None])[:, 0]
    return [(js, lp) for js, lp in zip(at, logprobs.split([len(js) for js in at]))]


def tag_nll(trajs, per_traj, tag_ids):
    """Mean over the tag's occurrences in the actions of the NLL summed over its tokens."""
    sums = []
    for t, (js, lp) in zip(trajs, per_traj):
        where = {j: k for k, j in enumerate(js)}
        for s in range(len(t.response_ids) - len(tag_ids) + 1):
            span = range(s, s + len(tag_ids))
            if t.response_ids[s:s + len(tag_ids)] == tag_ids and all(j in where for j in span):
                sums.append(-sum(lp[where[j]].item() for j in span))
    return sum(sums) / max(len(sums), 1)


@torch.no_grad()
def evaluate(model, tokenizer, trajs):
    """(mean NLL per action token, closing tag NLL, opening tag NLL) on the held-out demonstrations."""
    per_traj = action_logprobs(model, trajs)
    nll = -torch.cat([lp for _, lp in per_traj]).mean().item()
    tags = [tokenizer.encode(tag, add_special_tokens=False) for tag in (CALL_END, CALL_START)]
    return nll, *(tag_nll(trajs, per_traj, ids) for ids in tags)


@torch.no_grad()
def greedy(model, tokenizer, prompts):
    """Greedy first turns, each stopped at the closing tag's text or EOS: [new ids]. The prompts
    are batched by length (the held-out prompts of one phrasing have one length: no padding)."""
    out = [None] * len(prompts)
    for length in sorted({len(p) for p in prompts}):
        group = [i for i, p in enumerate(prompts) if len(p) == length]
        step = model(input_ids=torch.tensor([prompts[i] for i in group]), use_cache=True, logits_to_keep=1)
        new, done = [[] for _ in group], [False] * len(group)
        for _ in range(MAX_NEW):
            token = step.logits[:, -1].argmax(-1)
            for k, t in enumerate(token.tolist()):
                if not done[k]:
                    new[k].append(t)
                    done[k] = t == tokenizer.eos_token_id or CALL_END in tokenizer.decode(new[k])
            if all(done):
                break
            step = model(input_ids=token[:, None], past_key_values=step.past_key_values, use_cache=True)
        for i, ids in zip(group, new):
            out[i] = ids
    return out


def calls_well_formed(model, tokenizer, prompts, forced=""):
    """Greedy first turns from the prompts (after the text `forced`, given as the turn's start):
    (fraction that open a call, fraction with a well-formed call, fraction closed with an added
    </tool_call> token or None, the first turn's text)."""
    start = tokenizer.encode(forced, add_special_tokens=False)
    gens = greedy(model, tokenizer, [p + start for p in prompts])
    texts = [forced + tokenizer.decode(ids, skip_special_tokens=False) for ids in gens]
    ok = sum(bool(calls) and not any(c.error for c in calls) for calls in map(parse_tool_calls, texts))
    end = tokenizer.convert_tokens_to_ids(CALL_END)
    added = end != tokenizer.unk_token_id and len(tokenizer.encode(CALL_END, add_special_tokens=False)) == 1
    opened = sum(CALL_START in text for text in texts) / len(texts)
    return opened, ok / len(gens), sum(end in ids for ids in gens) / len(gens) if added else None, texts[0]


def warm_start(model, trajs, draws, lr):
    """Imitation: cross-entropy on the action tokens (a token mean over the batch), AdamW, fp32."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    for step, drawn in enumerate(draws):
        loss = -torch.cat([lp for _, lp in action_logprobs(model, [trajs[i] for i in drawn])]).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 5 == 0 or step == len(draws) - 1:
            print(f"    step {step + 1:2d}/{len(draws)} | nll {loss.item():.4f}", flush=True)
    model.eval()


def run_variant(variant, path, train, held_out, draws, lr):
    start = time.perf_counter()
    model, tokenizer = load(variant, path)
    train_trajs, held_trajs = demos(tokenizer, *train), demos(tokenizer, *held_out)
    calling = [t.prompt_ids for t, script in zip(held_trajs, held_out[1]) if script[0].startswith(CALL_START)]
    end_tag = tokenizer.convert_ids_to_tokens(tokenizer.encode(CALL_END, add_special_tokens=False))
    print(f"({variant}) {VARIANTS[variant]}: {len(tokenizer)} tokens, closing tag = {end_tag}", flush=True)
    before = evaluate(model, tokenizer, held_trajs)
    print(f"    before: nll/action token {before[0]:.3f} | </tool_call> nll {before[1]:.3f} "
          f"| <tool_call> nll {before[2]:.3f}", flush=True)
    warm_start(model, train_trajs, draws, lr)
    after = evaluate(model, tokenizer, held_trajs)
    opened, well_formed, added, example = calls_well_formed(model, tokenizer, calling)
    _, forced_ok, forced_added, forced_example = calls_well_formed(model, tokenizer, calling, CALL_START)
    print(f"    after:  nll/action token {after[0]:.3f} | </tool_call> nll {after[1]:.3f} "
          f"| <tool_call> nll {after[2]:.3f} | greedy, of {len(calling)}: opens a call {opened:.2f}, "
          f"well-formed call {well_formed:.2f}"
          + (f" (closed by the added token: {added:.2f})" if added is not None else "")
          + f"; given the opening tag: well-formed call {forced_ok:.2f}"
          + (f" (closed by the added token: {forced_added:.2f})" if added is not None else "")
          + f" | {time.perf_counter() - start:.0f} s\n    first greedy turn: {example!r}\n"
          f"    first greedy turn given the opening tag: {forced_example!r}", flush=True)
    return before, after, opened, well_formed, added, forced_ok


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", default="abc", help="which of a, b, c to run")
    parser.add_argument("--steps", type=int, default=10, help="warm start steps")
    parser.add_argument("--lr", type=float, default=1e-3, help="warm start lr (train.warm_start_lr's)")
    parser.add_argument("--batch", type=int, default=4, help="demonstrations per step")
    parser.add_argument("--held-out", type=int, default=16, help="held-out demonstrations")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    steps, batch, held_out_n = args.steps, args.batch, args.held_out
    path = ensure_smollm2()
    rng = random.Random(f"tool-tags-{SEED}")
    train_rows, held_rows = make_prompts(TRAIN_ROWS, SEED, "train"), make_prompts(held_out_n, SEED, "val")
    cfg = make_config(overrides=["data.task=arithmetic"])
    train = (train_rows, [demonstration(row, rng, cfg) for row in train_rows])
    held_out = (held_rows, [demonstration(row, rng, cfg) for row in held_rows])
    draws = [[rng.randrange(TRAIN_ROWS) for _ in range(batch)] for _ in range(steps)]
    print(f"SmolLM2-135M-Instruct, arithmetic demonstrations: warm start {steps} steps x {batch} "
          f"at lr {args.lr} "
          f"(AdamW, fp32, clip {GRAD_CLIP}); {held_out_n} held-out demonstrations, "
          f"{sum(s[0].startswith(CALL_START) for s in held_out[1])} of them calling the tool", flush=True)
    results = {v: run_variant(v, path, train, held_out, draws, args.lr) for v in args.variants}
    print(f"\n{'variant':34s} {'nll before':>10s} {'after':>6s} {'</tc> before':>12s} {'after':>6s} "
          f"{'<tc> after':>10s} {'opens':>6s} {'calls ok':>8s} {'added':>6s} {'forced ok':>9s}")
    for v, (before, after, opened, well_formed, added, forced_ok) in results.items():
        shown = "-" if added is None else f"{added:.2f}"
        print(f"({v}) {VARIANTS[v]:30s} {before[0]:10.3f} {after[0]:6.3f} {before[1]:12.3f} {after[1]:6.3f} "
              f"{after[2]:10.3f} {opened:6.2f} {well_formed:8.2f} {shown:>6s} {forced_ok:9.2f}")


if __name__ == "__main__":
    main()
