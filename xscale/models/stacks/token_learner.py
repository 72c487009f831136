"""TokenLearner (Ryoo et al. 2021, "TokenLearner: What Can 8 Learned Tokens Do for Images and Videos?", sec. 3.1):
mid-stack, the n tokens X [n, d] are pooled into S learned tokens,

  z_i = A_i(X) = rho(X * gamma(alpha_i(X))),   i = 1..S   (eq. 1),

alpha_i(X) [n] a learned spatial attention map through a sigmoid, gamma its broadcast over the d channels and rho
the spatial (token) average, so z_i = (1/n) sum_t alpha_i(x_t) x_t. The remaining blocks run on the S tokens.

``model.stack: {kind: token_learner, options: {tokens: S, after_layer: k}}``: blocks 1..k on the n tokens, TokenLearner,
blocks k+1..n_layers on the S tokens; a classifier (``train.task=classify``, ``model.pooling`` mean or max) reads
them. Departures: alpha(X) = sigmoid(W_2 GELU(W_1 LayerNorm(x_t))) per token (the paper's alpha_i is a small stack of
convolutions over the image grid; its later version uses this MLP), and rho averages over the real tokens of a padded
batch only (padding never enters a learned token). No TokenFuser: token-level outputs (MLM) and decoders are refused.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from xscale.config.schema import Config, ConfigError, ModelConfig
from xscale.models.position import PositionEncoding
from xscale.models.registry import POSITION, STACK
from xscale.models.stacks.stack import Stack
from xscale.models.traits import Refusal, Serves, StackTraits
from xscale.runtime import StepContext


@dataclasses.dataclass
class TokenLearnerOptions:
    tokens: int = dataclasses.field(default=8, metadata={"help": "S, the learned tokens the sequence is pooled into"})
    after_layer: int = dataclasses.field(default=1, metadata={
        "help": "blocks run on the input tokens before TokenLearner (1 <= after_layer < model.n_layers)"})

    def __post_init__(self) -> None:
        if self.tokens < 1:
            raise ConfigError(f"model.stack.options.tokens must be >= 1 (the learned tokens S), got {self.tokens}")


class TokenLearner(nn.Module):
    """z_i = mean_t alpha_i(x_t) x_t over the real tokens, alpha = sigmoid(W_2 GELU(W_1 LayerNorm(x))) [n, S]."""

    def __init__(self, d_model: int, tokens: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d_model)
        self.hidden = nn.Linear(d_model, d_model)
        self.maps = nn.Linear(d_model, tokens)

    def attention_maps(self, x: torch.Tensor) -> torch.Tensor:
        """alpha(X) [B, n, S], in (0, 1)."""
        return torch.sigmoid(self.maps(F.gelu(self.hidden(self.norm(x)))))

    def forward(self, x: torch.Tensor, padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """[B, n, d] -> [B, S, d]; ``padding_mask`` [B, n], True at real tokens (None: all real)."""
        maps = self.attention_maps(x)
        if padding_mask is None:
            return maps.transpose(1, 2) @ x / x.shape[1]
        real = padding_mask.to(x.dtype).unsqueeze(-1)
        return (maps * real).transpose(1, 2) @ x / real.sum(dim=1, keepdim=True).clamp_min(1)


@STACK.register("token_learner")
class TokenLearnerStack(Stack):
    """The plain loop with TokenLearner after block ``after_layer`` (module docstring)."""

    Options = TokenLearnerOptions
    stack_traits = StackTraits(
        pp=Refusal("TokenLearner's weights sit between blocks, outside the pipeline's stage cut"),
        tp=Refusal("TokenLearner's maps are not in the tensor-parallel plan"),
        sequence_parallel=Refusal("its token average reads the whole sequence, which sequence parallelism splits"),
        serves=(Serves(family="encoder", task="classify"),),
        serves_reason="pools an encoder's tokens for a classifier (no TokenFuser maps them back)",
    )

    def __init__(self, config: ModelConfig, n_layers: int, *, causal: bool, cross: bool, first_index: int,
                 options: TokenLearnerOptions) -> None:
        super().__init__(config, n_layers, causal=causal, cross=cross, first_index=first_index, options=options)
        self.after_layer = options.after_layer
        self.token_learner = TokenLearner(config.d_model, options.tokens)

    @classmethod
    def check(cls, config: Config, options: TokenLearnerOptions) -> None:
        """Refuse what a TokenLearner stack cannot run with, each with what to change."""
        model = config.model
        if model.pooling == "cls":
            raise ConfigError("model.stack=token_learner pools the class token away; set model.pooling=mean or max")
        if not 1 <= options.after_layer < model.n_layers:
            raise ConfigError(f"model.stack.options.after_layer={options.after_layer} must leave blocks on both "
                              f"sides: 1 <= after_layer < model.n_layers={model.n_layers}")
        if options.tokens > model.max_seq_len:
            raise ConfigError(f"model.stack.options.tokens={options.tokens} exceeds model.max_seq_len="
                              f"{model.max_seq_len}; pool into fewer tokens")
        if model.position.kind in POSITION.names() and not POSITION.get(model.position.kind).adds_to_input \
                and model.position.kind != "none":
            raise ConfigError(f"model.stack=token_learner's learned tokens have no positions: model.position="
                              f"{model.position} is refused; use learned, sinusoidal or none")
        if model.share_layers:
            raise ConfigError("model.stack=token_learner and model.share_layers=true do not combine; set one off")

    def output_mask(self, mask: torch.Tensor | None) -> torch.Tensor | None:
        """Every learned token is real."""
        return None if mask is None else mask.new_ones(mask.shape[0], self.token_learner.maps.out_features)

    def run(self, x: torch.Tensor, position: PositionEncoding | None, memory: torch.Tensor | None,
            scores: torch.Tensor | None, context: StepContext,
            layer_states: list[torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        for depth, block in zip(self.depths, self.blocks()):
            if depth == self.after_layer:
                x = self.token_learner(x, context.padding_mask)
                context = context.with_padding_mask(self.output_mask(context.padding_mask))
            x, scores = self.run_block(depth, block, x, position, memory, scores, context)
            if layer_states is not None:
                layer_states.append(x)
        return x, scores
