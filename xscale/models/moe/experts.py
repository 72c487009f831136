"""The experts: E copies of the project's FFN with weights stacked on a leading expert dimension.

Stacking ([E, out, in] per projection, like ``nn.Linear`` with an expert index in front) is what lets
expert parallelism shard the experts by slicing dimension 0, and a dense FFN checkpoint turn into
experts by stacking.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from xscale.models.ffn import ACTIVATIONS, GatedMLP
from xscale.models.registry import FFN


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

    def per_expert(self) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """(weight, bias) of each expert; one ``unbind`` so backward stacks the gradients once."""
        weights = self.weight.unbind(0)
        biases = self.bias.unbind(0) if self.bias is not None else [None] * len(weights)
        return list(zip(weights, biases))


class StackedExperts(nn.Module):
    """Expert i is ``config.ffn`` with its own weights; tokens arrive sorted by expert (Lepikhin et al. 2020)."""

    def __init__(self, num_experts: int, ffn_kind: str, d_model: int, hidden: int, bias: bool) -> None:
        super().__init__()
        ffn_class = FFN.get(ffn_kind)
        self.num_experts = num_experts
        self.activation = ffn_class.activation
        self.gated = issubclass(ffn_class, GatedMLP)
        if self.gated:
            self.w_gate = StackedLinear(num_experts, d_model, hidden, bias)
            self.w_up = StackedLinear(num_experts, d_model, hidden, bias)
            self.w_down = StackedLinear(num_experts, hidden, d_model, bias)
        else:
            self.w_in = StackedLinear(num_experts, d_model, hidden, bias)
            self.w_out = StackedLinear(num_experts, hidden, d_model, bias)

    def _ffn(self, x: torch.Tensor, *projections: tuple[torch.Tensor, torch.Tensor | None]) -> torch.Tensor:
        """One expert's FFN on tokens x [n, d_model], given its (weight, bias) per projection."""
        if self.gated:
            from xscale.ops import gated_activation

            gate, up, down = projections
            return F.linear(gated_activation(F.linear(x, *gate), F.linear(x, *up), self.activation), *down)
        w_in, w_out = projections
        return F.linear(ACTIVATIONS[self.activation](F.linear(x, *w_in)), *w_out)

    def forward(self, tokens_by_expert: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Tokens [sum(counts), d] sorted by expert, ``counts[i]`` of them for expert i -> outputs, same order.

        Variable-size expert batches (dropless-capable): one GEMM per expert on its own rows.
        """
        if len(counts) != self.num_experts:
            raise ValueError(f"got token counts for {len(counts)} experts, this module holds {self.num_experts}")
        projections = (self.w_gate, self.w_up, self.w_down) if self.gated else (self.w_in, self.w_out)
        per_expert = zip(*(projection.per_expert() for projection in projections))
        chunks = tokens_by_expert.split(counts)
        outputs = [self._ffn(chunk, *weights) for chunk, weights in zip(chunks, per_expert)]
        return torch.cat(outputs) if outputs else tokens_by_expert
