"""
The trainer's forward passes as they were before packing, written out plainly: rows right-padded
to [B, L] with an attention mask, the model's own sdpa attention, the LM head and the log-softmax
over every position. The reference the packed passes (nanoagent.model) must equal, in fp32.
"""

import torch
from transformers import AutoModelForCausalLM

from nanoagent.batch import pad_rows, shared_prompts
from nanoagent.model import PACKED, Critic, Policy
from nanoagent.logprobs import nucleus_of_logprobs


def plain_lm(path):
    """The model with transformers' sdpa attention (not the trainer's packed attention)."""
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")


def load_causal_lm(path, dtype=torch.float32):
    """The whole model in one process with the trainer's packed attention (nanoagent.model), for its
    forward passes (not for generation): what the plain one is compared with."""
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=PACKED)


def load_policy(path, dtype=torch.float32):
    """The trainer's Policy over load_causal_lm's model, unsharded."""
    return Policy(load_causal_lm(path, dtype))


def shifted(per_position):
    """[B, L] results at the positions that predict token t+1 -> aligned with the ids (index 0 is 0)."""
    return torch.cat([per_position.new_zeros(per_position.shape[0], 1), per_position[:, :-1]], 1)


def nucleus_logprobs(logits, labels, temperature, top_p):
    """The logprob of each label under softmax(logits / temperature) restricted to its top_p nucleus and
    renormalised (logits [..., V], labels [...] -> [...] fp32), from the whole logits at once: the
    reference for the trainer's, computed in chunks with the LM head (nanoagent.logprobs)."""
    logprobs = torch.log_softmax(logits.float() / temperature, -1)                          # [..., V]
    V = logprobs.shape[-1]
    return nucleus_of_logprobs(logprobs.reshape(-1, V), labels.reshape(-1), top_p).view(labels.shape)


def logprobs(model, rows, temperature=1.0, top_p=1.0):
    """(logprobs, entropy, nucleus logprobs), each [B, L] over the padded rows, aligned with the ids."""
    ids, attention = pad_rows(rows, 0), pad_rows([[1] * len(r) for r in rows], 0)
    logits = model(input_ids=ids, attention_mask=attention).logits.float()  # [B, L, V]
    logp = (logits / temperature).log_softmax(-1)
    labels = ids.roll(-1, 1)
    chosen = logp.gather(-1, labels[..., None]).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    nucleus = nucleus_logprobs(logits.detach(), labels, temperature, top_p) if top_p < 1 else chosen.detach()
    return shifted(chosen), shifted(entropy), shifted(nucleus)


def values(critic, rows):
    """The critic's values over the padded rows, [B, L], aligned like the logprobs."""
    ids, attention = pad_rows(rows, 0), pad_rows([[1] * len(r) for r in rows], 0)
    hidden = critic.backbone(input_ids=ids, attention_mask=attention).last_hidden_state
    return shifted(critic.value_head(hidden.float()).squeeze(-1))


def critic_of(path):
    """A critic over the plain model's backbone, its value head drawn at random (seeded)."""
    critic = Critic(plain_lm(path))
    torch.nn.init.normal_(critic.value_head.weight, generator=torch.Generator().manual_seed(0))
    return critic


def batch_of(rows, masks):
    """The host batch the trainer's forward passes read (batch.collate's keys), from token rows and
    their action masks."""
    ids = pad_rows(rows, 0)
    return {"input_ids": ids, **shared_prompts(rows, masks), "row": torch.arange(len(rows))[:, None].expand_as(ids),
            "action_mask": pad_rows(masks, 0, torch.float32),
            "lengths": [len(r) for r in rows], "trajectory": torch.arange(len(rows))}
