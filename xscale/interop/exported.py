"""Load ``xscale export``'s default output (xscale names, one safetensors file) back into an xscale model.

The file stores tied weights once (under ``embedding.weight``) and its ``model`` config as JSON in the safetensors
metadata (``xscale_model``); loading restores the tie, so ``load_state_dict(strict=True)`` accepts it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from xscale.config.load import from_dict
from xscale.config.schema import ConfigError, ModelConfig
from xscale.models import Transformer, build_model

MODEL_METADATA = "xscale_model"


def exported_model_config(path: str | Path) -> ModelConfig:
    """The model config an export recorded in its metadata."""
    with safe_open(str(path), framework="pt") as handle:
        metadata = handle.metadata() or {}
    if MODEL_METADATA not in metadata:
        raise ConfigError(f"{path} records no xscale model config (written by an older xscale export?); pass "
                          "config= (the model section of the run's config) to load it")
    return from_dict(ModelConfig, json.loads(metadata[MODEL_METADATA]), "model")


def exported_state_dict(path: str | Path, config: ModelConfig) -> dict[str, torch.Tensor]:
    """The export's tensors with the tied output projection restored."""
    state = load_file(str(path))
    if config.tie_embeddings and "output.weight" not in state:
        state["output.weight"] = state["embedding.weight"]
    return state


def load_exported(path: str | Path, config: ModelConfig | None = None, device: str = "cpu") -> Transformer:
    """An xscale model holding an export's weights (``config``: its model section; None: the recorded one)."""
    config = exported_model_config(path) if config is None else config
    model = build_model(config, device, materialize=True)
    model.load_state_dict(exported_state_dict(path, config), strict=True)
    return model
