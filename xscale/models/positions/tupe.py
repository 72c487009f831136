"""TUPE, Transformer with Untied Positional Encoding (Ke et al. 2021, "Rethinking Positional Encoding in Language
Pre-training", sec. 3, eq. 7-8): absolute positions are not added to the word embeddings; each head adds a
positional correlation computed from the positions alone, with its own projections, and (TUPE-R) a relative bias,

  alpha_ij = (x_i W^Q)(x_j W^K)^T / sqrt(2d) + (p_i U^Q)(p_j U^K)^T / sqrt(2d) + b_{j-i},

b_{j-i} T5's bucketed relative bias (``relative``; false gives TUPE-A). The positional term depends on positions
only, so it is a logit bias that any core taking one reads (``PositionEncoding.bias``).

Departures: the content term keeps the core's 1/sqrt(d) (the core owns it) while the positional term takes the
paper's 1/sqrt(2d); one p, U^Q, U^K per stack, read by every layer (xscale's position components are per stack);
the [CLS] untying of sec. 3.2 is not done (a model here need not start with a [CLS] token). Tensor parallelism
replicates it (each rank reads its heads' rows, gradients summed); context parallelism takes the held queries' rows
of the whole sequence's bias.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn

from xscale.models.position import T5BiasOptions, T5RelativeBias, _query_rows, relative_distances
from xscale.models.registry import POSITION
from xscale.models.traits import ParallelTraits
from xscale.runtime import StepContext


@dataclasses.dataclass
class TupeOptions(T5BiasOptions):
    relative: bool = dataclasses.field(default=True, metadata={"help": "add T5's relative bias b_{j-i} (TUPE-R); "
                                                                        "false: TUPE-A"})


@POSITION.register("tupe")
class UntiedPositionalAttention(T5RelativeBias):
    """(p_i U^Q)(p_j U^K)^T / sqrt(2d) (+ b_{j-i}) per head as a logit bias (Ke et al. 2021, eq. 7-8)."""

    Options = TupeOptions
    parallel_traits = ParallelTraits(tp="replicated", cp=True)
    biases_logits = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.table = nn.Parameter(torch.empty(self.max_seq_len, self.d_model))  # p
        self.query = nn.Linear(self.d_model, self.n_heads * self.head_dim, bias=False)  # U^Q
        self.key = nn.Linear(self.d_model, self.n_heads * self.head_dim, bias=False)  # U^K

    def bias(self, q_len: int, k_len: int, heads: slice, context: StepContext | None = None) -> torch.Tensor:
        def bias_of(queries: int, keys: int) -> torch.Tensor:
            if keys > self.max_seq_len:
                raise ValueError(f"sequence length {keys} exceeds model.max_seq_len={self.max_seq_len}")
            positions = self.table[:keys]
            pq = self.query(positions[keys - queries:]).view(queries, self.n_heads, self.head_dim).transpose(0, 1)
            pk = self.key(positions).view(keys, self.n_heads, self.head_dim).transpose(0, 1)
            out = pq[heads] @ pk[heads].transpose(-1, -2) / math.sqrt(2 * self.head_dim)
            if self.options.relative:
                relative = relative_distances(queries, keys, self.weight.device)
                out = out + self.weight[self._bucket(relative)].permute(2, 0, 1)[heads]
            return out

        return _query_rows(bias_of, q_len, k_len, context)
