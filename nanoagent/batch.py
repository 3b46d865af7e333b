"""
The step's batch: its trajectories as token rows on the host, what each token earns, which rows
train, and how the rows are balanced over ranks and cut into the packed micro-batches every forward
and backward pass goes through.

The batch is a dict of host tensors, R rows (one per trajectory, or one per turn with
rollout.context=last_k) of L tokens (the longest row; right-padded), B trajectories:

    key               shape         by          what it holds
    input_ids         [R, L] long   collate     token ids
    position_ids      [R, L] long   collate     each token's position in its row
    prompt_length     [R] long      collate     the tokens before the row's first action
    prompt            [R] long      collate     an id equal for rows that begin with the same prompt
    row               [R, L] long   collate     each token's row
    action_mask       [R, L] float  collate     1 on sampled tokens (step_batch: 0 on rows left out)
    rollout_logprobs  [R, L] float  collate     the engine's logprob of each action token
    version           [R, L] long   collate     the step whose policy sampled each action token
    lengths           R ints        collate     each row's tokens
    trajectory        [R] long      collate     the trajectory (0..B-1) each row belongs to
    steps             B lists       collate     each trajectory's actions in turn order: (row, start, end)
    step              [R, L] long   collate     on an action's tokens its step's id, unique in the batch
    old_logprobs      [R, L] float  train.py    the policy's before the update (on-policy: its own)
    nucleus_logprobs  [R, L] float  train.py    the same within the rollout's top-p nucleus
    ref_logprobs      [R, L] float  train.py    the reference's (with a KL term)
    values            [R, L] float  train.py    the critic's, where value_mask is 1 (ppo)
    value_mask        [R, L] float  train.py    where a value is learned: actions, or steps' first (ppo)
    returns           [R, L] float  train.py    GAE's returns (ppo)
    advantages        [R, L] float  train.py    the estimator's
    unit_tokens       [R, L] float  update_*    its loss unit's token count (rl.unit_counts), for one pass

A trajectory left out of the update still counts in its group's baseline when it is a real sample of
the policy (one a budget cut, under train.overlong_filter), with the reward it earned; one whose
environment failed (env_error) counts nowhere, as if it had not been sampled: its reward says nothing
of the policy. docs/formulation.md: "Dynamic sampling and overlong filtering".

Packing (model.py's forwards run on it): the rows of a micro-batch are laid end to end into one
sequence [1, T], at most train.micro_batch_tokens tokens unless one row is longer; rows that begin
with the same prompt (a group's samples) share one copy of it. Rows go into micro-batches first-fit
decreasing, a prompt's rows together where they fit, and every rank runs as many micro-batches as the
busiest (FSDP's forward and backward are collectives). Results come back to [R, L] exactly (unpack).
"""

from dataclasses import dataclass, replace
from typing import NamedTuple

import torch
import torch.distributed as dist

from nanoagent import rl
from nanoagent.common import all_reduce


# -----------------------------------------------------------------------------
# the rows

def pad_rows(rows, pad_value, dtype=torch.long):
    """List of 1-D sequences -> right-padded [B, L] tensor."""
    width = max(len(r) for r in rows)
    out = torch.full((len(rows), width), pad_value, dtype=dtype)
    for i, r in enumerate(rows):
        out[i, :len(r)] = torch.as_tensor(r, dtype=dtype)
    return out


