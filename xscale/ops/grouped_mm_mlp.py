"""Expert FFNs through ``torch._grouped_mm``: one grouped GEMM per projection for all experts (CUDA).

For rows sorted by expert (``counts[e]`` rows for expert e), ``torch._grouped_mm(x, W^T, offs)`` multiplies each
expert's row group by its own weight in one kernel (CUTLASS grouped GEMM on Hopper), where
:func:`xscale.ops.grouped_mlp.grouped_mlp` launches one GEMM per expert (the CPU path, experts side by side on the
threads). Same arithmetic as the unfused FFN:

    MLP:        y_e = act(x_e W1_e^T + b1_e) W2_e^T + b2_e
    gated MLP:  y_e = (act(x_e Wg_e^T + bg_e) * (x_e Wu_e^T + bu_e)) W2_e^T + b2_e

torch's CUDA kernel takes bf16 operands whose inner dimensions are multiples of 8 (16-byte rows):
:func:`grouped_mm_applies` says when this path is taken.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from xscale.ops.grouped_mlp import ExpertWeights, autocast_operands, check_experts


class _ContiguousGradient(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient (``_grouped_mm``'s backward refuses expanded ones)."""

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def _activation(pre: torch.Tensor, activation: str) -> torch.Tensor:
    if activation in ("gelu", "gelu_tanh"):
        return F.gelu(pre, approximate="tanh" if activation == "gelu_tanh" else "none")
    if activation == "silu":
        return F.silu(pre)
    if activation == "relu":
        return F.relu(pre)
    raise ValueError(f"unknown activation '{activation}' (gelu, gelu_tanh, silu, relu)")


def grouped_mm_applies(x: torch.Tensor, weights: ExpertWeights) -> bool:
    """Whether torch's grouped GEMM runs these operands: CUDA, bf16 (after autocast), 16-byte-aligned rows."""
    if not x.is_cuda or not hasattr(torch, "_grouped_mm") or type(x).__name__ == "DTensor":
        return False
    dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else x.dtype
    if dtype != torch.bfloat16 or (not torch.is_autocast_enabled("cuda") and weights.w1.dtype != torch.bfloat16):
        return False
    return x.shape[-1] % 8 == 0 and weights.hidden % 8 == 0


def _grouped_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, offsets: torch.Tensor,
                    expert_of_row: torch.Tensor | None) -> torch.Tensor:
    """Rows of group e times weight[e]^T (+ bias[e]); weight [E, out, in] as ``nn.Linear`` stores it."""
    y = _ContiguousGradient.apply(torch._grouped_mm(x, weight.transpose(-2, -1), offs=offsets))
    return y if bias is None else y + bias[expert_of_row]


def _grouped_ffn(x: torch.Tensor, offsets: torch.Tensor, expert_of_row: torch.Tensor | None,
                 weights: ExpertWeights) -> torch.Tensor:
    """The FFN of each row group (cumulative ends ``offsets``, int32) through the grouped GEMM, autocast off."""
    with torch.autocast(x.device.type, enabled=False):
        hidden = _activation(_grouped_linear(x, weights.w1, weights.b1, offsets, expert_of_row), weights.activation)
        if weights.gated:
            hidden = hidden * _grouped_linear(x, weights.w_up, weights.b_up, offsets, expert_of_row)
        return _grouped_linear(hidden, weights.w2, weights.b2, offsets, expert_of_row)


def _has_bias(weights: ExpertWeights) -> bool:
    return any(b is not None for b in (weights.b1, weights.b_up, weights.b2))


def grouped_mm_mlp(x: torch.Tensor, counts: list[int], weights: ExpertWeights) -> torch.Tensor:
    """x [sum(counts), d] sorted by expert -> [sum(counts), d]; under autocast in the autocast dtype."""
    check_experts(counts, weights)
    if sum(counts) != x.shape[0]:
        raise ValueError(f"the row counts add up to {sum(counts)}, x has {x.shape[0]} rows")
    x, weights = autocast_operands(x, weights)
    sizes = torch.tensor(counts, device=x.device)
    offsets = sizes.cumsum(0).to(torch.int32)
    expert_of_row = (torch.repeat_interleave(torch.arange(len(counts), device=x.device), sizes)
                     if _has_bias(weights) else None)
    return _grouped_ffn(x, offsets, expert_of_row, weights)


def grouped_mm_token_experts(tokens: torch.Tensor, token_index: torch.Tensor, gate: torch.Tensor, counts: list[int],
                             weights: ExpertWeights, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """tokens [N, d] -> [N, d]: y_t = gate[a] FFN_e(tokens[t]) for the kept assignment a = (t, e), else 0 (top-1,
    as :func:`xscale.ops.token_experts.token_experts`), with the experts through the grouped GEMM."""
    expert_out = grouped_mm_mlp(tokens[token_index], counts, weights)
    return _combine_by_gate(expert_out, gate, token_index, tokens.shape[0]).to(out_dtype or tokens.dtype)


def _combine_by_gate(expert_out: torch.Tensor, gate: torch.Tensor, token_index: torch.Tensor,
                     num_tokens: int) -> torch.Tensor:
    """[num_tokens, d]: row a of ``expert_out`` times gate[a], summed into token ``token_index[a]`` (0 elsewhere)."""
    weighted = expert_out * gate.unsqueeze(-1).to(expert_out.dtype)
    return weighted.new_zeros((num_tokens, weighted.shape[-1])).index_add(0, token_index, weighted)


def grouped_mm_static_rows(tokens: torch.Tensor, token_index: torch.Tensor, gate: torch.Tensor,
                           row_ends: torch.Tensor, expert_of_row: torch.Tensor,
                           weights: ExpertWeights) -> torch.Tensor:
    """tokens [N, d] -> [N, d]: y_t = sum over t's rows a of gate[a] FFN_e(a)(tokens[t]), with the row groups'
    ends on the device (``row_ends`` [E], the last = number of rows; ``expert_of_row`` [A]): no host sync, every
    shape fixed by A (:func:`xscale.models.moe.routing.static_rows_routing`; rows with gate 0 add exactly 0)."""
    if weights.w1.shape[0] != row_ends.shape[0]:
        raise ValueError(f"got row ends for {row_ends.shape[0]} experts, the weights hold {weights.w1.shape[0]}")
    x, weights = autocast_operands(tokens.index_select(0, token_index), weights)
    expert_out = _grouped_ffn(x, row_ends.to(torch.int32), expert_of_row if _has_bias(weights) else None, weights)
    return _combine_by_gate(expert_out, gate, token_index, tokens.shape[0]).to(tokens.dtype)
