"""ETC's global-local attention with external global tokens (Ainslie et al. 2020, "ETC: Encoding Long and Structured
Inputs in Transformers", sec. 3.1): a separate global input of g tokens beside the n long tokens, and four pieces,

  global-to-global and global-to-long:  G   = softmax(Q_g [K_g ; K]^T / sqrt(d)) [V_g ; V]
  long-to-long (a band of radius r) and long-to-global:
                                        O_i = softmax(q_i [K_{|i - j| <= r} ; K_g]^T / sqrt(d)) [V_{|i - j| <= r} ; G],

so a long token reaches any other through the globals in O(n (r + g)) score pairs. The patterns in
:mod:`xscale.models.attention.sparse` make the first tokens of the sequence global (internal); here the global
tokens are extra. Departures: ETC carries the global tokens' hidden states through the layers; here each layer's
globals are g learned (query, key, value) vectors per head (Q_g, K_g, V_g) that first read the whole sequence (G)
and are then read by the long tokens, keys K_g and values G, in the same layer. Attention dropout acts on the long
tokens' probabilities. Encoder only (the globals read every token); a key-padding mask hides the padded keys from
both pieces. The scores are formed densely with the band masked (O(n^2) memory, like ``local`` without its kernel).
Q_g, K_g, V_g are per-head state: tensor parallelism splits them with the heads; context parallelism runs the core on
the gathered sequence.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from xscale.config.schema import ModelConfig
from xscale.models.attention.core import AttentionCore, check_heads, expand_kv
from xscale.models.attention.sparse import require_positive
from xscale.models.registry import ATTENTION
from xscale.models.traits import ParallelTraits
from xscale.runtime import StepContext


@dataclasses.dataclass
class ExternalGlobalOptions:
    global_tokens: int = dataclasses.field(default=4, metadata={"help": "g: external global tokens (learned, per head)"})
    window: int = dataclasses.field(default=8, metadata={"help": "r: long tokens see the long tokens within r"})

    def __post_init__(self) -> None:
        require_positive("etc", global_tokens=self.global_tokens, window=self.window)


@ATTENTION.register("etc", "external_global")
class ExternalGlobalAttention(AttentionCore):
    """A local band plus g external global tokens that read, and are read by, every token (ETC, sec. 3.1)."""

    Options = ExternalGlobalOptions
    causal_capable = False
    takes_padding_mask = True
    per_head_state = ("global_queries", "global_keys", "global_values")
    parallel_traits = ParallelTraits(tp="head_state", cp_whole_sequence=True)

    def __init__(self, model: ModelConfig, layer_index: int, options: ExternalGlobalOptions) -> None:
        super().__init__(model, layer_index, options)
        shape = (model.n_heads, options.global_tokens, model.head_dim)
        self.global_queries = nn.Parameter(torch.randn(shape) * model.init_std)  # Q_g
        self.global_keys = nn.Parameter(torch.randn(shape) * model.init_std)  # K_g
        self.global_values = nn.Parameter(torch.randn(shape) * model.init_std)  # V_g

    def forward(self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, bias: Tensor | None = None,
                context: StepContext | None = None) -> Tensor:
        check_heads(self, self.global_queries, q.shape[1])
        k, v = expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1])
        batch, length, count = q.shape[0], k.shape[2], self.options.global_tokens
        global_keys = self.global_keys.to(k.dtype).expand(batch, -1, -1, -1)
        padding = None if bias is None else bias.to(q.dtype)  # (B, 1, 1, Tk): -inf on padded keys
        global_scores = self.global_queries.to(q.dtype) @ torch.cat([global_keys, k], 2).transpose(-1, -2)
        global_scores = global_scores * q.shape[-1] ** -0.5
        if padding is not None:
            global_scores = global_scores + F.pad(padding, (count, 0))
        global_values = torch.cat([self.global_values.to(v.dtype).expand(batch, -1, -1, -1), v], 2)
        summaries = torch.softmax(global_scores, dim=-1) @ global_values  # G (B, H, g, d)
        distance = torch.arange(length, device=q.device)[None, :] - torch.arange(length, device=q.device)[:, None]
        band = torch.zeros(length, length, dtype=q.dtype, device=q.device)
        band = band.masked_fill(distance.abs() > self.options.window, float("-inf"))
        mask = F.pad(band if padding is None else band + padding, (0, count))  # the globals are seen by every token
        return self.attend(q, torch.cat([k, global_keys], 2), torch.cat([v, summaries], 2), mask, context)
