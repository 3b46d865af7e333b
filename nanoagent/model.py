"""
The trainer's models, how they are loaded and sharded, and their forward passes over trajectories:
the policy (a Hugging Face causal LM, its LM head fused with the logprob), the critic (the same
backbone plus a scalar value head, its own weights) and the reference (a frozen copy of the initial
policy, only with a KL term).

LoRA (train.lora_rank > 0): peft's adapters in every targeted linear layer of the backbone, the base
weights frozen (the critic's value head is trained whole). What a full fine-tune needs twice costs
nothing then: the KL reference is the policy with its adapters switched off (BaseModel), and the
engine gets the merged weights W + (alpha / r) B A, the same names and shapes as a full model's.

Loading at scale: a 7B model in fp32 is 30 GB, and eight ranks each building one on the host is 240 GB.
So every model is built on the meta device, sharded with FSDP2, allocated shard by shard, and filled by
broadcast from rank 0, the only rank that reads the checkpoint.

Precision: fp32 master weights and optimizer state; with train.dtype=bfloat16 FSDP2 all-gathers and
computes in bf16 and reduces gradients in fp32, on a CPU (gloo) as on a GPU (NCCL). The value head stays
fp32: it is regressed onto returns of order 1. Train mode (transformers checkpoints activations only
there), dropout off, no KV cache.

Alignment, the one thing to get right: the logprob, entropy and value of token t come from the hidden
state at position t-1 (where token t was chosen) and are stored at index t (index 0 holds 0), so every
per-token tensor is [B, L], aligned with the ids and the action mask of the row.

Packed micro-batches (batch.micro_steps): the rows are laid end to end into one sequence [1, T], never
padding; packed_attention, plugged into transformers' attention interface, keeps attention within each
row with one scaled_dot_product_attention call per bucket of rows of about the same length (flash on a
GPU where no mask is needed, no T x T mask anywhere). Rows that begin with the same prompt (a GRPO
group's samples) share one copy of it, each attending to the prompt and to itself (a tree), so the
prompt's forward and backward are paid once, not G times. The LM head runs only at the positions
whose next token is an action (a 152k vocabulary on Qwen2.5: tool results and prompts are most of a
row), fused with the log-softmax and entropy a chunk at a time, so that no tokens x vocabulary logits
tensor is ever made (Policy); the value head runs only where a value is read.
"""

import math
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from accelerate import init_empty_weights
from peft import LoraConfig, inject_adapter_in_model
from peft.tuners.lora import LoraLayer
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from transformers import AttentionInterface, AutoConfig, AutoModelForCausalLM

from nanoagent.batch import micro_steps, unpack
from nanoagent.config import ConfigError
from nanoagent.logprobs import head_logprobs

# the trainer's attention implementation (packed_attention), by its name in transformers
PACKED = "nanoagent_packed"


