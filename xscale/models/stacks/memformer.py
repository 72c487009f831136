"""Memformer (Wu et al. 2020, "Memformer: A Memory-Augmented Transformer for Sequence Modeling", sec. 3): k memory
slots M_t [k, d] carried from segment to segment. The sequence is cut into segments x_1, x_2, ... of S tokens; the
blocks run on each segment in turn and read the memory left by the segments before it, then the segment's final
states H_t write the memory for the next one:

  read (every block, sec. 3.2.1):   H <- H + Attn(Q = H W_Q, K = M_t W_K, V = M_t W_V) W_O      (cross-attention)
  write (slot attention, 3.2.2):    A'_i = [q_i . k_i ; q_i . K_H] / sqrt(d_h),   q_i = m_i W_Q, k_i = m_i W_K,
                                    K_H = H_t W_K, V_H = H_t W_V (one W_K for the slot and the tokens), per head;
                                    m'_i = softmax(A'_i / tau) [m_i ; V_H]      (the slot's own value is m_i itself)
  forget (biased memory normalization, 3.2.3):
                                    m_{t+1,i} = (m'_i + v_i) / ||m'_i + v_i||,   M_0 = v / ||v|| (per slot)

Each slot attends over itself and the segment only, not over the other slots, so slots stay independent; the
weight a slot gives itself is its retention: that share of m'_i is the old slot unchanged (no value or output
projection on it), the rest writes the segment into it; the learned bias v pulls a slot that is not refreshed back
towards the terminal state v / ||v|| (forgetting). The self-attention inside a segment is the model's (causal for a
decoder), so token t reads its own segment up to t and, through the memory, only the segments before its own: the
model stays autoregressive.

``model.stack: {kind: memformer, options: {slots: k, segment: S, heads: h, temperature: tau}}`` with
``model.family=decoder`` and ``train.task=lm``: each of the ``model.n_layers`` blocks gets a cross-attention sub-layer
for the read; the writer (h heads, concatenated, no output projection) follows the last block. Departures: Memory
Replay Back-Propagation is replaced by plain back-propagation through the segments of one training sequence
(train.seq_len / S of them; the memory starts at M_0 for every sequence, so the span it carries is bounded by
train.seq_len; MRBP gives these gradients with less memory, so the gradients are the paper's); one decoder stack both
reads the memory and predicts the tokens (the paper's encoder reads and writes the memory, its decoder predicts the
tokens from the encoder's states); the writer's queries and keys are taken from LayerNorm'd slots and states (the
pre-norm of every sub-layer here; the paper's equations show none); tau defaults to 1 (the paper sharpens with
tau < 1 but the value it trains with is not stated in the material we checked: set ``temperature`` to follow it);
generation recomputes the prefix (no KV cache).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from xscale.config.schema import Config, ConfigError, ModelConfig
from xscale.models.position import PositionEncoding
from xscale.models.registry import BLOCK, POSITION, STACK
from xscale.models.stacks.stack import Stack, carrying_kinds
from xscale.models.traits import Refusal, Serves, StackTraits
from xscale.runtime import StepContext


@dataclasses.dataclass
class MemformerOptions:
    slots: int = dataclasses.field(default=8, metadata={"help": "k, the memory slots carried from segment to segment"})
    segment: int = dataclasses.field(default=64, metadata={"help": "S, the tokens of a segment"})
    heads: int = dataclasses.field(default=1, metadata={"help": "heads of the memory writer's slot attention"})
    temperature: float = dataclasses.field(default=1.0, metadata={
        "help": "tau of the writer's softmax(A / tau); the paper sharpens with tau < 1"})

    def __post_init__(self) -> None:
        if self.slots < 1 or self.segment < 1 or self.heads < 1:
            raise ConfigError(f"model.stack.options.slots, segment and heads must be >= 1, got {self.slots}, "
                              f"{self.segment} and {self.heads}")
        if not self.temperature > 0:
            raise ConfigError(f"model.stack.options.temperature={self.temperature} must be > 0 (the paper's tau is "
                              "below 1; 1: a plain softmax)")


class MemoryWriter(nn.Module):
    """Slot attention over [m_i ; H] per slot and head, the slot's own value m_i itself, then biased memory
    normalization (module docstring)."""

    def __init__(self, d_model: int, slots: int, heads: int, temperature: float = 1.0) -> None:
        super().__init__()
        self.heads = heads
        self.temperature = temperature
        self.memory_norm = nn.LayerNorm(d_model)
        self.state_norm = nn.LayerNorm(d_model)
        self.query = nn.Linear(d_model, d_model)
        self.key = nn.Linear(d_model, d_model)
        self.value = nn.Linear(d_model, d_model)
        self.bias = nn.Parameter(torch.empty(slots, d_model))  # v, one per slot
        if not self.bias.is_meta:
            nn.init.normal_(self.bias, std=0.02)

    def initial(self, batch: int, dtype: torch.dtype) -> torch.Tensor:
        """M_0 = v / ||v||: [B, k, d]."""
        return F.normalize(self.bias.to(dtype), dim=-1).expand(batch, -1, -1)

    def split(self, x: torch.Tensor) -> torch.Tensor:
        return x.unflatten(-1, (self.heads, -1)).transpose(-3, -2)  # [..., h, L, d/h]

    def forward(self, memory: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
        """memory [B, k, d], the segment's final states [B, S, d] -> the next memory [B, k, d]."""
        slots, tokens = self.memory_norm(memory), self.state_norm(states)
        query, own_key = self.split(self.query(slots)), self.split(self.key(slots))  # [B, h, k, d/h]
        token_keys, token_values = self.split(self.key(tokens)), self.split(self.value(tokens))  # [B, h, S, d/h]
        scale = query.shape[-1] ** -0.5 / self.temperature
        own = (query * own_key).sum(-1, keepdim=True) * scale  # [B, h, k, 1]: each slot with itself
        seen = (query @ token_keys.transpose(-1, -2)) * scale  # [B, h, k, S]
        weights = torch.cat([own, seen], dim=-1).softmax(dim=-1)
        written = weights[..., :1] * self.split(memory) + weights[..., 1:] @ token_values  # [B, h, k, d/h]
        written = written.transpose(1, 2).flatten(2)  # the heads side by side: m'_i
        return F.normalize(written + self.bias.to(written.dtype), dim=-1)


