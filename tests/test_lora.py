"""
LoRA (train.lora_rank): the adapted policy's logprobs and gradients against plain autograd through
W + (alpha / r) B A, the base with the adapters off, the merged weights in the real vLLM engine,
checkpoints of the adapters alone and their bit-identical resume, the export (merged, and peft's
adapter) against the trainer. A GRPO and a PPO step with LoRA on 2 ranks in bf16: test_train.py.
"""

import math
import os

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.nn.utils import parametrize
from transformers import AutoModelForCausalLM, AutoTokenizer

import padded
import procs
from nanoagent.checkpoint import check_resume, export_hf, load_latest, save_checkpoint
from nanoagent.config import ConfigError, make_config, to_dict
from nanoagent.engine import SamplingConfig, VLLMEngine, stop_token_ids
from nanoagent.model import (BaseModel, build_models, build_policy, full_tensors, gathered, lora_config,
                             merge_adapters, policy_forward, read_weights, training_config)

CPU = torch.device("cpu")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def lora_cfg(model_dir, *overrides):
    return make_config("tiny", [f"model={model_dir}", "train.lora_rank=4", "train.lora_alpha=8", *overrides])


def lora_policy(model_dir, dtype=torch.float32, seed=0, targets=",".join(TARGETS)):
    cfg = lora_cfg(model_dir, f"train.lora_targets={targets}")
    return build_policy(training_config(model_dir), read_weights(model_dir), CPU, dtype, False, False,
                        lora_config(cfg.train), seed)


def adapters(policy):
    """{layer name: (A, B)} of a policy's LoRA layers."""
    return {name: (m.lora_A["default"].weight, m.lora_B["default"].weight)
            for name, m in policy.named_modules() if hasattr(m, "lora_A")}


