"""The model zoo: plain single-device PyTorch, built from a ModelConfig."""

from __future__ import annotations

import torch

import xscale.models.checks  # noqa: F401  (the zoo's config checks register themselves)
import xscale.models.zoo  # noqa: F401  (every component registers itself)
from xscale.config.schema import ConfigError, ModelConfig
from xscale.models.init import init_weights
from xscale.models.transformer import Transformer
from xscale.runtime.meta_init import skip_meta_init


def build_model(config: ModelConfig, device: torch.device | str = "cpu", seed: int = 0,
                materialize: bool = True) -> Transformer:
    """Build on the meta device, then (unless ``materialize=False``) allocate on ``device`` and init."""
    if config.vocab_size == 0 and config.input == "tokens":
        raise ConfigError("model.vocab_size=0 (automatic) takes the tokenizer's vocabulary when xscale builds the "
                          "run's data; with a Dataset of your own (or a model built directly) set model.vocab_size")
    with torch.device("meta"), skip_meta_init():  # initialised below, once materialised
        model = Transformer(config)
    if materialize:
        model.to_empty(device=device)
        model.tie_weights()
        init_weights(model, config, seed)
    return model


__all__ = ["Transformer", "build_model"]