def collate(trajs, pad_id):
    """
    Trajectories -> a batch of their token rows (Trajectory.sequences: one row `prompt | response`
    each, or one per turn with context=last_k) right-padded to [R, L] on the host. action_mask,
    rollout_logprobs and version are laid over the whole row (0 on the prompt and padding), so every
    per-token tensor shares one index. "position_ids", "prompt", "prompt_length": see shared_prompts; "row":
    [R, L] each token's row; "trajectory": [R] the trajectory each row belongs to; "steps": for each
    trajectory its turns' actions in order, as (row, start, end); "step": [R, L] on the tokens of
    each action an id of its step, unique in the batch (1, 2, ...; 0 elsewhere).
    """
    sequences, owner, steps = [], [], []
    for i, t in enumerate(trajs):
        rows, places = t.assemble()
        steps.append([(len(sequences) + row, s, e) for row, s, e in places])
        for ids, mask, logprobs, _, versions in rows:
            sequences.append((ids, mask, logprobs, versions))
            owner.append(i)
    input_ids = pad_rows([ids for ids, *_ in sequences], pad_id)
    step = torch.zeros_like(input_ids)
    for n, (row, start, end) in enumerate(span for trajectory in steps for span in trajectory):
        step[row, start:end] = n + 1
    return {
        "input_ids": input_ids,
        **shared_prompts([ids for ids, *_ in sequences], [mask for _, mask, *_ in sequences]),
        "row": torch.arange(len(sequences))[:, None].expand_as(input_ids),
        "action_mask": pad_rows([mask for _, mask, *_ in sequences], 0, torch.float32),
        "rollout_logprobs": pad_rows([logprobs for _, _, logprobs, _ in sequences], 0.0, torch.float32),
        "version": pad_rows([versions for *_, versions in sequences], 0),
        "lengths": [len(ids) for ids, *_ in sequences],
        "trajectory": torch.tensor(owner),
        "steps": steps,
        "step": step,
    }


def shared_prompts(rows, masks):
    """The keys of a batch that say which rows share a prompt, from its token rows and action masks:
    "position_ids" [R, L] each token's position in its row, "prompt_length" [R] the tokens before a
    row's first action (all of them without one), "prompt" [R] an id equal for rows whose prompts are
    the same tokens (a group's samples, the first turns of a group's trajectories with
    rollout.context=last_k)."""
    lengths = [next((t for t, m in enumerate(mask) if m), len(mask)) for mask in masks]
    ids = {}
    prompt = [ids.setdefault(tuple(row[:n]), len(ids)) for row, n in zip(rows, lengths)]
    return {"position_ids": pad_rows([range(len(r)) for r in rows], 0),
            "prompt_length": torch.tensor(lengths), "prompt": torch.tensor(prompt)}


def share_prefix(batch):
    """The batch with its rows reading one copy of the tokens they all begin with, up to the first action
    of any: "prompt" and "prompt_length" as if that prefix were one prompt (packed_layout). A warm
    start's demonstrations ask different questions after the same system prompt and tools, about half
    their tokens, which the packed passes then compute once a micro-batch."""
    ids, before_actions = batch["input_ids"], int(batch["prompt_length"].min())
    same = (ids[:, :before_actions] == ids[:1, :before_actions]).all(0)                  # [before_actions]
    shared = int(same.long().cumprod(0).sum())
    return {**batch, "prompt": torch.zeros_like(batch["prompt"]),
            "prompt_length": torch.full_like(batch["prompt_length"], shared)}


# -----------------------------------------------------------------------------
# what each token earns, and which rows train

def token_rewards(trajs, batch, tool_call_reward):
    """([R, L] all rewards, [R, L] the process rewards among them) on the batch's action tokens: the
    outcome on the trajectory's last; on each turn's last, its step reward, plus tool_call_reward
    when it is not the last turn and its tool calls all succeeded."""
    rewards, process = torch.zeros_like(batch["action_mask"]), torch.zeros_like(batch["action_mask"])
    for t, steps in zip(trajs, batch["steps"]):
        for turn, (row, _, end) in enumerate(steps):
            calls = [c for c in t.tool_calls if c.turn == turn]
            succeeded = turn < len(steps) - 1 and calls and not any(c.error for c in calls)
            process[row, end - 1] += t.step_rewards[turn] + (tool_call_reward if succeeded else 0.0)
        if steps:  # (row, start, end) of the last turn; a trajectory without one trains nothing (env_error)
            rewards[steps[-1][0], steps[-1][2] - 1] += t.reward
    return rewards + process, process


def counted_in_baseline(trajs):
    """[B] bool: the trajectories that count in their group's baseline (module docstring): all but
    those whose environment failed."""
    return torch.tensor([t.finish_reason != "env_error" for t in trajs], dtype=torch.bool)