def attention_plan(position_ids):
    """
    How packed_attention attends in a packed sequence ([1, T] positions), read once a forward on the
    host. A segment is a run of positions going up by one, (start, end, prompt start, prompt length
    p): one that starts at position 0 opens a row (or a shared prompt), p = 0; one that starts at
    p > 0 is a row's own tokens after a shared prompt, the first p tokens of the last segment that
    opened at 0. Segments of about the same length (query and key lengths up to the same powers of 2)
    make one bucket, computed by one attention call: (S segments, query index [S * Q] and key index
    [S * K] into the packed sequence, mask [S, 1, Q, K], or None where every segment opens a row:
    plain causal then, as a row's padded keys come after all its queries). Padded queries see one key
    and are dropped. Returns (buckets, out [T]: where each position's output sits among the buckets'
    outputs laid end to end). A segment that starts at p > 0 with no segment of at least p tokens opened
    at 0 before it cannot be a shared prompt's continuation: it is refused, not read as one.
    """
    positions, device = position_ids[0], position_ids.device
    # where each segment starts: index 0 always
    starts = (torch.diff(positions, prepend=positions[:1]) != 1).nonzero().flatten().tolist()
    by_length, root, opened = {}, 0, 0  # the last segment opened at 0: where it starts, its length
    for s, e, p in zip(starts, starts[1:] + [len(positions)], positions[starts].tolist()):
        if p == 0:
            root, opened = s, e - s
        elif p > opened:
            raise ValueError(f"packed positions: the segment at index {s} starts at position {p}, and no "
                             f"segment of at least {p} tokens opened at 0 before it: a row's positions "
                             "start at 0, a row after a shared prompt goes on from the prompt's "
                             "(batch.packed_layout)")
        by_length.setdefault(((e - s - 1).bit_length(), (p + e - s - 1).bit_length()),
                             []).append((s, e, root, p))
    buckets, out, done = [], [0] * len(positions), 0
    for segments in by_length.values():
        S, Q, K = (len(segments), max(e - s for s, e, _, _ in segments),
                   max(p + e - s for s, e, _, p in segments))
        query_index, key_index = torch.zeros(S, Q, dtype=torch.long), torch.zeros(S, K, dtype=torch.long)
        mask = None if all(p == 0 for _, _, _, p in segments) else torch.zeros(S, 1, Q, K, dtype=torch.bool)
        for i, (s, e, root, p) in enumerate(segments):
            n = e - s
            query_index[i, :n] = key_index[i, p:p + n] = torch.arange(s, e)
            key_index[i, :p] = torch.arange(root, root + p)
            out[s:e] = range(done + i * Q, done + i * Q + n)
            if mask is not None:
                mask[i, 0, :n, :p] = True
                mask[i, 0, :n, p:p + n] = torch.ones(n, n, dtype=torch.bool).tril()
                mask[i, 0, n:, 0] = True
        buckets.append((S, query_index.flatten().to(device), key_index.flatten().to(device),
                        mask if mask is None else mask.to(device)))
        done += S * Q
    return buckets, torch.tensor(out, device=device)


def packed_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, position_ids=None,
                     plan=None, **kwargs):
    """
    Causal attention within each row of a packed sequence: query [1, H, T, D], key and value
    [1, Hkv, T, D]. A row attends to itself; a row's own tokens after a shared prompt attend to the
    prompt and to themselves (a tree). One attention call per bucket of segments (attention_plan),
    not per row: on a GPU, a call per row and layer is launch-bound (a GRPO batch has dozens). The
    forward's caller passes the plan (model(..., plan=...), which transformers hands every layer),
    read once from the positions: read here, every layer would wait for the GPU. Returns
    ([1, T, H, D], None), as transformers' attention functions do. No mask is built over the packed
    sequence (transformers makes none for an implementation it does not know): its own sdpa path
    keeps packed rows apart through a T x T block-diagonal mask, T^2 memory and time.
    """
    if query.shape[0] != 1:
        raise ValueError(f"packed attention takes one packed sequence, [1, T] ids and positions; "
                         f"got a batch of {query.shape[0]}")
    buckets, out = plan if plan is not None else attention_plan(position_ids)
    H, D, repeat = query.shape[1], query.shape[3], query.shape[1] // key.shape[1]
    results = []
    for S, query_index, key_index, mask in buckets:
        q = query[0].index_select(1, query_index).view(H, S, -1, D).transpose(0, 1)         # [S, H, Q, D]
        k, v = (x[0].index_select(1, key_index).view(x.shape[1], S, -1, D).transpose(0, 1)
                .repeat_interleave(repeat, 1) for x in (key, value))                        # [S, H, K, D]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                           scale=scaling)                                   # [S, H, Q, D]
        results.append(o.transpose(1, 2).reshape(-1, H, D))                                # [S * Q, H, D]
    return torch.cat(results).index_select(0, out)[None], None                              # [1, T, H, D]


AttentionInterface.register(PACKED, packed_attention)


