"""Attention with persistent memory vectors (Sukhbaatar et al. 2019, "Augmenting Self-attention with Persistent
Memory", sec. 4, eq. 6-7): each head's keys and values are extended by N learned vectors that every query sees,

  K~ = [K ; M_k],   V~ = [V ; M_v],   O_i = softmax(q_i K~^T / sqrt(d) + mask) V~,

the context keys causally masked (when causal), the persistent ones never. In the paper these vectors replace the
feed-forward sub-layer (the "all-attention layer"). Departures: the block keeps ``model.ffn`` (removing it is the
block's business, not the core's), and M_k, M_v start from the model's normal init with no rescaling by sqrt(d) or
sqrt(N). M_k and M_v are (heads, N, d/H) per-head state: tensor parallelism splits them with the heads; context
parallelism runs the core on the gathered sequence. Attention dropout acts on the (T + N)-wide probabilities.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from xscale.config.schema import ModelConfig
from xscale.models.attention.core import AttentionCore, check_heads, expand_kv
from xscale.models.attention.dense import causal_bias
from xscale.models.attention.sparse import require_positive
from xscale.models.registry import ATTENTION
from xscale.models.traits import ParallelTraits
from xscale.runtime import StepContext


@dataclasses.dataclass
class PersistentOptions:
    persistent_vectors: int = dataclasses.field(default=16, metadata={"help": "N: learned key/value pairs per head"})

    def __post_init__(self) -> None:
        require_positive("persistent", persistent_vectors=self.persistent_vectors)


@ATTENTION.register("persistent", "all_attention")
class PersistentMemoryAttention(AttentionCore):
    """Softmax attention over the context keys and N persistent key/value vectors per head (eq. 6-7)."""

    Options = PersistentOptions
    supports_bias = True
    takes_padding_mask = True
    per_head_state = ("persistent_keys", "persistent_values")
    parallel_traits = ParallelTraits(tp="head_state", cp_whole_sequence=True)

    def __init__(self, model: ModelConfig, layer_index: int, options: PersistentOptions) -> None:
        super().__init__(model, layer_index, options)
        shape = (model.n_heads, options.persistent_vectors, model.head_dim)
        self.persistent_keys = nn.Parameter(torch.randn(shape) * model.init_std)
        self.persistent_values = nn.Parameter(torch.randn(shape) * model.init_std)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, bias: Tensor | None = None,
                context: StepContext | None = None) -> Tensor:
        check_heads(self, self.persistent_keys, q.shape[1])
        batch = q.shape[0]
        keys = torch.cat([expand_kv(k, q.shape[1]), self.persistent_keys.to(k.dtype).expand(batch, -1, -1, -1)], 2)
        values = torch.cat([expand_kv(v, q.shape[1]), self.persistent_values.to(v.dtype).expand(batch, -1, -1, -1)],
                           2)
        mask = None
        if causal:
            mask = causal_bias(q.shape[2], k.shape[2], q.device, q.dtype)
        if bias is not None:
            mask = bias.to(q.dtype) if mask is None else mask + bias.to(q.dtype)
        if mask is not None:  # the persistent vectors are seen by every query
            mask = F.pad(mask, (0, self.options.persistent_vectors))
        return self.attend(q, keys, values, mask, context)
