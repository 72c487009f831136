"""Predictive attention (Wang et al. 2021, "Predictive Attention Transformer: Improving Transformer with Attention Map
Prediction", ICLR 2021 submission; published as "Evolving Attention with Residual Convolutions", ICML 2021): a 2-D
convolution over the previous layer's attention logits (pre-softmax), the heads as channels, predicts this layer's.
With C_l = Q_l K_l^T / sqrt(d) and S_l the map layer l carries to the next one:

  form=predictive (the ICLR text):   S_l = alpha Conv2d(S_{l-1}) + (1 - alpha) C_l
  form=evolving (the ICML paper and its authors' code, pkuyym/EvolvingAttention):
                                     X_l = r S_{l-1} + (1 - r) C_l                  (attention residual, r: residual)
                                     S_l = alpha ReLU(Conv2d(X_l)) + (1 - alpha) X_l  (convolution module)
  P_l = softmax(S_l + bias + mask),   O_l = P_l V_l.

The first carrying layer of a stack has no map to read: S_1 = C_1, plain attention, and no convolution (as in the
authors' code). S_l travels to
the next layer as RealFormer's scores do (``carries_scores``, :mod:`xscale.models.attention.residual`): without the
position bias or the causal mask. Causal: the kernel reads rows <= i and columns <= j of the map it convolves (padded
before, not around), so no query sees a later token; bidirectional: a kernel centred on (i, j), zero-padded.
Departures: fixed alpha and r (hyper-parameters in the papers too; the authors' code defaults r = 0.5); the carried
map leaves out the position bias (the authors' code carries its relative-position logits along); whether the ICLR
text's convolution is followed by a nonlinearity is not in the material we checked (form=predictive has none, the
ICML code's ReLU is in form=evolving). The convolution mixes the heads (``mixes_heads``): tensor parallelism gathers
every head's q and k (``tp="gather_heads"``, :mod:`xscale.parallel.tensor.talking_heads`), each rank computes and
carries every head's map and applies its own heads' probabilities to its v; the convolution is replicated with
gradients summed. Context parallelism runs it on the gathered sequence. O(H T^2) memory per layer for the carried
maps.
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

FORMS = ("predictive", "evolving")


@dataclasses.dataclass
class PredictiveOptions:
    kernel_size: int = dataclasses.field(default=3, metadata={"help": "the convolution's kernel over the maps (k x k)"})
    alpha: float = dataclasses.field(default=0.5, metadata={
        "help": "the convolution's weight against the map it is mixed with"})
    form: str = dataclasses.field(default="predictive", metadata={
        "help": "predictive: Conv(S_{l-1}) mixed with this layer's logits (ICLR text); evolving: the residual mix of "
                "S_{l-1} and this layer's logits, convolved with a ReLU and mixed with itself (ICML paper)"})
    residual: float | None = dataclasses.field(default=None, metadata={
        "help": "form=evolving: r, the previous layer's map's weight in the residual mix (unset: 0.5)"})

    def __post_init__(self) -> None:
        require(self.kernel_size >= 1, f"model.attention.options.kernel_size must be >= 1 for 'predictive' "
                                       f"(got {self.kernel_size})")
        require(0.0 <= self.alpha <= 1.0, f"model.attention.options.alpha must be in [0, 1] for 'predictive' "
                                          f"(got {self.alpha})")
        require(self.form in FORMS, f"model.attention.options.form='{self.form}' is not a form of 'predictive'; use "
                                    f"one of {', '.join(FORMS)}")
        require(self.residual is None or self.form == "evolving",
                "model.attention.options.residual is read by form=evolving only; set form=evolving or drop residual")
        require(self.residual is None or 0.0 <= self.residual <= 1.0,
                f"model.attention.options.residual must be in [0, 1] for 'predictive' (got {self.residual})")

    @property
    def residual_weight(self) -> float:
        """r of form=evolving (0.5 unless set)."""
        return 0.5 if self.residual is None else self.residual


def reads_a_previous_map(model: ModelConfig, layer_index: int) -> bool:
    """Whether the layer at ``layer_index`` can be handed a carried map: an earlier layer of its stack carries one
    (an encoder-decoder's decoder starts its own maps), or the layers are shared (one module at every depth)."""
    if model.share_layers:
        return True
    first = model.n_layers if model.family == "encoder_decoder" and layer_index >= model.n_layers else 0
    kinds = [model.attention.kind_for_layer(index) for index in range(first, layer_index)]
    return any(kind in ATTENTION.names() and ATTENTION.get(kind).carries_scores for kind in kinds)


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
        self.n_heads = model.n_heads
        # The first carrying layer of a stack reads no map: it has no convolution (as in the authors' code).
        reads = reads_a_previous_map(model, layer_index)
        self.convolution = nn.Conv2d(model.n_heads, model.n_heads, options.kernel_size) if reads else None

    def predicted(self, previous: Tensor, causal: bool) -> Tensor:
        """Conv2d over (B, H, Tq, Tk) maps, heads as channels, same size out: padded before the rows and columns
        (causal) or around them."""
        size = self.options.kernel_size
        if causal:
            padding = (size - 1, 0, size - 1, 0)
        else:
            padding = (size // 2, (size - 1) // 2, size // 2, (size - 1) // 2)
        return self.convolution(F.pad(previous, padding))

    def mixed(self, previous: Tensor, current: Tensor, causal: bool) -> Tensor:
        """S_l from S_{l-1} and C_l in the configured form (module docstring)."""
        if self.convolution is None:
            raise ValueError(f"predictive: layer {self.layer_index} was built as its stack's first carrying layer "
                             "(no convolution) but received a previous layer's map")
        if previous.shape != current.shape:
            raise ValueError(f"predictive: the previous layer's maps have shape {tuple(previous.shape)}, "
                             f"this layer's {tuple(current.shape)}; every carrying layer needs the same heads and "
                             "length (and carries all heads: do not mix it with realformer under tensor parallelism)")
        alpha = self.options.alpha
        if self.options.form == "predictive":
            return alpha * self.predicted(previous, causal) + (1 - alpha) * current
        residual = self.options.residual_weight
        mix = residual * previous + (1 - residual) * current
        return alpha * F.relu(self.predicted(mix, causal)) + (1 - alpha) * mix

    def forward(self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, bias: Tensor | None = None,
                context: StepContext | None = None, previous_scores: Tensor | None = None) -> tuple[Tensor, Tensor]:
        n_heads = self.n_heads
        if q.shape[1] != n_heads:
            raise ValueError(f"predictive attention convolves all {n_heads} heads' maps but got {q.shape[1]} heads' "
                             "queries; a tensor-parallel plan must gather every head's q and k (tp='gather_heads')")
        scores = q @ expand_kv(k, n_heads).transpose(-1, -2) * q.shape[-1] ** -0.5  # C_l
        if previous_scores is not None:
            scores = self.mixed(previous_scores, scores, causal)
        logits = scores if bias is None else scores + bias.to(scores.dtype)
        if causal:
            logits = logits + causal_bias(q.shape[2], k.shape[2], q.device, q.dtype)
        heads = slice(None) if context is None else context.heads_held(n_heads)  # this rank's output heads
        probs = self.dropout(torch.softmax(logits[:, heads], dim=-1), context)
        return probs @ expand_kv(v, probs.shape[1]), scores
