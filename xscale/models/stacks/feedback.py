"""The Feedback Transformer (Fan et al. 2020, "Addressing Some Limitations of Transformers with Feedback Memory",
sec. 3): a decoder whose layers, at step t, attend not to the layer below's states of earlier steps but to one
memory vector per earlier step, a learned mix of every layer's state at that step,

  m_tau = sum_{l=0}^{L} softmax(w)_l x_tau^l      (x_tau^0 the embedded token, x_tau^l block l's output)
  x_t^l = FFN-residual(x_t^{l-1} + Attn(norm(x_t^{l-1}), {norm(m_tau)}_{tau < t}))

so the highest layer's view of the past reaches the lowest layer of the next step, and the computation is
sequential over tokens: training runs a loop over the T steps (each step every block once, on one token). The
weights w (L + 1 of them) are ``layer_weights``; the blocks are the model's (``model.block=standard``), pre-norm, each
with its own key and value projections of the memory.

``model.stack=feedback`` serves decoders only. At the first step the memory is empty: the attention's weighted sum
is zero (its output projection's bias remains). The block is always called whole, so ZeRO-3 gathers its parameters
around it. Departures: the keys and values of the whole memory are recomputed at every step (O(T^2)
projections, for clarity; the paper caches them and shares them across layers); positions are added to the input
only (learned, sinusoidal, learned_frequency or none), as the memory holds no relative positions; no limit on the
memory's span.
"""

from __future__ import annotations

import torch
from torch import nn

from xscale.config.schema import Config, ConfigError, ModelConfig
from xscale.models.position import PositionEncoding
from xscale.models.registry import ATTENTION, POSITION, STACK
from xscale.models.stacks.stack import Stack
from xscale.models.traits import Refusal, Serves, StackTraits
from xscale.runtime import StepContext


class StepPosition:
    """The one token a step holds, at position ``step`` of ``length``: dropout masks drawn at a step are those of
    that token in the whole sequence (a :class:`~xscale.runtime.step_context.SequenceLayout`)."""

    def __init__(self, step: int, length: int) -> None:
        self.step, self.length = step, length

    def global_size(self, local_size: int) -> int:
        return self.length

    def coordinates(self, local_size: int, device: torch.device) -> torch.Tensor:
        return torch.arange(self.step, self.step + local_size, device=device)


@STACK.register("feedback")
class FeedbackStack(Stack):
    """Every block at step t attends to the memories of steps < t (module docstring)."""

    stack_traits = StackTraits(
        pp=Refusal("each step's memory mixes every layer's state, so every block must run on one stage"),
        tp=Refusal("the memory's layer weights and the loop over steps are not in the tensor-parallel plan"),
        sequence_parallel=Refusal("each step holds one token, which sequence parallelism cannot split"),
        cp=Refusal("each step reads the memory of every earlier step, which context parallelism splits"),
        serves=(Serves(family="decoder", task="lm"),),
        serves_reason="is a decoder (step t reads the memories of steps before it)",
    )

    def __init__(self, config: ModelConfig, n_layers: int, *, causal: bool, cross: bool, first_index: int,
                 options: object = None) -> None:
        # The blocks attend to past memories only, so they need no causal mask of their own.
        super().__init__(config, n_layers, causal=False, cross=cross, first_index=first_index, options=options)
        self.layer_weights = nn.Parameter(torch.zeros(n_layers + 1))

    @classmethod
    def check(cls, config: Config, options: object) -> None:
        """Refuse what the Feedback Transformer cannot run with, each with what to change."""
        model, where = config.model, "model.stack=feedback"
        if model.block.kind != "standard" or model.norm_placement != "pre":
            raise ConfigError(f"{where} runs pre-norm standard blocks (each reads the memory normalised by its "
                              "attention's norm); set model.block=standard and model.norm_placement=pre")
        kinds = model.attention.per_layer or [model.attention.kind]
        if any(kind in ATTENTION.names() and ATTENTION.get(kind) is not ATTENTION.get("dense") for kind in kinds):
            raise ConfigError(f"{where} attends densely to the memory; set model.attention.kind=dense")
        position = model.position.kind
        if position != "none" and position in POSITION.names() and not POSITION.get(position).adds_to_input:
            raise ConfigError(f"{where}: the memory holds no relative positions for model.position={position}; use "
                              "learned, sinusoidal, learned_frequency or none")
        if model.moe.num_experts or model.segment_memory:
            raise ConfigError(f"{where} takes neither MoE layers (routing one token per step) nor a segment memory; "
                              "set model.moe.num_experts=0 and model.segment_memory=0")

    def run(self, x: torch.Tensor, position: PositionEncoding | None, memory: torch.Tensor | None,
            scores: torch.Tensor | None, context: StepContext,
            layer_states: list[torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        if context.padding_mask is not None or context.kv_cache is not None:
            raise ValueError("model.stack=feedback takes no padding mask and no KV cache; decode by recomputing the "
                             "prefix")
        weights = torch.softmax(self.layer_weights.float(), dim=0).to(x.dtype)
        memories: list[torch.Tensor] = []
        outputs = []
        for step in range(x.shape[1]):
            step_context = context.with_sequence(StepPosition(step, x.shape[1]))
            h = x[:, step:step + 1]
            states = [h]
            past = torch.cat(memories, dim=1) if memories else x[:, :0]  # the first step's memory is empty
            for depth, block in zip(self.depths, self.blocks()):
                h = block(h, position, keys=past, context=self.block_context(depth, step_context))
                states.append(h)
            memories.append(torch.einsum("l,lbtd->btd", weights, torch.stack(states)))
            outputs.append(h)
        return torch.cat(outputs, dim=1), scores
