"""The fused ops as the models call them: each picks Triton, apex or PyTorch through ``dispatch.choose_backend``."""

from __future__ import annotations

import torch

from xscale.ops import apex as apex_ops
from xscale.ops import reference
from xscale.ops.block_sparse_attention import (
    BlockLayout,
    block_sparse_attention_gathered,
    block_sparse_attention_reference,
    build_layout,
)
from xscale.ops.chunked_cross_entropy import chunked_linear_cross_entropy_sum
from xscale.ops.dispatch import choose_backend, is_distributed, kernel_module
from xscale.ops.flex_block_sparse import flex_block_sparse_attention
from xscale.ops.moe_permute import Permutation, permute_reference, plan_permutation, unpermute_reference


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, backend: str = "auto") -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight."""
    backend = choose_backend((x, weight), backend, apex_has_op=True)
    if backend == "triton":
        return kernel_module("norm").residual_norm(x, None, weight, None, eps, is_rms=True)
    if backend == "apex":
        return apex_ops.rms_norm(x, weight, eps)
    return reference.rms_norm(x, weight, eps)


def rms_norm_residual(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                      eps: float, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) in one pass."""
    backend = choose_backend((x, residual, weight), backend, apex_has_op=True)
    if backend == "triton":
        return kernel_module("norm").residual_norm(x, residual, weight, None, eps, is_rms=True)
    if backend == "apex":
        summed = x + residual
        return apex_ops.rms_norm(summed, weight, eps), summed
    return reference.rms_norm_residual(x, residual, weight, eps)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float,
               backend: str = "auto") -> torch.Tensor:
    backend = choose_backend((x, weight), backend, apex_has_op=True)
    if backend == "triton":
        return kernel_module("norm").residual_norm(x, None, weight, bias, eps, is_rms=False)
    if backend == "apex":
        return apex_ops.layer_norm(x, weight, bias, eps)
    return reference.layer_norm(x, weight, bias, eps)


