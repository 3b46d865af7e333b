"""
The code a GPU run takes, run on the CPU: where collectives go, how models are loaded and
sharded, bf16 mixed precision, activation checkpointing without a KV cache, prompts checked when
they are loaded, and the data order. (PPO and GRPO steps in bf16 under torchrun: test_train.py.)
"""

import dataclasses
import os
import random
import sys

import pytest
import torch
import torch.distributed as dist
from torch._dynamo.utils import counters
from transformers import AutoTokenizer

import procs
import train
from padded import load_causal_lm
from nanoagent import common, rl, update
from nanoagent.agent import Trajectory, scripted_trajectories
from nanoagent.batch import collate, shared_prompts, synced_micro_batches, token_rewards
from nanoagent.config import make_config
from nanoagent.data import fit_prompts, step_prompts
from nanoagent.engine import pad_token_id
from nanoagent.model import (Policy, build_critic, build_policy, build_reference, critic_forward,
                             decoder_layers, policy_forward, read_weights, shard, training_config)
from nanoagent.tasks import arithmetic, task_data
from nanoagent.env import tool_env
from nanoagent.tools import calculator_tool

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPU = torch.device("cpu")


def test_a_gpu_run_gives_cpu_tensors_a_backend(monkeypatch):
    """NCCL carries only CUDA tensors; the trainer's metrics, denominators and flags are CPU
    tensors, so a GPU process group must also have gloo for them."""
    assert common.process_group_backend(CPU) == "gloo"
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kwargs: calls.append((backend, kwargs)))
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda: 1)
    # a world of one writes RANK, MASTER_PORT, ... into os.environ: into a copy here, or every later single-process
    # train.py the suite starts would take them for torchrun's and serve its store on this one port (two at once collide)
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")})
    _, _, device = common.init_distributed()
    [(backend, kwargs)] = calls
    assert device.type == "cuda" and kwargs["device_id"] == device
    assert sorted(backend.split(",")) == ["cpu:gloo", "cuda:nccl"]


def test_built_models_hold_the_checkpoint(process_group, tiny_model_dir):
    """Built on the meta device and filled from rank 0's copy: the same weights, rotary buffers
    and tied embedding as a plain from_pretrained; the reference in the compute dtype; the
    critic's backbone from the checkpoint and its value head zero, in fp32."""
    config, weights = training_config(tiny_model_dir), read_weights(tiny_model_dir)
    plain = load_causal_lm(tiny_model_dir)
    policy = build_policy(config, weights, CPU, torch.float32, activation_checkpointing=False)
    assert policy.lm_head.weight is policy.model.embed_tokens.weight
    for (name, p), (plain_name, q) in zip(policy.named_parameters(), plain.named_parameters(), strict=True):
        assert name == plain_name and p.dtype == torch.float32 and torch.equal(p.full_tensor(), q), name
    for (name, b), (_, c) in zip(policy.named_buffers(), plain.named_buffers(), strict=True):
        assert torch.equal(b, c), name
    ref = build_reference(config, weights, CPU, torch.bfloat16)
    for (name, p), (_, q) in zip(ref.named_parameters(), plain.named_parameters(), strict=True):
        assert p.dtype == torch.bfloat16 and not p.requires_grad and torch.equal(p.full_tensor(), q.bfloat16()), name
    critic = build_critic(config, weights, CPU, torch.bfloat16, activation_checkpointing=False)
    for name, p in critic.backbone.named_parameters():
        assert torch.equal(p.full_tensor(), plain.model.get_parameter(name)), name
    assert critic.value_head.weight.dtype == torch.float32 and critic.value_head.weight.full_tensor().abs().sum() == 0


