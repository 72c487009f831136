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

import torch
from torch import nn

from xscale.config.schema import CHOICES, ModelConfig
from xscale.models.act import AdaptiveComputationTime
from xscale.models.block import PRE_NORM_PLACEMENTS, TransformerBlock
from xscale.models.classifier import ClassificationHead
from xscale.models.dropout import Dropout, name_dropout_sites
from xscale.models.early_exit import LayerExits, run_until_exit
from xscale.models.funnel import Funnel
from xscale.models.norm import build_norm
from xscale.models.patch_embedding import PatchEmbedding
from xscale.models.position import PositionEncoding, TappedPosition, build_position
from xscale.models.reversible import reversible_stack
from xscale.ops import check_backend
from xscale.ops.reference import ACTIVATIONS
from xscale.runtime import StepContext
from xscale.runtime.hooks import CallsFusedOps, RunsSparseAttention

# Model options that change how a stack runs its blocks (``xscale inspect`` names those set; the zoo matrix has a case
# for each): option -> what it is.
STACK_VARIANTS = {
    "share_layers": "one block at every depth (ALBERT, Lan et al. 2020)",
    "reversible": "reversible residuals (RevNet, Gomez et al. 2017; Reformer, Kitaev et al. 2020)",
    "act": "Universal Transformer with Adaptive Computation Time (Dehghani et al. 2019; Graves 2016)",
    "funnel": "sequence pooled between block groups (Funnel-Transformer, Dai et al. 2020)",
    "early_exit": "a classifier after every layer, exits per example (DeeBERT, Xin et al. 2020; PABEE, Zhou et al. 2020)",
}

SPARSE_ATTENTION = CHOICES["train.sparse_attention"]


def stack_variants(config: ModelConfig) -> list[str]:
    """The :data:`STACK_VARIANTS` options ``config`` sets."""
    return [name for name in STACK_VARIANTS if getattr(config, name)]


