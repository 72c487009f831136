"""One Transformer layer: self-attention, optional cross-attention, FFN (or MoE), with residual norms.

Placement (Xiong et al. 2020; Ding et al. 2021 for sandwich; Bachlechner et al. 2020; Wang et al. 2022):
  post:     x = norm(x + f(x))
  pre:      x = x + f(norm(x))
  sandwich: x = x + norm_out(f(norm_in(x)))
  rezero:   x = x + alpha f(x), alpha a learned scalar initialised to 0, no norm
  deepnorm: x = norm(alpha x + f(x)), alpha fixed by the depth (:mod:`xscale.models.deepnorm`, with its init)
These are placements, not norms: they say how the residual and the norm (model.norm) combine, and deepnorm still
uses model.norm. Only pre and sandwich end a stack with a final norm. With ``model.init=admin`` (Liu et al. 2020,
eq. 7) a post-norm residual is x = norm(omega * x + f(x)), omega a learned vector set by :mod:`xscale.models.init`.

:class:`TransformerBlock` is the ``standard`` block kind (``model.block``): attention, cross-attention, FFN; the other
kinds (Macaron, Sandwich orderings, GTrXL gates) live in :mod:`xscale.models.blocks`, one file each.

A block whose attention core ``carries_scores`` (RealFormer, He et al. 2020) takes the previous layer's
pre-softmax scores and returns ``(x, scores)``: the scores ride beside the residual stream, so a pipeline
stage sends the pair to the next stage (see :mod:`xscale.models.transformer`).
"""

from __future__ import annotations

import torch
from torch import nn

from xscale.config.schema import ModelConfig
from xscale.models.attention import Attention
from xscale.models.compressive_memory import MemoryCompression, reconstruction_loss
from xscale.models.deepnorm import deepnorm_scales
from xscale.models.dropout import Dropout
from xscale.models.ffn import build_ffn
from xscale.models.moe import attach_auxiliary_loss, build_moe
from xscale.models.norm import build_norm
from xscale.models.position import PositionEncoding
from xscale.models.traits import BlockParts
from xscale.runtime import StepContext

# The placements that normalise a sub-layer's input, and so end a stack with a final norm.
PRE_NORM_PLACEMENTS = ("pre", "sandwich")


