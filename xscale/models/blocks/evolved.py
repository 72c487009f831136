"""Evolved Transformer blocks (So et al. 2019, "The Evolved Transformer", fig. 3 and appendix): the searched
encoder cell, four pre-norm residuals,

  x <- x + GLU(norm(x)),  GLU(h) = (W_v h) * sigmoid(W_g h)
  x <- x + pad_d(SepConv_9x1(norm_4d(ReLU(W_wide h) + pad_4d(ReLU(Conv_3x1(h)))))),  h = norm(x)
       (W_wide: d -> 4d; Conv_3x1: d -> d/2 channels; SepConv: depthwise 9-wide over 4d, then pointwise 4d -> d/2;
        pad_n: zeros up to n channels)
  x <- x + attention(norm(x))
  x <- x + FFN(norm(x))

Departures: the searched cell is fixed (no architecture search); the same encoder cell serves decoders, with
causal convolutions (the paper's decoder cell, with its 16-head attention branch and 11x1 / 7x1 convolutions, is
not built); the FFN is ``model.ffn``. Padded tokens are zeroed before each convolution.

Tensor parallelism splits the attention and FFN as in the standard block and replicates the first two residuals'
branches: the GLU per token (the d-wide sum has no reduction to split it into), the convolution branch on the whole
sequence (``norm_4d`` normalises over all 4d channels between the two convolutions, which a channel split could not
do without reducing its statistics over tp inside the cell; under sequence parallelism the sequence is gathered
before the branch, since its convolutions read neighbouring tokens).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from xscale.config.schema import ConfigError, ModelConfig
from xscale.models.block import Residual, TransformerBlock
from xscale.models.blocks.kind import OWN_ORDER, BlockTraits
from xscale.models.norm import build_norm
from xscale.models.registry import BLOCK
from xscale.models.traits import ParallelTraits, Refusal
from xscale.runtime import StepContext

NARROW_KERNEL, SEPARABLE_KERNEL = 3, 9  # the searched cell's 3x1 and 9x1 convolutions


def causal_or_centred(x: torch.Tensor, width: int, causal: bool) -> torch.Tensor:
    """(B, C, T) padded along T for a ``width``-wide convolution: past tokens only (causal) or centred."""
    before = width - 1 if causal else (width - 1) // 2
    return F.pad(x, (before, width - 1 - before))


def pad_channels(x: torch.Tensor, channels: int) -> torch.Tensor:
    return F.pad(x, (0, channels - x.shape[-1]))


def zero_padding(x: torch.Tensor, context: StepContext | None) -> torch.Tensor:
    if context is None or context.padding_mask is None:
        return x
    return x * context.padding_mask.unsqueeze(-1).to(x.dtype)


class GatedLinearUnit(nn.Module):
    """GLU(h) = (W_v h) * sigmoid(W_g h), the branch of the cell's first residual."""

    parallel_traits = ParallelTraits(tp="per_token")

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.w_value = nn.Linear(config.d_model, config.d_model, bias=config.bias)
        self.w_gate = nn.Linear(config.d_model, config.d_model, bias=config.bias)

    def forward(self, h: torch.Tensor, context: StepContext | None = None) -> torch.Tensor:
        return self.w_value(h) * torch.sigmoid(self.w_gate(h))


class ConvolutionBranch(nn.Module):
    """The branch of the cell's second residual: a wide ReLU branch beside a 3x1 convolution, normed, then a 9x1
    separable convolution, zero-padded back to d channels."""

    parallel_traits = ParallelTraits(tp="replicated")

    def __init__(self, config: ModelConfig, causal: bool) -> None:
        super().__init__()
        d, wide = config.d_model, 4 * config.d_model
        self.causal = causal
        self.w_wide = nn.Linear(d, wide, bias=config.bias)
        self.narrow_conv = nn.Conv1d(d, d // 2, NARROW_KERNEL, bias=config.bias)
        self.hidden_norm = build_norm(config.norm, wide)
        self.depthwise_conv = nn.Conv1d(wide, wide, SEPARABLE_KERNEL, groups=wide, bias=False)
        self.w_pointwise = nn.Linear(wide, d // 2, bias=config.bias)

    def _convolve(self, conv: nn.Conv1d, x: torch.Tensor, context: StepContext | None) -> torch.Tensor:
        """(B, T, C) -> (B, T, C') through ``conv`` along T."""
        padded = causal_or_centred(zero_padding(x, context).transpose(1, 2), conv.kernel_size[0], self.causal)
        return conv(padded).transpose(1, 2)

    def forward(self, h: torch.Tensor, context: StepContext | None = None) -> torch.Tensor:
        wide = torch.relu(self.w_wide(h))
        narrow = torch.relu(self._convolve(self.narrow_conv, h, context))
        hidden = self.hidden_norm(wide + pad_channels(narrow, wide.shape[-1]))
        return pad_channels(self.w_pointwise(self._convolve(self.depthwise_conv, hidden, context)), h.shape[-1])


@BLOCK.register("evolved")
class EvolvedBlock(TransformerBlock):
    """The searched cell (module docstring): GLU and convolution residuals, then the standard block's attention
    (and cross-attention in a decoder of an encoder-decoder) and FFN; needs ``model.norm_placement=pre``."""

    block_traits = BlockTraits(
        other_stacks=OWN_ORDER,
        segment_memory=Refusal("the cell's convolutions would need the previous segment's inputs too"),
        cp=Refusal("the cell's 3x1 and 9x1 convolutions read neighbouring tokens, which context parallelism puts on "
                   "another rank (no halo exchange is built: a cp=2 run differed from one process)"))

    @classmethod
    def residual_names(cls, cross: bool) -> tuple[str, ...]:
        return ("gated_linear", "convolutions", *super().residual_names(cross))

    @classmethod
    def check(cls, model: ModelConfig, options: object) -> None:
        if model.norm_placement != "pre" or model.d_model % 2:
            raise ConfigError(f"model.block=evolved is the paper's pre-norm cell with d/2-channel convolutions: set "
                              f"model.norm_placement=pre (it is {model.norm_placement}) and an even model.d_model")

    def __init__(self, config: ModelConfig, layer_index: int, *, causal: bool, **kwargs) -> None:
        super().__init__(config, layer_index, causal=causal, **kwargs)
        self.gated_linear = Residual(config, GatedLinearUnit(config))
        self.convolutions = Residual(config, ConvolutionBranch(config, causal))

    def forward(self, x: torch.Tensor, *args, context: StepContext | None = None,
                **kwargs) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if context is not None and context.kv_cache is not None:
            raise ValueError("model.block=evolved: incremental decoding would need the convolutions' past inputs, "
                             "which the KV cache does not keep; generate with a standard block")
        x = self.convolutions(self.gated_linear(x, context=context), context=context)
        return super().forward(x, *args, context=context, **kwargs)