def randomise_b(policy, seed=1):
    """B away from 0 (where every adapter starts), so that the adapters change the function."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, b in adapters(policy).values():
            local = b.to_local()
            local.copy_(0.05 * torch.randn(local.shape, generator=generator))


def packed(rows):
    """Rows laid end to end: ([1, T] ids, [1, T] positions, [1, T] needed: every token but a row's first)."""
    ids = torch.tensor([t for r in rows for t in r])[None]
    positions = torch.cat([torch.arange(len(r)) for r in rows])[None]
    return ids, positions, positions > 0


def aligned(per_row, rows):
    """[B, L] aligned per-row values -> [1, T] as packed() lays the rows."""
    return torch.cat([per_row[i, :len(r)] for i, r in enumerate(rows)])[None]


class PlusLoRA(nn.Module):
    """W -> W + scaling * B A, as a parametrisation of a plain Linear's weight: the reference."""

    def __init__(self, a, b, scaling):
        super().__init__()
        self.a, self.b, self.scaling = nn.Parameter(a), nn.Parameter(b), scaling

    def forward(self, weight):
        return weight + self.scaling * (self.b @ self.a)


ROWS = [[5, 17, 300, 42, 9, 77, 120], [3, 250, 8, 61, 199]]


def test_lora_logprobs_and_gradients_match_plain_autograd_and_adapters_off_are_the_base(process_group,
                                                                                      tiny_model_dir):
    policy = lora_policy(tiny_model_dir)
    base = build_policy(training_config(tiny_model_dir), read_weights(tiny_model_dir), CPU, torch.float32, False)
    ids, positions, needed = packed(ROWS)
    base_logprobs = policy_forward(base, ids, positions, needed)[0]
    # B = 0 at the start: the adapted policy is its base exactly (the KL to the base is 0 at step 0)
    assert torch.equal(policy_forward(policy, ids, positions, needed)[0], base_logprobs)
    assert sum(p.numel() for p in policy.parameters() if p.requires_grad) == sum(
        a.numel() + b.numel() for a, b in adapters(policy).values())

    randomise_b(policy)
    logprobs = policy_forward(policy, ids, positions, needed)[0]
    weights = torch.linspace(0.5, 1.5, ids.shape[1])[None]
    (logprobs * weights * needed).sum().backward()

    plain = padded.plain_lm(tiny_model_dir)
    plain.requires_grad_(False)
    reference = {}
    for name, (a, b) in adapters(policy).items():
        linear = plain.get_submodule(name)
        reference[name] = PlusLoRA(gathered(a).clone(), gathered(b).clone(), 8 / 4)
        parametrize.register_parametrization(linear, "weight", reference[name])
    expected = aligned(padded.logprobs(plain, ROWS)[0], ROWS)
    (expected * weights * needed).sum().backward()
    torch.testing.assert_close(logprobs[needed], expected[needed], atol=1e-5, rtol=0)
    assert (logprobs - base_logprobs)[needed].abs().max() > 1e-2  # the adapters moved it
    for name, (a, b) in adapters(policy).items():
        torch.testing.assert_close(a.grad.full_tensor(), reference[name].a.grad, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(b.grad.full_tensor(), reference[name].b.grad, atol=1e-5, rtol=1e-4)
    assert all(p.grad is None for p in policy.parameters() if not p.requires_grad)

    # the adapters off: the base exactly, and on again afterwards
    with torch.no_grad():
        assert torch.equal(policy_forward(BaseModel(policy), ids, positions, needed)[0], base_logprobs)
        assert torch.equal(policy_forward(policy, ids, positions, needed)[0], logprobs.detach())


@pytest.mark.skipif(os.environ.get("TORCH_COMPILE_DISABLE") == "1", reason="TORCH_COMPILE_DISABLE=1")
def test_compiled_lora_layers_compute_what_eager_ones_do(process_group, tiny_model_dir):
    """train.compile with LoRA: the layers' norms and MLPs (their adapters inside) compiled, through FSDP2 and
    activation checkpointing, give the eager policy's logprobs and the adapters' gradients."""
    config, weights, cfg = training_config(tiny_model_dir), read_weights(tiny_model_dir), lora_cfg(tiny_model_dir)
    eager, compiled = (build_policy(config, weights, CPU, torch.float32, True, compile_layers, lora_config(cfg.train))
                       for compile_layers in (False, True))
    randomise_b(eager)
    randomise_b(compiled)
    ids, positions, needed = packed(ROWS)
    for model in (eager, compiled):
        policy_forward(model, ids, positions, needed)[0][needed].sum().backward()
    torch.testing.assert_close(policy_forward(compiled, ids, positions, needed)[0],
                               policy_forward(eager, ids, positions, needed)[0], atol=1e-5, rtol=1e-5)
    grads = {name: p.grad.full_tensor() for name, p in eager.named_parameters() if p.requires_grad}
    for name, p in compiled.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(p.grad.full_tensor(), grads[name], atol=1e-4, rtol=1e-4, msg=name)


def test_lora_targets_that_name_no_linear_layer_are_refused(process_group, tiny_model_dir):
    with pytest.raises(ConfigError, match=r"train.lora_targets: qkv is no linear layer .* \(it has .*q_proj"):
        lora_policy(tiny_model_dir, targets="q_proj,qkv")
    only = lora_policy(tiny_model_dir, targets="down_proj")
    assert {name.rpartition(".")[2] for name in adapters(only)} == {"down_proj"}


def test_merging_in_place_keeps_the_function_and_makes_it_the_base(process_group, tiny_model_dir):
    policy = lora_policy(tiny_model_dir)
    randomise_b(policy)
    ids, positions, needed = packed(ROWS)
    with torch.no_grad():
        before = policy_forward(policy, ids, positions, needed)[0]
        merge_adapters(policy)
        after = policy_forward(policy, ids, positions, needed)[0]
        base = policy_forward(BaseModel(policy), ids, positions, needed)[0]
    torch.testing.assert_close(after, before, atol=1e-5, rtol=0)
    assert torch.equal(base, after)  # B = 0 now: the adapters add nothing
    assert all(torch.equal(b.full_tensor(), torch.zeros(b.shape)) for _, b in adapters(policy).values())


def test_in_bf16_the_frozen_base_is_stored_in_bf16_and_the_adapters_train_in_fp32(process_group, tiny_model_dir):
    policy = lora_policy(tiny_model_dir, dtype=torch.bfloat16)
    dtypes = {p.requires_grad: set() for p in policy.parameters()}
    for p in policy.parameters():
        dtypes[p.requires_grad].add(p.dtype)
    assert dtypes == {True: {torch.float32}, False: {torch.bfloat16}}
    randomise_b(policy)
    ids, positions, needed = packed(ROWS)
    logprobs = policy_forward(policy, ids, positions, needed)[0]
    logprobs[needed].sum().backward()
    assert all(p.grad.dtype == torch.float32 and p.grad.full_tensor().abs().sum() > 0
               for p in policy.parameters() if p.requires_grad)
    merge_adapters(policy)
    with torch.no_grad():
        merged = policy_forward(policy, ids, positions, needed)[0]
    assert all(p.dtype == torch.bfloat16 for p in policy.parameters() if not p.requires_grad)
    torch.testing.assert_close(merged[needed], logprobs.detach()[needed], atol=0.05, rtol=0)  # bf16 rounding


def test_merged_weights_in_the_engine_give_the_trainers_logprobs(process_group, tiny_model_dir):
    """The push (full_tensors) sends W + (alpha / r) B A under the LM's names: the real vLLM engine
    samples from the adapted policy, its logprobs the trainer's to fp32 rounding."""
    policy = lora_policy(tiny_model_dir)
    randomise_b(policy, seed=2)
    pushed = dict(full_tensors(policy))
    assert set(pushed) == {n for n, _ in padded.load_causal_lm(tiny_model_dir).named_parameters(remove_duplicate=False)}
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    engine = VLLMEngine(tiny_model_dir, stop_token_ids(tok), max_model_len=128, dtype="float32", seed=0, compile=False)
    try:
        engine.load_weights(full_tensors(policy))
        prompts = [r[:4] for r in ROWS] * 2
        gens = engine.generate(prompts, SamplingConfig(max_new_tokens=10, temperature=1.0), seeds=[0, 1, 2, 3])
        rows = [p + list(g.token_ids) for p, g in zip(prompts, gens)]
        ids, positions, needed = packed(rows)
        with torch.no_grad():
            trainer = policy_forward(policy, ids, positions, needed)[0][0]
            base = policy_forward(BaseModel(policy), ids, positions, needed)[0][0]
    finally:
        del engine
        from vllm.distributed import cleanup_dist_env_and_memory
        cleanup_dist_env_and_memory()  # ends the world of one the engine joined: a new one for the module's other tests
        store = torch.distributed.TCPStore("127.0.0.1", 0, 1, is_master=True)  # binds its own port
        torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
    start, diffs, moved = 0, [], []
    for p, g in zip(prompts, gens):
        at = slice(start + len(p), start + len(p) + len(g.token_ids))
        diffs.append((torch.tensor(g.logprobs) - trainer[at]).abs().max())
        moved.append((torch.tensor(g.logprobs) - base[at]).abs().max())
        start += len(p) + len(g.token_ids)
    assert max(diffs) <= 1e-4, diffs
    assert max(moved) > 1e-2  # the engine's weights are the adapted ones, not the base's


def step(models, optimizers, seed):
    """One optimizer step of every model from fixed gradients of its trained parameters (a seed's)."""
    generator = torch.Generator().manual_seed(seed)
    for name, model in models.items():
        for p in model.parameters():
            if p.requires_grad:
                p.grad = torch.distributed.tensor.distribute_tensor(
                    torch.randn(p.shape, generator=generator), p.device_mesh, p.placements)
        optimizers[name].step()
        optimizers[name].zero_grad(set_to_none=True)


def trained_state(models, optimizers):
    return {name: ({n: gathered(p).clone() for n, p in m.named_parameters() if p.requires_grad},
                   [{k: v.full_tensor().clone() if hasattr(v, "full_tensor") else v for k, v in s.items()}
                    for s in optimizers[name].state.values()])
            for name, m in models.items()}


def test_a_lora_checkpoint_holds_the_adapters_alone_and_a_warm_started_run_resumes_bit_identically(
        process_group, tiny_model_dir, tmp_path):
    """A warm start's adapters merged into the base (exported to run_dir/warm_start, as imitate does),
    then RL's: a resume builds the base from warm_start and loads the adapters, the critic's and their
    optimizer state; its next steps, logprobs and reference logprobs are the run's, bit for bit."""
    cfg = lora_cfg(tiny_model_dir, "algo=ppo", "train.kl_mode=loss", f"run_dir={tmp_path / 'run'}")
    warm_dir = str(tmp_path / "run" / "warm_start")
    models, ref, optimizers = build_models(cfg, tiny_model_dir, None, CPU)
    policy = models["policy"]
    assert isinstance(ref, BaseModel) and ref.policy is policy  # no second copy of the weights
    randomise_b(policy)  # the warm start's adapters
    merge_adapters(policy)
    export_hf(policy, AutoTokenizer.from_pretrained(tiny_model_dir), warm_dir, torch.float32)
    step(models, optimizers, 0)
    path = save_checkpoint(cfg.run_dir, 1, models, optimizers, {}, to_dict(cfg))
    # the adapters, the value head and their AdamW state: no base weight
    saved = FileSystemReader(path).read_metadata().state_dict_metadata
    parameters = [key for key in saved if key.endswith((".weight", ".bias", ".exp_avg", ".exp_avg_sq"))]
    assert parameters and all(".lora_" in key or ".value_head." in key for key in parameters), sorted(saved)
    held = sum(math.prod(saved[key].size) * 4 for key in parameters)
    assert held == sum(p.numel() * 4 * 3 for m in models.values() for p in m.parameters() if p.requires_grad)

    ids, positions, needed = packed(ROWS)
    step(models, optimizers, 1)
    expected = trained_state(models, optimizers)
    with torch.no_grad():
        logprobs = policy_forward(policy, ids, positions, needed)[0]
        ref_logprobs = policy_forward(ref, ids, positions, needed)[0]

    resumed, resumed_ref, resumed_optimizers = build_models(cfg, tiny_model_dir, warm_dir, CPU)
    assert load_latest(cfg.run_dir, resumed, resumed_optimizers)[1] == 1
    step(resumed, resumed_optimizers, 1)
    got = trained_state(resumed, resumed_optimizers)
    for name in expected:
        assert expected[name][0].keys() == got[name][0].keys()
        assert all(torch.equal(expected[name][0][k], got[name][0][k]) for k in expected[name][0])
        for a, b in zip(expected[name][1], got[name][1]):
            assert all(torch.equal(a[k], b[k]) for k in a)
    with torch.no_grad():
        assert torch.equal(policy_forward(resumed["policy"], ids, positions, needed)[0], logprobs)
        assert torch.equal(policy_forward(resumed_ref, ids, positions, needed)[0], ref_logprobs)

    # a resume that changes the adapters is refused, naming the key
    with pytest.raises(ConfigError, match=r"train.lora_rank: 4 -> 8"):
        check_resume(path, lora_cfg(tiny_model_dir, "algo=ppo", "train.kl_mode=loss", "train.lora_rank=8",
                                    f"run_dir={tmp_path / 'run'}"))


def test_the_export_is_merged_and_peft_reads_its_adapter_over_the_base(process_group, tiny_model_dir, tmp_path):
    from peft import PeftModel
    policy = lora_policy(tiny_model_dir)
    randomise_b(policy, seed=3)
    out = str(tmp_path / "hf")
    export_hf(policy, AutoTokenizer.from_pretrained(tiny_model_dir), out, torch.float32, base=tiny_model_dir)
    assert sorted(os.listdir(os.path.join(out, "adapter"))) == ["adapter_config.json", "adapter_model.safetensors"]
    ids, positions, needed = packed(ROWS)
    with torch.no_grad():
        trainer = policy_forward(policy, ids, positions, needed)[0]
        merged = aligned(padded.logprobs(padded.plain_lm(out), ROWS)[0], ROWS)
        with_adapter = PeftModel.from_pretrained(padded.plain_lm(tiny_model_dir), os.path.join(out, "adapter"))
        over_base = aligned(padded.logprobs(with_adapter, ROWS)[0], ROWS)
    torch.testing.assert_close(merged[needed], trainer[needed], atol=1e-5, rtol=0)
    torch.testing.assert_close(over_base[needed], trainer[needed], atol=1e-5, rtol=0)
    assert AutoModelForCausalLM.from_pretrained(out).config.architectures == ["Qwen2ForCausalLM"]