def test_bf16_critic_forward_and_backward(process_group, tiny_model_dir):
    """Under bf16 mixed precision the backbone computes in bf16 and the value head in fp32."""
    critic = build_critic(training_config(tiny_model_dir), read_weights(tiny_model_dir), CPU, torch.bfloat16, activation_checkpointing=True)
    torch.nn.init.normal_(critic.value_head.weight)
    ids, positions = torch.randint(3, 300, (1, 12)), torch.tensor([list(range(7)) + list(range(5))])
    values = critic_forward(critic, ids, positions, positions > 0)
    assert values.shape == (1, 12) and values.dtype == torch.float32 and values[positions > 0].abs().min() > 0
    values.sum().backward()
    assert critic.value_head.weight.grad.dtype == torch.float32 and critic.value_head.weight.grad.full_tensor().abs().sum() > 0


class RowPerTurn(Trajectory):
    """A trajectory each of whose turns is a row of its own, the whole row before the turn for its prompt: the
    trainer's case of a trajectory in several rows (contexts that do not go on from each other, agent.py), with
    the tokens of one row."""

    def assemble(self):
        rows, places = [], []
        for k, (s, e) in enumerate(self.turn_spans):
            prompt, action = self.turn_ids(k)
            P = len(prompt)
            rows.append((prompt + action, [0] * P + self.action_mask[s:e], [0.0] * P + self.rollout_logprobs[s:e],
                         [(P, P + e - s)], [0] * P + self.versions[s:e]))
            places.append((k, P, P + e - s))
        return rows, places


def update_batch(tokenizer, n=6, context="full"):
    """A batch as train.py builds it, from scripted arithmetic trajectories (no engine needed); context="rows":
    each turn a row of its own (RowPerTurn)."""
    env = tool_env([calculator_tool()], tokenizer)
    rows = arithmetic.make_prompts(n, 0, "train")
    cfg = make_config("tiny")
    scripts = [arithmetic.demonstration(row, random.Random(i), cfg) for i, row in enumerate(rows)]
    trajs = scripted_trajectories(env, rows, scripts)
    if context == "rows":
        trajs = [RowPerTurn(**{f.name: getattr(t, f.name) for f in dataclasses.fields(t)}) for t in trajs]
    for i, t in enumerate(trajs):
        t.reward = (i % 3) / 2
    batch = collate(trajs, pad_token_id(tokenizer))
    batch["rewards"], batch["process"] = token_rewards(trajs, batch, tool_call_reward=0.1)
    batch["old_logprobs"] = torch.zeros_like(batch["action_mask"])
    batch["advantages"] = torch.randn(batch["action_mask"].shape) * batch["action_mask"]
    return batch


@pytest.mark.skipif(os.environ.get("TORCH_COMPILE_DISABLE") == "1", reason="TORCH_COMPILE_DISABLE=1")
def test_compiled_layers_compute_what_eager_ones_do_and_compile_once(process_group, tiny_model_dir):
    """train.compile: the policy built with its layers' norms and MLPs compiled (dynamic shapes) gives
    the eager policy's logprobs, entropies and gradients in fp32 to rounding, through FSDP2 and
    activation checkpointing; micro-batches of other lengths and other packing plans run what was
    compiled for the first, without compiling again."""
    config, weights = training_config(tiny_model_dir), read_weights(tiny_model_dir)
    counters.clear()
    eager = build_policy(config, weights, CPU, torch.float32, True)
    compiled = build_policy(config, weights, CPU, torch.float32, True, compile_layers=True)

    def step(model, length):
        g = torch.Generator().manual_seed(length)
        ids = torch.randint(3, config.vocab_size, (1, length), generator=g)
        positions = (torch.arange(length) % (7 + length % 31))[None]   # rows of other lengths: other plans
        logprobs, entropy, _ = policy_forward(model, ids, positions, positions > 0)
        (logprobs.sum() + 0.1 * entropy.sum()).backward()
        return logprobs.detach(), entropy.detach()

    for i, length in enumerate((100, 173, 260, 411)):
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            for a, b in zip(step(compiled, length), step(eager, length)):
                torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    grads = {name: p.grad.full_tensor() for name, p in eager.named_parameters()}
    for name, p in compiled.named_parameters():
        torch.testing.assert_close(p.grad.full_tensor(), grads[name], atol=1e-4, rtol=1e-4, msg=name)
    assert counters["stats"]["unique_graphs"] >= 2  # the norm's and the MLP's, shared by the layers


