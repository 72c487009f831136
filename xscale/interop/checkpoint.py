"""Weights from outside (a Hugging Face folder, an ``xscale export`` file) written as an xscale checkpoint at step 0.

The checkpoint holds the model only (``weights_only`` in its meta.json) and the source folder's tokenizer: ``checkpoint.resume=`` starts training from
it with a fresh optimizer, schedule and data order, and ``xscale export`` reads it like any other.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from xscale.checkpoint.checkpointer import Checkpointer
from xscale.checkpoint.init_sources import WEIGHTS_ONLY
from xscale.config.check import validate
from xscale.config.schema import Config, ModelConfig
from xscale.data.load_tokenizer import META_KEY as TOKENIZER_META_KEY
from xscale.interop.hf.save import TOKENIZER_FILES, TOKENIZER_FOLDER
from xscale.models import build_model
from xscale.models.parameters import count_parameters


def run_config(model: ModelConfig) -> Config:
    """A valid run config around ``model`` (sequences no longer than its positions allow)."""
    config = Config(model=model)
    config.train = dataclasses.replace(config.train, seq_len=min(config.train.seq_len, model.max_seq_len))
    return config


@torch.no_grad()
def write_weights_checkpoint(model: ModelConfig, fill: Callable[[dict[str, torch.Tensor]], None],
                             directory: str | Path, source: str, tokenizer_from: str | Path | None = None) -> Path:
    """Build ``model``, let ``fill`` copy weights into its state dict, save it as step 0 under ``directory``.
    ``tokenizer_from``: an HF folder whose tokenizer files the checkpoint carries (:func:`hf_tokenizer_files`)."""
    config = run_config(model)
    validate(config)
    built = build_model(model, "cpu", seed=config.train.seed)
    state = get_model_state_dict(built)
    fill(state)
    carry = hf_tokenizer_files(tokenizer_from) if tokenizer_from is not None else {}
    checkpointer = Checkpointer(directory, carry=carry)
    meta = {"config": config.to_dict(), "sampler": None, "world_size": 1, "layout": "single process",
            "num_params": count_parameters(config).total, "parent": source, WEIGHTS_ONLY: True}
    recorded = [name for name in (f"{TOKENIZER_FOLDER}/tokenizer.json", f"{TOKENIZER_FOLDER}/tokenizer.model")
                if name in carry]
    if recorded:  # the tokenizer generate and eval read (data/load_tokenizer.py: META_KEY)
        meta[TOKENIZER_META_KEY] = recorded[0]
    checkpointer.save(0, {"model": state}, meta)
    return checkpointer.latest()


def hf_tokenizer_files(hf_directory: str | Path) -> dict[str, Path]:
    """The HF folder's tokenizer files, by their name inside a checkpoint (``tokenizer/NAME``): carried and
    checksummed with the weights, and copied out again by ``xscale export --format hf``."""
    return {f"{TOKENIZER_FOLDER}/{name}": Path(hf_directory) / name for name in TOKENIZER_FILES
            if (Path(hf_directory) / name).is_file()}
