"""Pipeline stages: the single-process Transformer with the modules a stage does not run deleted.

A stage is :meth:`Transformer.keep_layers` applied to a copy of the meta model: it keeps, under the single-process
names, the embedding when it starts a stack, its run of blocks (``stack.layers.<k>``, ``decoder.layers.<k>``),
and the final norm, head transform and output projection when it ends the last stack; it runs the model's own
forward. Under ``parallel.pp_vocab_parallel`` the last pp stages hold the output projection instead, each its
rank's rows (:mod:`~xscale.parallel.pipeline.vocabulary`). The union of the stages' state dicts is the single-process state dict, so checkpoints move between
layouts. Parameters that several stages hold (tied embeddings, an encoder-decoder's embedding, T5's position
table, a shared block) are kept equal by :mod:`~xscale.parallel.pipeline.shared`; the only one held under another
name is a tied output projection on a stage without the embedding (``output.weight``, a copy of
``embedding.weight``).

An encoder-decoder model (Raffel et al. 2020) is cut along the concatenation of its stacks: layer indices
0..n_layers-1 are the encoder's blocks, n_layers.. the decoder's. With ``share_layers`` (ALBERT, Lan et al. 2020;
Universal Transformer, Dehghani et al. 2019) each stage running some of a stack's depths holds its one block and
runs it once per depth it owns.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch

from xscale.config.schema import ConfigError, ModelConfig
from xscale.models.init import canonical_name, init_weights
from xscale.models.transformer import Transformer
from xscale.parallel.pipeline.vocabulary import VocabularyPlace, VocabularyShard

TIED_COPY = "output.weight"
TIED_SOURCE = "embedding.weight"


def pipeline_layers(config: ModelConfig) -> int:
    """The blocks a pipeline cuts: the encoder's then the decoder's for an encoder-decoder model."""
    return config.total_layers


def is_first(stage: Transformer) -> bool:
    """Whether ``stage`` holds the first block of the model (it reads the token ids)."""
    return stage.stack is not None and stage.stack.starts


def holds_tied_copy(stage: Transformer) -> bool:
    """Whether ``stage``'s output projection is its own copy of the tied embedding."""
    return stage.config.tie_embeddings and stage.output is not None and stage.embedding is None


def embeds_midway(stage: Transformer) -> bool:
    """Whether ``stage`` embeds tokens but is not the first stage (an encoder-decoder's first decoder stage)."""
    return stage.embedding is not None and not is_first(stage)


def whole_backward(stage: Transformer) -> bool:
    """Whether a split (zero-bubble) backward must run whole in its input half: a stage that embeds tokens midway
    or runs a shared block at several depths (:class:`~xscale.parallel.pipeline.MicrobatchStage`)."""
    reuses_block = stage.config.share_layers and any(
        stack is not None and len(stack.depths) > 1 for stack in (stage.stack, stage.decoder))
    return embeds_midway(stage) or reuses_block


def source_name(stage: Transformer, name: str) -> str:
    """The single-process name of ``stage``'s parameter ``name`` (canonical): a tied copy's source, else ``name``."""
    return TIED_SOURCE if name == TIED_COPY and holds_tied_copy(stage) else name


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


def cut_stage(meta_model: Transformer, layer_indices: list[int], vocabulary: VocabularyPlace | None = None,
              vocabulary_parallel: bool = False) -> Transformer | VocabularyShard:
    """A copy of ``meta_model`` cut to the stage holding ``layer_indices``; ``vocabulary``: a vocabulary stage
    there instead (:mod:`~xscale.parallel.pipeline.vocabulary`). With ``vocabulary_parallel`` the last
    block stage leaves the output projection to the vocabulary stages."""
    stage = copy.deepcopy(meta_model)
    if vocabulary is not None:
        return VocabularyShard(stage, vocabulary)
    stage.keep_layers(layer_indices)
    if vocabulary_parallel:
        stage.output = None
    return stage


def build_stage_module(meta_model: Transformer, layer_indices: list[int], *, device: torch.device | str, seed: int,
                       parallelize: Callable[[Transformer], None] | None = None,
                       vocabulary: VocabularyPlace | None = None,
                       vocabulary_parallel: bool = False) -> Transformer | VocabularyShard:
    """Cut a stage from a meta-device Transformer (:func:`cut_stage`), apply ``parallelize`` to it (still on the
    meta device: tensor parallelism, activation checkpointing), allocate it on ``device`` and fill it with the
    single-process initial weights (copies take their source's values; a vocabulary stage its rows)."""
    stage = cut_stage(meta_model, layer_indices, vocabulary, vocabulary_parallel)
    if parallelize is not None:
        parallelize(stage)
    if vocabulary is not None:
        stage.to_empty(device=device)
        stage.reset_parameters(seed)
        return stage
    stage.to_empty(device=device)
    stage.tie_weights()
    names = {id(param): source_name(stage, canonical_name(name)) for name, param in stage.named_parameters()}
    init_weights(stage, stage.config, seed, names=names)
    return stage