class Policy(nn.Module):
    """
    The causal LM as the trainer computes it: its backbone, then its LM head fused with the logprob and
    entropy (logprobs.head_logprobs), so that the logits of a micro-batch's action tokens ([N, V], 5 GB
    in bf16 for 16k tokens of Qwen's vocabulary) are never made. It holds the LM's own modules under the
    LM's own names (model.*, lm_head.*): its state dict, checkpoints, the weight push and the export
    are the LM's. An LM head with a bias is refused (Qwen2 and Llama have none). lora_config: peft's
    LoraConfig of the adapters in lm.model, None for full fine-tuning.
    """

    def __init__(self, lm, lora_config=None):
        super().__init__()
        if lm.lm_head.bias is not None:
            raise ValueError("Policy: the LM head has a bias; head_logprobs computes hidden @ weight.T only")
        self.model, self.lm_head, self.config = lm.model, lm.lm_head, lm.config
        self.generation_config, self.lora_config = lm.generation_config, lora_config

    def forward(self, input_ids, position_ids, at, labels, temperature=1.0, top_p=1.0):
        """(logprobs, entropy, nucleus) [N] fp32 of labels [N] predicted at the positions `at` ([N]) of
        a packed sequence [1, T] (logprobs.head_logprobs)."""
        hidden = self.model(input_ids=input_ids, position_ids=position_ids, plan=attention_plan(position_ids),
                            use_cache=False).last_hidden_state                              # [1, T, H]
        return head_logprobs(hidden[0, at], self.lm_head.weight, labels, temperature, top_p)  # [N] x 3


class BaseModel:
    """
    The policy with its LoRA adapters switched off: the base model they adapt, called as the policy is
    (policy_forward), the KL reference without a second copy of the weights. The switch is peft's flag
    that its layers' forward reads, set directly: peft's enable_adapters also flips the adapters'
    requires_grad, and FSDP2 makes a parameter's unsharded copy once, with the flag it had then.
    """

    def __init__(self, policy):
        self.policy = policy
        self.adapted = [m for m in policy.modules() if isinstance(m, LoraLayer)]

    def __call__(self, *args):
        for layer in self.adapted:
            layer._disable_adapters = True
        try:
            return self.policy(*args)
        finally:
            for layer in self.adapted:
                layer._disable_adapters = False


class Critic(nn.Module):
    """Backbone of the pretrained LM (without its LM head) + a linear value head, zero-initialised
    so the first values are 0 and the first advantages are the plain returns."""

    def __init__(self, lm, lora_config=None):
        super().__init__()
        self.backbone, self.lora_config = lm.model, lora_config
        self.value_head = nn.Linear(lm.config.hidden_size, 1, dtype=torch.float32)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    def forward(self, input_ids, position_ids, at):
        """The values of the states at positions `at` ([N]) of a packed sequence [1, T]: [N] fp32."""
        hidden = self.backbone(input_ids=input_ids, position_ids=position_ids,
                               plan=attention_plan(position_ids),
                               use_cache=False).last_hidden_state                           # [1, T, H]
        values = self.value_head(hidden[0, at].float())                                     # [N, 1] fp32
        # FSDP2 hooks the backward onto a module's output, which must not be a view of another tensor
        return values.view(-1).clone()                                                      # [N]


# -----------------------------------------------------------------------------
# loading and sharding

def training_config(path):
    """The model's config with dropout off: the trainer runs in train mode, and old, new and
    reference logprobs must all be the same deterministic function of the weights."""
    config = AutoConfig.from_pretrained(path)
    for key, value in config.to_dict().items():
        if isinstance(value, float) and ("dropout" in key or key.endswith("pdrop")):
            setattr(config, key, 0.0)
    return config


def read_weights(path):
    """The checkpoint's tensors, read on rank 0 only, in the dtype they are stored in (bf16 for
    Qwen2.5); the other ranks get {} and receive their shards by broadcast."""
    if dist.get_rank() != 0:
        return {}
    return AutoModelForCausalLM.from_pretrained(path, dtype="auto").state_dict()


def backbone(model):
    """The transformer (embeddings, blocks, final norm) of a Policy or of a Critic."""
    return model.backbone if isinstance(model, Critic) else model.model


