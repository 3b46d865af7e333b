"""
Per-token logprobs from logits, shared by the trainer's forward passes (model.py) and the rollout
engines (engine.py), so that both compute the same numbers: the logprob and entropy kernel that
never holds a second tokens x vocabulary tensor, and the top_p nucleus (vLLM's rule) that the
engines sample from and the trainer renormalises over to compare with them.
"""

import torch


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


@torch.no_grad()
def nucleus_logprobs(logits, labels, temperature, top_p, chunk_size=None):
    """
    Per-token logprob of `labels` under softmax(logits / temperature) restricted to its top_p
    nucleus and renormalised: the distribution the engine sampled from, whose logprobs it reports
    (vLLM's processed logprobs cannot be had before the nucleus). logits: [..., V], labels: [...];
    returns fp32 [...]. The importance ratio of truncated IS keeps the full softmax on the trainer's
    side (the policy trained) over this behaviour distribution; this function is for comparing the
    engine with the trainer like with like (engine_logprob_diff). A label just outside the trainer's
    nucleus (the engine rounded the boundary the other way) gets its renormalised logprob all the
    same: a small gap, not an infinite one. chunk_size: rows per fp32 chunk (a sort is two copies).
    """
    shape, V = labels.shape, logits.shape[-1]
    logits, labels = logits.reshape(-1, V), labels.reshape(-1)
    chunk_size = chunk_size or max(1, 2 ** 23 // V)
    out = torch.empty(labels.shape, dtype=torch.float32, device=logits.device)
    for s in range(0, len(labels), chunk_size):
        logprobs = torch.log_softmax(logits[s:s + chunk_size].float() / temperature, -1)   # [n, V]
        kept = nucleus_mask(logprobs.exp(), top_p)
        log_mass = torch.logsumexp(logprobs.masked_fill(~kept, -torch.inf), -1)           # [n]
        out[s:s + chunk_size] = logprobs.gather(-1, labels[s:s + chunk_size, None]).squeeze(-1) - log_mass
    return out.view(shape)


# -----------------------------------------------------------------------------
# logprobs and entropy from logits, without a second tokens x vocabulary tensor

class _LogprobEntropy(torch.autograd.Function):
    """
    Logprob of the label and entropy of softmax(logits / temperature), per row of logits [N, V]
    in any dtype. Works through the rows in chunks, in fp32, with two chunk-sized temporaries;
    the backward recomputes the softmax per chunk instead of saving it, and writes the gradient
    over the saved logits (nothing needs them after this backward), so no second [N, V] tensor
    exists at any time: with Qwen's vocabulary a [16k, 151936] bf16 copy is 5 GB.
    A gradient that does not reach an output (entropy, when it is only logged) is not computed.
    """

    @staticmethod
    def forward(ctx, logits, labels, temperature, chunk_size):
        N = logits.shape[0]
        logprobs = logits.new_empty(N, dtype=torch.float32)
        entropy = logits.new_empty(N, dtype=torch.float32)
        lse = logits.new_empty(N, dtype=torch.float32)
        for s in range(0, N, chunk_size):
            sl = slice(s, s + chunk_size)
            z = logits[sl].to(torch.float32, copy=True).div_(temperature)  # [n, V]
            lse[sl] = torch.logsumexp(z, dim=-1)
            logprobs[sl] = z.gather(1, labels[sl, None]).squeeze(1) - lse[sl]
            p = (z - lse[sl, None]).exp_()
            entropy[sl] = lse[sl] - (p.unsqueeze(1) @ z.unsqueeze(2)).view(-1)  # H = lse - E_p[z]
        ctx.save_for_backward(logits, labels, lse, entropy)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        ctx.set_materialize_grads(False)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        logits, labels, lse, entropy = ctx.saved_tensors
        for s in range(0, logits.shape[0], ctx.chunk_size):
            sl = slice(s, s + ctx.chunk_size)
            z = logits[sl].to(torch.float32, copy=True).div_(ctx.temperature)  # [n, V]
            p = (z - lse[sl, None]).exp_()
            # with z = logits / T: d logp(y)/dz = onehot(y) - p ;  dH/dz = -p * (z - E_p[z]), E_p[z] = lse - H
            if grad_entropy is None:
                grad = z.zero_()
            else:
                grad = z.sub_((lse[sl] - entropy[sl])[:, None]).mul_(p).mul_(-grad_entropy[sl, None])
            if grad_logprobs is not None:
                grad.sub_(p.mul_(grad_logprobs[sl, None]))
                grad.scatter_add_(1, labels[sl, None], grad_logprobs[sl, None])
            logits[sl] = grad.div_(ctx.temperature)
        return logits, None, None, None


def logprobs_and_entropy(logits, labels, temperature=1.0, chunk_size=None):
    """
    Per-token logprob of `labels` and entropy of softmax(logits / temperature). logits: [..., V],
    labels: [...] int. Returns two fp32 tensors of shape [...], differentiable. The logits are
    consumed: the backward overwrites them with their gradient. chunk_size: rows per fp32 chunk;
    default ~32M elements (128 MiB in fp32) per chunk.
    """
    shape, V = labels.shape, logits.shape[-1]
    chunk_size = chunk_size or max(1, 2 ** 25 // V)
    logprobs, entropy = _LogprobEntropy.apply(logits.reshape(-1, V), labels.reshape(-1), temperature,
                                              chunk_size)
    return logprobs.view(shape), entropy.view(shape)
