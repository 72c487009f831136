"""Funnel-Transformer (Dai et al. 2020): an encoder whose sequence is pooled between groups of blocks.

``model.stack: {kind: funnel, options: {groups: [n_1, ..., n_G]}}`` splits the ``model.n_layers`` = sum n_g blocks into G groups. Before group g > 1
the sequence is halved by strided mean pooling (stride 2, the paper's), of the *queries only* (sec. 2.2):

    h'   = Pool(h),  Pool(h)_j = mean over the real tokens i in [2j, 2j + 2) of h_i
    h''  = LayerNorm(h' + MultiHeadAttention(Q = h', KV = h))      (the group's first block; its FFN as usual)

so the first block of a group still reads every unpooled key and value, and the later blocks of the group run on
the pooled sequence. The padding mask is pooled with it: a pooled position is real when any of its window is
(m'_j = m_{2j} or m_{2j+1}), and the mean reads the real rows only, so padding never enters a pooled state.
With ``model.pooling=cls`` (a classifier), the class token at position 0 is never pooled (sec. 2.2: "[cls]" kept).

Token-level outputs (the MLM objective; sec. 2.3's decoder): the last group's states are up-sampled by repetition
to the full length and added to the first group's output (the last full-length layer's),

    g = h^(1) + Up(h^(G)),  Up(h)_i = h_{floor(i / 2^(G-1))},

then ``model.stack.options.decoder_layers`` full-length Transformer blocks (the paper's 2; 0: none) run on g before the LM
head. They are extra blocks: ``model.n_layers`` = sum n_g counts the encoder's blocks only (the paper's "B6-6-6"
names those too), and they sit in the stack's ``layers`` after them (``stack.layers.<n_layers + i>``), so ZeRO-3,
activation checkpointing and the parameter counts treat them as any block. A classifier reads the pooled states
of the last group (no up-sampling) and has no decoder blocks.

The positions must be added to the input (learned, sinusoidal or none) and the attention must take queries of
another length than its keys (the dense core): :meth:`FunnelStack.check` refuses the rest.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from xscale.config.schema import Config, ConfigError, ModelConfig
from xscale.models.position import PositionEncoding
from xscale.models.registry import ATTENTION, POSITION, STACK
from xscale.models.stacks.stack import Stack
from xscale.models.traits import Refusal, Serves, StackTraits
from xscale.runtime import StepContext

STRIDE = 2  # the paper's pooling stride (sec. 2.2)


@dataclasses.dataclass
class FunnelOptions:
    groups: list[int] = dataclasses.field(default_factory=list, metadata={
        "help": "blocks per group, pooled between groups (e.g. [2, 2]); they sum to model.n_layers"})
    decoder_layers: int = dataclasses.field(default=2, metadata={
        "help": "token-level outputs: full-length blocks on h^(1) + Up(h^(G)) (sec. 2.3); 0: none"})

    def __post_init__(self) -> None:
        if not 0 <= self.decoder_layers <= 64:
            raise ConfigError(f"model.stack.options.decoder_layers must be in [0, 64] (0: no decoder blocks), got "
                              f"{self.decoder_layers}")


def pool_mask(mask: torch.Tensor, keep_first: bool) -> torch.Tensor:
    """(B, T) bool -> (B, 1 + ceil((T-1)/2)) or (B, ceil(T/2)): a pooled position is real if any of its window is."""
    head, body = (mask[:, :1], mask[:, 1:]) if keep_first else (mask[:, :0], mask)
    body = F.pad(body, (0, (-body.shape[1]) % STRIDE), value=False)
    return torch.cat([head, body.view(body.shape[0], -1, STRIDE).any(dim=-1)], dim=1)


def pool_sequence(hidden: torch.Tensor, mask: torch.Tensor | None,
                  keep_first: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Strided mean pooling of (B, T, D) over the real rows of each window of ``STRIDE`` (mask: (B, T), True at
    real tokens; None: all real); ``keep_first``: position 0 (the class token) passes unpooled."""
    real = torch.ones(hidden.shape[:2], dtype=torch.bool, device=hidden.device) if mask is None else mask
    head, body = (hidden[:, :1], hidden[:, 1:]) if keep_first else (hidden[:, :0], hidden)
    weights = real[:, 1:] if keep_first else real
    pad = (-body.shape[1]) % STRIDE
    body = F.pad(body, (0, 0, 0, pad))
    weights = F.pad(weights.to(hidden.dtype), (0, pad))
    batch, length, width = body.shape
    body = body.view(batch, length // STRIDE, STRIDE, width)
    weights = weights.view(batch, length // STRIDE, STRIDE, 1)
    pooled = (body * weights).sum(dim=2) / weights.sum(dim=2).clamp_min(1)
    return torch.cat([head, pooled], dim=1), None if mask is None else pool_mask(mask, keep_first)


def upsample(pooled: torch.Tensor, length: int, factor: int, keep_first: bool) -> torch.Tensor:
    """Up(h)_i = h_{floor(i / factor)} for i < ``length`` (repetition; the unpooled class token stays at 0)."""
    head, body = (pooled[:, :1], pooled[:, 1:]) if keep_first else (pooled[:, :0], pooled)
    repeated = body.repeat_interleave(factor, dim=1)[:, :length - head.shape[1]]
    return torch.cat([head, repeated], dim=1)


@STACK.register("funnel")
class FunnelStack(Stack):
    """Runs the blocks in ``groups`` with pooling between them, then (token-level outputs) the up-sampling and the
    decoder blocks (module docstring)."""

    Options = FunnelOptions
    stack_traits = StackTraits(
        pp=Refusal("the up-sampling adds the first group's output to the last group's, across stages"),
        tp=Refusal("its pooled-query attention is not in the tensor-parallel plan"),
        sequence_parallel=Refusal("strided pooling would mix windows that sequence parallelism splits over ranks"),
        serves=(Serves(family="encoder"),),
        serves_reason="pools an encoder's sequence",
    )

    def __init__(self, config: ModelConfig, n_layers: int, *, causal: bool, cross: bool, first_index: int,
                 options: FunnelOptions) -> None:
        super().__init__(config, n_layers, causal=causal, cross=cross, first_index=first_index, options=options)
        self.groups = list(options.groups)
        self.keep_first = config.num_classes > 0 and config.pooling == "cls"
        self.upsamples = config.num_classes == 0  # token-level outputs (MLM) need the full length back
        self.decoder_layers = self.extra_blocks(config, options)

    @classmethod
    def extra_blocks(cls, config: ModelConfig, options: FunnelOptions) -> int:
        """The full-length blocks run after up-sampling (sec. 2.3): ``decoder_layers`` for token-level outputs;
        none for a classifier (it reads the pooled states)."""
        return options.decoder_layers if config.num_classes == 0 else 0

    @classmethod
    def sequence_divisor(cls, config: ModelConfig, options: FunnelOptions) -> int:
        return STRIDE ** (len(options.groups) - 1)

    @classmethod
    def check(cls, config: Config, options: FunnelOptions) -> None:
        """Refuse model options a funnel cannot run with, each with what to change."""
        model, groups = config.model, options.groups
        if len(groups) < 2 or any(size < 1 for size in groups):
            raise ConfigError(f"model.stack.options.groups={groups} must list at least two block counts, each at "
                              "least 1 (e.g. [2, 2]: two blocks, pool, two blocks)")
        if sum(groups) != model.n_layers:
            raise ConfigError(f"model.stack.options.groups={groups} holds {sum(groups)} blocks but model.n_layers="
                              f"{model.n_layers}; make them agree")
        if model.position.kind in POSITION.names() and not POSITION.get(model.position.kind).adds_to_input \
                and model.position.kind != "none":
            raise ConfigError(f"model.stack=funnel pools the queries, whose positions then differ from the keys': "
                              f"model.position={model.position} is refused; use learned, sinusoidal or none")
        dense = ATTENTION.get("dense")
        for kind in model.attention.per_layer or [model.attention.kind]:
            if kind in ATTENTION.names() and ATTENTION.get(kind) is not dense:
                raise ConfigError(f"model.stack=funnel attends from pooled queries to unpooled keys, which attention "
                                  f"'{kind}' cannot (its queries and keys must have one length); use "
                                  "model.attention.kind=dense")
        if model.share_layers:
            raise ConfigError("model.stack=funnel and model.share_layers=true do not combine; set one of them off")

    def output_mask(self, mask: torch.Tensor | None) -> torch.Tensor | None:
        """The padding mask of the funnel's output (pooled once per group after the first, unless up-sampled)."""
        if mask is None or self.upsamples:
            return mask
        for _ in self.groups[1:]:
            mask = pool_mask(mask, self.keep_first)
        return mask

    def run(self, x: torch.Tensor, position: PositionEncoding | None, memory: torch.Tensor | None,
            scores: torch.Tensor | None, context: StepContext,
            layer_states: list[torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The groups' sum n_g blocks in order, then the ``decoder_layers`` decoder blocks."""
        blocks = self.blocks()
        full_length = context  # the decoder blocks read the unpooled padding mask
        depth = 0
        first_group_output = x
        for group, size in enumerate(self.groups):
            for index in range(size):
                block = blocks[depth]
                if group > 0 and index == 0:
                    # Through the block's own call (ZeRO-3 gathers its parameters there); the context keeps the
                    # unpooled mask, of the keys, for this block's attention.
                    pooled, mask = pool_sequence(x, context.padding_mask, self.keep_first)
                    x = block(pooled, position, context=context, keys=x)
                    context = context.with_padding_mask(mask)
                else:
                    x = block(x, position, context=context)
                depth += 1
            if group == 0:
                first_group_output = x
        if not self.upsamples:
            return x, scores
        factor = STRIDE ** (len(self.groups) - 1)
        x = first_group_output + upsample(x, first_group_output.shape[1], factor, self.keep_first)
        for block in blocks[depth:depth + self.decoder_layers]:
            x = block(x, position, context=full_length)
        return x, scores
