"""Predictive attention (Wang et al. 2021, "Predictive Attention Transformer: Improving Transformer with Attention Map
Prediction"; published as "Evolving Attention with Residual Convolutions", ICML 2021): a 2-D convolution over the
previous layer's attention maps, the heads as channels, predicts this layer's, and the prediction is added to the
logits,

  S_l = alpha Conv2d(S_{l-1}) + (1 - alpha) Q_l K_l^T / sqrt(d),   P_l = softmax(S_l + bias + mask),   O_l = P_l V_l,

S_0 = 0 as RealFormer's (the first layer's logits are then (1 - alpha) Q K^T / sqrt(d) plus the convolution's bias, a
constant per head that the softmax ignores). S_l travels to the next layer as RealFormer's scores do
(``carries_scores``, :mod:`xscale.models.attention.residual`): without the position bias or the causal mask. Causal:
the kernel reads rows <= i and columns <= j of the previous map (padded before, not around), so no query sees a later
token; bidirectional: a kernel centred on (i, j), zero-padded. Departures: one convolution (``kernel_size``, the
paper's 3 x 3, no nonlinearity) and a fixed ``alpha``; the ICML version's evolving attention instead convolves the
residual mix alpha S_{l-1} + (1 - alpha) Q K^T / sqrt(d) and adds the result to it with a second weight, which is not
built here. The convolution mixes the heads (``mixes_heads``): tensor parallelism gathers every head's q and k
(``tp="gather_heads"``, :mod:`xscale.parallel.tensor.talking_heads`), each rank computes and carries every head's map
and applies its own heads' probabilities to its v; the convolution is replicated with gradients summed. Context
parallelism runs it on the gathered sequence. O(H T^2) memory per layer for the carried maps.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from xscale.config.schema import ModelConfig
from xscale.models.attention.core import AttentionCore, expand_kv
from xscale.models.attention.dense import causal_bias
from xscale.models.attention.sparse import require
from xscale.models.registry import ATTENTION
from xscale.models.traits import ParallelTraits
from xscale.runtime import StepContext


@dataclasses.dataclass
class PredictiveOptions:
    kernel_size: int = dataclasses.field(default=3, metadata={"help": "the convolution's kernel over the maps (k x k)"})
    alpha: float = dataclasses.field(default=0.5, metadata={"help": "the predicted map's weight against this layer's"})

    def __post_init__(self) -> None:
        require(self.kernel_size >= 1, f"model.attention.options.kernel_size must be >= 1 for 'predictive' "
                                       f"(got {self.kernel_size})")
        require(0.0 <= self.alpha <= 1.0, f"model.attention.options.alpha must be in [0, 1] for 'predictive' "
                                          f"(got {self.alpha})")


@ATTENTION.register("predictive", "evolving")
class PredictiveAttention(AttentionCore):
    """Dense attention whose logits add a convolution of the previous layer's maps (Wang et al. 2021)."""

    Options = PredictiveOptions
    supports_bias = True
    takes_padding_mask = True
    carries_scores = True
    mixes_heads = True
    parallel_traits = ParallelTraits(tp="gather_heads", cp_whole_sequence=True)

    def __init__(self, model: ModelConfig, layer_index: int, options: PredictiveOptions) -> None:
        super().__init__(model, layer_index, options)
        self.convolution = nn.Conv2d(model.n_heads, model.n_heads, options.kernel_size)

    def predicted(self, previous: Tensor, causal: bool) -> Tensor:
        """Conv2d over the (B, H, Tq, Tk) maps, heads as channels, same size out: padded before the rows and columns
        (causal) or around them."""
        size = self.options.kernel_size
        if causal:
            padding = (size - 1, 0, size - 1, 0)
        else:
            padding = (size // 2, (size - 1) // 2, size // 2, (size - 1) // 2)
        return self.convolution(F.pad(previous, padding))

    def forward(self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, bias: Tensor | None = None,
                context: StepContext | None = None, previous_scores: Tensor | None = None) -> tuple[Tensor, Tensor]:
        n_heads = self.convolution.in_channels
        if q.shape[1] != n_heads:
            raise ValueError(f"predictive attention convolves all {n_heads} heads' maps but got {q.shape[1]} heads' "
                             "queries; a tensor-parallel plan must gather every head's q and k (tp='gather_heads')")
        scores = q @ expand_kv(k, n_heads).transpose(-1, -2) * q.shape[-1] ** -0.5
        if previous_scores is None:
            previous_scores = torch.zeros_like(scores)  # S_0
        elif previous_scores.shape != scores.shape:
            raise ValueError(f"predictive: the previous layer's maps have shape {tuple(previous_scores.shape)}, "
                             f"this layer's {tuple(scores.shape)}; every carrying layer needs the same heads and "
                             "length (and carries all heads: do not mix it with realformer under tensor parallelism)")
        alpha = self.options.alpha
        scores = alpha * self.predicted(previous_scores, causal) + (1 - alpha) * scores
        logits = scores if bias is None else scores + bias.to(scores.dtype)
        if causal:
            logits = logits + causal_bias(q.shape[2], k.shape[2], q.device, q.dtype)
        heads = slice(None) if context is None else context.heads_held(n_heads)  # this rank's output heads
        probs = self.dropout(torch.softmax(logits[:, heads], dim=-1), context)
        return probs @ expand_kv(v, probs.shape[1]), scores