@pytest.mark.parametrize("made_by", ["build_policy", "from_pretrained"])
@pytest.mark.parametrize("checkpointing", [True, 2, False])
def test_activation_checkpointing_recomputes_every_layer(process_group, tiny_model_dir, made_by,
                                                         checkpointing):
    """With activation checkpointing each decoder layer runs again in the backward pass, or every k-th one
    with train.checkpoint_every=k: its forward pre-hook fires twice per micro-batch of an update (models
    come in train mode). (A post-hook would not: the recompute stops as soon as it has rebuilt what the
    backward needs.)"""
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    batch = update_batch(tok)
    cfg = make_config("tiny", ["train.micro_batch_tokens=200"])
    if made_by == "build_policy":
        policy = build_policy(training_config(tiny_model_dir), read_weights(tiny_model_dir), CPU, torch.float32, checkpointing)
    else:  # from_pretrained returns a model in eval mode, where transformers does not checkpoint
        policy = shard(Policy(load_causal_lm(tiny_model_dir)), torch.float32, checkpointing)
    optimizer = torch.optim.SGD(policy.parameters(), lr=0.0)
    forwards = []
    for i, layer in enumerate(decoder_layers(policy)):
        layer.register_forward_pre_hook(lambda *args, i=i: forwards.append(i))
    rows = list(range(len(batch["lengths"])))
    micro = len(synced_micro_batches(batch["lengths"], cfg.train.micro_batch_tokens, list(zip(batch["prompt"].tolist(), batch["prompt_length"].tolist()))))
    assert micro >= 2
    update.update_policy(policy, optimizer, batch, rows, False, cfg, 1, CPU)
    layers = len(decoder_layers(policy))
    recomputed = [i for i in range(layers) if checkpointing and i % checkpointing == 0]
    assert layers >= 2 and [forwards.count(i) for i in range(layers)] == [
        (2 if i in recomputed else 1) * micro for i in range(layers)]


def test_trainer_forwards_build_no_kv_cache(process_group, tiny_model_dir):
    config, weights = training_config(tiny_model_dir), read_weights(tiny_model_dir)
    caches = []

    def record(module, args, kwargs):
        caches.append(kwargs.get("past_key_values"))
    ids, positions = torch.randint(3, 300, (1, 10)), torch.arange(10)[None]
    for model, forward in [(build_policy(config, weights, CPU, torch.float32, False), policy_forward),
                           (build_critic(config, weights, CPU, torch.float32, False), critic_forward)]:
        decoder_layers(model)[0].register_forward_pre_hook(record, with_kwargs=True)
        forward(model, ids, positions, positions > 0)
    assert len(caches) == 2 and all(c is None for c in caches)


