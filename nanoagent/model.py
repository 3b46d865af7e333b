"""
The trainer's models and their forward passes over trajectories.

- policy: a Hugging Face causal LM; its per-token logprobs (and entropy) are recomputed here for
  the sampled tokens, at the rollout temperature.
- critic: the same pretrained backbone plus a scalar value head, with its own weights.

Alignment, the one thing to get right: in a row `ids[0..L)`, the logprob, entropy and value of
token t come from the hidden state at position t-1 (the state in which token t was chosen), and
are stored at index t. Index 0 holds 0. So every per-token tensor is [B, L], aligned with the ids
and with the action mask of the same row.

Rows are right-padded to the longest row of their micro-batch; micro-batches are built under a
token budget (rows x longest row) after sorting by length, so similar lengths share a micro-batch
and little is spent on padding.
"""

import torch
from torch import nn

from nanoagent.rl import logprobs_and_entropy


def load_causal_lm(path, dtype=torch.float32):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype)


class Critic(nn.Module):
    """Backbone of the pretrained LM (without its LM head) + a linear value head, zero-initialised
    so the first values are 0 and the first advantages are the plain returns."""

    def __init__(self, lm):
        super().__init__()
        self.backbone = lm.model
        self.value_head = nn.Linear(lm.config.hidden_size, 1, dtype=torch.float32)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    def forward(self, input_ids, attention_mask):
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state  # [B, L, H]
        return self.value_head(hidden.float()).squeeze(-1)                                              # [B, L]


def micro_batches(lengths, token_budget):
    """
    Group row indices into micro-batches whose padded size (rows x longest row) stays within
    token_budget; rows sorted longest first. A row longer than the budget gets a micro-batch of
    its own (it cannot be split without changing the computation).
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches, current = [], []
    for i in order:
        width = lengths[current[0]] if current else lengths[i]  # the first row is the longest
        if current and (len(current) + 1) * width > token_budget:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


def pad_rows(rows, pad_value, dtype=torch.long):
    """List of 1-D sequences -> right-padded [B, L] tensor."""
    width = max(len(r) for r in rows)
    out = torch.full((len(rows), width), pad_value, dtype=dtype)
    for i, r in enumerate(rows):
        out[i, :len(r)] = torch.as_tensor(r, dtype=dtype)
    return out


def policy_forward(model, input_ids, attention_mask, temperature=1.0):
    """
    Per-token logprobs and entropy of a micro-batch. input_ids, attention_mask: [B, L].
    Returns (logprobs, entropy), both [B, L] fp32, aligned with the ids (index 0 is 0).
    """
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1]  # [B, L-1, V]
    if temperature != 1.0:
        logits = logits / temperature
    logprobs, entropy = logprobs_and_entropy(logits, input_ids[:, 1:])                 # [B, L-1]
    pad = logprobs.new_zeros(logprobs.shape[0], 1)
    return torch.cat([pad, logprobs], 1), torch.cat([pad, entropy], 1)


def critic_forward(critic, input_ids, attention_mask):
    """Per-token values of a micro-batch, [B, L] fp32, aligned like policy_forward (index 0 is 0)."""
    values = critic(input_ids, attention_mask)[:, :-1]                                  # [B, L-1]
    return torch.cat([values.new_zeros(values.shape[0], 1), values], 1)


def decoder_layers(model):
    """The list of transformer blocks of a Hugging Face causal LM or of a Critic."""
    backbone = model.backbone if isinstance(model, Critic) else model.model
    return backbone.layers


def shard(model, bf16=False, activation_checkpointing=False):
    """
    FSDP2: shard each decoder layer and the root over the default process group (parameters,
    gradients and, once the optimizer is built on the sharded parameters, optimizer state).
    bf16: compute in bf16 with fp32 gradient reduction (GPU); otherwise everything in fp32.
    FSDP averages the ranks' gradients; rl.aggregate_loss gives each rank its share of a global
    mean, whose gradients must be summed: scale the loss by the world size before backward
    (gloo has no pre-multiplied sum, so the divide factor of FSDP cannot be set to 1 on the CPU).
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    if activation_checkpointing:
        (model.backbone if isinstance(model, Critic) else model).gradient_checkpointing_enable()
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
    for layer in decoder_layers(model):
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    return model
