"""Pipeline stages cut from the single-process Transformer, under its parameter names.

A stage keeps the modules it runs and drops the rest: the first stage the embedding, every stage
its blocks (``stack.layers.<k>`` for its layer indices k), the last stage the final norm, the head
transform and the output projection. Names are untouched, so the union of the stages' state dicts
is the single-process state dict and checkpoints move between layouts. Parameters that several stages
use (tied embeddings, T5's position table, an encoder-decoder's embedding) are held by each of them:
:mod:`~xscale.parallel.pipeline_shared`.

An encoder-decoder model (Raffel et al. 2020) is cut along the concatenation of its stacks: layer indices
0..n_layers-1 are the encoder's blocks (``stack.layers.<k>``), n_layers.. the decoder's (``decoder.layers.<k>``,
k = index - n_layers). Encoder stages send hidden states; the stage holding the last encoder block applies the
encoder's final norm and sends the memory; from the first decoder block on, stages send (decoder hidden, memory),
so the memory's gradient, which every decoder block's cross-attention adds to, comes back stage by stage. The
stage holding the first decoder block embeds the microbatch's ``decoder_input_ids`` itself (set by the engine
with :class:`decoder_input_ids`), with its own copy ``decoder_embedding`` (and ``decoder_embedding_norm``) of the
first stage's embedding when it is not the first stage.

RealFormer blocks (He et al. 2020) pass their pre-softmax scores to the next block: a stage sends
``(x, scores)`` when a block before its end made scores that a block after it reads, else ``x``; in an
encoder-decoder each stack has its own scores (the decoder's start at its first block), which travel last:
``(x, scores)`` inside the encoder, ``(decoder hidden, memory, scores)`` inside the decoder.

With ``share_layers`` (ALBERT, Lan et al. 2020; Universal Transformer, Dehghani et al. 2019) a stack has one block,
``stack.layers.0``, run at every depth: each stage running some of that stack's depths holds the block once, under
its single-process name (so its dropout sites and its initial values are the single-process ones), and runs it
once per depth it owns, numbering the depths from its first (each depth draws its own dropout masks). The copies' gradients are summed like the other shared parameters'.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from xscale.config import ConfigError, ModelConfig
from xscale.models.init import canonical_name, init_weights
from xscale.models.moe.token_ids import routing_token_ids
from xscale.models.position import PositionEncoding
from xscale.models.scoped import Scope, ScopedValue
from xscale.models.transformer import Transformer, run_blocks

TIED_COPY = "output.weight"
TIED_SOURCE = "embedding.weight"
# The first decoder stage's copies (stage-local name -> the single-process module they copy).
DECODER_COPIES = {"decoder_embedding": "embedding", "decoder_embedding_norm": "embedding_norm"}


def source_name(stage: PipelineStageModule, name: str) -> str:
    """The single-process name of ``stage``'s parameter ``name`` (canonical): a copy's source, else ``name``."""
    if name == TIED_COPY and stage.is_last and not stage.is_first and stage.config.tie_embeddings:
        return TIED_SOURCE
    head, _, rest = name.partition(".")
    return f"{DECODER_COPIES[head]}.{rest}" if head in DECODER_COPIES else name


def pipeline_layers(config: ModelConfig) -> int:
    """The blocks a pipeline cuts: the encoder's then the decoder's for an encoder-decoder model."""
    return config.n_layers + (config.decoder_layers if config.family == "encoder_decoder" else 0)


_DECODER_IDS: ScopedValue[torch.Tensor] = ScopedValue()


def decoder_input_ids(token_ids: torch.Tensor | None) -> Scope[torch.Tensor]:
    """The microbatch's ``decoder_input_ids`` that a pipeline stage holding the first decoder block embeds."""
    return _DECODER_IDS.scope(token_ids)


