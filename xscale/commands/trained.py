"""A trained model read back from its checkpoint on one process (no process group), with the tokenizer its run used.

The checkpoint is a step directory, a checkpoint root whose ``latest`` names one, or a run's output directory; DCP assembles full tensors
from every shard, as ``xscale export`` does. The tokenizer is, in order: ``--tokenizer`` (given by the caller),
the checkpoint's own record (``meta.json`` key ``tokenizer``, when a run wrote one), the run's ``data.tokenizer``,
a synthetic task's fixed vocabulary, or the SentencePiece model the trainer trained and cached under
``<output_dir>/tokenizer/<dataset>-<vocab>.model`` (looked up beside the checkpoint root first, so a moved run
directory still finds it).
"""

from __future__ import annotations

import copy
import typing
from dataclasses import dataclass
from pathlib import Path

import torch

from xscale.checkpoint.checkpointer import (
    Checkpointer,
    CheckpointError,
    check_fingerprint,
    load_state,
    shape_fingerprint,
)
from xscale.checkpoint.init_sources import WEIGHTS_ONLY
from xscale.commands.export import resolve_checkpoint
from xscale.config.load import config_from_dict, parse_override, set_path
from xscale.config.schema import Config, ConfigError
from xscale.data import TASKS, trained_tokenizer_name
from xscale.data.fixed_vocab import FixedVocab
from xscale.data.load_tokenizer import load_tokenizer as load_tokenizer_file
from xscale.data.tokenizer import Tokenizer
from xscale.models import Transformer, build_model


@dataclass
class TrainedModel:
    model: Transformer
    config: Config  # the run's config, with the caller's overrides
    step_dir: Path
    meta: dict[str, typing.Any]

    @property
    def step(self) -> int:
        return int(self.meta["step"])

    @property
    def run_dirs(self) -> list[Path]:
        """Where the run wrote (its tokenizer cache): beside the default checkpoint root, then train.output_dir."""
        dirs = [self.step_dir.parent.parent] if self.step_dir.parent.name == "checkpoints" else []
        return dirs + [Path(self.config.train.output_dir)]


def checkpoint_config(meta: dict[str, typing.Any], overrides: typing.Sequence[str] = ()) -> Config:
    """The config a checkpoint saved, with dotted overrides (``data.path=...``) applied and validated."""
    tree = copy.deepcopy(meta["config"])
    for text in overrides:
        keys, value = parse_override(text)
        set_path(tree, keys, value)
    return config_from_dict(tree)


def load_trained_model(checkpoint: str | Path, overrides: typing.Sequence[str] = (),
                       device: str | torch.device = "cpu") -> TrainedModel:
    """The model of ``checkpoint`` in evaluation mode on ``device``; CheckpointError / ConfigError say what is wrong."""
    path = Path(checkpoint)
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist; give a step directory "
                              "(<output_dir>/checkpoints/step_N) or a checkpoint root holding a 'latest' file")
    step_dir = resolve_checkpoint(path)
    meta = Checkpointer.read_meta(step_dir, verify="full")
    config = checkpoint_config(meta, overrides)
    model = build_model(config.model, device, seed=config.train.seed).use_kernels(
        config.train.kernels, config.train.sparse_attention)
    state = model.state_dict()
    check_fingerprint(meta.get("fingerprint", {}), shape_fingerprint(state), step_dir)
    load_state({"model": state}, step_dir)
    model.load_state_dict(state)
    return TrainedModel(model.eval(), config, step_dir, meta)


def tokenizer_path(trained: TrainedModel) -> Path | None:
    """The tokenizer file the run used (its checkpoint copy first), when it had one (None: a synthetic task's vocabulary)."""
    data = trained.config.data
    if data.dataset.kind in TASKS:
        return None
    recorded = trained.meta.get("tokenizer")
    if recorded:
        return trained.step_dir / recorded if not Path(recorded).is_absolute() else Path(recorded)
    if trained.meta.get(WEIGHTS_ONLY):  # converted (xscale convert): no run, so no trained tokenizer to look for
        raise ConfigError(f"no tokenizer found for {trained.step_dir}: it was converted from "
                          f"{trained.meta.get('parent')}, which held no tokenizer.json or tokenizer.model; pass "
                          "--tokenizer PATH (a SentencePiece .model, a tokenizer.json or its folder, a .tiktoken file)")
    if data.tokenizer:
        return Path(data.tokenizer)
    candidates = [run_dir / "tokenizer" / trained_tokenizer_name(trained.config) for run_dir in trained.run_dirs]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise ConfigError(f"no tokenizer found for {trained.step_dir}: its run sets no data.tokenizer and the tokenizer "
                      f"it trained is not at {' or '.join(str(c) for c in dict.fromkeys(candidates))}; pass "
                      "--tokenizer PATH.model (or data.tokenizer=PATH.model)")


def load_tokenizer(trained: TrainedModel, given: str | None = None) -> Tokenizer | FixedVocab:
    """``given`` (a SentencePiece .model, a Hugging Face tokenizer.json or folder, a .tiktoken file), else the tokenizer the run used (:func:`tokenizer_path`)."""
    path = Path(given) if given else tokenizer_path(trained)
    if path is None:
        data = trained.config.data
        return TASKS[data.dataset.kind](trained.config.train.seq_len, **data.dataset.options).vocab
    try:
        return load_tokenizer_file(path)
    except (OSError, ValueError) as error:
        raise ConfigError(f"tokenizer: {error}") from error