def test_a_tokenizer_without_pad_token_pads_with_eos(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.pad_token = None
    batch = update_batch(tok)
    short = min(range(len(batch["lengths"])), key=lambda i: batch["lengths"][i])
    assert batch["input_ids"][short, batch["lengths"][short]:].eq(tok.eos_token_id).all()


def test_step_prompts_cover_each_epoch_once_per_rank_share():
    rows = [{"id": i} for i in range(10)]
    per_rank, world = 3, 2

    def ids(step, rank):
        return [r["id"] for r in step_prompts(rows, step, per_rank, rank, world, seed=1, shuffle=True)]
    seen = [i for step in range(5) for rank in range(world) for i in ids(step, rank)]  # 30 draws: three epochs of ten
    for epoch in range(3):
        assert sorted(seen[epoch * 10:(epoch + 1) * 10]) == list(range(10))
    assert seen[:10] != seen[10:20]  # reshuffled every epoch
    assert ids(3, 1) == ids(3, 1)  # a function of the step
    unshuffled = [r["id"] for r in step_prompts(rows, 1, per_rank, 0, world, seed=1, shuffle=False)]
    assert unshuffled == [6, 7, 8]


def test_fit_prompts_refuses_or_drops_long_prompts():
    rows = [{"id": f"q{i}"} for i in range(5)]
    lengths = [10, 50, 12, 60, 9]
    with pytest.raises(ValueError, match=r"f.jsonl: 2 of 5 prompts are longer than data.max_prompt_tokens=20 \(first: q1, q3\)"):
        fit_prompts(rows, lengths, 20, "refuse", "f.jsonl")
    assert [r["id"] for r in fit_prompts(rows, lengths, 20, "drop", "f.jsonl")] == ["q0", "q2", "q4"]
    with pytest.raises(ValueError, match="no prompts to train on"):
        fit_prompts(rows, lengths, 5, "drop", "f.jsonl")


def test_long_prompts_stop_every_rank_when_the_data_is_loaded(tiny_model_dir, tmp_path):
    """Under torchrun with 2 ranks, a prompt over data.max_prompt_tokens is refused by every rank
    before any collective: the run ends at once with the count and the first ids, no hang."""
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    cfg = make_config("tiny")
    _, _, env = task_data(arithmetic, cfg, tok)
    rows = arithmetic.prompts(cfg, "train")
    lengths = env.prompt_lengths([r["messages"] for r in rows])
    assert min(lengths) < max(lengths)  # the two phrasings
    over = [r["id"] for r, n in zip(rows, lengths) if n > min(lengths)]
    cmd = [*procs.torchrun(2), "train.py", "--config=tiny",
           f"model={tiny_model_dir}", f"run_dir={tmp_path / 'run'}", f"data.max_prompt_tokens={min(lengths)}"]
    proc = procs.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode != 0
    assert f"{len(over)} of {len(rows)} prompts are longer than data.max_prompt_tokens={min(lengths)} (first: {over[0]}," in proc.stderr
    assert "data.bad_prompts=drop" in proc.stderr
    kept, _, _ = task_data(arithmetic, make_config("tiny", [f"data.max_prompt_tokens={min(lengths)}", "data.bad_prompts=drop"]), tok)
    assert len(kept) == len(rows) - len(over) and not {r["id"] for r in kept} & set(over)


def test_step_credit_trains_the_critic_where_the_step_values_are_read_only(process_group, tiny_model_dir):
    """With ppo.credit=step the value loss is taken where step_gae put the returns (each turn's first
    action index, whose critic output is the value of what was read before the action), not on every
    action token: update_critic's loss is the clipped value loss's mean over value_mask, computed here
    by hand from the critic's values."""
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    batch = update_batch(tok)
    cfg = make_config("tiny", ["algo=ppo", "ppo.credit=step"])
    critic = build_critic(training_config(tiny_model_dir), read_weights(tiny_model_dir), CPU, torch.float32, False)
    values = train.forward_all(lambda *packed: critic_forward(critic, *packed), batch,
                               list(range(len(batch["lengths"]))), 10_000, CPU)
    boundaries = (batch["action_mask"].diff(dim=1, prepend=torch.zeros_like(batch["action_mask"][:, :1])) > 0).float()  # action starts
    assert 0 < boundaries.sum() < batch["action_mask"].sum()
    batch["value_mask"], batch["values"] = boundaries, (values + 0.3) * boundaries
    batch["returns"] = torch.randn(boundaries.shape) * boundaries
    expected, _ = rl.clipped_value_loss(values, batch["values"], batch["returns"], boundaries, cfg.ppo.value_clip)
    rows = list(range(len(batch["lengths"])))
    frozen = torch.optim.SGD(critic.parameters(), lr=0.0)
    shares, _ = update.update_critic(critic, frozen, batch, rows, cfg, 1, CPU)
    assert shares["vf_loss"] == pytest.approx((expected.sum() / boundaries.sum()).item(), rel=1e-4)


@pytest.mark.parametrize("loss_agg", ["token_mean", "seq_mean_token_mean", "step_mean_token_mean"])
def test_a_row_per_turn_trains_like_one_row_when_nothing_is_left_out(process_group, tiny_model_dir, loss_agg):
    """Two-turn trajectories, each turn a row of its own (a context rendered afresh that left nothing out):
    each turn's row is its prefix of the one full-context row. The trainer must then see the same thing: the same
    logprobs and values on each turn's tokens, the same step-level advantages and returns (step_gae
    linking the rows of a trajectory), the same GRPO advantages, and the same policy and critic
    updates, for every train.loss_agg (a token mean over all rows of the mini-batch, or a mean over
    trajectories: a trajectory's rows weigh as much as its one row, not once per turn)."""
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    cfg = make_config("tiny", ["algo=ppo", "ppo.credit=step", "train.micro_batch_tokens=400", f"train.loss_agg={loss_agg}"])
    config, weights = training_config(tiny_model_dir), read_weights(tiny_model_dir)
    batches, updated = {}, {}
    for context in ("full", "rows"):
        batch = batches[context] = update_batch(tok, context=context)
        rows = list(range(len(batch["lengths"])))
        policy = build_policy(config, weights, CPU, torch.float32, False)
        critic = build_critic(config, weights, CPU, torch.float32, False)
        torch.manual_seed(0)  # the same value head in both contexts, with values that differ from token to token
        with torch.no_grad():
            torch.nn.init.normal_(critic.value_head.weight, std=0.1)
        batch["old_logprobs"] = train.forward_all(lambda *packed: policy_forward(policy, *packed)[0],
                                                  batch, rows, 400, CPU)
        values = train.forward_all(lambda *packed: critic_forward(critic, *packed), batch, rows,
                                   400, CPU)
        batch["step_advantages"], batch["returns"], batch["value_mask"] = rl.step_gae(batch["rewards"], values, batch["action_mask"],
                                                                                      batch["steps"], 0.9, 0.8)
        batch["values"] = values * batch["value_mask"]
        outcomes = torch.tensor([(i % 3) / 2 for i in range(6)])  # update_batch's rewards
        batch["advantages"] = rl.outcome_token_advantages(rl.grpo_advantages(outcomes, torch.tensor([0, 0, 0, 1, 1, 1])), batch["process"],
                                                          batch["action_mask"], batch["steps"])
        policy_sgd = torch.optim.SGD(policy.parameters(), lr=1.0)
        critic_sgd = torch.optim.SGD(critic.parameters(), lr=1.0)
        batch["shares"], _, _ = update.update_policy(policy, policy_sgd, batch, rows, False, cfg, 1, CPU)
        batch["vf_shares"], _ = update.update_critic(critic, critic_sgd, batch, rows, cfg, 1, CPU)
        updated[context] = {**dict(policy.named_parameters()), **{"critic." + n: p for n, p in critic.named_parameters()}}
    full, lastk = batches["full"], batches["rows"]
    assert len(full["lengths"]) == 6 and len(lastk["lengths"]) == sum(map(len, full["steps"])) > 6  # several two-turn trajectories
    for full_steps, lastk_steps in zip(full["steps"], lastk["steps"]):
        for (fr, fs, fe), (lr, ls, le) in zip(full_steps, lastk_steps, strict=True):
            assert fs == ls and torch.equal(full["input_ids"][fr, :fe], lastk["input_ids"][lr, :le])  # the same tokens
            for key, tol in (("old_logprobs", 1e-5), ("step_advantages", 1e-5), ("advantages", 0)):
                torch.testing.assert_close(lastk[key][lr, ls:le], full[key][fr, fs:fe], atol=tol, rtol=tol)
            torch.testing.assert_close(lastk["returns"][lr, ls], full["returns"][fr, fs], atol=1e-5, rtol=1e-5)
    assert lastk["step_advantages"].abs().sum() > 0 and lastk["advantages"].abs().sum() > 0
    assert lastk["shares"]["pg_loss"] == pytest.approx(full["shares"]["pg_loss"], abs=1e-6)
    assert lastk["shares"]["entropy"] == pytest.approx(full["shares"]["entropy"], rel=1e-5)
    assert lastk["vf_shares"]["vf_loss"] == pytest.approx(full["vf_shares"]["vf_loss"], rel=1e-5)
    for name, param in updated["full"].items():
        torch.testing.assert_close(updated["rows"][name], param, atol=1e-6, rtol=1e-5)


def test_a_step_value_is_the_critics_after_everything_the_policy_read(process_group, tiny_model_dir):
    """ppo.credit=step: V(s_k) is the critic's value of everything the policy read before step k's
    action (Agent-R1 v0.1's step MDP), the critic's output at the last token before the action, read
    through critic_forward's alignment as train.py reads it. With a one-token prompt V(s_0) is the
    value of that token: it changes with it, and the value loss, taken where the value is read, trains
    the critic (read one token early, it would be critic_forward's padding 0, which no gradient reaches)."""
    cfg = make_config("tiny", ["algo=ppo", "ppo.credit=step"])
    critic = build_critic(training_config(tiny_model_dir), read_weights(tiny_model_dir), CPU, torch.float32, False)
    torch.manual_seed(0)
    with torch.no_grad():
        torch.nn.init.normal_(critic.value_head.weight)
    #                     p  a0  a0  o   o   a1  a1     rows 0 and 1 differ in their prompt's one token only
    ids = torch.tensor([[5, 40, 41, 60, 61, 42, 43], [6, 40, 41, 60, 61, 42, 43], [5, 40, 41, 0, 0, 0, 0]])
    mask = torch.tensor([[0., 1, 1, 0, 0, 1, 1], [0., 1, 1, 0, 0, 1, 1], [0., 1, 1, 0, 0, 0, 0]])
    steps = [[(0, 1, 3), (0, 5, 7)], [(1, 1, 3), (1, 5, 7)], [(2, 1, 3)]]
    lengths = [7, 7, 3]
    batch = {"input_ids": ids, **shared_prompts([r[:n] for r, n in zip(ids.tolist(), lengths)], [m[:n] for m, n in zip(mask.tolist(), lengths)]),
             "action_mask": mask, "lengths": lengths, "trajectory": torch.tensor([0, 1, 2]), "steps": steps}
    rewards = torch.zeros_like(mask)
    rewards[:2, 6], rewards[2, 2] = 1.0, 1.0
    values = train.forward_all(lambda *packed: critic_forward(critic, *packed), batch,
                               [0, 1, 2], 400, CPU)
    advantages, batch["returns"], batch["value_mask"] = rl.step_gae(rewards, values, mask, steps, 1.0, 1.0)
    batch["values"] = values * batch["value_mask"]
    read = {}
    with torch.no_grad():
        for n, trajectory in enumerate(steps):
            for row, start, _ in trajectory:  # the critic on exactly what the policy had read before the action
                read[row, start] = critic(ids[row:row + 1, :start], torch.arange(start)[None], torch.tensor([start - 1]))[0]
                torch.testing.assert_close(batch["returns"][row, start] - advantages[row, start], read[row, start], atol=1e-5, rtol=1e-5)
    assert batch["value_mask"].nonzero().tolist() == [[0, 1], [0, 5], [1, 1], [1, 5], [2, 1]]
    assert abs(read[0, 1] - read[1, 1]) > 1e-3  # V(s_0) follows the prompt's token
    # a one-step trajectory after a one-token prompt: the value loss at V(s_0) alone moves the critic
    frozen = torch.optim.SGD(critic.parameters(), lr=0.0)
    _, stats = update.update_critic(critic, frozen, batch, [2], cfg, 1, CPU)
    assert stats["vf_grad_norm"] > 0