def decoder_layers(model):
    """The list of transformer blocks of a Policy or of a Critic."""
    return backbone(model).layers


def shard(model, compute_dtype=torch.float32, activation_checkpointing=False, compile_layers=False):
    """
    FSDP2: shard each decoder layer and the root over the default process group (parameters,
    gradients and, once the optimizer is built on the sharded parameters, optimizer state).
    Parameters are all-gathered and computed in compute_dtype, gradients reduced in fp32.
    FSDP averages the ranks' gradients; rl.aggregate_loss gives each rank its share of a global
    mean, whose gradients must be summed: scale the loss by the world size before backward
    (gloo has no pre-multiplied sum, so the divide factor of FSDP cannot be set to 1 on the CPU).
    activation_checkpointing: recompute every k-th decoder layer's activations in the backward pass
    (True: every layer; 2: every other one, half the recompute for half the memory saved; 0: none).
    compile_layers: regional torch.compile of each decoder layer's norms and MLP, with dynamic shapes
    (packed micro-batches differ in length): eager PyTorch runs their element-wise work (RMSNorm,
    SwiGLU, dtype casts) kernel by kernel, launch-bound on a GPU. Not the attention: its packing plan
    (attention_plan) is host data whose structure changes from micro-batch to micro-batch, and a
    compiled region that took it would be recompiled for each. Returns the model in train mode.
    """
    if activation_checkpointing:  # non-reentrant: transformers' checkpointing, layer by layer
        backbone(model).gradient_checkpointing_enable()
        for i, layer in enumerate(decoder_layers(model)):
            layer.gradient_checkpointing = i % activation_checkpointing == 0
    mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    for layer in decoder_layers(model):
        if compile_layers:
            for part in (layer.input_layernorm, layer.mlp, layer.post_attention_layernorm):
                part.compile(dynamic=True)
        fully_shard(layer, mp_policy=mp)
    if isinstance(model, Critic):
        fully_shard(model.value_head,
                    mp_policy=MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32))
    fully_shard(model, mp_policy=mp)
    return model.train()


def lora_config(train):
    """peft's LoraConfig of train.lora_rank, lora_alpha and lora_targets; None for full fine-tuning."""
    if not train.lora_rank:
        return None
    targets = [name.strip() for name in train.lora_targets.split(",") if name.strip()]
    return LoraConfig(r=train.lora_rank, lora_alpha=train.lora_alpha, target_modules=targets, lora_dropout=0.0,
                      bias="none")


def empty_lm(config, dtype, lora=None):
    """The LM's structure with its parameters on the meta device (no memory) and its buffers, such
    as the rotary frequencies that checkpoints do not hold, computed for real; with lora (a LoraConfig),
    peft's adapters in the backbone's targeted linear layers, each target matching at least one."""
    with init_empty_weights():
        lm = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=PACKED)
    # init_empty_weights unties the embedding and the LM head; the config says whether they are one
    lm.tie_weights()
    if lora is not None:
        linear = {name.rpartition(".")[2] for name, m in lm.model.named_modules() if isinstance(m, nn.Linear)}
        if missing := sorted(set(lora.target_modules) - linear):
            raise ConfigError(f"train.lora_targets: {', '.join(missing)} is no linear layer of "
                              f"{config.model_type}'s backbone (it has {', '.join(sorted(linear))})")
        inject_adapter_in_model(lora, lm.model)
    return lm


def train_adapters_only(model, compute_dtype):
    """With LoRA: only the adapters (and a critic's value head) train, in fp32; the base weights are
    frozen and stored in the compute dtype, all they are ever computed in (no fp32 master copy: a 7B
    base is 15 GB in bf16, not 30)."""
    if model.lora_config is not None:
        for name, param in model.named_parameters():
            param.requires_grad_(".lora_" in name or name.startswith("value_head."))
            if not param.requires_grad:
                param.data = param.data.to(compute_dtype)
    return model


