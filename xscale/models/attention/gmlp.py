"""gMLP's spatial gating unit (Liu et al. 2021, "Pay Attention to MLPs", sec. 2, eq. 2-3) as the token mixer of a
block: the channels split in two halves Z1, Z2, and

  s(Z) = Z1 * f_{W,b}(Z2),   f_{W,b}(Z2) = W Z2 + b,

W an (n x n) matrix over the sequence, initialised near zero with b = 1 so each block starts close to an FFN, and Z2
layer-normalised first (sec. 2, "we find it effective to normalize the input of f"). Causal: W lower-triangular
(the paper's masking for autoregressive language modelling, sec. 4.3).

Departures: the unit sits in the attention slot of a block: Z1 = GeLU(the query projection), Z2 = GeLU(the value
projection) per head, and the module's output projection is gMLP's V; the block keeps its FFN after it (gMLP's
block is this unit alone, between the two channel projections). One W (``model.max_seq_len`` square) and b are
shared by the heads and the LayerNorm is over a head's d/H features, so tensor parallelism splits the heads (W
replicated, gradients summed); b is stored as 1 + a zero-initialised bias. Context parallelism runs it on the
gathered sequence. No attention probabilities: attention dropout does not apply.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from xscale.config.schema import ModelConfig
from xscale.models.attention.core import AttentionCore, NoOptions, expand_kv
from xscale.models.attention.sparse import require
from xscale.models.registry import ATTENTION
from xscale.models.traits import ParallelTraits
from xscale.runtime import StepContext


@ATTENTION.register("gmlp")
class SpatialGatingUnit(AttentionCore):
    """Z1 * (W LayerNorm(Z2) + b) over the sequence (Liu et al. 2021, eq. 2-3)."""

    Options = NoOptions
    parallel_traits = ParallelTraits(tp="split_heads", cp_whole_sequence=True)

    def __init__(self, model: ModelConfig, layer_index: int, options: NoOptions) -> None:
        super().__init__(model, layer_index, options)
        self.spatial = nn.Linear(model.max_seq_len, model.max_seq_len)  # W (near zero) and b - 1 (zero)
        self.norm = nn.LayerNorm(model.d_model // model.n_heads)
        self.uses_keys = False

    @classmethod
    def applies_attention_dropout(cls, causal: bool) -> bool:
        return False  # a spatial projection forms no attention probabilities

    def forward(self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, bias: Tensor | None = None,
                context: StepContext | None = None) -> Tensor:
        length = q.shape[2]
        require(length <= self.spatial.weight.shape[0],
                f"gmlp's spatial projection W is model.max_seq_len={self.spatial.weight.shape[0]} square; got "
                f"{length} positions: raise model.max_seq_len")
        weight = self.spatial.weight[:length, :length]
        if causal:
            weight = weight.tril()
        gate = self.norm(F.gelu(expand_kv(v, q.shape[1])))
        spatial = weight.to(gate.dtype) @ gate + (1 + self.spatial.bias[:length, None]).to(gate.dtype)
        return F.gelu(q) * spatial
