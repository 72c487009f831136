"""The average attention network (Zhang et al. 2018, "Accelerating Neural Transformer via an Average Attention
Network", sec. 3, eq. 1-3), a decoder's self-attention replaced by a cumulative average and a gate:

  g_j = FFN((1 / j) sum_{k <= j} y_k)                      (eq. 1, the average layer with its FFN)
  i_j, f_j = sigmoid(W [y_j ; g_j])                          (eq. 2, input and forget gates)
  h_j = i_j * y_j + f_j * g_j                                (eq. 3)

O(T d) with no attention scores. As a core it reads per head: the averaged y_k are the value projections, the gated
y_j the query projections (the block's input through its own projection), and the result goes through the module's
output projection. Departures: the FFN (d -> 4d -> d, ReLU) and the gate's W act on each head's slice of d/H
features, shared by the heads (the paper's act on the whole model width), so tensor parallelism can split the heads
(their parameters replicated, gradients summed); the block's residual and norm follow as for any attention. Decoder
only (the paper's use; an encoder is refused by name). The average reads every earlier position, so context
parallelism runs it on the gathered sequence.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from xscale.config.schema import ModelConfig
from xscale.models.attention.core import AttentionCore, NoOptions, expand_kv
from xscale.models.registry import ATTENTION
from xscale.models.traits import ParallelTraits
from xscale.runtime import StepContext


def cumulative_average(v: Tensor) -> Tensor:
    """(1 / j) sum_{k <= j} v_k along dim 2."""
    count = torch.arange(1, v.shape[2] + 1, device=v.device, dtype=v.dtype)[:, None]
    return v.cumsum(2) / count


@ATTENTION.register("average")
class AverageAttention(AttentionCore):
    """Cumulative average, FFN and input/forget gates (Zhang et al. 2018, eq. 1-3)."""

    Options = NoOptions
    bidirectional_capable = False
    parallel_traits = ParallelTraits(tp="split_heads", cp_whole_sequence=True)

    def __init__(self, model: ModelConfig, layer_index: int, options: NoOptions) -> None:
        super().__init__(model, layer_index, options)
        head_dim = model.d_model // model.n_heads
        self.ffn_in = nn.Linear(head_dim, 4 * head_dim)
        self.ffn_out = nn.Linear(4 * head_dim, head_dim)
        self.gates = nn.Linear(2 * head_dim, 2 * head_dim)
        self.uses_keys = False

    @classmethod
    def applies_attention_dropout(cls, causal: bool) -> bool:
        return False  # an average forms no attention probabilities

    def forward(self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, bias: Tensor | None = None,
                context: StepContext | None = None) -> Tensor:
        average = cumulative_average(expand_kv(v, q.shape[1]))
        g = self.ffn_out(torch.relu(self.ffn_in(average)))
        input_gate, forget_gate = torch.sigmoid(self.gates(torch.cat([q, g], dim=-1))).chunk(2, dim=-1)
        return input_gate * q + forget_gate * g