def adapted_weights(model, weights, seed):
    """
    Rank 0's full state dict (`weights`, the LM's names) for a model with LoRA adapters: the base
    weights under peft's names (`q_proj.base_layer.weight`), A initialised as peft does (Kaiming
    uniform, seeded), B zero, so that the adapted model starts as the base model exactly. Unchanged
    without adapters or off rank 0 ({}).
    """
    if not weights or model.lora_config is None:
        return weights
    generator, out = torch.Generator().manual_seed(seed), {}
    for name, meta in model.state_dict().items():
        if ".lora_A." in name:
            out[name] = nn.init.kaiming_uniform_(torch.empty(meta.shape), a=math.sqrt(5), generator=generator)
        elif ".lora_B." in name:
            out[name] = torch.zeros(meta.shape)
        else:
            out[name] = weights[name.replace(".base_layer.", ".")].to(meta.dtype)
    return out


def gathered(param):
    """A parameter's full tensor: its shards all-gathered (FSDP2), or itself."""
    return param.full_tensor() if hasattr(param, "full_tensor") else param.data


def merged_weight(layer):
    """A LoRA linear layer's weight with its adapter merged in, W + (alpha / r) B A: [out, in], full (its
    shards gathered)."""
    weight, a, b = (gathered(p) for p in (layer.base_layer.weight, layer.lora_A["default"].weight,
                                          layer.lora_B["default"].weight))
    return weight + layer.scaling["default"] * (b @ a)


def merged_state_dict(full, lora):
    """A full state dict of a model with LoRA adapters (peft's names) -> the LM's: each adapted weight
    merged as merged_weight does (alpha / r the scaling), the adapters gone."""
    scaling, out = lora.lora_alpha / lora.r, {}
    for name, tensor in full.items():
        layer, _, kind = name.partition(".base_layer.")
        if kind == "weight":
            a, b = full[f"{layer}.lora_A.default.weight"], full[f"{layer}.lora_B.default.weight"]
            out[f"{layer}.weight"] = tensor + scaling * (b @ a)
        elif ".lora_" not in name:
            out[name.replace(".base_layer.", ".")] = tensor
    return out


@torch.no_grad()
def merge_adapters(policy):
    """
    Merge the adapters into the frozen base weights in place, W <- W + (alpha / r) B A (rounded to the
    base's dtype, the compute dtype: a resume reads it back from the export in that dtype, the same
    values), then B <- 0: the adapted policy is the same function, and its base is now it (a warm
    start's result, RL's KL reference). Each rank adds its rows: FSDP2 shards W [out, in] and B
    [out, r] by rows alike.
    """
    for layer in policy.modules():
        if isinstance(layer, LoraLayer):
            weight, a, b = (layer.base_layer.weight, layer.lora_A["default"].weight,
                            layer.lora_B["default"].weight)
            weight.to_local().add_(layer.scaling["default"] * (b.to_local() @ a.full_tensor()))
            b.to_local().zero_()


