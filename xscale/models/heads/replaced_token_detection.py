"""ELECTRA's replaced-token detection (Clark et al. 2020, sec. 2): a small generator trained as a masked LM fills the
masked positions with its samples, and the model (the discriminator) tells each token original or replaced.

    x_masked = REPLACE(x, m, [MASK]);   x_hat_i ~ p_G(x_i | x_masked) for i in m;   x_corrupt = REPLACE(x, m, x_hat)
    L = L_MLM(x, G) + lambda L_Disc(x, D),   L_Disc = sum_t BCE(D(x_corrupt)_t, [x_corrupt_t != x_t])

lambda = 50 (``rtd_weight``). lambda is this head's option, not ``train.objective``'s (the masking, in
:mod:`xscale.data.objectives.electra`): the head computes and weighs both losses, and a model is built from the
``model`` section alone, which cannot read the data layer's options (data sits above models). A sample equal to the
original counts as original. No gradient flows through the sampling. The generator is a plain encoder stack of the
same depth (``generator_layers``) and a fraction of the width; the token embeddings and the output embedding are the
discriminator's, shared, projected to the generator's width and back (the paper shares token and position embeddings;
here the generator keeps its own position encoding). The discriminator head is ELECTRA's: a dense layer with GeLU,
then one logit per token.

Samples are drawn by inverse CDF from one uniform per position that the data carries (``sample_uniform``), so a
row's samples are the same under every layout. Engines divide the loss by the masked tokens, so each example's mean
BCE is weighted by its masked count n_b: (sum MLM + lambda sum_b n_b mean_t BCE_bt) / sum_b n_b, the paper's mean
generator MLM plus lambda times the mean discriminator loss when every example masks as many tokens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from xscale.config.schema import Component, ConfigError, ModelConfig
from xscale.models.heads.objective import Batch, TokenLossSum
from xscale.models.registry import OBJECTIVE_HEAD
from xscale.models.stacks.plain import PlainStack
from xscale.runtime import StepContext


@dataclasses.dataclass
class ReplacedTokenDetectionOptions:
    generator_fraction: float = dataclasses.field(default=0.25, metadata={
        "help": "the generator's width over the discriminator's (its heads: this x model.n_heads, at least 1)"})
    generator_layers: int = dataclasses.field(default=0, metadata={
        "help": "the generator's blocks; 0: model.n_layers"})
    rtd_weight: float = dataclasses.field(default=50.0, metadata={"help": "lambda, the discriminator loss weight"})

    def __post_init__(self) -> None:
        if not 0 < self.generator_fraction <= 1:
            raise ConfigError(f"model.objective_head.options.generator_fraction={self.generator_fraction} must be in "
                              "(0, 1]")
        if not 0 <= self.generator_layers <= 256:
            raise ConfigError(f"model.objective_head.options.generator_layers={self.generator_layers} must be in "
                              "[0, 256] (0: model.n_layers)")
        if not self.rtd_weight > 0:
            raise ConfigError(f"model.objective_head.options.rtd_weight={self.rtd_weight} must be positive")


def generator_config(config: ModelConfig, options: ReplacedTokenDetectionOptions) -> ModelConfig:
    """The generator: the model's head size and blocks, ``generator_fraction`` of its heads (at least one)."""
    heads = max(1, round(options.generator_fraction * config.n_heads))
    return dataclasses.replace(config, d_model=config.head_dim * heads, n_heads=heads, n_kv_heads=None, d_ff=None,
                               n_layers=options.generator_layers or config.n_layers, num_classes=0,
                               objective_head=Component("none"))


def inverse_cdf_sample(logits: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """One token per row of ``logits`` (N, V) from softmax(logits), by the uniform ``uniform`` (N,) in [0, 1)."""
    cdf = torch.softmax(logits.float(), dim=-1).cumsum(dim=-1)
    picked = torch.searchsorted(cdf, (uniform.float() * cdf[:, -1]).unsqueeze(1)).squeeze(1)
    return picked.clamp_max(logits.shape[-1] - 1)


@OBJECTIVE_HEAD.register("replaced_token_detection")
class ReplacedTokenDetectionHead(nn.Module):
    """The generator (embedding projection, plain stack, projection back) and the discriminator's per-token logit
    (module docstring); reads the batch's ``labels`` (the masked originals) and ``sample_uniform``."""

    Options = ReplacedTokenDetectionOptions
    batch_keys = ("sample_uniform",)
    corrupts_inputs = True
    adds_to_token_loss = False  # the model's own states feed the discriminator, not the MLM

    def __init__(self, config: ModelConfig, options: ReplacedTokenDetectionOptions) -> None:
        super().__init__()
        small = generator_config(config, options)
        self.rtd_weight = options.rtd_weight
        self.generator_in = nn.Linear(config.d_model, small.d_model)
        self.generator = PlainStack(small, small.n_layers, causal=False, cross=False, first_index=0)
        self.generator_out = nn.Linear(small.d_model, config.d_model)
        self.discriminator_dense = nn.Linear(config.d_model, config.d_model)
        self.discriminator_out = nn.Linear(config.d_model, 1)

    def generate(self, embedded: torch.Tensor, context: StepContext) -> torch.Tensor:
        """(B, T, D) embedded masked tokens -> (B, T, D) generator states in the output embedding's space."""
        x = self.generator_in(embedded)
        if self.generator.position is not None:
            x = self.generator.position.embed(x, context)
        x, _ = self.generator(x, None, None, context)
        if self.generator.final_norm is not None:
            x = self.generator.final_norm(x)
        return self.generator_out(x)

    def corrupt(self, embedding: nn.Module, output: Callable[[torch.Tensor], torch.Tensor], batch: Batch,
                token_loss_sum: TokenLossSum, context: StepContext) -> tuple[torch.Tensor, torch.Tensor]:
        """(x_corrupt, the generator's summed MLM loss): the generator reads x_masked through the shared
        ``embedding``; ``output`` gives its vocabulary logits at the masked positions to sample from."""
        states = self.generate(embedding(batch["input_ids"]), context)
        masked = batch["labels"] != -100
        loss = token_loss_sum(states, batch["labels"])
        with torch.no_grad():
            samples = inverse_cdf_sample(output(states[masked]), batch["sample_uniform"][masked])
        corrupted = batch["input_ids"].clone()
        corrupted[masked] = samples.to(corrupted.dtype)
        return corrupted, loss

    def loss_sum(self, hidden: torch.Tensor, batch: Batch, token_loss_sum: TokenLossSum) -> torch.Tensor:
        """lambda sum_b n_b mean_t BCE over the discriminator's reading of ``batch["input_ids"]`` (x_corrupt)."""
        masked = batch["labels"] != -100
        original = torch.where(masked, batch["labels"], batch["input_ids"])
        replaced = (batch["input_ids"] != original).to(torch.float32)
        logits = self.discriminator_out(F.gelu(self.discriminator_dense(hidden))).squeeze(-1).float()
        per_example = F.binary_cross_entropy_with_logits(logits, replaced, reduction="none").mean(dim=1)
        return self.rtd_weight * (masked.sum(dim=1).to(torch.float32) * per_example).sum()
