"""Weights from outside (a Hugging Face folder, an ``xscale export`` file) written as an xscale checkpoint at step 0.

The checkpoint holds the model only (``weights_only`` in its meta.json): ``checkpoint.resume=`` starts training from
it with a fresh optimizer, schedule and data order, and ``xscale export`` reads it like any other.
"""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from xscale.checkpoint.checkpointer import Checkpointer
from xscale.checkpoint.init_sources import WEIGHTS_ONLY
from xscale.config.check import validate
from xscale.config.schema import Config, ModelConfig
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
                             directory: str | Path, source: str) -> Path:
    """Build ``model``, let ``fill`` copy weights into its state dict, save it as step 0 under ``directory``."""
    config = run_config(model)
    validate(config)
    built = build_model(model, "cpu", seed=config.train.seed)
    state = get_model_state_dict(built)
    fill(state)
    checkpointer = Checkpointer(directory)
    meta = {"config": config.to_dict(), "sampler": None, "world_size": 1, "layout": "single process",
            "num_params": count_parameters(config).total, "parent": source, WEIGHTS_ONLY: True}
    checkpointer.save(0, {"model": state}, meta)
    return checkpointer.latest()


def copy_hf_tokenizer(hf_directory: str | Path, step_dir: Path) -> list[str]:
    """The HF folder's tokenizer files into ``step_dir/tokenizer`` (``xscale export --format hf`` copies them out)."""
    names = [name for name in TOKENIZER_FILES if (Path(hf_directory) / name).is_file()]
    if names:
        (step_dir / TOKENIZER_FOLDER).mkdir(exist_ok=True)
        for name in names:
            shutil.copyfile(Path(hf_directory) / name, step_dir / TOKENIZER_FOLDER / name)
    return names
