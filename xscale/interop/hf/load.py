"""Read a Hugging Face model folder (``config.json`` + safetensors, sharded or not) into xscale tensors.

Tensors are read one rule at a time (``safe_open`` maps the files), so a model is converted without a second copy
of it in memory: :func:`fill_from_hf` writes each tensor straight into a (possibly sharded) state dict.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch.distributed.tensor import DTensor, distribute_tensor

from xscale.checkpoint.init_sources import register_init_source
from xscale.checkpoint.integrity import CheckpointError
from xscale.config.load import from_dict
from xscale.config.schema import ConfigError, ModelConfig
from xscale.interop.hf.families import family_of, laid_over, model_fields, read_hf_config
from xscale.interop.hf.rules import Family, InteropError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def model_config_from_hf(hf_config: dict[str, Any], overrides: Mapping[str, Any] | None = None) -> ModelConfig:
    """The xscale ModelConfig an HF config dict describes, with ``overrides`` (model fields) applied."""
    fields = laid_over(model_fields(hf_config), dict(overrides or {}))
    try:
        return from_dict(ModelConfig, fields, "model")
    except ConfigError as error:
        raise InteropError(str(error)) from error


def hf_model_config(directory: str | Path, overrides: Mapping[str, Any] | None = None) -> ModelConfig:
    """The xscale ModelConfig of an HF folder's ``config.json``, with ``overrides`` (model fields) applied."""
    return model_config_from_hf(read_hf_config(directory), overrides)


class HFWeights:
    """The tensors of an HF folder by name, across its safetensors shards (read lazily)."""

    def __init__(self, directory: str | Path, family: Family) -> None:
        directory = Path(directory)
        self.base_prefix = family.base_prefix
        if (directory / INDEX).is_file():
            weight_map = json.loads((directory / INDEX).read_text()).get("weight_map", {})
            files = sorted(set(weight_map.values()))
        elif (directory / SINGLE).is_file():
            files = [SINGLE]
        else:
            found = ", ".join(sorted(p.name for p in directory.iterdir())) if directory.is_dir() else "nothing"
            raise InteropError(f"{directory} holds no {SINGLE} or {INDEX} (found: {found}); xscale reads safetensors "
                               "only: re-save the model with model.save_pretrained(folder)")
        self.where: dict[str, Any] = {}
        for file in files:
            handle = safe_open(str(directory / file), framework="pt")
            self.where.update(dict.fromkeys(handle.keys(), handle))

    def get(self, name: str) -> torch.Tensor:
        """Tensor ``name``; a bare base-model checkpoint (no ``transformer.``/``model.``/``bert.`` prefix) works too."""
        for candidate in (name, name.removeprefix(self.base_prefix)):
            if candidate in self.where:
                return self.where[candidate].get_tensor(candidate)
        raise InteropError(f"the Hugging Face checkpoint has no tensor '{name}' (does config.json match the weights?)")


def converted_tensors(get: Any, model: ModelConfig, family: Family) -> Iterator[tuple[str, torch.Tensor]]:
    """(xscale name, tensor) for every parameter of ``model``, rule by rule; ``get(hf_name)`` reads one HF tensor. A
    tied head comes last, as the embedding's values under ``output.weight``."""
    embedding = None
    for rule in family.rules(model):
        ours = rule.to_ours(*(get(name) for name in rule.hf))
        for name, tensor in zip(rule.ours, ours):
            if name == "embedding.weight":
                embedding = tensor
            yield name, tensor
    if model.tie_embeddings:
        yield "output.weight", embedding


def state_dict_from_hf(hf_state: Mapping[str, torch.Tensor], model: ModelConfig,
                       model_type: str) -> dict[str, torch.Tensor]:
    """An xscale state dict from an in-memory HF state dict (``hf_model.state_dict()``)."""
    family = family_of({"model_type": model_type})
    return {name: tensor.detach().clone() for name, tensor in converted_tensors(hf_state.__getitem__, model, family)}


def load_hf(directory: str | Path,
            overrides: Mapping[str, Any] | None = None) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(ModelConfig, full xscale state dict) of an HF folder."""
    model = hf_model_config(directory, overrides)
    family = family_of(read_hf_config(directory))
    weights = HFWeights(directory, family)
    return model, {name: tensor.clone() for name, tensor in converted_tensors(weights.get, model, family)}


@torch.no_grad()
def fill_from_hf(state: dict[str, torch.Tensor], directory: str | Path, model: ModelConfig) -> None:
    """Copy an HF folder's weights into ``state`` in place: single-process names, plain tensors or DTensors (each
    rank keeps its shard), a pipeline stage's subset of names. Every entry of ``state`` must be filled."""
    family = family_of(read_hf_config(directory))
    weights = HFWeights(directory, family)
    missing = set(state)
    for name, full in converted_tensors(weights.get, model, family):
        if name not in state:
            continue
        target = state[name]
        if tuple(full.shape) != tuple(target.shape):
            raise InteropError(f"{name}: the Hugging Face weights give shape {list(full.shape)}, the model "
                               f"{list(target.shape)}; leave the model.* settings of config.json as they are")
        if isinstance(target, DTensor):
            shard = distribute_tensor(full.to(target.device), target.device_mesh, target.placements, src_data_rank=None)
            target.to_local().copy_(shard.to_local())
        else:
            target.copy_(full)
        missing.discard(name)
    if missing:
        raise InteropError(f"the Hugging Face weights give no value for {', '.join(sorted(missing)[:5])}; the "
                           f"{family.model_type} map covers only the model config.json describes")


def fill_init_source(state: dict[str, torch.Tensor], directory: str, model: ModelConfig) -> None:
    """``checkpoint.init_from=hf:DIR`` (:mod:`xscale.checkpoint.init_sources`): :func:`fill_from_hf`, its errors
    as a checkpoint error that names the setting."""
    try:
        fill_from_hf(state, directory, model)
    except InteropError as error:
        raise CheckpointError(f"checkpoint.init_from=hf:{directory}: {error}") from error


register_init_source("hf", fill_init_source)