def split_layers(n_layers: int, num_stages: int, pp_split: list[int] | None = None,
                 what: str = "model.n_layers") -> list[list[int]]:
    """Layer indices per stage: ``pp_split`` blocks per stage when given, else as even as possible
    (the earlier stages take one more layer when ``num_stages`` does not divide ``n_layers``). ``what``
    names the layer count in messages."""
    if num_stages < 1:
        raise ConfigError(f"a pipeline needs at least one stage, got {num_stages}")
    if pp_split is None:
        if n_layers < num_stages:
            raise ConfigError(
                f"{what}={n_layers} cannot fill {num_stages} pipeline stages (parallel.pp x "
                f"parallel.pp_stages_per_rank); lower pp or pp_stages_per_rank to at most {n_layers} stages"
            )
        base, extra = divmod(n_layers, num_stages)
        sizes = [base + (1 if stage < extra else 0) for stage in range(num_stages)]
    else:
        sizes = list(pp_split)
        if len(sizes) != num_stages:
            raise ConfigError(
                f"parallel.pp_split={sizes} has {len(sizes)} entries but the pipeline has {num_stages} stages "
                f"(parallel.pp x parallel.pp_stages_per_rank); give one block count per stage"
            )
        if any(size < 1 for size in sizes):
            raise ConfigError(f"parallel.pp_split={sizes}: every stage needs at least one block")
        if sum(sizes) != n_layers:
            raise ConfigError(
                f"parallel.pp_split={sizes} sums to {sum(sizes)} blocks but {what}={n_layers}; "
                f"make the counts sum to {n_layers}"
            )
    bounds = [sum(sizes[:stage]) for stage in range(num_stages + 1)]
    return [list(range(bounds[stage], bounds[stage + 1])) for stage in range(num_stages)]


def stage_to_rank(num_stages: int, pp_size: int, style: str) -> list[int]:
    """The pp rank of every stage: ``loop`` puts stage s on rank s % pp (Narayanan et al. 2021),
    ``v`` runs down the ranks and back up (ZB-V, Qi et al. 2024, sec. 6)."""
    if style == "loop":
        return [stage % pp_size for stage in range(num_stages)]
    if style == "v":
        return [stage if stage < pp_size else 2 * pp_size - 1 - stage for stage in range(num_stages)]
    raise ValueError(f"unknown stage placement '{style}'")