class ReZeroGain(nn.Module):
    """alpha, one learned scalar initialised to 0 (Bachlechner et al. 2020, eq. 3); shape [1], not 0-d, as FSDP2
    (ZeRO-3) refuses 0-d parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.rezero_alpha = nn.Parameter(torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rezero_alpha.to(x.dtype) * x


class AdminOmega(nn.Module):
    """Admin's omega (Liu et al. 2020, eq. 7): a learned vector scaling the residual stream before a post-norm
    residual adds the branch; its initial value depends on the sub-layer's depth (:mod:`xscale.models.init`)."""

    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.admin_omega = nn.Parameter(torch.ones(d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.admin_omega.to(x.dtype) * x


class Residual(nn.Module):
    """A sub-layer with its norm(s), dropout and residual connection, in the configured placement.
    ``in_decoder``: the block is in an encoder-decoder's decoder (DeepNorm's alpha differs there).
    ``branch_scale``: the branch is added times this factor (Macaron's half steps, Lu et al. 2019).
    ``gain``: the learned module acting on the stream (ReZero's alpha on the branch, Admin's omega on x)."""

    def __init__(self, config: ModelConfig, sublayer: nn.Module, in_decoder: bool = False,
                 branch_scale: float = 1.0) -> None:
        super().__init__()
        self.placement = config.norm_placement
        self.sublayer = sublayer
        self.branch_scale = branch_scale
        self.norm = None if self.placement == "rezero" else build_norm(config.norm, config.d_model)
        if self.placement == "sandwich":
            self.norm_out = build_norm(config.norm, config.d_model)
        if self.placement == "rezero":
            self.gain = ReZeroGain()
        if config.init == "admin":  # the config check allows it with the post placement only
            self.gain = AdminOmega(config.d_model)
        self.residual_scale = deepnorm_scales(config, in_decoder)[0] if self.placement == "deepnorm" else 1.0
        self.dropout = Dropout(config.dropout)

    def forward(self, x: torch.Tensor, *args, context: StepContext | None = None,
                **kwargs) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The sub-layer may return ``(out, carry)``: the carry passes through untouched beside the result."""
        if self.placement not in ("post", "deepnorm"):
            out = self.branch(x, *args, context=context, **kwargs)
            out, carry = out if isinstance(out, tuple) else (out, None)
            return x + out if carry is None else (x + out, carry)
        out = self.sublayer(x, *args, context=context, **kwargs)
        out, carry = out if isinstance(out, tuple) else (out, None)
        kept = self.gain(x) if hasattr(self, "gain") else self.residual_scale * x
        x = self.norm(kept + self.branch_scale * self.dropout(out, context))
        return x if carry is None else (x, carry)

    def branch(self, x: torch.Tensor, *args, context: StepContext | None = None,
               **kwargs) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """What a pre/sandwich/rezero residual adds to ``x``: dropout(f(norm(x))) (sandwich: dropout(norm_out(f(norm(x)))),
        rezero: alpha dropout(f(x))); the reversible stack (:mod:`xscale.models.stacks.reversible`) adds it to the other half
        of the stream."""
        normed = self.placement in PRE_NORM_PLACEMENTS
        if normed and kwargs.get("remembered") is not None:  # the memory holds layer inputs: normed as x is
            kwargs["remembered"] = self.norm(kwargs["remembered"])
        out = self.sublayer(self.norm(x) if normed else x, *args, context=context, **kwargs)
        out, carry = out if isinstance(out, tuple) else (out, None)
        if self.placement == "sandwich":
            out = self.norm_out(out)
        out = self.dropout(out, context)
        if self.placement == "rezero":
            out = self.gain(out)
        if self.branch_scale != 1.0:
            out = self.branch_scale * out
        return out if carry is None else (out, carry)


def build_feed_forward(config: ModelConfig, layer_index: int) -> nn.Module:
    if config.moe.is_moe_layer(layer_index):
        return build_moe(config, layer_index)
    return build_ffn(config.ffn, config.d_model, config.ffn_hidden, config.bias, config.dropout)


def residual_parts(block: nn.Module, names: tuple[str, ...]) -> BlockParts:
    """The tensor-parallel parts of a block made of the residuals ``names``: each residual's sub-layer is an
    attention (split by heads) or a module split by its own traits (an FFN, an MoE layer)."""
    sublayers = {name: block.get_submodule(name).sublayer for name in names}
    return BlockParts(
        attentions=tuple(f"{name}.sublayer" for name, sublayer in sublayers.items() if isinstance(sublayer, Attention)),
        residuals=names,
        modules=tuple(f"{name}.sublayer" for name, sublayer in sublayers.items()
                      if not isinstance(sublayer, Attention)))


class TransformerBlock(nn.Module):
    """The ``standard`` block (Vaswani et al. 2017): x <- R(x, attention); x <- R(x, cross-attention) in a decoder
    of an encoder-decoder; x <- R(x, FFN), R the residual in ``model.norm_placement``. A block kind that changes
    only the residual sets :attr:`residual_class` (GTrXL's gate, :mod:`xscale.models.blocks.gtrxl`)."""

    residual_class: type[Residual] = Residual
    # What each residual stores for the backward beyond the standard block's, in bytes per token and model feature at
    # 16 bits (GTrXL's gate: 12); tensor parallelism keeps it whole on every rank unless sequence parallelism splits
    # the tokens (xscale.estimate.activations).
    extra_activations_per_residual: int = 0

    @classmethod
    def residual_names(cls, cross: bool) -> tuple[str, ...]:
        """The block's residuals in the order they run (Admin's omega_i counts them, :mod:`xscale.models.init`)."""
        return ("attention", "cross_attention", "feed_forward") if cross else ("attention", "feed_forward")

    def __init__(self, config: ModelConfig, layer_index: int, *, causal: bool, cross: bool = False,
                 uses_bias: bool = False, mixes_values: bool = False, options: object = None) -> None:
        super().__init__()
        self.options = options
        self.layer_index = layer_index
        in_decoder = cross  # an encoder-decoder's decoder (DeepNorm)
        residual = self.residual_class
        self.attention = residual(config, self.self_attention(config, layer_index, causal=causal, uses_bias=uses_bias,
                                                              mixes_values=mixes_values), in_decoder)
        self.cross_attention = (
            residual(config, Attention(config, layer_index, causal=False, cross=True), in_decoder) if cross else None
        )
        self.feed_forward = residual(config, self.feed_forward_sublayer(config, layer_index), in_decoder)
        self.carries_scores = self.attention.sublayer.core.carries_scores
        # The Compressive Transformer's f_c for the states leaving this layer's memory (Rae et al. 2020).
        self.compression = MemoryCompression(config) if config.compressed_memory and not cross else None

    def tensor_parallel_parts(self) -> BlockParts:
        """What the tensor-parallel plan splits here, and how (:class:`~xscale.models.traits.BlockParts`)."""
        return residual_parts(self, self.residual_names(self.cross_attention is not None))

    def self_attention(self, config: ModelConfig, layer_index: int, **kwargs) -> nn.Module:
        """The self-attention sub-layer (kwargs: causal, uses_bias, mixes_values); Lite Transformer's LSRA replaces
        it (:mod:`xscale.models.blocks.lite`)."""
        return Attention(config, layer_index, **kwargs)

    def feed_forward_sublayer(self, config: ModelConfig, layer_index: int) -> nn.Module:
        """The FFN (or MoE) sub-layer; DeLighT's light-weight FFN replaces it (:mod:`xscale.models.blocks.delight`)."""
        return build_feed_forward(config, layer_index)

    def forward(self, x: torch.Tensor, position: PositionEncoding | None = None, memory: torch.Tensor | None = None,
                scores: torch.Tensor | None = None, context: StepContext | None = None,
                keys: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Returns x, or ``(x, scores)`` when ``carries_scores`` (``scores``: None before the first such block).
        ``keys``: the sequence self-attention takes its keys and values from when ``x`` is a pooled one (Funnel-
        Transformer, :mod:`xscale.models.stacks.funnel`), normalised as the placement normalises ``x``.
        A context with a ``segment_memory`` gives the self-attention the previous segments' inputs to this layer
        as extra keys and records this segment's (Transformer-XL: :mod:`xscale.models.segment_memory`)."""
        remembered = None
        if context is not None and context.segment_memory is not None:
            remembered = context.segment_memory.exchange((context.first_sample, self.layer_index), x)
            if self.compression is not None:
                x = self._compress_leaving(x, context)
        extra = {} if remembered is None else {"remembered": remembered}  # absent, not None, for the tp plan's hooks
        if keys is not None:
            keys = self.attention.norm(keys) if self.attention.placement in PRE_NORM_PLACEMENTS else keys
            x = self.attention(x, position, keys, context=context)
        elif self.carries_scores:
            x, scores = self.attention(x, position, scores=scores, context=context, **extra)
        else:
            x = self.attention(x, position, context=context, **extra)
        if self.cross_attention is not None:
            x = self.cross_attention(x, None, memory, context=context)
        x = self.feed_forward(x, context=context)
        return (x, scores) if self.carries_scores else x

    def _compress_leaving(self, x: torch.Tensor, context: StepContext) -> torch.Tensor:
        """Compress the states that left the memory into the compressed memory; a learned f_c's
        attention-reconstruction loss rides on ``x`` (:mod:`xscale.models.compressive_memory`)."""
        key = (context.first_sample, self.layer_index)
        leaving = context.segment_memory.leaving(key)
        if leaving is None:
            return x
        compressed = self.compression(leaving)
        context.segment_memory.record_compressed(key, compressed)
        if not (self.training and self.compression.learns and torch.is_grad_enabled()):
            return x
        loss = reconstruction_loss(self.attention.sublayer, x, leaving, compressed)
        return attach_auxiliary_loss(x, loss * context.moe_loss_scale)
