"""Token logprobs and entropies from final hidden states, in fp32, a chunk of rows at a time, with a hand-written
backward that recomputes each chunk instead of storing it: neither direction holds more than one [C, V] block
and the [N, V] logits never exist. N rows, V vocabulary, H hidden size, C rows per chunk. For one row with
scaled logits z = hidden @ W.T / temperature and p = softmax(z):
    logprob(y) = log p_y = z_y - logsumexp(z)        d/dz = onehot(y) - p
    entropy    = -sum_k p_k log p_k                  d/dz = -p * (log p + entropy)
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def fp32_logits(hidden: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """hidden [C, H] @ weight [V, H].T (+ bias) -> [C, V] float32, never rounded to a half dtype on the way (a
    bf16 output, as a model's own lm_head gives, rounds logits of ~20 by up to 0.06). Half-precision weights
    on CUDA: products in their dtype, accumulated in fp32 (torch.mm's out_dtype); elsewhere fp32 throughout."""
    with torch.autocast(hidden.device.type, enabled=False):
        if weight.dtype != torch.float32 and hidden.is_cuda:
            logits = torch.mm(hidden.to(weight.dtype), weight.t(), out_dtype=torch.float32)
            return logits if bias is None else logits.add_(bias.float())
        return F.linear(hidden.float(), weight.float(), None if bias is None else bias.float())


def _log_distribution(logits: Tensor, temperature: float) -> Tensor:
    """log_softmax(logits / temperature) of a fresh fp32 [C, V] block, divided in place (x / 1.0 == x exactly)."""
    return torch.log_softmax(logits if temperature == 1.0 else logits.div_(temperature), dim=-1)


class LogprobsFromHidden(torch.autograd.Function):
    """(hidden [N, H], weight [V, H], bias [V] or None, labels [N], temperature, chunk_size, with_entropy)
    -> (logprobs [N] fp32, entropy [N] fp32, or [0] when not requested).

    Each chunk's statistics are the textbook log_softmax(z).gather and -(p * log p).sum, so the values equal
    the unchunked ones bit for bit; the weight gradient is accumulated in fp32 and cast once at the end.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, temperature, chunk_size, with_entropy):
        logprobs = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        entropy = torch.empty_like(logprobs) if with_entropy else logprobs.new_empty(0)
        for start in range(0, hidden.shape[0], chunk_size):
            rows = slice(start, start + chunk_size)
            log_distribution = _log_distribution(fp32_logits(hidden[rows], weight, bias), temperature)
            logprobs[rows] = log_distribution.gather(-1, labels[rows].unsqueeze(-1)).squeeze(-1)
            if with_entropy:
                entropy[rows] = -(log_distribution.exp() * log_distribution).sum(dim=-1)
        ctx.save_for_backward(hidden, weight, bias, labels, entropy)
        ctx.temperature, ctx.chunk_size, ctx.with_entropy = temperature, chunk_size, with_entropy
        # An output that the loss does not use then reaches backward as None instead of a zero tensor.
        ctx.set_materialize_grads(False)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, bias, labels, entropy = ctx.saved_tensors
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight else None
        grad_bias = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if need_bias else None
        for start in range(0, hidden.shape[0], ctx.chunk_size):
            rows = slice(start, start + ctx.chunk_size)
            # The gradient with respect to the chunk's scaled logits (see the module docstring), then / T.
            log_distribution = _log_distribution(fp32_logits(hidden[rows], weight, bias), ctx.temperature)
            distribution = log_distribution.exp()
            grad = torch.zeros_like(distribution)
            if grad_logprobs is not None:
                grad -= distribution * grad_logprobs[rows].unsqueeze(-1)
                grad.scatter_add_(-1, labels[rows].unsqueeze(-1), grad_logprobs[rows].unsqueeze(-1))
            if grad_entropy is not None and ctx.with_entropy:
                grad -= (distribution * (log_distribution + entropy[rows].unsqueeze(-1))
                         * grad_entropy[rows].unsqueeze(-1))
            grad = grad.div_(ctx.temperature).to(weight.dtype)
            if need_hidden:
                grad_hidden[rows] = (grad @ weight).to(hidden.dtype)
            if need_weight:
                grad_weight += (grad.t() @ hidden[rows].to(weight.dtype)).float()
            if need_bias:
                grad_bias += grad.float().sum(dim=0)
        return (grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype),
                None if grad_bias is None else grad_bias.to(bias.dtype), None, None, None, None)