class PipelineStageModule(nn.Module):
    """One pipeline stage: token ids (first stage) or what the previous stage sent in, hidden states out.

    The last stage returns the hidden states the LM head projects (after the final norm and the
    head transform); the engine's loss function applies ``output``. The forward mirrors
    :meth:`Transformer.hidden_states` for the layers this stage holds (indices into :func:`pipeline_layers`).
    Encoder-decoder stages take and return, by position: the first stage token ids; an encoder stage the hidden
    states; the stage after the encoder's end the memory; later decoder stages (decoder hidden, memory). The
    stage takes over (and prunes) ``model``'s modules: pass a copy.
    """

    def __init__(self, model: Transformer, layer_indices: list[int], *, is_first: bool, is_last: bool) -> None:
        super().__init__()
        config = self.config = model.config
        self.layer_indices = list(layer_indices)
        self.is_first, self.is_last = is_first, is_last
        self.seq2seq = config.family == "encoder_decoder"
        encoder = [index for index in layer_indices if index < config.n_layers]
        decoder = [index - config.n_layers for index in layer_indices if index >= config.n_layers]
        self.ends_encoder = self.seq2seq and config.n_layers - 1 in encoder
        self.starts_decoder = self.seq2seq and 0 in decoder
        self.embeds_midway = self.starts_decoder and not is_first  # token ids from the engine, not an input
        # RealFormer scores (He et al. 2020) cross a stage boundary when made before it and read after it, by the
        # same stack: an encoder-decoder's decoder starts its own scores.
        carrying = [[depth for depth, block in enumerate(model.stack.blocks()) if block.carries_scores]]
        if self.seq2seq:
            carrying.append([config.n_layers + depth for depth, block in enumerate(model.decoder.blocks())
                             if block.carries_scores])
        self.receives_scores = not is_first and _scores_cross(carrying, layer_indices[0] - 1)
        self.sends_scores = not is_last and _scores_cross(carrying, layer_indices[-1])
        if is_first:
            self.embedding = model.embedding
            self.embedding_norm = model.embedding_norm
            self.embedding_dropout = model.embedding_dropout
        elif self.starts_decoder:  # copies of the first stage's, under their own names
            self.decoder_embedding = model.embedding
            self.decoder_embedding_norm = model.embedding_norm
            self.decoder_embedding_dropout = model.embedding_dropout
        if encoder or not self.seq2seq:
            self.stack = self._prune(model.stack, encoder, is_first, keep_norm=is_last or self.ends_encoder)
        if decoder:
            self.decoder = self._prune(model.decoder, decoder, self.starts_decoder, keep_norm=is_last)
        if is_last:
            self.head_transform = model.head_transform
            self.output = model.output
        # A stage running a shared block at several depths reuses its parameters inside one backward, so the weight
        # half of a split backward would run back through the earlier depths' graph: it runs its backward whole.
        self.reuses_block = config.share_layers and any(len(indices) > 1 for indices in (encoder, decoder))

    @property
    def whole_backward(self) -> bool:
        """Whether a split (zero-bubble) backward must run whole in its input half: a stage that embeds tokens
        midway (:class:`~xscale.parallel.pipeline.MicrobatchStage`) or runs a shared block more than once."""
        return self.embeds_midway or self.reuses_block

    @staticmethod
    def _prune(stack: nn.Module, held_layers: list[int], embeds: bool, keep_norm: bool) -> nn.Module:
        # A shared stack builds one block ("0") and runs it n_layers times (Stack.blocks): keep it, run it per depth.
        held = {"0"} if stack.share_layers else {str(index) for index in held_layers}
        stack.first_depth = held_layers[0]
        for name in [name for name in stack.layers if name not in held]:
            del stack.layers[name]
        stack.n_layers = len(held_layers)
        if not embeds and stack.position.adds_to_input:
            # Absolute positions are added once, before the stack's first block; later stages need no table.
            position = stack.position
            stack.position = PositionEncoding(position.d_model, position.n_heads, position.head_dim,
                                              position.max_seq_len, position.causal)
        if not keep_norm:
            stack.final_norm = None
        return stack

    def _embed(self, tokens: torch.Tensor, stack: nn.Module, embedding: nn.Module, norm: nn.Module | None,
               dropout: nn.Module) -> torch.Tensor:
        """:meth:`Transformer._embed_for_stack` with this stage's (copy of the) embedding."""
        x = embedding(tokens)
        if self.seq2seq and self.config.tie_embeddings:
            x = x * self.config.d_model**0.5
        x = stack.position.embed(x)
        if norm is not None:
            x = norm(x)
        return dropout(x)

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """What the previous stage sent (token ids on the first stage); returns what this stage sends. RealFormer
        scores, when they cross a boundary, travel last: (x, scores) or (decoder hidden, memory, scores)."""
        if not self.seq2seq:
            return self._forward_stack(*inputs)
        scores = inputs[-1] if self.receives_scores else None
        inputs = inputs[:-1] if self.receives_scores else inputs
        stack = getattr(self, "stack", None)
        if stack is not None:
            x = inputs[0]
            if self.is_first:
                x = self._embed(x, stack, self.embedding, self.embedding_norm, self.embedding_dropout)
            received = scores
            with _tapped_bias(stack.position, None if self.is_first else x):
                x, scores = run_blocks(stack.blocks(), x, stack.position, scores=scores,
                                       first_depth=stack.shared_first_depth)
            if not self.ends_encoder:
                return self._with_scores((x,), scores, received)  # encoder hidden states
            if stack.final_norm is not None:
                x = stack.final_norm(x)
            if not hasattr(self, "decoder"):
                return x  # the memory
            memory, scores = x, None  # the decoder starts its own scores
        else:
            memory = inputs[-1]
        decoder = self.decoder
        tokens = _DECODER_IDS.current
        if self.starts_decoder:
            if tokens is None:
                raise ValueError("the first decoder stage needs the microbatch's decoder_input_ids")
            if self.is_first:
                y = self._embed(tokens, decoder, self.embedding, self.embedding_norm, self.embedding_dropout)
            else:
                y = self._embed(tokens, decoder, self.decoder_embedding, self.decoder_embedding_norm,
                                self.decoder_embedding_dropout)
        else:
            y = inputs[0]
        # A stage that embeds the decoder's tokens runs its backward whole (MicrobatchStage): no tap needed.
        received = scores
        with routing_token_ids(tokens), _tapped_bias(decoder.position, None if self.starts_decoder else y):
            y, scores = run_blocks(decoder.blocks(), y, decoder.position, memory, scores=scores,
                                   first_depth=decoder.shared_first_depth)
        if self.is_last:
            if decoder.final_norm is not None:
                y = decoder.final_norm(y)
            return self._head(y)
        # A new tensor (not a view: schedules detach their outputs in place), so the memory's gradient goes back.
        return self._with_scores((y, memory.clone()), scores, received)

    def _with_scores(self, outputs: tuple[torch.Tensor, ...], scores: torch.Tensor | None,
                     received: torch.Tensor | None) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """``outputs`` (one tensor alone), with the RealFormer scores last when this stage sends them; scores passed
        through untouched leave as a new tensor, so the schedule's backward reaches them."""
        if self.sends_scores:
            outputs = (*outputs, scores.clone() if scores is received else scores)
        return outputs[0] if len(outputs) == 1 else outputs

    def _forward_stack(self, x: torch.Tensor,
                       scores: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """A decoder-only or encoder-only stage: hidden states (or token ids, first stage), with the previous
        stage's RealFormer scores when it sends them; returns the hidden states, with the scores when this stage
        sends them."""
        stack = self.stack
        if self.is_first:
            x = self._embed(x, stack, self.embedding, self.embedding_norm, self.embedding_dropout)
        received = scores
        with _tapped_bias(stack.position, None if self.is_first else x):
            x, scores = run_blocks(stack.blocks(), x, stack.position, scores=scores,
                                   first_depth=stack.shared_first_depth)
        if self.is_last and stack.final_norm is not None:
            x = stack.final_norm(x)
        return self._with_scores((self._head(x),), scores, received)

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_last and self.head_transform is not None:
            x = self.head_transform(x)
        return x


def _scores_cross(carrying: list[list[int]], boundary: int) -> bool:
    """Whether RealFormer scores cross the boundary after layer ``boundary``: one of its stack's carrying layers
    (``carrying``: per stack, in :func:`pipeline_layers` indices) is at or before it and one after it."""
    return any(any(i <= boundary for i in stack) and any(i > boundary for i in stack) for stack in carrying)


class _GradientTap(torch.autograd.Function):
    """Identity on ``value``, with an (unused) edge to ``anchor``, a stage input: see :func:`_tapped_bias`."""

    @staticmethod
    def forward(ctx, value: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
        return value.view_as(value)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


@contextmanager
def _tapped_bias(position: PositionEncoding, anchor: torch.Tensor | None) -> Iterator[None]:
    """While a stage runs its blocks, each block's logit bias from a learned table (T5) passes through a
    :class:`_GradientTap` with an edge to the stage input ``anchor``.

    Zero-bubble schedules (Qi et al. 2024) split a stage's backward in two: the input half keeps, for each
    parameter, the gradients at the nodes where the parameter's path joins the input's, and the weight half
    later runs backward from those nodes to the parameter. For a table every block reads, the joining nodes
    would be the blocks' scores, and from block k's scores the way back to the table also runs through the
    blocks before it (which read it too): the weight half would redo the stage's backward on a freed graph.
    The tap is a joining node whose only way back is to the table.
    """
    tapping = (anchor is not None and anchor.requires_grad and torch.is_grad_enabled()
               and any(param.requires_grad for param in position.parameters()))
    if not tapping:
        yield
        return
    bias = position.bias  # the class's method (under tp, the one reading local parameters)
    position.bias = lambda *args, **kwargs: _tap(bias(*args, **kwargs), anchor)
    try:
        yield
    finally:
        del position.bias


def _tap(value: torch.Tensor | None, anchor: torch.Tensor) -> torch.Tensor | None:
    return None if value is None else _GradientTap.apply(value, anchor)


def build_stage_module(meta_model: Transformer, layer_indices: list[int], *, is_first: bool, is_last: bool,
                       device: torch.device | str, seed: int,
                       parallelize: Callable[[PipelineStageModule], None] | None = None) -> PipelineStageModule:
    """Cut a stage from a meta-device Transformer, apply ``parallelize`` to it (still on the meta device:
    tensor parallelism, activation checkpointing), allocate it on ``device`` and fill it with the
    single-process initial weights (copies take their source's values)."""
    model = copy.deepcopy(meta_model)
    stage = PipelineStageModule(model, layer_indices, is_first=is_first, is_last=is_last)
    untie = model.config.tie_embeddings and is_last and not is_first
    if untie:
        stage.output.weight = nn.Parameter(torch.empty_like(stage.output.weight))
    if parallelize is not None:
        parallelize(stage)
    stage.to_empty(device=device)
    names = {id(param): source_name(stage, canonical_name(name)) for name, param in stage.named_parameters()}
    init_weights(stage, model.config, seed, names=names)
    return stage