def trained_rows(trajs, outcomes, process_size, groups, counted, cfg):
    """
    Which trajectories the update trains on ([B] float, 1 or 0), and how many are left out for each
    reason. DAPO's dynamic sampling (grpo.drop_uniform_groups): a grpo/rloo group whose counted
    outcomes are all equal and which earned no process reward (process_size: [B] the process rewards
    summed in absolute value) has advantages all 0. DAPO's overlong filtering (train.overlong_filter):
    a trajectory that a budget ended is not trained on; nor is one not counted (env_error).
    """
    uniform = torch.zeros(len(trajs), dtype=torch.bool)
    if cfg.algo in ("grpo", "rloo") and cfg.grpo.drop_uniform_groups and counted.any():
        c = counted.nonzero().flatten()
        no_process = rl.uniform_groups(process_size[c], groups[c]) & (process_size[c] == 0)
        uniform[c] = rl.uniform_groups(outcomes[c], groups[c]) & no_process
        uniform = torch.isin(groups, groups[uniform])  # a group's members that do not count go with it
    cut = ("truncated", "context_budget")
    overlong = torch.tensor([cfg.train.overlong_filter and t.finish_reason in cut for t in trajs])
    dropped = {"dropped_uniform": uniform.sum().item(),
               "dropped_overlong": (overlong & ~uniform).sum().item(),
               "dropped_env_error": (~counted & ~uniform & ~overlong).sum().item()}
    return (~uniform & ~overlong & counted).float(), dropped


@dataclass
class StepData:
    """A rank's share of a step, from its scored trajectories to the update (step_batch)."""
    trajs: list            # B trajectories: group_size consecutive ones share a prompt
    batch: dict            # the rows, the keys of the table above
    rewards: torch.Tensor  # [R, L] outcome and tool-call rewards, on the action tokens that train
    process: torch.Tensor  # [R, L] process rewards (a step's), on the action tokens that train
    scores: dict           # [B] each: outcome, earned (its process rewards), group, counted, trained
    kept: list             # the rows that train (the others: mask 0, no forward pass)
    dropped: dict          # trajectories left out of the update, by reason


