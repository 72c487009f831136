"""The experts: E copies of the project's FFN with weights stacked on a leading expert dimension.

Stacking ([E, out, in] per projection, like ``nn.Linear`` with an expert index in front) is what lets
expert parallelism shard the experts by slicing dimension 0, and a dense FFN checkpoint turn into
experts by stacking.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from xscale.models.ffn import GatedMLP
from xscale.models.registry import FFN
from xscale.ops.grouped_mlp import ExpertWeights, grouped_mlp
from xscale.ops.grouped_mm_mlp import (
    grouped_mm_applies,
    grouped_mm_mlp,
    grouped_mm_static_rows,
    grouped_mm_token_experts,
)
from xscale.ops.shared_input_gradient import SharedInputGradient
from xscale.ops.token_experts import token_experts


class StackedLinear(nn.Module):
    """E independent ``nn.Linear(in_features, out_features)``: weight [E, out, in], bias [E, out]."""

    def __init__(self, num_experts: int, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, out_features, in_features))
        self.bias = nn.Parameter(torch.empty(num_experts, out_features)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.weight.is_meta:
            return
        bound = 1.0 / math.sqrt(self.weight.shape[-1])
        nn.init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            nn.init.zeros_(self.bias)


class StackedExperts(nn.Module):
    """Expert i is ``config.ffn`` with its own weights; tokens arrive sorted by expert (Lepikhin et al. 2020)."""

    def __init__(self, num_experts: int, ffn_kind: str, d_model: int, hidden: int, bias: bool) -> None:
        super().__init__()
        ffn_class = FFN.get(ffn_kind)
        self.activation = ffn_class.activation
        self.gated = issubclass(ffn_class, GatedMLP)
        if self.gated:
            self.w_gate = StackedLinear(num_experts, d_model, hidden, bias)
            self.w_up = StackedLinear(num_experts, d_model, hidden, bias)
            self.w_down = StackedLinear(num_experts, hidden, d_model, bias)
        else:
            self.w_in = StackedLinear(num_experts, d_model, hidden, bias)
            self.w_out = StackedLinear(num_experts, hidden, d_model, bias)

    @property
    def num_experts(self) -> int:
        """The experts held here: all of them, or this rank's slice under expert parallelism (the weights' rows)."""
        first = self.w_gate if self.gated else self.w_in
        return first.weight.shape[0]

    def weights(self) -> ExpertWeights:
        if self.gated:
            return ExpertWeights(self.w_gate.weight, self.w_gate.bias, self.w_up.weight, self.w_up.bias,
                                 self.w_down.weight, self.w_down.bias, self.activation)
        return ExpertWeights(self.w_in.weight, self.w_in.bias, None, None, self.w_out.weight, self.w_out.bias,
                             self.activation)

    def forward(self, tokens_by_expert: torch.Tensor, counts: list[int], token_index: torch.Tensor | None = None,
                gate: torch.Tensor | None = None, input_gradient: SharedInputGradient | None = None) -> torch.Tensor:
        """Tokens [sum(counts), d] sorted by expert, ``counts[i]`` of them for expert i -> outputs, same order.

        Variable-size expert batches (dropless-capable): each expert's whole FFN runs on its own rows
        (:func:`xscale.ops.grouped_mlp.grouped_mlp`). With ``token_index`` and ``gate`` (top-1: each token kept at
        most once) the first argument is the layer's tokens [N, d] in token order, and the result the gated
        combination per token [N, d] (:func:`xscale.ops.token_experts.token_experts`: dispatch and combine inside
        each expert's pass; ``input_gradient``: the router's, see :mod:`xscale.ops.shared_input_gradient`). On
        CUDA in bf16 the experts run as grouped GEMMs (``torch._grouped_mm``, :mod:`xscale.ops.grouped_mm_mlp`).
        """
        if len(counts) != self.num_experts:
            raise ValueError(f"got token counts for {len(counts)} experts, this module holds {self.num_experts}")
        weights = self.weights()
        if grouped_mm_applies(tokens_by_expert, weights):
            if token_index is not None:
                return grouped_mm_token_experts(tokens_by_expert, token_index, gate, counts, weights)
            return grouped_mm_mlp(tokens_by_expert, counts, weights)
        if token_index is not None:
            return token_experts(tokens_by_expert, token_index, gate, counts, weights, input_gradient=input_gradient)
        return grouped_mlp(tokens_by_expert, counts, weights.activation, weights.w1, weights.b1, weights.w2,
                           weights.b2, weights.w_up, weights.b_up)

    def static_rows_apply(self, tokens: torch.Tensor) -> bool:
        """Whether :meth:`static_rows` runs here: where the grouped GEMM does (CUDA, bf16)."""
        return grouped_mm_applies(tokens, self.weights())

    def static_rows(self, tokens: torch.Tensor, token_index: torch.Tensor, gate: torch.Tensor,
                    row_ends: torch.Tensor, expert_of_row: torch.Tensor) -> torch.Tensor:
        """tokens [N, d] -> the gated sum of each token's experts [N, d], from a static-rows routing
        (:func:`xscale.models.moe.routing.static_rows_routing`: every assignment a row, the group ends on the
        device), through one grouped GEMM per projection with no host sync."""
        return grouped_mm_static_rows(tokens, token_index, gate, row_ends, expert_of_row, self.weights())