def build_sharded(model, weights, device, compute_dtype, activation_checkpointing=False,
                  compile_layers=False, seed=0):
    """
    An empty model (meta parameters, real buffers) sharded, allocated on the device shard by shard,
    and filled from rank 0's `weights` (a full state dict; {} on the other ranks) by broadcast, its
    LoRA adapters (if any) initialised from seed.
    """
    weights = adapted_weights(model, weights, seed)
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    shard(model, compute_dtype, activation_checkpointing, compile_layers)
    model.to_empty(device=device)
    with torch.no_grad():
        for name, b in model.named_buffers():
            b.copy_(buffers[name])
    # a copy: set_model_state_dict puts this model's shards into the dict it is given
    set_model_state_dict(model, dict(weights),
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    return model


def build_policy(config, weights, device, compute_dtype, activation_checkpointing, compile_layers=False,
                 lora=None, seed=0):
    """The policy: fp32 master weights, computed in compute_dtype; with lora, its adapters train alone
    (train_adapters_only)."""
    policy = train_adapters_only(Policy(empty_lm(config, torch.float32, lora), lora), compute_dtype)
    return build_sharded(policy, weights, device, compute_dtype, activation_checkpointing, compile_layers, seed)


def build_critic(config, weights, device, compute_dtype, activation_checkpointing, compile_layers=False,
                 lora=None, seed=0):
    """The critic: the LM's backbone weights (`model.*` -> `backbone.*`) and a zero value head; with lora,
    adapters of its own and the value head train."""
    critic = train_adapters_only(Critic(empty_lm(config, torch.float32, lora), lora), compute_dtype)
    if weights:  # rank 0
        weights = {"backbone." + k[len("model."):]: v for k, v in weights.items() if k.startswith("model.")}
        weights.update({f"value_head.{k}": v for k, v in critic.value_head.state_dict().items()})
    return build_sharded(critic, weights, device, compute_dtype, activation_checkpointing, compile_layers,
                         seed + 1)


def build_reference(config, weights, device, compute_dtype):
    """The frozen reference policy, stored in the compute dtype: it is never updated, so it needs
    no fp32 master copy."""
    return build_sharded(Policy(empty_lm(config, compute_dtype)), weights, device,
                         compute_dtype).requires_grad_(False)


def build_models(cfg, model_path, warm_dir, device):
    """Policy, critic (ppo), frozen reference (with a KL term) and their AdamW optimizers (over what
    trains), built sharded from rank 0's copy of the weights. bf16 compute means the same on a CPU as
    on a GPU. The reference is the policy RL starts from: a resumed run's warm_dir when it has one,
    else the model; on a fresh start with a warm start (warm_dir None) the warm start returns it. With
    LoRA it is the policy's base (BaseModel), which a resumed warm-started run reads from warm_dir."""
    compute_dtype, lora = getattr(torch, cfg.train.dtype), lora_config(cfg.train)
    config, weights = training_config(model_path), read_weights(model_path)
    warm_started = warm_dir is not None and os.path.isdir(warm_dir)  # a resumed run that warm-started
    checkpointing = cfg.train.checkpoint_every if cfg.train.activation_checkpointing else 0
    models = {"policy": build_policy(config, read_weights(warm_dir) if lora and warm_started else weights,
                                     device, compute_dtype, checkpointing, cfg.train.compile, lora, cfg.seed)}
    if cfg.algo == "ppo":
        models["critic"] = build_critic(config, weights, device, compute_dtype, checkpointing,
                                        cfg.train.compile, lora, cfg.seed)
    ref = None  # a fresh start's warm start returns its own, the warm-started policy (imitation.imitate)
    if warm_started or lora:
        ref = load_reference(cfg, warm_dir, models["policy"], device)
    elif cfg.train.kl_mode != "none" and (warm_dir is not None or not cfg.train.warm_start_steps):
        ref = build_reference(config, weights, device, compute_dtype)  # the model: the weights read above
    optimizers = {name: torch.optim.AdamW([p for p in m.parameters() if p.requires_grad],
                                          lr=cfg.train.lr if name == "policy" else cfg.ppo.critic_lr,
                                          weight_decay=cfg.train.weight_decay)
                  for name, m in models.items()}
    return models, ref, optimizers


def load_reference(cfg, path, policy, device):
    """The frozen KL reference: the policy's base with LoRA, else read from the Hugging Face folder at
    path; None without a KL term."""
    if cfg.train.kl_mode == "none":
        return None
    if policy.lora_config is not None:
        return BaseModel(policy)
    return build_reference(training_config(path), read_weights(path), device, getattr(torch, cfg.train.dtype))


# -----------------------------------------------------------------------------
# forward passes over trajectories

@torch.no_grad()
def forward_all(model_fn, batch, rows, micro_batch_tokens, device, per_token=()):
    """A per-token forward function ((input_ids, position_ids, actions), packed [1, T] -> [1, T,
    *per_token], read where actions is True) over the given rows of the batch; [B, L, *per_token] on
    the CPU, 0 on the other rows and tokens."""
    out = torch.zeros(*batch["input_ids"].shape, *per_token)
    for layout, get in micro_steps(batch, rows, micro_batch_tokens, device):
        unpack(model_fn(get("input_ids"), get("position_ids"), get("action_mask") > 0), layout, out)
    return out


def full_tensors(model):
    """(name, full tensor) for every parameter, all-gathered one at a time: every rank's engine
    gets the whole model without any rank holding a second full copy at once. Tied parameters
    are sent under each of their names: vLLM's CPU backend keeps a repacked copy of the LM head
    that is not updated through the embedding. A LoRA layer's weight is sent merged, under the LM's
    name (merged_weight)."""
    adapted = {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}
    for name, param in model.named_parameters(remove_duplicate=False):
        layer, _, kind = name.partition(".base_layer.")
        if ".lora_" in name:
            continue
        if kind == "weight":
            yield f"{layer}.weight", merged_weight(adapted[layer])
        else:
            yield name.replace(".base_layer.", "."), gathered(param)


def read_positions(position_ids, needed):
    """([N] the packed indices of the needed tokens ([1, T] bool, as an action mask), [N] the index of
    the state that predicts each): the token before it in its row, or for a row's first own token
    after a shared prompt, the prompt's last (see packed_attention). A needed token must not open a
    row (it has no state before it)."""
    positions = position_ids[0]
    index = torch.arange(len(positions), device=positions.device)
    # [T] where the row or prompt of each token starts
    prompt = torch.where(positions == 0, index, 0).cummax(0).values
    follows = torch.cat([positions.new_zeros(1, dtype=torch.bool), positions[1:] == positions[:-1] + 1])
    state = torch.where(follows, index - 1, prompt + positions - 1)                  # [T]
    tokens = needed[0].nonzero().flatten()
    if bool((positions[tokens] == 0).any()):
        raise ValueError("a needed token opens its row: it has no state of its own row to be read from")
    return tokens, state[tokens]


def scatter(values, tokens, length):
    """[N] values of the tokens at packed indices tokens -> [1, length], 0 elsewhere; differentiable."""
    return values.new_zeros(length).index_copy(0, tokens, values)[None]


def policy_forward(policy, input_ids, position_ids, needed, temperature=1.0, top_p=None):
    """
    Per-token logprobs and entropy of a packed micro-batch, on the tokens where needed is True
    (input_ids, position_ids, needed: [1, T]). Returns (logprobs, entropy, nucleus), [1, T] fp32,
    aligned with the ids, 0 where not needed; nucleus (without grad, only when top_p is given): the
    same tokens' logprobs renormalised over the top_p nucleus, the distribution the engine sampled
    from and reports, for engine_logprob_diff to compare like with like. The LM head runs on the
    states that predict a needed token only.
    """
    tokens, at = read_positions(position_ids, needed)                                           # [N], [N]
    logprobs, entropy, nucleus = policy(input_ids, position_ids, at, input_ids[0, tokens], temperature,
                                        1.0 if top_p is None else top_p)                        # [N] x 3
    length = input_ids.shape[1]
    return (scatter(logprobs, tokens, length), scatter(entropy, tokens, length),
            None if top_p is None else scatter(nucleus, tokens, length))


def old_policy_forward(model, input_ids, position_ids, needed, temperature=1.0, top_p=1.0):
    """The old-logprob pass (no grad) of a packed micro-batch: [1, T, 2] fp32, aligned like
    policy_forward: [..., 0] the logprobs of the policy trained (PPO's ratio, truncated IS),
    [..., 1] those renormalised over the top_p nucleus (engine_logprob_diff)."""
    logprobs, _, nucleus = policy_forward(model, input_ids, position_ids, needed, temperature, top_p)
    return torch.stack([logprobs, nucleus], -1)


def critic_forward(critic, input_ids, position_ids, needed):
    """Per-token values of a packed micro-batch on the tokens where needed is True ([1, T]), [1, T]
    fp32, aligned like policy_forward (a token's value is that of the state before it), 0 elsewhere."""
    tokens, at = read_positions(position_ids, needed)
    return scatter(critic(input_ids, position_ids, at), tokens, input_ids.shape[1])
