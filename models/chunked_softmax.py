"""Chunked, fp32 log-softmax statistics (token logprob, entropy) with hand-written backward passes that
recompute each chunk instead of storing it, so neither direction holds more than one [C, V] fp32 block.

Two entry points share the math: from logits ([N, V] given) and from final hidden states ([N, H] and the
output projection [V, H]), which never builds the [N, V] logits at all. N rows, V vocabulary, H hidden
size, C rows per chunk. For one row with scaled logits z = logits / temperature and p = softmax(z):
    logprob(y) = log p_y = z_y - logsumexp(z)        d/dz = onehot(y) - p
    entropy    = -sum_k p_k log p_k                  d/dz = -p * (log p + entropy)
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def _scaled(logits: Tensor, temperature: float, owned: bool) -> Tensor:
    """logits.float() / temperature; divides in place when `logits` is a temporary fp32 block of ours."""
    if temperature == 1.0:
        return logits.float()  # no copy for fp32 input; x / 1.0 == x exactly
    if owned and logits.dtype == torch.float32:
        return logits.div_(temperature)
    return logits.float() / temperature


def _chunk_statistics(logits: Tensor, labels: Tensor, temperature: float, with_entropy: bool, owned: bool = False):
    """logits [C, V] any float dtype, labels [C] -> (logprobs [C] fp32, entropy [C] fp32 or None).

    The same kernels as the textbook log_softmax(logits.float() / T).gather and -(p * log p).sum, row by
    row, so the values equal the unchunked ones bit for bit. owned: `logits` may be overwritten.
    """
    log_distribution = torch.log_softmax(_scaled(logits, temperature, owned), dim=-1)
    logprobs = log_distribution.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    entropy = -(log_distribution.exp() * log_distribution).sum(dim=-1) if with_entropy else None
    return logprobs, entropy


def _chunk_grad_scaled(logits, labels, entropy, grad_logprobs, grad_entropy, temperature, owned=False):
    """Gradient of the chunk's outputs with respect to its logits, fp32 [C, V] (already divided by T)."""
    log_distribution = torch.log_softmax(_scaled(logits, temperature, owned), dim=-1)
    distribution = log_distribution.exp()
    grad = torch.zeros_like(distribution)
    if grad_logprobs is not None:
        grad -= distribution * grad_logprobs.unsqueeze(-1)
        grad.scatter_add_(-1, labels.unsqueeze(-1), grad_logprobs.unsqueeze(-1))
    if grad_entropy is not None:
        grad -= distribution * (log_distribution + entropy.unsqueeze(-1)) * grad_entropy.unsqueeze(-1)
    return grad.div_(temperature)


def _chunks(num_rows: int, chunk_size: int):
    for start in range(0, num_rows, chunk_size):
        yield slice(start, min(start + chunk_size, num_rows))


class LogprobsFromLogits(torch.autograd.Function):
    """(logits [N, V], labels [N]) -> (logprobs [N] fp32, entropy [N] fp32; empty [0] when not requested)."""

    @staticmethod
    def forward(ctx, logits, labels, temperature, chunk_size, with_entropy):
        num_rows = logits.shape[0]
        logprobs = torch.empty(num_rows, dtype=torch.float32, device=logits.device)
        entropy = torch.empty_like(logprobs) if with_entropy else logprobs.new_empty(0)
        for rows in _chunks(num_rows, chunk_size):
            chunk_logprobs, chunk_entropy = _chunk_statistics(logits[rows], labels[rows], temperature, with_entropy)
            logprobs[rows] = chunk_logprobs
            if with_entropy:
                entropy[rows] = chunk_entropy
        ctx.save_for_backward(logits, labels, entropy)
        ctx.temperature, ctx.chunk_size, ctx.with_entropy = temperature, chunk_size, with_entropy
        # An output that the loss does not use then reaches backward as None instead of a zero tensor.
        ctx.set_materialize_grads(False)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        logits, labels, entropy = ctx.saved_tensors
        grad_logits = torch.empty_like(logits)
        for rows in _chunks(logits.shape[0], ctx.chunk_size):
            grad = _chunk_grad_scaled(
                logits[rows], labels[rows], entropy[rows] if ctx.with_entropy else None,
                None if grad_logprobs is None else grad_logprobs[rows],
                None if (grad_entropy is None or not ctx.with_entropy) else grad_entropy[rows],
                ctx.temperature,
            )
            grad_logits[rows] = grad.to(logits.dtype)
        return grad_logits, None, None, None, None


def fp32_logits(hidden: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """hidden [C, H] @ weight [V, H].T (+ bias) -> [C, V] float32, never rounded to a half dtype on the way.

    fp32 weights: one fp32 product. Half-precision weights (FSDP2's bf16 compute) on CUDA: the products in
    their dtype, accumulated and written in fp32 (torch.mm's out_dtype); elsewhere both sides are cast to fp32
    first (exact). A bf16 output, as a model's own lm_head gives, rounds logits of ~20 by up to 0.06.
    """
    with torch.autocast(hidden.device.type, enabled=False):
        if weight.dtype != torch.float32 and hidden.is_cuda:
            logits = torch.mm(hidden.to(weight.dtype), weight.t(), out_dtype=torch.float32)
            return logits if bias is None else logits.add_(bias.float())
        return F.linear(hidden.float(), weight.float(), None if bias is None else bias.float())


class LogprobsFromHidden(torch.autograd.Function):
    """(hidden [N, H], weight [V, H], bias [V] or None, labels [N]) -> (logprobs [N], entropy [N] or [0]).

    Each chunk's logits are fp32_logits(hidden, weight, bias). Backward recomputes them chunk by chunk; the
    weight gradient is accumulated in fp32 across chunks and cast to the weight's dtype once at the end.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, temperature, chunk_size, with_entropy):
        num_rows = hidden.shape[0]
        logprobs = torch.empty(num_rows, dtype=torch.float32, device=hidden.device)
        entropy = torch.empty_like(logprobs) if with_entropy else logprobs.new_empty(0)
        for rows in _chunks(num_rows, chunk_size):
            logits = fp32_logits(hidden[rows], weight, bias)
            chunk_logprobs, chunk_entropy = _chunk_statistics(logits, labels[rows], temperature, with_entropy, owned=True)
            logprobs[rows] = chunk_logprobs
            if with_entropy:
                entropy[rows] = chunk_entropy
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
        for rows in _chunks(hidden.shape[0], ctx.chunk_size):
            logits = fp32_logits(hidden[rows], weight, bias)
            grad = _chunk_grad_scaled(
                logits, labels[rows], entropy[rows] if ctx.with_entropy else None,
                None if grad_logprobs is None else grad_logprobs[rows],
                None if (grad_entropy is None or not ctx.with_entropy) else grad_entropy[rows],
                ctx.temperature, owned=True,
            ).to(weight.dtype)
            if need_hidden:
                grad_hidden[rows] = (grad @ weight).to(hidden.dtype)
            if need_weight:
                grad_weight += (grad.t() @ hidden[rows].to(weight.dtype)).float()
            if need_bias:
                grad_bias += grad.float().sum(dim=0)
        return (
            grad_hidden,
            None if grad_weight is None else grad_weight.to(weight.dtype),
            None if grad_bias is None else grad_bias.to(bias.dtype),
            None, None, None, None,
        )
