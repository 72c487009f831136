"""The Transformer: decoder-only (GPT), encoder-only (BERT) or encoder-decoder (T5), by config.

Plain single-device PyTorch, with one forward. Layers live in a ``ModuleDict`` keyed by their index, so a pipeline
stage is this model with modules deleted (:meth:`Transformer.keep_layers`) under the names checkpoints use, and
runs this same forward on what it holds: the embedding when it starts a stack, a run of each stack's blocks, the
final norm and head when it ends the last stack.

What crosses a stage boundary, by position (``forward``'s ``inputs, *received`` and its return value):
  inside a stack           x, then the RealFormer scores when blocks on both sides carry them (He et al. 2020)
  encoder end -> decoder   the memory (the decoder starts its own scores)
  inside the decoder       (decoder hidden, memory), then the decoder's scores when they cross
The memory goes along stage by stage, so its gradient, which every decoder block's cross-attention adds to,
comes back the same way.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from xscale.config.schema import CHOICES, ModelConfig
from xscale.models.dropout import Dropout, name_dropout_sites
from xscale.models.float8 import use_float8
from xscale.models.heads.classifier import ClassificationHead
from xscale.models.heads.early_exit import LayerExits, run_until_exit
from xscale.models.heads.lm import LMHeadTransform
from xscale.models.heads.objective import build_objective_head
from xscale.models.norm import build_norm
from xscale.models.patch_embedding import PatchEmbedding
from xscale.models.registry import STACK
from xscale.models.stacks import Stack
from xscale.models.stacks.plain import PlainStack
from xscale.ops import check_backend
from xscale.runtime import StepContext
from xscale.runtime.hooks import CallsFusedOps, RunsSparseAttention

SPARSE_ATTENTION = CHOICES["train.sparse_attention"]


@dataclasses.dataclass
class StageValues:
    """What a stack's run of blocks reads and passes on (module docstring): the hidden states, the memory a
    decoder's cross-attention reads, the RealFormer scores, and each layer's output where the stack keeps them."""

    hidden: torch.Tensor
    memory: torch.Tensor | None = None
    scores: torch.Tensor | None = None
    layer_states: list[torch.Tensor] | None = None

    def sent(self, stack: Stack, arrived: torch.Tensor | None) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """What a stage ending inside ``stack`` sends on: the hidden states, a decoder's memory (a new tensor, not a
        view: schedules detach their outputs in place, and the memory's gradient must go back), then the scores
        when they cross (passed through untouched as a new tensor, so the pipeline's backward reaches them)."""
        outputs = (self.hidden,) if self.memory is None else (self.hidden, self.memory.clone())
        if stack.scores_cross(stack.held[1]):
            outputs = (*outputs, self.scores.clone() if self.scores is arrived else self.scores)
        return outputs[0] if len(outputs) == 1 else outputs


class Transformer(nn.Module):
    kernels = "auto"  # the fused-op backend of its modules and of the loss that reads it (use_kernels)

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.seq2seq = config.family == "encoder_decoder"
        # model.input=patches: images read as a class token and their patches (ViT), classified, never decoded.
        self.reads_pixels = config.input == "patches"
        if self.reads_pixels and self.seq2seq:
            raise ValueError("model.input=patches serves an encoder (a classifier), not an encoder-decoder")
        self.embedding = (PatchEmbedding(config) if self.reads_pixels
                          else nn.Embedding(config.vocab_size, config.d_model))
        self.embedding_norm = (
            build_norm(config.norm, config.d_model) if config.embedding_norm else None
        )
        self.embedding_dropout = Dropout(config.dropout)
        decoder_only = config.family == "decoder"
        self.stack: Stack | None = STACK.build(config.stack, "model.stack", config, config.n_layers,
                                               causal=decoder_only, cross=False, first_index=0)
        self.decoder = (
            PlainStack(config, config.decoder_layers, causal=True, cross=True, first_index=config.n_layers)
            if self.seq2seq else None
        )
        # A classifier (model.num_classes > 0) maps the pooled sequence to class logits instead of tokens to words.
        self.classifier = ClassificationHead(config) if config.num_classes else None
        exits = self.stack.keeps_layer_states and self.classifier is not None
        self.exits = LayerExits(config, self.stack.options.entropy, self.stack.options.patience) if exits else None
        self.head_transform = LMHeadTransform(config) if config.lm_head_transform and not self.classifier else None
        self.output = (nn.Linear(config.d_model, config.vocab_size, bias=config.lm_head_bias)
                       if self.classifier is None else None)
        # A pre-training objective's extra head (SpanBERT's SBO, NSP/SOP), read by the loss beside the projection.
        self.objective_head = build_objective_head(config)
        self.tie_weights()
        name_dropout_sites(self)

    def tie_weights(self) -> None:
        """Share the embedding matrix with the output projection (Press & Wolf 2017); re-run after to_empty. A
        pipeline stage holding the projection but not the embedding keeps its own copy (``output.weight``)."""
        if self.config.tie_embeddings and not self.reads_pixels and self.embedding is not None and self.output is not None:
            self.output.weight = self.embedding.weight

    def use_kernels(self, backend: str, sparse_attention: str = "gather") -> Transformer:
        """Run the fused ops (norms, RoPE, gated activations, the loss) through ``backend`` (``train.kernels``:
        auto | triton | apex | torch; :mod:`xscale.ops.dispatch`) and the position-sparse attention cores through
        ``sparse_attention`` (``train.sparse_attention``: gather | flex): set on every module that calls one, as
        :meth:`nn.Module.train` sets the mode."""
        check_backend(backend)
        if sparse_attention not in SPARSE_ATTENTION:
            raise ValueError(f"sparse attention '{sparse_attention}' is not one of {', '.join(SPARSE_ATTENTION)} "
                             "(train.sparse_attention)")
        for module in self.modules():
            if isinstance(module, CallsFusedOps):
                module.kernels = backend
            if isinstance(module, RunsSparseAttention):
                module.sparse_attention = sparse_attention
        return self

    def use_float8(self, recipe: str, device: torch.device) -> list[str]:
        """``train.precision=fp8``: the blocks' linear layers through torchao's float8 training with ``recipe``
        scaling (:func:`xscale.models.float8.use_float8`), in place, before any layout; their names."""
        return use_float8(self, recipe, device)

    def keep_layers(self, layers: list[int]) -> None:
        """Cut this model down to a pipeline stage holding the consecutive ``layers`` (indices into the encoder's
        blocks then the decoder's) by deleting every module the stage does not run: the embedding unless the stage
        starts a stack, the head unless it ends the last one. A tied output projection without the embedding
        becomes a copy of its own, whose gradients the pipeline sums with the embedding's."""
        n = self.config.n_layers
        for name, depths in (("stack", [i for i in layers if i < n]), ("decoder", [i - n for i in layers if i >= n])):
            stack = getattr(self, name)
            if stack is None:
                continue
            if depths:
                stack.keep(range(depths[0], depths[-1] + 1))
            else:
                setattr(self, name, None)
        stacks = [stack for stack in (self.stack, self.decoder) if stack is not None]
        if not any(stack.starts for stack in stacks):
            self.embedding, self.embedding_norm = None, None
        last = self.decoder if self.seq2seq else self.stack
        if last is None or not last.ends:
            self.head_transform, self.output, self.classifier, self.exits = None, None, None, None
            self.objective_head = None
        elif self.config.tie_embeddings and self.embedding is None and self.output is not None:
            self.output.weight = nn.Parameter(self.output.weight.detach().clone())

    def _embed(self, tokens: torch.Tensor, stack: Stack, context: StepContext) -> torch.Tensor:
        """Token ids (B, T), or pixels (B, C, H, W) read as a class token and T - 1 patches, -> (B, T, D)."""
        if self.embedding is None:
            raise ValueError("this pipeline stage starts a stack but holds no embedding")
        x = self.embedding(tokens)
        if self.seq2seq and self.config.tie_embeddings:
            x = x * self.config.d_model**0.5  # T5/Vaswani scaling keeps tied embeddings well-conditioned
        if stack.position is not None:
            x = stack.position.embed(x, context)
        if self.embedding_norm is not None:
            x = self.embedding_norm(x)
        return self.embedding_dropout(x, context=context)

    def _exit_early(self, x: torch.Tensor, stack: Stack, context: StepContext) -> torch.Tensor:
        """Realised early exit (:func:`~xscale.models.heads.early_exit.run_until_exit`) from the embedded ``x``: block l
        and exit l on the rows still in, their padding masks and token ids with them."""
        if self.exits is None or not (stack.starts and stack.ends):
            raise ValueError("exit_early=True needs a whole early-exit classifier (model.stack=early_exit)")
        if self.exits.rows_coupled is not None:
            raise ValueError(f"exit_early=True drops the exited rows, but {self.exits.rows_coupled}; compute every "
                             "exit instead (the forward without exit_early)")
        mask, token_ids = context.padding_mask, context.token_ids

        def rows_of(tensor: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor | None:
            return None if tensor is None else tensor[rows]

        def run_layer(depth: int, carry: tuple, rows: torch.Tensor) -> tuple:
            rows_context = context.with_padding_mask(rows_of(mask, rows)).with_token_ids(rows_of(token_ids, rows))
            return stack.run_depth(depth, carry[0], carry[1], rows_context)

        def exit_logits(depth: int, hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
            if depth < stack.n_layers - 1:
                return self.exits.logits_at(depth, hidden, stack.final_norm, rows_of(mask, rows))
            hidden = stack.final_norm(hidden) if stack.final_norm is not None else hidden
            return self.classifier(hidden, rows_of(mask, rows))

        return run_until_exit((x, None), run_layer, exit_logits, stack.n_layers, self.exits.entropy,
                              self.exits.patience)

    def forward(self, inputs: torch.Tensor, *received: torch.Tensor, decoder_input_ids: torch.Tensor | None = None,
                context: StepContext | None = None, project: bool = True,
                padding_mask: torch.Tensor | None = None,
                exit_early: bool = False) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """Token ids (B, T) -> logits (B, T, vocab) (an encoder-decoder's: of its decoder, fed ``decoder_input_ids``);
        with ``model.input=patches``, pixels (B, C, H, W) -> class logits.

        ``context``: the batch's place in the run (dropout masks, router noise, hash-routing ids; None: plain
        PyTorch draws). ``project=False`` returns the hidden states the output projection reads (after BERT's head
        transform), for a loss that fuses the projection. ``padding_mask`` (B, T), True at real tokens: attention takes
        no padded key; a classifier (``model.num_classes``) returns class logits (B, classes) pooled over the real
        tokens, with ``model.stack=early_exit`` every layer's (layers, B, classes), and with ``exit_early=True``
        (inference) each example stopped at its exit layer: (B, 3) int64, its class, 0-based exit layer and layers
        run (:func:`~xscale.models.heads.early_exit.run_until_exit`). A pipeline stage takes what the previous one
        sent (``inputs``, then ``received``) and returns what it sends on (see the module docstring).
        """
        context = self._context(context, padding_mask)
        memory = None
        if self.stack is not None:
            values, stack_context = self._arrive(self.stack, inputs, received, context, inputs)
            if exit_early:
                return self._exit_early(values.hidden, self.stack, stack_context)
            values = self._through(self.stack, values, stack_context)
            if not (self.stack.ends and self.seq2seq):
                return self._head(values, self.stack, stack_context, project)
            if self.decoder is None:
                return values.hidden  # the memory, for the stage holding the decoder's first block
            memory = values.hidden
        values, _ = self._arrive(self.decoder, inputs, received, context, decoder_input_ids, memory)
        decoder_context = context.with_token_ids(decoder_input_ids)
        return self._head(self._through(self.decoder, values, decoder_context), self.decoder, context, project)

    def _context(self, context: StepContext | None, padding_mask: torch.Tensor | None) -> StepContext:
        context = StepContext() if context is None else context
        if padding_mask is None:
            return context
        if self.seq2seq:
            raise ValueError("padding masks serve encoder and decoder stacks; an encoder-decoder takes none")
        return context.with_padding_mask(padding_mask.to(torch.bool))

    def _arrive(self, stack: Stack, inputs: torch.Tensor, received: tuple[torch.Tensor, ...], context: StepContext,
                tokens: torch.Tensor | None, memory: torch.Tensor | None = None) -> tuple[StageValues, StepContext]:
        """What the held run of ``stack`` starts from, and its context: the embedded ``tokens`` where it starts the
        stack (a decoder's memory being the encoder's output, computed here or sent as ``inputs``), else what the
        previous stage sent."""
        decoder = stack is self.decoder
        if not stack.starts:
            scores = received[-1] if stack.scores_cross(stack.held[0]) else None
            return StageValues(inputs, memory=received[0] if decoder else None, scores=scores), context
        if decoder:
            if tokens is None:
                raise ValueError("an encoder-decoder model needs decoder_input_ids")
            return StageValues(self._embed(tokens, stack, context), memory=inputs if memory is None else memory), \
                context
        if received:
            raise TypeError("Transformer.forward takes the token ids and, by keyword, decoder_input_ids= "
                            f"(got {len(received)} more positional tensors)")
        context = context if self.reads_pixels else context.with_token_ids(tokens)
        return StageValues(self._embed(tokens, stack, context)), context

    def _through(self, stack: Stack, values: StageValues, context: StepContext) -> StageValues | tuple:
        """``values`` through the held blocks of ``stack``, then its final norm where the stack ends here; a stage
        ending inside the stack returns what it sends on (:meth:`StageValues.sent`)."""
        layer_states = [] if stack.keeps_layer_states and self.exits is not None else None
        hidden, scores = stack(values.hidden, values.memory, values.scores, context, layer_states)
        after = dataclasses.replace(values, hidden=hidden, scores=scores, layer_states=layer_states)
        if not stack.ends:
            return after.sent(stack, values.scores)
        if stack.final_norm is not None:
            after.hidden = stack.final_norm(after.hidden)
        return after

    def _head(self, values: StageValues | tuple, stack: Stack, context: StepContext,
              project: bool) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """The classifier's logits (every exit's with early exit), the vocabulary logits, or (``project=False``)
        the hidden states the projection reads; a stage ending inside the stack passes its values on."""
        if not isinstance(values, StageValues):
            return values
        if self.classifier is not None:
            mask = stack.output_mask(context.padding_mask)
            logits = self.classifier(values.hidden, mask)
            if self.exits is None:
                return logits
            return self.exits(values.layer_states[:-1], stack.final_norm, mask, logits)  # (layers, B, classes)
        hidden = values.hidden if self.head_transform is None else self.head_transform(values.hidden)
        return self.output(hidden) if project else hidden

