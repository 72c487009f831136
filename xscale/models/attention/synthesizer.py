"""Synthesizer attention (Tay et al. 2021): attention weights synthesised without query-key products.

  dense:      B_i = W_2 relu(W_1 q_i + b_1) + b_2, one row of n logits per token from that token alone;
  random:     B = R, a learned n x n matrix per head;
  factorized: B = R_1 R_2^T with R_1, R_2 of n x rank (the paper's factorised random synthesizer);
  out = softmax(B (+ bias, mask)) V, n = model.max_seq_len (rows and columns cut to the actual lengths).
The dense variant reads the per-head query q_i = x_i W_q^h in place of the paper's x_i (so W_1 acts through
W_q^h); random and factorized read no queries and no keys (no W_q, W_k are built). Every logit of token i
depends only on token i or on positions, so the causal mask alone makes each variant causal. Cost T^2.
RoPE rotates nothing here (it needs queries and keys); the logit columns are positions already, and learned,
sinusoidal, ALiBi or T5 encodings add to them as usual.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor, nn

from xscale.config.schema import ModelConfig
from xscale.models.attention.core import AttentionCore, check_heads, expand_kv
from xscale.models.attention.dense import causal_bias
from xscale.models.attention.sparse import require, require_positive
from xscale.models.registry import ATTENTION
from xscale.models.traits import ParallelTraits
from xscale.runtime import StepContext

MODES = ("dense", "random", "factorized")


@dataclasses.dataclass
class SynthesizerOptions:
    mode: str = "dense"
    rank: int = 8  # factorized: the inner dimension of R_1 R_2^T

    def __post_init__(self) -> None:
        require(self.mode in MODES,
                f"model.attention.options.mode='{self.mode}' is not a synthesizer mode; use one of {', '.join(MODES)}")
        require_positive("synthesizer", rank=self.rank)


@ATTENTION.register("synthesizer")
class SynthesizerAttention(AttentionCore):
    Options = SynthesizerOptions
    supports_bias = True
    takes_padding_mask = True  # the padding mask enters as a -inf logit bias on the padded keys
    per_head_state = ("hidden_weight", "hidden_bias", "output_weight", "output_bias", "random_logits",
                      "random_left", "random_right")
    parallel_traits = ParallelTraits(tp="head_state", cp_whole_sequence=True)

    def __init__(self, model: ModelConfig, layer_index: int, options: SynthesizerOptions) -> None:
        super().__init__(model, layer_index, options)
        heads, head_dim, length = model.n_heads, model.head_dim, model.max_seq_len
        self.uses_queries = options.mode == "dense"
        self.uses_keys = False
        if options.mode == "dense":
            self.hidden_weight = nn.Parameter(torch.empty(heads, head_dim, head_dim))
            self.hidden_bias = nn.Parameter(torch.zeros(heads, head_dim))
            self.output_weight = nn.Parameter(torch.empty(heads, head_dim, length))
            self.output_bias = nn.Parameter(torch.zeros(heads, length))
        elif options.mode == "random":
            self.random_logits = nn.Parameter(torch.empty(heads, length, length))
        else:
            self.random_left = nn.Parameter(torch.empty(heads, length, options.rank))
            self.random_right = nn.Parameter(torch.empty(heads, length, options.rank))

    def logits(self, q: Tensor, k_len: int) -> Tensor:
        """(B or 1, H, Tq, Tk) synthesised logits; q is a (B, H, Tq, 0) placeholder unless mode is dense."""
        q_len = q.shape[2]
        mode = self.options.mode
        if mode == "dense":
            check_heads(self, self.hidden_weight, q.shape[1])
            hidden = torch.relu(torch.einsum("bhtd,hde->bhte", q, self.hidden_weight) + self.hidden_bias[:, None])
            return (torch.einsum("bhte,hen->bhtn", hidden, self.output_weight[..., :k_len])
                    + self.output_bias[:, None, :k_len])
        if mode == "random":
            check_heads(self, self.random_logits, q.shape[1])
            return self.random_logits[None, :, :q_len, :k_len]
        check_heads(self, self.random_left, q.shape[1])
        return (self.random_left[:, :q_len] @ self.random_right[:, :k_len].transpose(-1, -2))[None]

    def forward(self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, bias: Tensor | None = None, context: StepContext | None = None) -> Tensor:
        limit = self.model_config.max_seq_len
        if max(q.shape[2], v.shape[2]) > limit:
            raise ValueError(f"synthesizer was built for at most model.max_seq_len={limit} tokens and got "
                             f"{max(q.shape[2], v.shape[2])}; raise model.max_seq_len")
        v = expand_kv(v, q.shape[1])
        logits = self.logits(q, v.shape[2]).to(v.dtype)
        if bias is not None:
            logits = logits + bias.to(logits.dtype)
        if causal:
            logits = logits + causal_bias(q.shape[2], v.shape[2], v.device, v.dtype)
        weights = torch.softmax(logits, dim=-1)
        weights = self.dropout(weights, context)
        return weights @ v