class LMHeadTransform(nn.Module):
    """BERT's MLM head transform: norm(act(x W + b)) before the vocabulary projection."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.d_model, config.d_model)
        self.activation = "gelu" if config.ffn.kind in ("gelu", "relu") else "gelu_tanh"
        self.norm = build_norm(config.norm, config.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(ACTIVATIONS[self.activation](self.dense(x)))


class Stack(nn.Module):
    """A stack of blocks with its own position encoding and (for pre/sandwich) final norm.

    ``held``: the depths [first, stop) whose blocks this module runs (all of them, or a pipeline stage's run).
    With ``share_layers`` (ALBERT, Lan et al. 2020) one block, ``layers.0``, runs at every held depth and draws
    its own dropout masks at each (the context's ``depth``). With ``reversible`` the blocks run as reversible
    residuals (:mod:`xscale.models.reversible`); with ``act`` the shared block is applied up to ``n_layers``
    times with per-position halting (:mod:`xscale.models.act`).
    """

    def __init__(self, config: ModelConfig, n_layers: int, *, causal: bool, cross: bool, first_index: int) -> None:
        super().__init__()
        self.n_layers = n_layers
        self.held = (0, n_layers)
        self.share_layers = config.share_layers
        self.reversible = config.reversible
        self.act = AdaptiveComputationTime(config) if config.act else None
        self.funnel = Funnel(config) if config.funnel and not causal else None
        self.position: PositionEncoding | None = build_position(
            config.position, config.d_model, config.n_heads, config.head_dim, config.max_seq_len, causal)
        uses_bias = self.position.biases_logits or self.position.biases_from_content
        # A funnel's decoder blocks come after the n_layers it pools between (:mod:`xscale.models.funnel`).
        built = 1 if config.share_layers else n_layers + (self.funnel.decoder_layers if self.funnel is not None else 0)
        self.layers = nn.ModuleDict({
            str(i): TransformerBlock(config, first_index + i, causal=causal, cross=cross, uses_bias=uses_bias,
                                     mixes_values=self.position.mixes_values)
            for i in range(built)
        })
        self.final_norm = (
            build_norm(config.norm, config.d_model)
            if config.norm_placement in PRE_NORM_PLACEMENTS else None
        )
        # Depths whose blocks take and pass on RealFormer scores (the whole stack's, kept when a stage is cut).
        self.carrying = tuple(depth for depth, block in zip(range(n_layers), self.blocks()) if block.carries_scores)

    @property
    def depths(self) -> range:
        return range(*self.held)

    @property
    def starts(self) -> bool:
        """Whether the stack's first block is held here (its input is the embedded tokens)."""
        return self.held[0] == 0

    @property
    def ends(self) -> bool:
        """Whether the stack's last block is held here (its final norm follows)."""
        return self.held[1] == self.n_layers

    def blocks(self) -> list[nn.Module]:
        """The held blocks in execution order (one block repeated when weights are shared)."""
        if self.share_layers:
            return [self.layers["0"]] * len(self.depths)
        return list(self.layers.values())

    def scores_cross(self, boundary: int) -> bool:
        """Whether RealFormer scores cross the boundary before depth ``boundary``: a carrying block on each side."""
        return any(d < boundary for d in self.carrying) and any(d >= boundary for d in self.carrying)

    def keep(self, depths: range) -> None:
        """Delete every block outside ``depths`` (a pipeline stage's run), the final norm unless the run ends the
        stack, and an absolute position table unless it starts it (positions are added once, before the first)."""
        kept = {"0"} if self.share_layers else {str(depth) for depth in depths}
        for name in [name for name in self.layers if name not in kept]:
            del self.layers[name]
        self.held = (depths.start, depths.stop)
        if not self.ends:
            self.final_norm = None
        if not self.starts and self.position is not None and self.position.adds_to_input:
            self.position = None

    def forward(self, x: torch.Tensor, memory: torch.Tensor | None, scores: torch.Tensor | None,
                context: StepContext,
                layer_states: list[torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Apply the held blocks in order; returns (x, scores), ``scores`` being the RealFormer scores that
        ``carries_scores`` blocks pass on (other blocks leave them as they are). ``layer_states``: a list that
        receives each block's output (early exit; the plain loop)."""
        position = self.position
        if position is not None and not self.starts:
            position = TappedPosition.around(position, x)
        if self.reversible:
            return self._reversible(x, position, context), scores
        if self.funnel is not None:
            return self.funnel(x, self.blocks(), position, context), scores
        if self.act is not None:
            block = self.layers["0"]
            return self.act(x, lambda h, depth: block(h, position, memory, context=context.at_depth(depth)),
                            len(self.depths)), scores
        for depth, block in zip(self.depths, self.blocks()):
            x, scores = self._run_block(depth, block, x, position, memory, scores, context)
            if layer_states is not None:
                layer_states.append(x)
        return x, scores

    def run_depth(self, depth: int, x: torch.Tensor, scores: torch.Tensor | None,
                  context: StepContext) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Block ``depth`` alone, as the plain loop runs it, in a whole stack (realised early exit runs the stack
        layer by layer on fewer and fewer rows)."""
        return self._run_block(depth, self.blocks()[depth], x, self.position, None, scores, context)

    def _run_block(self, depth: int, block: nn.Module, x: torch.Tensor, position: PositionEncoding | None,
                   memory: torch.Tensor | None, scores: torch.Tensor | None,
                   context: StepContext) -> tuple[torch.Tensor, torch.Tensor | None]:
        block_context = context.at_depth(depth) if self.share_layers else context
        if block.carries_scores:
            return block(x, position, memory, scores=scores, context=block_context)
        return block(x, position, memory, context=block_context), scores

    def _reversible(self, x: torch.Tensor, position: PositionEncoding | None, context: StepContext) -> torch.Tensor:
        """The held blocks as reversible residuals: F = the attention branch, G = the feed-forward branch."""
        branches = []
        for depth, block in zip(self.depths, self.blocks()):
            block_context = context.at_depth(depth) if self.share_layers else context
            branches.append((
                lambda h, block=block, c=block_context: block.attention.branch(h, position, context=c),
                lambda h, block=block, c=block_context: block.feed_forward.branch(h, context=c)))
        return reversible_stack(x, branches, list(self.parameters()))


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
        self.stack: Stack | None = Stack(config, config.n_layers, causal=decoder_only, cross=False, first_index=0)
        self.decoder = (
            Stack(config, config.decoder_layers, causal=True, cross=True, first_index=config.n_layers)
            if self.seq2seq else None
        )
        # A classifier (model.num_classes > 0) maps the pooled sequence to class logits instead of tokens to words.
        self.classifier = ClassificationHead(config) if config.num_classes else None
        self.exits = LayerExits(config) if config.early_exit and self.classifier is not None else None
        self.head_transform = LMHeadTransform(config) if config.lm_head_transform and not self.classifier else None
        self.output = (nn.Linear(config.d_model, config.vocab_size, bias=config.lm_head_bias)
                       if self.classifier is None else None)
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

    @property
    def layer_count(self) -> int:
        """Blocks a pipeline cuts: the encoder's, then the decoder's for an encoder-decoder model."""
        return self.config.n_layers + (self.config.decoder_layers if self.seq2seq else 0)

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

    def _head(self, x: torch.Tensor, project: bool) -> torch.Tensor:
        if self.head_transform is not None:
            x = self.head_transform(x)
        return self.output(x) if project else x

    @staticmethod
    def _send(outputs: tuple[torch.Tensor, ...], stack: Stack, scores: torch.Tensor | None,
              received: torch.Tensor | None) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """What a stage ending inside ``stack`` sends on: ``outputs``, with the scores last when they cross (passed
        through untouched, as a new tensor, so the pipeline's backward reaches them)."""
        if stack.scores_cross(stack.held[1]):
            outputs = (*outputs, scores.clone() if scores is received else scores)
        return outputs[0] if len(outputs) == 1 else outputs

    def _exit_early(self, x: torch.Tensor, stack: Stack, context: StepContext) -> torch.Tensor:
        """Realised early exit (:func:`~xscale.models.early_exit.run_until_exit`) from the embedded ``x``: block l
        and exit l on the rows still in, their padding masks and token ids with them."""
        if self.exits is None or not (stack.starts and stack.ends):
            raise ValueError("exit_early=True needs a whole early-exit classifier (model.early_exit=true)")
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
        tokens, with ``model.early_exit`` every layer's (layers, B, classes), and with ``exit_early=True`` (inference)
        each example stopped at its exit layer: (B, 3) int64, its class, 0-based exit layer and layers run
        (:func:`~xscale.models.early_exit.run_until_exit`). A pipeline stage takes what the previous one sent
        (``inputs``, then ``received``) and returns what it sends on (see the module docstring).
        """
        context = StepContext() if context is None else context
        if padding_mask is not None:
            if self.seq2seq:
                raise ValueError("padding masks serve encoder and decoder stacks; an encoder-decoder takes none")
            context = context.with_padding_mask(padding_mask.to(torch.bool))
        stack, decoder = self.stack, self.decoder
        memory = None
        if stack is not None:
            if stack.starts:
                if received:
                    raise TypeError("Transformer.forward takes the token ids and, by keyword, decoder_input_ids= "
                                    f"(got {len(received)} more positional tensors)")
                x, scores = self._embed(inputs, stack, context), None
                context = context if self.reads_pixels else context.with_token_ids(inputs)
            else:
                x, scores = inputs, (received[-1] if stack.scores_cross(stack.held[0]) else None)
            if exit_early:
                return self._exit_early(x, stack, context)
            arrived = scores
            layer_states = [] if self.exits is not None else None
            x, scores = stack(x, None, scores, context, layer_states)
            if not stack.ends:
                return self._send((x,), stack, scores, arrived)
            if stack.final_norm is not None:
                x = stack.final_norm(x)
            if self.classifier is not None:
                mask = context.padding_mask if stack.funnel is None else stack.funnel.output_mask(context.padding_mask)
                logits = self.classifier(x, mask)
                if self.exits is not None:  # every layer's exit, (layers, B, classes)
                    return self.exits(layer_states[:-1], stack.final_norm, mask, logits)
                return logits
            if not self.seq2seq:
                return self._head(x, project)
            if decoder is None:
                return x  # the memory, for the stage holding the decoder's first block
            memory = x
        if decoder_input_ids is None and decoder.starts:
            raise ValueError("an encoder-decoder model needs decoder_input_ids")
        if decoder.starts:
            memory = inputs if memory is None else memory
            y, scores = self._embed(decoder_input_ids, decoder, context), None
        else:
            y, memory = inputs, received[0]
            scores = received[-1] if decoder.scores_cross(decoder.held[0]) else None
        arrived = scores
        y, scores = decoder(y, memory, scores, context.with_token_ids(decoder_input_ids))
        if not decoder.ends:
            # A new tensor (not a view: schedules detach their outputs in place), so the memory's gradient goes back.
            return self._send((y, memory.clone()), decoder, scores, arrived)
        if decoder.final_norm is not None:
            y = decoder.final_norm(y)
        return self._head(y, project)