def step_batch(trajs, pad_id, cfg):
    """The StepData of trajectories: their rows (collate: one per trajectory, or per turn with last_k), what
    each token earns, which rows train (trained_rows) and which trajectories count in a baseline."""
    batch = collate(trajs, pad_id)
    owner = batch["trajectory"]
    rewards, process = token_rewards(trajs, batch, cfg.train.tool_call_reward)
    earned = torch.zeros(len(trajs)).index_add_(0, owner, process.sum(-1))              # [B]
    process_size = torch.zeros(len(trajs)).index_add_(0, owner, process.abs().sum(-1))  # [B]
    outcomes = torch.tensor([t.reward for t in trajs], dtype=torch.float32)
    groups = torch.arange(len(trajs) // cfg.rollout.group_size).repeat_interleave(cfg.rollout.group_size)
    counted = counted_in_baseline(trajs)
    keep, dropped = trained_rows(trajs, outcomes, process_size, groups, counted, cfg)
    mask = batch["action_mask"] = batch["action_mask"] * keep[owner][:, None]
    scores = {"outcome": outcomes, "earned": earned, "group": groups, "counted": counted,
              "trained": keep > 0}
    kept = keep[owner].nonzero().flatten().tolist()
    return StepData(trajs, batch, rewards * mask, process * mask, scores, kept, dropped)


# -----------------------------------------------------------------------------
# balancing over ranks, packed micro-batches

def packed_tokens(batch, rows):
    """The tokens the trainer's packed passes compute for these rows of batch: their lengths, a
    prompt that several of them begin with counted once (packed_layout)."""
    prompts, tokens = set(), 0
    for i in rows:
        prompt = batch["prompt"][i].item()
        tokens += batch["lengths"][i] - (batch["prompt_length"][i].item() if prompt in prompts else 0)
        prompts.add(prompt)
    return tokens


def group_tokens(batch, rows, groups):
    """[G] the tokens the trainer's packed passes compute for each group's rows among `rows`
    (packed_tokens); groups: [B] each trajectory's group id, 0..G-1."""
    rows_of = [[] for _ in range(int(groups.max()) + 1 if len(groups) else 0)]
    for row, group in zip(rows, groups[batch["trajectory"][rows]].tolist()):
        rows_of[group].append(row)
    return [packed_tokens(batch, r) for r in rows_of]


def balance_groups(trajs, costs, group_size):
    """
    This rank's trajectories after whole groups (group_size consecutive trajectories: a prompt's
    samples) moved between ranks so that every rank trains on about as many tokens. Every FSDP pass
    is a collective, so an update lasts as long as the busiest rank's passes, and multi-turn
    trajectories differ in length far more than single-turn answers. costs: the tokens the trainer
    would compute for each of this rank's groups (packed_tokens; 0 for a group left out of the
    update). Every rank plans the same moves from the gathered costs: while a group of the busiest
    rank weighs less than its gap to the idlest, the one that evens the two best moves (each move
    lowers the sum of squared loads, so it ends). Moved trajectories travel without their
    environments (they are scored). Returns the groups this rank kept, in order, then those it
    received, by sending rank; a group stays whole, so its baseline and its shared prompt do too.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    if world == 1:
        return trajs
    gathered = [None] * world
    dist.all_gather_object(gathered, costs)
    owner = {(r, g): r for r in range(world) for g in range(len(gathered[r]))}
    load = [sum(c) for c in gathered]
    while True:
        busiest, idlest = max(range(world), key=load.__getitem__), min(range(world), key=load.__getitem__)
        gap = load[busiest] - load[idlest]
        movable = [(abs(gap - 2 * gathered[r][g]), r, g) for (r, g), o in owner.items()
                   if o == busiest and 0 < gathered[r][g] < gap]
        if not movable:
            break
        _, r, g = min(movable)
        owner[r, g] = idlest
        load[busiest], load[idlest] = load[busiest] - gathered[r][g], load[idlest] + gathered[r][g]
    group = lambda g: trajs[g * group_size:(g + 1) * group_size]  # noqa: E731
    sent = {}
    for g in range(len(costs)):
        if owner[rank, g] != rank:
            sent.setdefault(owner[rank, g], []).extend(replace(t, env=None) for t in group(g))
    received = [None] * world
    dist.all_gather_object(received, sent)
    kept = [t for g in range(len(costs)) if owner[rank, g] == rank for t in group(g)]
    return kept + [t for s in received for t in s.get(rank, [])]


def micro_batches(lengths, token_budget, prompts=None):
    """
    Group row indices into micro-batches of at most token_budget tokens in all (their rows packed
    end to end), first-fit decreasing: largest first, each into the first micro-batch it fits.
    prompts: for each row (prompt id, prompt length) as collate gives them; the rows of one prompt
    go in as one unit, the prompt counted once (a unit over the budget goes in pieces). A row longer
    than the budget gets a micro-batch of its own (it cannot be split without changing the
    computation).
    """
    units = {}
    for i in range(len(lengths)):
        units.setdefault(prompts[i][0] if prompts else i, []).append(i)
    pieces = []  # (tokens, rows)
    for rows in units.values():
        prompt = prompts[rows[0]][1] if prompts and len(rows) > 1 else 0
        piece, tokens = [], prompt
        for i in sorted(rows, key=lambda i: -lengths[i]):
            if piece and tokens + lengths[i] - prompt > token_budget:
                pieces.append((tokens, piece))
                piece, tokens = [], prompt
            piece.append(i)
            tokens += lengths[i] - prompt
        pieces.append((tokens, piece))
    batches, tokens = [], []
    for size, piece in sorted(pieces, key=lambda p: -p[0]):
        fit = next((b for b in range(len(batches)) if tokens[b] + size <= token_budget), None)
        if fit is None:
            batches.append([])
            tokens.append(0)
            fit = len(batches) - 1
        batches[fit] += piece
        tokens[fit] += size
    return batches


def synced_micro_batches(lengths, token_budget, prompts=None):
    """
    micro_batches(), with the same count on every rank: each FSDP forward and backward is a
    collective, so a rank with fewer micro-batches would leave the others waiting forever. Short
    ranks split their fullest micro-batches in two (rows alternately, so the halves carry about the
    same tokens), then add empty ones ([]), which callers run as a zero-weight pass over one row.
    """
    batches = micro_batches(lengths, token_budget, prompts)
    [count] = all_reduce([len(batches)], "max")
    while len(batches) < count:
        fullest = max(range(len(batches)), key=lambda b: sum(lengths[i] for i in batches[b]), default=None)
        if fullest is not None and len(batches[fullest]) > 1:
            batches[fullest:fullest + 1] = [batches[fullest][::2], batches[fullest][1::2]]
        else:
            batches.append([])
    return batches


def micro_steps(batch, rows, token_budget, device):
    """
    The packed micro-batches of `rows` (this rank's row indices into batch, maybe none), kept in
    step across ranks: the one iterator every forward and backward pass goes through. Yields
    (layout, get): layout as packed_layout gives it (layout.rows: the rows of the micro-batch),
    get(key) that [R, L] tensor of the batch for them, packed ([1, T]) on the device. An empty
    micro-batch comes as a layout of no rows and get() over one row of the batch, so its collectives
    still run; its results must be given weight 0.
    """
    lengths = [batch["lengths"][i] for i in rows]
    prompts = [(batch["prompt"][i].item(), batch["prompt_length"][i].item()) for i in rows]
    for micro in synced_micro_batches(lengths, token_budget, prompts):
        layout = packed_layout(batch, [rows[i] for i in micro])
        run = layout if layout.rows else packed_layout(batch, (rows or [0])[:1])
        yield layout, lambda key, run=run: pack(batch, key, run, device)


class Layout(NamedTuple):
    """Where the tokens of some rows sit in their packed sequence."""
    rows: list                 # the rows, in packed order
    source_rows: torch.Tensor  # [T] the batch row of each packed token
    source_cols: torch.Tensor  # [T] its column in that row
    places: dict               # {row: [its length] packed index of each of its tokens, shared prompt too}


def packed_layout(batch, idx):
    """The packed sequence of the rows idx: a prompt's rows together, its first row whole, each other
    row's own tokens after it (positions going on from the prompt's; packed_attention reads them
    from the prompt's copy)."""
    groups = {}
    for i in idx:
        groups.setdefault(batch["prompt"][i].item(), []).append(i)
        if not torch.equal(batch["position_ids"][i, :batch["lengths"][i]], torch.arange(batch["lengths"][i])):
            raise ValueError(f"row {i}'s position ids are not 0, 1, 2, ...: the packed forward would read "
                             "it as the continuation of a shared prompt (attention_plan); a row begins "
                             "at position 0")
    rows, source_rows, source_cols, places = [], [], [], {}
    for members in groups.values():
        start = len(source_rows)
        for n, i in enumerate(members):
            length, prompt = batch["lengths"][i], batch["prompt_length"][i].item() if n else 0
            here = len(source_rows)
            places[i] = list(range(start, start + prompt)) + list(range(here, here + length - prompt))
            source_rows += [i] * (length - prompt)
            source_cols += range(prompt, length)
            rows.append(i)
    return Layout(rows, torch.tensor(source_rows, dtype=torch.long),
                  torch.tensor(source_cols, dtype=torch.long), places)


def pack(batch, key, layout, device):
    """batch[key] ([R, L, *] on the host) laid out as layout says: [1, T, *] on the device."""
    return batch[key][layout.source_rows, layout.source_cols][None].to(device)


def unpack(packed, layout, out):
    """Write a packed result [1, T, *] back into the rows of out [R, L, *] (on the host), a shared
    prompt's values into every row of it; returns out."""
    for i in layout.rows:
        out[i, :len(layout.places[i])] = packed[0, layout.places[i]].to(out.device, out.dtype)
    return out
