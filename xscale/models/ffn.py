"""Position-wise feed-forward networks: the 2-layer MLP and its GLU variants (Shazeer 2020)."""

from __future__ import annotations

import torch
from torch import nn

from xscale.config.schema import Component
from xscale.models.dropout import Dropout
from xscale.models.registry import FFN
from xscale.models.traits import ParallelTraits
from xscale.ops import gated_activation
from xscale.ops.reference import ACTIVATIONS
from xscale.runtime import StepContext


class MLP(nn.Module):
    """FFN(x) = act(x W_in + b_in) W_out + b_out."""

    activation = "relu"
    parallel_traits = ParallelTraits(tp="split_hidden", column_parallel=("w_in",), row_parallel=("w_out",))

    def __init__(self, d_model: int, hidden: int, bias: bool = False, dropout: float = 0.0) -> None:
        super().__init__()
        self.w_in = nn.Linear(d_model, hidden, bias=bias)
        self.w_out = nn.Linear(hidden, d_model, bias=bias)
        self.dropout = Dropout(dropout)

    def forward(self, x: torch.Tensor, context: StepContext | None = None) -> torch.Tensor:
        return self.dropout(self.w_out(ACTIVATIONS[self.activation](self.w_in(x))), context)


@FFN.register("relu")
class ReluMLP(MLP):
    activation = "relu"


@FFN.register("gelu")
class GeluMLP(MLP):
    activation = "gelu"


@FFN.register("gelu_tanh")
class GeluTanhMLP(MLP):
    """GELU with the tanh approximation (GPT-2's ``gelu_new``)."""

    activation = "gelu_tanh"


class GatedMLP(nn.Module):
    """FFN_GLU(x) = (act(x W_gate) * (x W_up)) W_down (Shazeer 2020, eq. 5-6)."""

    activation = "silu"
    parallel_traits = ParallelTraits(tp="split_hidden", column_parallel=("w_gate", "w_up"), row_parallel=("w_down",))
    kernels = "auto"  # the fused-op backend (Transformer.use_kernels)

    def __init__(self, d_model: int, hidden: int, bias: bool = False, dropout: float = 0.0) -> None:
        super().__init__()
        self.w_gate = nn.Linear(d_model, hidden, bias=bias)
        self.w_up = nn.Linear(d_model, hidden, bias=bias)
        self.w_down = nn.Linear(hidden, d_model, bias=bias)
        self.dropout = Dropout(dropout)

    def forward(self, x: torch.Tensor, context: StepContext | None = None) -> torch.Tensor:
        hidden = gated_activation(self.w_gate(x), self.w_up(x), self.activation, self.kernels)
        return self.dropout(self.w_down(hidden), context)


@FFN.register("swiglu")
class SwiGLU(GatedMLP):
    activation = "silu"


@FFN.register("geglu")
class GeGLU(GatedMLP):
    activation = "gelu"


@FFN.register("reglu")
class ReGLU(GatedMLP):
    activation = "relu"


def build_ffn(ffn: Component, d_model: int, hidden: int, bias: bool, dropout: float) -> nn.Module:
    """The feed-forward block ``model.ffn`` names, given its options when it takes any (the product-key memory)."""
    options = FFN.options(ffn, "model.ffn")
    cls = FFN.get(ffn.kind)
    extra = {"options": options} if hasattr(cls, "Options") else {}
    return cls(d_model, hidden, bias=bias, dropout=dropout, **extra)