@STACK.register("memformer")
class MemformerStack(Stack):
    """The blocks run segment by segment, reading the memory by cross-attention; the writer updates the memory after
    each segment (module docstring)."""

    Options = MemformerOptions
    decodes_from_cache = False  # the memory is rebuilt from the whole prefix
    stack_traits = StackTraits(
        pp=Refusal("every segment runs all the blocks and the memory it writes feeds the first block again, so the "
                   "stack cannot be cut into stages"),
        tp=Refusal("its memory writer is not in the tensor-parallel plan"),
        sequence_parallel=Refusal("the segments run one after the other over the whole sequence, which sequence "
                                  "parallelism splits"),
        cp=Refusal("each segment reads the memory the segments before it wrote, so the sequence cannot be split "
                   "over context-parallel ranks"),
        serves=(Serves(family="decoder", task="lm"),),
        serves_reason="carries a memory from segment to segment of a causal stream",
    )

    def __init__(self, config: ModelConfig, n_layers: int, *, causal: bool, cross: bool, first_index: int,
                 options: MemformerOptions) -> None:
        super().__init__(config, n_layers, causal=causal, cross=True, first_index=first_index, options=options)
        self.segment = options.segment
        self.writer = MemoryWriter(config.d_model, options.slots, options.heads, options.temperature)

    @classmethod
    def check(cls, config: Config, options: MemformerOptions) -> None:
        """Refuse what the Memformer stack cannot run with, each with what to change."""
        model = config.model
        if model.d_model % options.heads:
            raise ConfigError(f"model.stack.options.heads={options.heads} must divide model.d_model={model.d_model}")
        if options.segment > config.train.seq_len:
            raise ConfigError(f"model.stack.options.segment={options.segment} exceeds train.seq_len="
                              f"{config.train.seq_len}: one segment, no memory to carry; use shorter segments")
        position = model.position.kind
        if position in POSITION.names() and not POSITION.get(position).adds_to_input and position not in ("none",
                                                                                                            "rope"):
            raise ConfigError(f"model.stack=memformer runs each segment's blocks on its own: model.position="
                              f"{model.position} is refused; use learned, sinusoidal, rope or none")
        block = model.block.kind
        if block in BLOCK.names() and BLOCK.get(block).block_traits.encoder_decoder is not None:
            raise ConfigError(f"model.stack=memformer reads the memory by each block's cross-attention, which "
                              f"model.block={block} has not; use model.block=standard")
        if model.share_layers:
            raise ConfigError("model.stack=memformer and model.share_layers=true do not combine; set one off")
        if carrying_kinds(model):
            raise ConfigError("model.stack=memformer cannot carry attention scores across segments (RealFormer); "
                              "choose another model.attention.kind")

    def run(self, x: torch.Tensor, position: PositionEncoding | None, memory: torch.Tensor | None,
            scores: torch.Tensor | None, context: StepContext,
            layer_states: list[torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        if context.padding_mask is not None:
            raise ValueError("model.stack=memformer reads a causal stream and takes no padding mask")
        slots = self.writer.initial(x.shape[0], x.dtype)
        token_ids = context.token_ids
        outputs = []
        for start in range(0, x.shape[1], self.segment):
            piece = slice(start, start + self.segment)
            segment_context = context.with_token_ids(None if token_ids is None else token_ids[:, piece])
            h = x[:, piece]
            for depth, block in zip(self.depths, self.blocks()):
                h, _ = self.run_block(depth, block, h, position, slots, None, segment_context)
            outputs.append(h)
            if start + self.segment < x.shape[1]:
                slots = self.writer(slots, h)
        return torch.cat(outputs, dim=1), scores
