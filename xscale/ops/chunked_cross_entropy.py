"""Linear + softmax cross-entropy over the vocabulary, chunk by chunk of tokens: full logits never exist.

loss = sum_t [lse(h_t W^T) - (h_t W^T)_{y_t}] over labelled tokens. Each chunk's logits turn, in place, into
dlogits = (softmax - onehot(y)) * grad, then dh = dlogits W and dW += dlogits^T h. Peak extra memory is
O(chunk * vocab) instead of O(tokens * vocab).

The loss is the last op of a training forward and its gradient is linear in the incoming scalar grad, so by
default (``gradient_in_forward``) the forward computes dh and dW for grad = 1 while each chunk's logits exist, and
the backward only scales them: the head's logits are computed once per step instead of twice (the recomputation
was ~6% of a GPT-2-small step on CPU). The cost is holding dh and the fp32 dW from the forward to the backward,
which the backward would allocate anyway; a schedule that runs several forwards before their backwards (GPipe)
passes ``gradient_in_forward=False``: the forward then keeps only the per-token log-sum-exp, and the backward
recomputes each chunk's logits.

The per-row softmax work is pluggable (:class:`RowLoss`): PyTorch here, a Triton kernel in
``xscale_kernels.cross_entropy``; the chunk loop and the matmuls are shared.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch

IGNORE_INDEX = -100
CHUNK_LOGIT_ELEMENTS = 1 << 25  # ~128 MiB of float32 logits per chunk
ROW_ALIGNMENT = 64  # elements between the starts of two rows of logits: 128-byte aligned rows in bf16


class RowLoss(Protocol):
    """The logits it gets are a (chunk, V) view with unit column stride and rows ``stride(0) >= V`` apart; what it
    returns in their place keeps that layout (the GEMMs after it read the rows aligned)."""

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss per row, log-sum-exp per row), both float32; loss is 0 where labels == -100; may overwrite logits."""

    def backward(self, logits: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor,
                 grad: torch.Tensor) -> torch.Tensor:
        """(softmax - onehot) * grad per row (0 on ignored rows), in logits' dtype; may overwrite logits."""

    def forward_backward(self, logits: torch.Tensor,
                         labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """forward's (loss, lse) and backward's rows for grad = 1, from one read of the logits (overwritten)."""


class TorchRowLoss:
    """The per-row cross-entropy in PyTorch ops, float32 inside."""

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        loss, lse, _ = self._exp_rows(logits.float(), labels)
        return loss, lse

    def forward_backward(self, logits: torch.Tensor,
                         labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        loss, lse, (exp_rows, sums) = self._exp_rows(logits.float(), labels)
        valid = labels != IGNORE_INDEX
        # softmax without a second exp pass over the logits, and 0 on ignored rows, in one pass over the chunk
        probs = exp_rows.mul_((valid.float() / sums).unsqueeze(1))
        return loss, lse, self._into(logits, self._subtract_onehot(probs, labels, valid))

    @staticmethod
    def _exp_rows(logits32: torch.Tensor, labels: torch.Tensor):
        """(loss, lse, (exp(z - row max), its row sums)); the first overwrites ``logits32``."""
        valid = labels != IGNORE_INDEX
        target = logits32.gather(1, labels.clamp_min(0).unsqueeze(1)).squeeze(1)
        # log-sum-exp in place (torch.logsumexp would allocate a second (chunk, vocab) buffer); a row
        # maximum of +-inf is shifted by 0 instead, as logsumexp does, so such rows give +-inf, not nan
        row_max = logits32.amax(dim=-1, keepdim=True)
        row_max = torch.where(row_max.isfinite(), row_max, torch.zeros_like(row_max))
        exp_rows = logits32.sub_(row_max).exp_()
        sums = exp_rows.sum(-1)
        lse = sums.log().add_(row_max.squeeze(1))
        return torch.where(valid, lse - target, torch.zeros_like(lse)), lse, (exp_rows, sums)

    def backward(self, logits: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor,
                 grad: torch.Tensor) -> torch.Tensor:
        # in place: a float32 chunk of logits becomes its own softmax, one (chunk, vocab) buffer in all
        probs = logits.float().sub_(lse.unsqueeze(1)).exp_()
        return self._into(logits, self._minus_onehot(probs, labels, grad))

    @staticmethod
    def _into(logits: torch.Tensor, rows32: torch.Tensor) -> torch.Tensor:
        """The float32 rows back in the logits' buffer and dtype. Float32 logits are already them: ``.float()``
        returned the logits themselves and every op since ran in place (no data pointers compared: the step also
        runs on fake tensors, as ``xscale inspect --measure`` does)."""
        return rows32 if logits.dtype == torch.float32 else logits.copy_(rows32)

    @classmethod
    def _minus_onehot(cls, probs: torch.Tensor, labels: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        """(probs - onehot(labels)) * grad in place, 0 on ignored rows."""
        valid = labels != IGNORE_INDEX
        return cls._subtract_onehot(probs, labels, valid).mul_((valid.float() * grad).unsqueeze(1))

    @staticmethod
    def _subtract_onehot(probs: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Minus one at each valid row's label, in place (a scatter, not a boolean index: no data-dependent shapes,
        so the step also runs on fake tensors, as ``xscale inspect --measure`` does)."""
        return probs.scatter_add_(1, labels.clamp(min=0).unsqueeze(1), -valid.to(probs.dtype).unsqueeze(1))


def default_chunk_tokens(num_tokens: int, vocab: int) -> int:
    return max(1, min(num_tokens, CHUNK_LOGIT_ELEMENTS // max(vocab, 1)))


class _GradientSums:
    """dh (N, d) and the float32 sum of dW (V, d), filled chunk by chunk from each chunk's dlogits."""

    def __init__(self, hidden: torch.Tensor, weight: torch.Tensor, needs_hidden: bool, needs_weight: bool) -> None:
        self.hidden, self.weight = hidden, weight
        self.grad_hidden = torch.empty_like(hidden) if needs_hidden else None
        self.grad_weight = None
        if needs_weight:  # the first chunk's product is written into it, the next ones added (no memset)
            self.grad_weight = torch.empty(weight.shape, dtype=torch.float32, device=weight.device)
        self.empty = True

    def add(self, start: int, end: int, dlogits: torch.Tensor) -> None:
        chunk = self.hidden[start:end]
        if self.grad_hidden is not None:
            torch.matmul(dlogits, self.weight, out=self.grad_hidden[start:end])
        if self.grad_weight is not None and self.weight.dtype == torch.float32:
            # beta = 0 ignores what the buffer held (torch.addmm's contract), so the first chunk writes it
            self.grad_weight.addmm_(dlogits.t(), chunk, beta=0.0 if self.empty else 1.0)
        elif self.grad_weight is not None and self.empty:  # a product in the weights' dtype, summed in float32
            self.grad_weight.copy_(dlogits.t() @ chunk)
        elif self.grad_weight is not None:
            self.grad_weight += dlogits.t() @ chunk
        self.empty = False

    def finish(self) -> None:
        """After the last chunk: a pass over no tokens has a zero dW."""
        if self.empty and self.grad_weight is not None:
            self.grad_weight.zero_()


def padded_row_length(vocab: int) -> int:
    """The row stride of the logits buffer: the vocabulary rounded up to ``ROW_ALIGNMENT`` elements."""
    return -(-vocab // ROW_ALIGNMENT) * ROW_ALIGNMENT


class _ChunkLogits:
    """Each chunk's logits h W^T written into one (chunk, V) buffer for the whole pass: a fresh buffer per chunk
    is a fresh mapping above glibc's 32 MiB mmap threshold, page-faulted on first touch (~50 ms of a 180 ms logits
    GEMM at 1048 x 768 x 32000 on 2 cores).

    The buffer's rows are :func:`padded_row_length` apart, so every GEMM that writes or reads the logits sees an
    aligned leading dimension whatever the vocabulary (GPT-2's 50257 is odd: 2-byte aligned bf16 rows, which
    cuBLAS's vectorised tensor-core kernels cannot load). The chunk is the (chunk, V) view of it; the padding
    columns hold zeros, never uninitialised memory."""

    def __init__(self, hidden: torch.Tensor, weight: torch.Tensor, chunk_tokens: int) -> None:
        self.weight = weight
        vocab = weight.shape[0]
        rows = min(chunk_tokens, hidden.shape[0])
        padded = hidden.new_empty((rows, padded_row_length(vocab)))
        # The padding columns are never written but a GEMM may read them: bf16 dot products take K in pairs (AVX-512
        # BF16, AMX), so dlogits @ W with an odd vocabulary reads one column past each row, times a zero-padded W.
        # Uninitialised memory there (a NaN pattern) made NaN * 0 = NaN in dh; zeros make it 0 * 0.
        padded[:, vocab:].zero_()
        self.buffer = padded[:, :vocab]

    def __call__(self, chunk: torch.Tensor) -> torch.Tensor:
        return torch.matmul(chunk, self.weight.t(), out=self.buffer[:chunk.shape[0]])


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """hidden (N, d), weight (V, d), labels (N,) -> scalar float32 sum of token CE."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_tokens: int,
                row_loss: RowLoss, gradient_in_forward: bool) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        lse = torch.empty(num_tokens, dtype=torch.float32, device=hidden.device)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        sums = _GradientSums(hidden, weight, *ctx.needs_input_grad[:2]) if gradient_in_forward else None
        logits = _ChunkLogits(hidden, weight, chunk_tokens)
        for start in range(0, num_tokens, chunk_tokens):
            end = min(start + chunk_tokens, num_tokens)
            if sums is None:
                loss_rows, lse[start:end] = row_loss.forward(logits(hidden[start:end]), labels[start:end])
            else:
                loss_rows, _, dlogits = row_loss.forward_backward(logits(hidden[start:end]), labels[start:end])
                sums.add(start, end, dlogits)
                del dlogits  # before the next chunk's logits: one float32 (chunk, vocab) buffer at a time
            total += loss_rows.sum()
        if sums is not None:
            sums.finish()
        ctx.chunk_tokens, ctx.row_loss, ctx.gradient_in_forward = chunk_tokens, row_loss, gradient_in_forward
        ctx.weight_dtype = weight.dtype
        if sums is None:
            ctx.save_for_backward(hidden, weight, labels, lse)
        else:
            ctx.save_for_backward(sums.grad_hidden, sums.grad_weight)
            ctx.scaled = False
        return total

    @staticmethod
    def backward(ctx, grad_total: torch.Tensor):
        grad = grad_total.float()
        if ctx.gradient_in_forward:
            if ctx.scaled:
                raise RuntimeError("the fused linear cross-entropy computed its gradient in the forward and scales "
                                   "it in place, so its graph takes one backward; call the loss with "
                                   "gradient_in_forward=False to backward through it more than once")
            ctx.scaled = True
            grad_hidden, grad_weight = ctx.saved_tensors
            if grad_hidden is not None:
                grad_hidden.mul_(grad.to(grad_hidden.dtype))
            if grad_weight is not None:
                grad_weight = grad_weight.mul_(grad).to(ctx.weight_dtype)
            return grad_hidden, grad_weight, None, None, None, None
        hidden, weight, labels, lse = ctx.saved_tensors
        sums = _GradientSums(hidden, weight, *ctx.needs_input_grad[:2])
        logits = _ChunkLogits(hidden, weight, ctx.chunk_tokens)
        for start in range(0, hidden.shape[0], ctx.chunk_tokens):
            end = min(start + ctx.chunk_tokens, hidden.shape[0])
            dlogits = ctx.row_loss.backward(logits(hidden[start:end]), labels[start:end], lse[start:end], grad)
            sums.add(start, end, dlogits)
            del dlogits
        sums.finish()
        grad_weight = None if sums.grad_weight is None else sums.grad_weight.to(weight.dtype)
        return sums.grad_hidden, grad_weight, None, None, None, None


def chunked_linear_cross_entropy_sum(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                                     row_loss: RowLoss | None = None, chunk_tokens: int | None = None,
                                     gradient_in_forward: bool = True) -> torch.Tensor:
    """Sum of CE(hidden @ weight^T, labels) over labels != -100, computed chunk by chunk of tokens.

    ``gradient_in_forward``: when autograd will need the gradient, compute it in the forward (module docstring;
    one backward per graph); False for a caller that keeps several forwards alive before their backwards.

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
        eager = gradient_in_forward and torch.is_grad_enabled() and (hidden2.requires_grad or weight.requires_grad)
        return ChunkedLinearCrossEntropy.apply(hidden2, weight, labels1, int(chunk), row_loss or TorchRowLoss(),
                                               eager)
