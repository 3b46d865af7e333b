"""
Per-token logprobs, shared by the trainer's forward passes (model.py) and the rollout engines
(engine.py), so that both compute the same numbers: the top_p nucleus (vLLM's rule) that the engines
sample from and the trainer renormalises over to compare with them, and the trainer's LM head fused
with the logprob and entropy, which never makes the tokens x vocabulary logits.
"""

import torch
import torch.nn.functional as F


# -----------------------------------------------------------------------------
# the top_p nucleus: what the engines sample from and report logprobs of when rollout.top_p < 1

def nucleus_mask(probs, top_p):
    """
    The top_p nucleus of each distribution in probs [..., V]: True on the tokens kept. vLLM's rule
    (apply_top_k_top_p), so that both engines and the trainer draw the same line: with the tokens
    sorted by increasing probability, a token is left out while the mass up to and including it is
    <= 1 - top_p; the most probable token always stays.
    """
    ascending, order = probs.sort(-1)                                  # [..., V]
    dropped = ascending.cumsum(-1) <= 1 - top_p
    dropped[..., -1] = False
    return ~torch.zeros_like(dropped).scatter_(-1, order, dropped)


# -----------------------------------------------------------------------------
# the LM head fused with the logprob and entropy: the tokens x vocabulary logits never exist

def nucleus_of_logprobs(logprobs, labels, top_p):
    """
    The logprob of each label [n] under the distribution logprobs [n, V] (fp32) restricted to its
    top_p nucleus and renormalised: the distribution the engine sampled from, whose logprobs it reports
    (vLLM's processed logprobs cannot be had before the nucleus). The importance ratio of truncated IS
    keeps the full softmax on the trainer's side (the policy trained); this is for comparing the engine
    with the trainer like with like (engine_logprob_diff). A label just outside the trainer's nucleus
    (the engine rounded the boundary the other way) gets its renormalised logprob all the same: a
    small gap, not an infinite one.
    """
    kept = nucleus_mask(logprobs.exp(), top_p)
    log_mass = torch.logsumexp(logprobs.masked_fill(~kept, -torch.inf), -1)                # [n]
    return logprobs.gather(-1, labels[:, None]).squeeze(-1) - log_mass


class _HeadLogprobs(torch.autograd.Function):
    """
    hidden [N, H] (the states that predict the labels) and the LM head's weight [V, H] -> the logprob
    of each label [N] and the entropy [N] of softmax(hidden @ weight.T / temperature), in fp32, and
    (without grad) the label's logprob renormalised over the top_p nucleus. The [N, V] logits never
    exist: with Qwen's vocabulary, 16k tokens' logits are 5 GB in bf16 and their fp32 softmax 10 GB.
    The forward computes them a chunk of rows at a time ([n, V] in fp32) and keeps only each row's
    max, log-mass (logsumexp after the max) and entropy, -sum p logp: shift-invariant, as log_softmax. The backward recomputes them a chunk of vocabulary columns at a time
    ([N, c] in fp32): a chunk's logit gradient gives its rows of the weight's gradient whole, in one
    matmul over all N tokens, as the LM head's own backward would, and adds its share to the hidden
    states' gradient ([N, H], summed over the chunks in fp32). The price is the LM head's matmul once
    more in the backward.
    """

    @staticmethod
    def forward(ctx, hidden, weight, labels, temperature, top_p, chunk_elements):
        N, V = hidden.shape[0], weight.shape[0]
        logprobs, entropy, top, log_mass, nucleus = (hidden.new_empty(N, dtype=torch.float32) for _ in range(5))
        rows = max(1, chunk_elements // V)
        for s in range(0, N, rows):
            sl = slice(s, s + rows)
            z = F.linear(hidden[sl], weight).float().div_(temperature)                     # [n, V]
            # shift-invariant, as log_softmax is: logp = (z - max) - log sum exp(z - max), never z - lse,
            # whose two large terms lose the small difference (fp32 at logits ~1e4: entropy off by ~5)
            top[sl] = z.amax(-1)
            logp = z.sub_(top[sl, None])
            log_mass[sl] = torch.logsumexp(logp, dim=-1)
            logp.sub_(log_mass[sl, None])                                                  # [n, V]
            logprobs[sl] = logp.gather(1, labels[sl, None]).squeeze(1)
            if top_p < 1.0:
                nucleus[sl] = nucleus_of_logprobs(logp, labels[sl], top_p)
            entropy[sl] = -logp.exp().mul_(logp).sum(-1)  # -sum p logp, summed pairwise (a dot drifts 1e-3)
        if top_p >= 1.0:
            nucleus.copy_(logprobs)
        ctx.save_for_backward(hidden, weight, labels, top, log_mass, entropy)
        ctx.temperature, ctx.chunk_elements = temperature, chunk_elements
        ctx.mark_non_differentiable(nucleus)
        ctx.set_materialize_grads(False)
        return logprobs, entropy, nucleus

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy, _):
        hidden, weight, labels, top, log_mass, entropy = ctx.saved_tensors
        (N, H), V, T = hidden.shape, weight.shape[0], ctx.temperature
        grad_hidden = hidden.new_zeros(N, H, dtype=torch.float32)
        grad_weight = torch.empty_like(weight)
        columns = max(1, ctx.chunk_elements // max(N, 1))
        for v in range(0, V, columns):
            w = weight[v:v + columns]                                                      # [c, H]
            z = F.linear(hidden, w).float().div_(T)                                        # [N, c]
            logp = z.sub_(top[:, None]).sub_(log_mass[:, None])                            # as the forward's
            p = logp.exp()
            # with z = logits / T: d logp(y)/dz = onehot(y) - p ;  dH/dz = -p * (logp + H)
            if grad_entropy is None:
                grad = logp.zero_()
            else:
                grad = logp.add_(entropy[:, None]).mul_(p).mul_(-grad_entropy[:, None])
            if grad_logprobs is not None:
                grad.sub_(p.mul_(grad_logprobs[:, None]))
                here = (labels >= v) & (labels < v + len(w))   # the labels in this chunk; no host sync
                grad.scatter_add_(1, (labels - v).clamp(0, len(w) - 1)[:, None],
                                  torch.where(here, grad_logprobs, 0.0)[:, None])
            grad = grad.div_(T).to(hidden.dtype)                                           # d/d logits [N, c]
            grad_hidden += grad @ w
            grad_weight[v:v + columns] = grad.T @ hidden
        return grad_hidden.to(hidden.dtype), grad_weight, None, None, None, None


def head_logprobs(hidden, weight, labels, temperature=1.0, top_p=1.0, chunk_elements=2 ** 25):
    """
    The LM head (weight [V, H], no bias) on the states hidden [N, H] that predict labels [N], fused
    with the logprob and entropy: (logprobs, entropy, nucleus), fp32 [N] each; logprobs and entropy
    differentiable in hidden and weight, nucleus (the logprobs renormalised over the top_p nucleus,
    for comparing with the engine; the logprobs themselves when top_p = 1) not. chunk_elements: the
    fp32 logits computed at a time (2**25: 128 MiB).
    """
    return _HeadLogprobs.apply(hidden, weight, labels, temperature, top_p, chunk_elements)
