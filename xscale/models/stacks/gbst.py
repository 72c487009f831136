"""Charformer's gradient-based subword tokenization (Tay et al. 2021, "Charformer: Fast Character Transformers via
Gradient-based Subword Tokenization", sec. 2.1): latent subwords learned from the embedded bytes X [T, d] before the
blocks run.

  X_{b,i} = mean(X[j b : (j+1) b]) for the block j = floor(i / b) holding position i,  b = 1..M   (candidate blocks)
  p_{b,i} = F_R(X_{b,i}) (a linear scoring d -> 1),  P_i = softmax_b(p_{b,i})                      (block scores)
  P^ = softmax(P P^T) P                                                              (score calibration, optional)
  X^_i = sum_b P^_{b,i} X_{b,i}                                                        (latent subword at i)
  X~ = mean pooling of X^ with window and stride d_s                                   (downsampling)

``model.stack: {kind: gbst, options: {max_block_size: M, downsample_rate: d_s, calibration: true}}`` over byte ids
(``model.vocab_size`` the byte alphabet and its specials); the blocks run on the T / d_s latent subwords. The embedding
stays the model's byte embedding (positions added to the bytes); GBST is the stack's first step, because the stack
owns the steps that change the sequence length (a funnel pools there too). In a padded batch the means read the real
bytes only, calibration attends to real positions only and a downsampled position is real when any of its window is.

Departures: no 1-D convolution over the bytes before the block pooling (the paper's optional offsets); d_s > 1 only
for a classifier (``train.task=classify``), since token-level outputs would need up-sampling; encoders only (a block
mean reads later bytes, so a decoder is refused).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from xscale.config.schema import Config, ConfigError, ModelConfig
from xscale.models.position import PositionEncoding
from xscale.models.registry import STACK
from xscale.models.stacks.stack import Stack
from xscale.models.traits import Refusal, Serves, StackTraits
from xscale.runtime import StepContext


@dataclasses.dataclass
class GBSTOptions:
    max_block_size: int = dataclasses.field(default=4, metadata={"help": "M: candidate blocks of 1..M bytes"})
    downsample_rate: int = dataclasses.field(default=2, metadata={
        "help": "d_s: latent subwords mean-pooled d_s to one (1: no downsampling; > 1: classifiers only)"})
    calibration: bool = dataclasses.field(default=True, metadata={"help": "score calibration P^ = softmax(P P^T) P"})

    def __post_init__(self) -> None:
        if self.max_block_size < 1 or self.downsample_rate < 1:
            raise ConfigError(f"model.stack.options.max_block_size and downsample_rate must be >= 1, got "
                              f"{self.max_block_size} and {self.downsample_rate}")


def block_means(x: torch.Tensor, real: torch.Tensor, size: int) -> torch.Tensor:
    """X_{b,i} [B, T, d]: the mean of the real rows of the non-overlapping block of ``size`` holding each i."""
    batch, length, width = x.shape
    pad = (-length) % size
    weights = F.pad(real, (0, pad)).view(batch, -1, size, 1)
    sums = (F.pad(x, (0, 0, 0, pad)).view(batch, -1, size, width) * weights).sum(dim=2)
    means = sums / weights.sum(dim=2).clamp_min(1)
    return means.repeat_interleave(size, dim=1)[:, :length]


def downsample(x: torch.Tensor, real: torch.Tensor, rate: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean of the real rows of each window of ``rate`` (stride ``rate``), and which windows hold a real row."""
    batch, length, width = x.shape
    pad = (-length) % rate
    weights = F.pad(real, (0, pad)).view(batch, -1, rate, 1)
    sums = (F.pad(x, (0, 0, 0, pad)).view(batch, -1, rate, width) * weights).sum(dim=2)
    counts = weights.sum(dim=2)
    return sums / counts.clamp_min(1), counts.squeeze(-1) > 0


class GradientBasedSubwordTokenization(nn.Module):
    """Bytes X [B, T, d] -> latent subwords [B, ceil(T / d_s), d] and their padding mask (module docstring)."""

    def __init__(self, d_model: int, options: GBSTOptions) -> None:
        super().__init__()
        self.max_block_size = options.max_block_size
        self.downsample_rate = options.downsample_rate
        self.calibration = options.calibration
        self.score = nn.Linear(d_model, 1)  # F_R

    def forward(self, x: torch.Tensor, padding_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        mask = torch.ones(x.shape[:2], dtype=torch.bool, device=x.device) if padding_mask is None else padding_mask
        real = mask.to(x.dtype)
        blocks = torch.stack([block_means(x, real, size) for size in range(1, self.max_block_size + 1)], dim=2)
        scores = self.score(blocks).squeeze(-1).softmax(dim=-1)  # P [B, T, M]
        if self.calibration:
            affinity = (scores @ scores.transpose(1, 2)).masked_fill(~mask[:, None, :], float("-inf"))
            scores = affinity.softmax(dim=-1) @ scores
        latent = (scores.unsqueeze(-1) * blocks).sum(dim=2)
        return downsample(latent, real, self.downsample_rate)


@STACK.register("gbst")
class GBSTStack(Stack):
    """GBST over the embedded bytes, then the plain loop on the latent subwords."""

    Options = GBSTOptions
    stack_traits = StackTraits(
        pp=Refusal("GBST runs before the first block, outside the pipeline's stage cut"),
        tp=Refusal("GBST's scoring is not in the tensor-parallel plan"),
        sequence_parallel=Refusal("its block means and calibration read the whole sequence, which sequence "
                                  "parallelism splits"),
        serves=(Serves(family="encoder"),),
        serves_reason="averages blocks that hold later bytes, which a decoder would leak",
    )

    def __init__(self, config: ModelConfig, n_layers: int, *, causal: bool, cross: bool, first_index: int,
                 options: GBSTOptions) -> None:
        super().__init__(config, n_layers, causal=causal, cross=cross, first_index=first_index, options=options)
        self.gbst = GradientBasedSubwordTokenization(config.d_model, options)

    @classmethod
    def check(cls, config: Config, options: GBSTOptions) -> None:
        """Refuse what GBST cannot run with, each with what to change."""
        model = config.model
        if options.downsample_rate > 1 and config.train.task != "classify":
            raise ConfigError(f"model.stack.options.downsample_rate={options.downsample_rate} shortens the "
                              "sequence, which token-level outputs cannot take; set it to 1 or train.task=classify")
        if config.train.task == "classify" and model.pooling == "cls":
            raise ConfigError("model.stack=gbst mixes the class token into the first block; set model.pooling=mean "
                              "or max")
        if config.parallel.cp > 1:
            raise ConfigError(f"parallel.cp={config.parallel.cp} is refused with model.stack=gbst: its calibration "
                              "reads every position; set parallel.cp=1")
        if model.share_layers:
            raise ConfigError("model.stack=gbst and model.share_layers=true do not combine; set one of them off")

    def output_mask(self, mask: torch.Tensor | None) -> torch.Tensor | None:
        """The padding mask of the latent subwords."""
        if mask is None:
            return None
        return downsample(mask[..., None].float(), mask.float(), self.gbst.downsample_rate)[1]

    def run(self, x: torch.Tensor, position: PositionEncoding | None, memory: torch.Tensor | None,
            scores: torch.Tensor | None, context: StepContext,
            layer_states: list[torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        x, mask = self.gbst(x, context.padding_mask)
        context = context.with_padding_mask(None if context.padding_mask is None else mask)
        return super().run(x, position, memory, scores, context, layer_states)
