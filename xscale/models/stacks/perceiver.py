"""Perceiver (Jaegle et al. 2021, "Perceiver: General Perception with Iterative Attention", sec. 2): a learned
latent array Z [N, d], N much smaller than the input length M, reads the embedded inputs X [M, d] by cross-attention
and is then refined by self-attention over the latents only,

  Z_1 = Z + Attn(Q = LN(Z) W_Q, K = LN(X) W_K, V = LN(X) W_V) W_O,   Z_1' = Z_1 + MLP(LN(Z_1))   (cross-attend),
  Z_{l+1} = TransformerBlock(Z_l),   l = 1..n_layers                                     (latent Transformer),

so a block costs O(M N) + O(N^2) rather than O(M^2). A classifier reads the final latents (the paper averages them).

Perceiver AR (Hawthorne et al. 2022, "General-purpose, long-context autoregressive modeling with Perceiver AR",
sec. 3): the latents are the last N positions of the input, Z = X[M-N:], and the cross-attention is causally masked,
latent i (input position p_i = M - N + i) reading the inputs j <= p_i only,

  Z_1[i] = X[p_i] + Attn(Q = LN(X[p_i]) W_Q, K = LN(X[:p_i+1]) W_K, V = LN(X[:p_i+1]) W_V) W_O,  then + MLP(LN(.)),

then the ``n_layers`` blocks run on the N latents with causal self-attention; the logits are those of the last N
positions only, so the loss covers those (:meth:`PerceiverStack.loss_positions`: the first M - N labels are
dropped, :func:`~xscale.models.stacks.label_loss_positions`).

``model.stack: {kind: perceiver, options: {latents: N, heads: h}}``: with ``train.task=classify`` (an encoder) the
Perceiver, with ``model.family=decoder`` and ``train.task=lm`` Perceiver AR; the cross-attend block (h heads,
single-head in the paper's ImageNet model) then the ``model.n_layers`` blocks of the stack, which run on the N
latents with the configured attention, norm and FFN. Departures: one cross-attend at the start (the Perceiver repeats
it, with shared weights, between latent stacks); no Fourier position features (the inputs take the model's position
encoding, added to the embedded tokens; Perceiver AR's rotary positions are refused since the cross-attention reads
positions only where they are added to the inputs); the classifier pools the latents by ``model.pooling`` (mean or
max); Perceiver AR keeps every input position (no dropout of the context's cross-attention inputs, sec. 3.3) and
decodes by running the whole prefix again (no KV cache).
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
class PerceiverOptions:
    latents: int = dataclasses.field(default=8, metadata={"help": "N, the latent array's length"})
    heads: int = dataclasses.field(default=1, metadata={"help": "heads of the cross-attention (the paper's: 1)"})

    def __post_init__(self) -> None:
        if self.latents < 1 or self.heads < 1:
            raise ConfigError(f"model.stack.options.latents and heads must be >= 1, got {self.latents} and "
                              f"{self.heads}")


class CrossAttend(nn.Module):
    """Z + Attn(LN(Z), LN(X)), then + MLP(LN(.)): the latents read the inputs (module docstring)."""

    def __init__(self, d_model: int, d_ff: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.latent_norm = nn.LayerNorm(d_model)
        self.input_norm = nn.LayerNorm(d_model)
        self.query = nn.Linear(d_model, d_model)
        self.key = nn.Linear(d_model, d_model)
        self.value = nn.Linear(d_model, d_model)
        self.out = nn.Linear(d_model, d_model)
        self.mlp_norm = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, d_ff), nn.GELU(), nn.Linear(d_ff, d_model))

    def split(self, x: torch.Tensor) -> torch.Tensor:
        return x.unflatten(-1, (self.heads, -1)).transpose(1, 2)  # [B, h, L, d/h]

    def forward(self, latents: torch.Tensor, inputs: torch.Tensor, padding_mask: torch.Tensor | None,
                causal: bool = False) -> torch.Tensor:
        """latents [B, N, d], inputs [B, M, d], padding_mask [B, M] (True: real; None: all) -> [B, N, d];
        ``causal``: latent i is input position M - N + i and reads the inputs up to it (Perceiver AR)."""
        keys = self.input_norm(inputs)
        q, k, v = self.split(self.query(self.latent_norm(latents))), self.split(self.key(keys)), \
            self.split(self.value(keys))
        mask = None if padding_mask is None else padding_mask[:, None, None, :]
        if causal:
            count, length = latents.shape[1], inputs.shape[1]
            seen = torch.ones(count, length, dtype=torch.bool, device=inputs.device).tril(length - count)
            mask = seen if mask is None else mask & seen
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).flatten(2)
        latents = latents + self.out(attended)
        return latents + self.mlp(self.mlp_norm(latents))


@STACK.register("perceiver")
class PerceiverStack(Stack):
    """The latent array (Perceiver AR: the last N positions) cross-attends to the inputs, then the blocks run on the
    latents (module docstring)."""

    Options = PerceiverOptions
    decodes_from_cache = False  # Perceiver AR's latents move with the end of the sequence
    stack_traits = StackTraits(
        pp=Refusal("the latent array and its cross-attention sit before the first block, outside the stage cut"),
        tp=Refusal("its cross-attention is not in the tensor-parallel plan"),
        sequence_parallel=Refusal("the cross-attention reads every input position, which sequence parallelism "
                                  "splits"),
        cp=Refusal("the cross-attention reads every input position and the latents are the last ones, which "
                   "context parallelism splits over ranks"),
        serves=(Serves(family="encoder", task="classify"), Serves(family="decoder", task="lm")),
        serves_reason="reads the inputs into latents for a classifier, or (Perceiver AR) into the last positions "
                      "for a language model",
    )

    def __init__(self, config: ModelConfig, n_layers: int, *, causal: bool, cross: bool, first_index: int,
                 options: PerceiverOptions) -> None:
        super().__init__(config, n_layers, causal=causal, cross=cross, first_index=first_index, options=options)
        self.autoregressive = causal
        self.latent_count = options.latents
        self.latents = None if causal else nn.Parameter(torch.empty(options.latents, config.d_model))
        if self.latents is not None and not self.latents.is_meta:
            nn.init.trunc_normal_(self.latents, std=0.02, a=-2.0, b=2.0)  # the paper's latent init
        self.cross_attend = CrossAttend(config.d_model, config.ffn_hidden, options.heads)

    @classmethod
    def check(cls, config: Config, options: PerceiverOptions) -> None:
        """Refuse what the Perceiver stack cannot run with, each with what to change."""
        model = config.model
        if model.family == "encoder" and model.pooling == "cls":
            raise ConfigError("model.stack=perceiver's latents hold no class token; set model.pooling=mean or max")
        if model.d_model % options.heads:
            raise ConfigError(f"model.stack.options.heads={options.heads} must divide model.d_model={model.d_model}")
        if options.latents > model.max_seq_len:
            raise ConfigError(f"model.stack.options.latents={options.latents} exceeds model.max_seq_len="
                              f"{model.max_seq_len}; use fewer latents")
        if model.position.kind in POSITION.names() and not POSITION.get(model.position.kind).adds_to_input \
                and model.position.kind != "none":
            raise ConfigError(f"model.stack=perceiver's cross-attention sees positions only where they are added to "
                              f"the inputs: model.position={model.position} is refused; use learned, sinusoidal or "
                              "none")
        if model.share_layers:
            raise ConfigError("model.stack=perceiver and model.share_layers=true do not combine; set one off")

    @classmethod
    def loss_positions(cls, config: ModelConfig, options: PerceiverOptions) -> int:
        """Perceiver AR's logits are the last N positions'."""
        return options.latents if config.family == "decoder" else 0

    def output_mask(self, mask: torch.Tensor | None) -> torch.Tensor | None:
        """Every latent is real (Perceiver AR: as real as its position)."""
        if mask is None:
            return None
        if self.autoregressive:
            return mask[:, -self.latent_count:]
        return mask.new_ones(mask.shape[0], self.latent_count)

    def run(self, x: torch.Tensor, position: PositionEncoding | None, memory: torch.Tensor | None,
            scores: torch.Tensor | None, context: StepContext,
            layer_states: list[torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.autoregressive:
            latents = self.cross_attend(x[:, -self.latent_count:], x, context.padding_mask, causal=True)
            token_ids = context.token_ids
            context = context.with_token_ids(None if token_ids is None else token_ids[:, -self.latent_count:])
        else:
            latents = self.latents.to(x.dtype).expand(x.shape[0], -1, -1)
            latents = self.cross_attend(latents, x, context.padding_mask)
        context = context.with_padding_mask(self.output_mask(context.padding_mask))
        return super().run(latents, position, memory, scores, context, layer_states)
