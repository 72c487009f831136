"""Funnel-Transformer (Dai et al. 2020): an encoder whose sequence is pooled between groups of blocks.

``model.funnel = [n_1, ..., n_G]`` splits the ``model.n_layers`` = sum n_g blocks into G groups. Before group g > 1
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

then ``model.funnel_decoder_layers`` full-length Transformer blocks (the paper's 2; 0: none) run on g before the LM
head. They are extra blocks: ``model.n_layers`` = sum n_g counts the encoder's blocks only (the paper's "B6-6-6"
names those too), and they sit in the stack's ``layers`` after them (``stack.layers.<n_layers + i>``), so ZeRO-3,
activation checkpointing and the parameter counts treat them as any block. A classifier reads the pooled states
of the last group (no up-sampling) and has no decoder blocks.

The positions must be added to the input (learned, sinusoidal or none) and the attention must take queries of
another length than its keys (the dense core): :func:`check_funnel_config` refuses the rest.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from xscale.config.schema import ConfigError, ModelConfig
from xscale.models.position import PositionEncoding
from xscale.models.registry import ATTENTION, POSITION
from xscale.runtime import StepContext

STRIDE = 2  # the paper's pooling stride (sec. 2.2)


def check_funnel_config(model: ModelConfig) -> None:
    """Refuse model options a funnel cannot run with, each with what to change."""
    if not model.funnel:
        return
    if model.family != "encoder":
        raise ConfigError(f"model.funnel pools an encoder's sequence; set model.family=encoder (got {model.family})")
    if len(model.funnel) < 2 or any(size < 1 for size in model.funnel):
        raise ConfigError(f"model.funnel={model.funnel} must list at least two block counts, each at least 1 "
                          "(e.g. [2, 2]: two blocks, pool, two blocks)")
    if sum(model.funnel) != model.n_layers:
        raise ConfigError(f"model.funnel={model.funnel} holds {sum(model.funnel)} blocks but model.n_layers="
                          f"{model.n_layers}; make them agree")
    if model.position.kind in POSITION.names() and not POSITION.get(model.position.kind).adds_to_input \
            and model.position.kind != "none":
        raise ConfigError(f"model.funnel pools the queries, whose positions then differ from the keys': "
                          f"model.position={model.position} is refused; use learned, sinusoidal or none")
    dense = ATTENTION.get("dense")
    for kind in model.attention.per_layer or [model.attention.kind]:
        if kind in ATTENTION.names() and ATTENTION.get(kind) is not dense:
            raise ConfigError(f"model.funnel attends from pooled queries to unpooled keys, which attention '{kind}' "
                              "cannot (its queries and keys must have one length); use model.attention.kind=dense")
    for option in ("share_layers", "reversible", "act"):
        if getattr(model, option):
            raise ConfigError(f"model.funnel and model.{option}=true do not combine; set one of them off")


def funnel_decoder_blocks(model: ModelConfig) -> int:
    """The full-length blocks a funnel runs after up-sampling (sec. 2.3): ``model.funnel_decoder_layers`` for
    token-level outputs; none for a classifier (it reads the pooled states) or without a funnel."""
    return model.funnel_decoder_layers if model.funnel and model.num_classes == 0 else 0


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


class Funnel(nn.Module):
    """Runs a stack's blocks in ``model.funnel`` groups with pooling between them, then (token-level outputs) the
    up-sampling and the decoder blocks (module docstring)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.groups = list(config.funnel)
        self.keep_first = config.num_classes > 0 and config.pooling == "cls"
        self.upsamples = config.num_classes == 0  # token-level outputs (MLM) need the full length back
        self.decoder_layers = funnel_decoder_blocks(config)

    def output_mask(self, mask: torch.Tensor | None) -> torch.Tensor | None:
        """The padding mask of the funnel's output (pooled once per group after the first, unless up-sampled)."""
        if mask is None or self.upsamples:
            return mask
        for _ in self.groups[1:]:
            mask = pool_mask(mask, self.keep_first)
        return mask

    def forward(self, x: torch.Tensor, blocks: list[nn.Module], position: PositionEncoding | None,
                context: StepContext) -> torch.Tensor:
        """``blocks``: the groups' sum n_g blocks in order, then the ``decoder_layers`` decoder blocks."""
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
            return x
        factor = STRIDE ** (len(self.groups) - 1)
        x = first_group_output + upsample(x, first_group_output.shape[1], factor, self.keep_first)
        for block in blocks[depth:depth + self.decoder_layers]:
            x = block(x, position, context=full_length)
        return x
