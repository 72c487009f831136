"""MLP-Mixer token mixing (Tolstikhin et al. 2021, "MLP-Mixer: An all-MLP Architecture for Vision", sec. 2, eq. 1):
an MLP across the sequence axis, applied to every channel alike,

  U_{*,i} = X_{*,i} + W_2 GELU(W_1 LayerNorm(X)_{*,i}),   i = 1..C,

W_1 [D_S x T] and W_2 [T x D_S] over the tokens (with biases), shared by the channels.

Departures: it runs in the attention slot of a block on each head's slice of the value projection (the channels of
the token MLP are a head's d/H features), the LayerNorm over those features; the module's output projection follows
and the block's residual is the paper's skip. The token MLP is ``model.max_seq_len`` wide (D_S = T_max, the paper's
D_S is a free width) and a shorter sequence uses the leading rows and columns of W_1, W_2. Causal (a decoder, not in
the paper): W_1 and W_2 are masked lower-triangular, so hidden unit j reads tokens <= j and output i reads hidden
units <= i; output i then depends on tokens <= i only. One W_1, W_2 shared by the heads, so tensor parallelism
splits the heads (the weights replicated, gradients summed). Context parallelism runs it on the gathered sequence.
No attention probabilities: attention dropout does not apply.
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


@ATTENTION.register("mlp_mixer")
class TokenMixingMLP(AttentionCore):
    """W_2 GELU(W_1 LayerNorm(V)) over the sequence (Tolstikhin et al. 2021, eq. 1); lower-triangular when causal."""

    Options = NoOptions
    parallel_traits = ParallelTraits(tp="split_heads", cp_whole_sequence=True)

    def __init__(self, model: ModelConfig, layer_index: int, options: NoOptions) -> None:
        super().__init__(model, layer_index, options)
        self.norm = nn.LayerNorm(model.d_model // model.n_heads)
        self.token_in = nn.Linear(model.max_seq_len, model.max_seq_len)  # W_1 (D_S = max_seq_len)
        self.token_out = nn.Linear(model.max_seq_len, model.max_seq_len)  # W_2
        self.uses_queries = False
        self.uses_keys = False

    @classmethod
    def applies_attention_dropout(cls, causal: bool) -> bool:
        return False  # a token MLP forms no attention probabilities

    def forward(self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, bias: Tensor | None = None,
                context: StepContext | None = None) -> Tensor:
        length = v.shape[2]
        width = self.token_in.weight.shape[0]
        require(length <= width, f"mlp_mixer's token MLP is model.max_seq_len={width} wide; got {length} positions: "
                                 "raise model.max_seq_len")
        w_in, w_out = self.token_in.weight[:length, :length], self.token_out.weight[:length, :length]
        if causal:
            w_in, w_out = w_in.tril(), w_out.tril()
        tokens = self.norm(expand_kv(v, q.shape[1]))  # [B, H, T, d/H]: the channels are a head's features
        hidden = F.gelu(w_in.to(tokens.dtype) @ tokens + self.token_in.bias[:length, None].to(tokens.dtype))
        return w_out.to(tokens.dtype) @ hidden + self.token_out.bias[:length, None].to(tokens.dtype)