def layer_norm_residual(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                        eps: float, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """(layer_norm(x + residual), x + residual) in one pass."""
    backend = choose_backend((x, residual, weight), backend, apex_has_op=True)
    if backend == "triton":
        return kernel_module("norm").residual_norm(x, residual, weight, bias, eps, is_rms=False)
    if backend == "apex":
        summed = x + residual
        return apex_ops.layer_norm(summed, weight, bias, eps), summed
    return reference.layer_norm_residual(x, residual, weight, bias, eps)


def gated_activation(gate: torch.Tensor, up: torch.Tensor, activation: str, backend: str = "auto") -> torch.Tensor:
    """act(gate) * up: SwiGLU (silu), GeGLU (gelu, gelu_tanh), ReGLU (relu)."""
    if choose_backend((gate, up), backend) == "triton":
        return kernel_module("gated").gated_activation(gate, up, activation)
    return reference.gated_activation(gate, up, activation)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """x * cos + rotate_half(x) * sin; the kernel takes cos/sin of shape ([1, ...,] T, head_dim).

    The kernel passes no gradient to cos/sin (position tables); other table shapes use the reference.
    """
    table = (x.shape[-2], x.shape[-1])
    kernel_shape = tuple(cos.shape[-2:]) == table and cos.numel() == table[0] * table[1] and sin.shape == cos.shape
    if kernel_shape and choose_backend((x, cos, sin), backend) == "triton":
        return kernel_module("rope").apply_rope(x, cos, sin)
    return reference.apply_rope(x, cos, sin)


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of token cross-entropies over labels != -100, in float32 (always the PyTorch reference)."""
    return reference.cross_entropy_sum(logits, labels)


def linear_cross_entropy_sum(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                             chunk_tokens: int | None = None, backend: str = "auto",
                             gradient_in_forward: bool = True) -> torch.Tensor:
    """cross_entropy_sum(hidden @ weight^T, labels) without materialising the logits (except under 'torch');
    ``gradient_in_forward``: :mod:`xscale.ops.chunked_cross_entropy`."""
    if choose_backend((hidden, weight), backend) == "triton":
        return kernel_module("cross_entropy").linear_cross_entropy_sum(hidden, weight, labels, chunk_tokens,
                                                                       gradient_in_forward)
    if backend == "torch" or is_distributed(hidden) or is_distributed(weight):
        return reference.linear_cross_entropy_sum(hidden, weight, labels)  # the chunked Function takes plain tensors
    return chunked_linear_cross_entropy_sum(hidden, weight, labels, chunk_tokens=chunk_tokens,
                                            gradient_in_forward=gradient_in_forward)


def moe_permute(tokens: torch.Tensor, expert_ids: torch.Tensor, num_experts: int,
                backend: str = "auto") -> tuple[torch.Tensor, Permutation]:
    """tokens (N, d), expert_ids (N, k) -> (N*k, d) rows grouped by expert (stable), and the plan to undo it."""
    plan = plan_permutation(expert_ids, num_experts)
    if choose_backend((tokens,), backend) == "triton":
        return kernel_module("moe_permute").Permute.apply(tokens, plan.token_of, plan.position), plan
    return permute_reference(tokens, plan), plan


def moe_unpermute(expert_out: torch.Tensor, plan: Permutation, gate_weights: torch.Tensor,
                  backend: str = "auto") -> torch.Tensor:
    """(N*k, d) expert outputs -> (N, d): y[t] = sum_j gate_weights[t, j] * expert_out[plan.position[t, j]]."""
    if gate_weights.shape != plan.position.shape:
        raise ValueError(f"gate_weights {tuple(gate_weights.shape)} must be (tokens, top_k) "
                         f"= {tuple(plan.position.shape)}")
    if choose_backend((expert_out, gate_weights), backend) == "triton":
        return kernel_module("moe_permute").Unpermute.apply(expert_out, plan.position, plan.token_of,
                                                            plan.pair_of, gate_weights)
    return unpermute_reference(expert_out, plan, gate_weights)


def block_sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: BlockLayout | None = None, *,
                           block_index: torch.Tensor | None = None, block_count: torch.Tensor | None = None,
                           block_size: int | None = None, causal: bool = False,
                           scale: float | None = None, backend: str = "auto") -> torch.Tensor:
    """q (B, H, Tq, hd), k/v (B, Hkv, Tk, hd) -> (B, H, Tq, hd) over a block layout (see block_sparse_attention.py).

    Pass a prebuilt ``layout`` (``build_layout``, reusable across layers and steps) or the raw tables.
    ``backend`` is a ``train.kernels`` setting, or ``flex``: PyTorch's FlexAttention (``ops/flex_block_sparse.py``).
    """
    if layout is None:
        if block_index is None or block_count is None or block_size is None:
            raise ValueError("pass layout=build_layout(...) or block_index, block_count and block_size")
        layout = build_layout(block_index, block_count, block_size, q.shape[-2], k.shape[-2])
    if k.shape[1] != q.shape[1]:
        if q.shape[1] % k.shape[1]:
            raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} key/value heads")
        repeats = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(repeats, dim=1), v.repeat_interleave(repeats, dim=1)
    if layout.mask.shape[0] not in (1, q.shape[1]):
        raise ValueError(f"a per-head layout has {layout.mask.shape[0]} heads but q has {q.shape[1]}")
    if backend == "flex":
        return flex_block_sparse_attention(q, k, v, layout, causal, scale)
    if choose_backend((q, k, v), backend) == "triton":
        return kernel_module("block_sparse_attention").BlockSparseAttention.apply(
            q, k, v, layout.index, layout.count, layout.transposed_index, layout.transposed_count,
            layout.block_size, causal, scale)
    if backend == "torch" or is_distributed(q):
        return block_sparse_attention_reference(q, k, v, layout, causal, scale)
    return block_sparse_attention_gathered(q, k, v, layout, causal, scale)
