"""Linear + softmax cross-entropy over the vocabulary, chunk by chunk of tokens: full logits never exist.

loss = sum_t [lse(h_t W^T) - (h_t W^T)_{y_t}] over labelled tokens. The forward keeps only the per-token
log-sum-exp; the backward recomputes each chunk's logits and turns them, in place, into
dlogits = (softmax - onehot(y)) * grad, then dh = dlogits W and dW += dlogits^T h.
Peak extra memory is O(chunk * vocab) instead of O(tokens * vocab).

The per-row softmax work is pluggable (:class:`RowLoss`): PyTorch here, a Triton kernel in
``xscale_kernels.cross_entropy``; the chunk loop and the matmuls are shared.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch

IGNORE_INDEX = -100
CHUNK_LOGIT_ELEMENTS = 1 << 25  # ~128 MiB of float32 logits per chunk


class RowLoss(Protocol):
    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss per row, log-sum-exp per row), both float32; loss is 0 where labels == -100; may overwrite logits."""

    def backward(self, logits: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor,
                 grad: torch.Tensor) -> torch.Tensor:
        """(softmax - onehot) * grad per row (0 on ignored rows), in logits' dtype; may overwrite logits."""


class TorchRowLoss:
    """The per-row cross-entropy in PyTorch ops, float32 inside."""

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits32 = logits.float()
        valid = labels != IGNORE_INDEX
        target = logits32.gather(1, labels.clamp_min(0).unsqueeze(1)).squeeze(1)
        # log-sum-exp in place (torch.logsumexp would allocate a second (chunk, vocab) buffer); a row
        # maximum of +-inf is shifted by 0 instead, as logsumexp does, so such rows give +-inf, not nan
        row_max = logits32.amax(dim=-1, keepdim=True)
        row_max = torch.where(row_max.isfinite(), row_max, torch.zeros_like(row_max))
        lse = logits32.sub_(row_max).exp_().sum(-1).log_().add_(row_max.squeeze(1))
        return torch.where(valid, lse - target, torch.zeros_like(lse)), lse

    def backward(self, logits: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor,
                 grad: torch.Tensor) -> torch.Tensor:
        # in place: a float32 chunk of logits becomes its own softmax, one (chunk, vocab) buffer in all
        probs = logits.float().sub_(lse.unsqueeze(1)).exp_()
        valid = labels != IGNORE_INDEX
        # minus one at each valid label (a scatter, not a boolean index: no data-dependent shapes, so the
        # step also runs on fake tensors, as ``xscale inspect --measure`` does)
        probs.scatter_add_(1, labels.clamp(min=0).unsqueeze(1), -valid.to(probs.dtype).unsqueeze(1))
        probs.mul_((valid.float() * grad).unsqueeze(1))
        return probs.to(logits.dtype)


def default_chunk_tokens(num_tokens: int, vocab: int) -> int:
    return max(1, min(num_tokens, CHUNK_LOGIT_ELEMENTS // max(vocab, 1)))


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """hidden (N, d), weight (V, d), labels (N,) -> scalar float32 sum of token CE."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_tokens: int,
                row_loss: RowLoss) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        lse = torch.empty(num_tokens, dtype=torch.float32, device=hidden.device)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, num_tokens, chunk_tokens):
            end = min(start + chunk_tokens, num_tokens)
            # no name holds the chunk's logits, so they are freed before the next chunk's are allocated
            loss_rows, lse[start:end] = row_loss.forward(hidden[start:end] @ weight.t(), labels[start:end])
            total += loss_rows.sum()
        ctx.save_for_backward(hidden, weight, labels, lse)
        ctx.chunk_tokens, ctx.row_loss = chunk_tokens, row_loss
        return total

    @staticmethod
    def backward(ctx, grad_total: torch.Tensor):
        hidden, weight, labels, lse = ctx.saved_tensors
        grad = grad_total.float()
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        accumulate_fp32 = weight.dtype != torch.float32
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for start in range(0, hidden.shape[0], ctx.chunk_tokens):
            end = min(start + ctx.chunk_tokens, hidden.shape[0])
            chunk = hidden[start:end]
            dlogits = ctx.row_loss.backward(chunk @ weight.t(), labels[start:end], lse[start:end], grad)
            if grad_hidden is not None:
                torch.matmul(dlogits, weight, out=grad_hidden[start:end])
            if grad_weight is not None:
                if accumulate_fp32:
                    grad_weight += dlogits.t() @ chunk
                else:
                    grad_weight.addmm_(dlogits.t(), chunk)
            del dlogits  # before the next chunk's logits exist: one (chunk, vocab) buffer at a time
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None


def chunked_linear_cross_entropy_sum(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                                     row_loss: RowLoss | None = None,
                                     chunk_tokens: int | None = None) -> torch.Tensor:
    """Sum of CE(hidden @ weight^T, labels) over labels != -100, computed chunk by chunk of tokens.

    Under autocast the matmuls run in the autocast dtype (as ``hidden @ weight.t()`` would) and the
    softmax in float32, like the unfused reference.
    """
    if hidden.shape[-1] != weight.shape[-1] or hidden.shape[:-1] != labels.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)} and labels "
                         f"{tuple(labels.shape)} do not fit: need hidden (..., d), weight (V, d), labels (...)")
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
    elif hidden.dtype != weight.dtype:
        raise ValueError(f"hidden is {hidden.dtype} but weight is {weight.dtype}: cast one, or run under autocast")
    hidden2 = hidden.reshape(-1, hidden.shape[-1])
    labels1 = labels.reshape(-1)
    vocab = weight.shape[0]
    chunk = chunk_tokens or default_chunk_tokens(hidden2.shape[0], vocab)
    if chunk < 1 or not math.isfinite(chunk):
        raise ValueError(f"chunk_tokens must be a positive integer, got {chunk_tokens}")
    with torch.autocast(device_type, enabled=False):
        return ChunkedLinearCrossEntropy.apply(hidden2, weight, labels1, int(chunk), row_loss or TorchRowLoss())
