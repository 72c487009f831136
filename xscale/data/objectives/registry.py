"""The ``train.objective`` registry: each kind names a class that turns a raw token window into a model batch, with
its settings in an ``Options`` dataclass beside it (``train.objective: {kind: mlm, options: {mask_probability:
0.2}}``; a bare ``mlm`` takes the defaults).

``auto`` is the family's objective (clm for a decoder, mlm for an encoder, span for an encoder-decoder) and takes
that kind's options. Labels use -100 for positions that carry no loss; every random choice comes from the
``generator`` a dataset passes, seeded by (seed, global sample index), so a sample is the same on any rank.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np
import torch

from xscale.config.schema import Component, Config, resolve_objective
from xscale.models.registry import NoOptions, Registry

IGNORE_INDEX = -100
OBJECTIVES = Registry("objective")
Sample = dict[str, torch.Tensor]


class TokenStream(Protocol):
    """Documents concatenated (each ending in eos) as one token sequence."""

    def __len__(self) -> int: ...

    def read(self, start: int, stop: int) -> np.ndarray: ...


class TextObjective:
    """An objective over windows of a text corpus: built with the run's tokenizer (None for clm over a token file
    without one), ``train.seq_len``, the corpus (None for a blend) and its options; reads ``window_length`` tokens
    per sample and maps them to a sample (:meth:`__call__`).

    ``family``: the model family it trains; ``head``: the ``model.objective_head`` it trains beside the token loss;
    ``text_only``: False for the three that also lay out the synthetic tasks' examples
    (:func:`xscale.data.datasets.layout_example`, without options); ``options_elsewhere``: option names a user may
    look for here -> the config key that holds them (refused with that key, :func:`xscale.data.checks.check_objective`).
    """

    Options: type = NoOptions
    family = "encoder"
    head = "none"
    text_only = True
    options_elsewhere: dict[str, str] = {}

    def __init__(self, tokenizer: Any, seq_len: int, stream: TokenStream | None, options: Any) -> None:
        self.tokenizer, self.options, self.window_length = tokenizer, options, seq_len

    def __call__(self, window: torch.Tensor, generator: torch.Generator) -> Sample:
        raise NotImplementedError


@OBJECTIVES.register("auto")
class Auto(TextObjective):
    """The family's objective: clm (decoder), mlm (encoder), span (encoder-decoder), with that kind's options.
    Resolved before anything is built (:func:`objective_component`)."""


def objective_component(config: Config) -> Component:
    """``train.objective`` with ``auto`` resolved to the family's kind (its options go with it)."""
    return Component(resolve_objective(config), dict(config.train.objective.options))


def objective_options(config: Config) -> Any:
    """The run's objective options as its ``Options`` dataclass; an unknown option or a value out of range is refused
    by name."""
    return OBJECTIVES.options(objective_component(config), "train.objective")


def build_objective(config: Config, tokenizer: Any, stream: TokenStream | None = None) -> TextObjective:
    """The run's objective over windows of text (``stream``: the corpus next-sentence prediction draws from)."""
    return OBJECTIVES.build(objective_component(config), "train.objective", tokenizer, config.train.seq_len, stream)
