"""The supported Hugging Face families, looked up by an HF ``model_type`` (import) or by an xscale model (export)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from xscale.config.load import register_completer
from xscale.config.schema import ConfigError, ModelConfig
from xscale.interop.hf.bert import BERT
from xscale.interop.hf.gpt2 import GPT2
from xscale.interop.hf.llama import LLAMA
from xscale.interop.hf.rules import Family, InteropError
from xscale.interop.hf.t5 import T5

FAMILIES: dict[str, Family] = {family.model_type: family for family in (GPT2, LLAMA, BERT, T5)}


def read_hf_config(directory: str | Path) -> dict[str, Any]:
    """``config.json`` of an HF model folder, as a dict."""
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise InteropError(f"{directory} is not a Hugging Face model folder: {path} is missing (save one with "
                           "model.save_pretrained(folder))")
    try:
        hf_config = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise InteropError(f"{path} is not valid JSON ({error})") from error
    if not isinstance(hf_config, dict):
        raise InteropError(f"{path} must hold a JSON object")
    return hf_config


def family_of(hf_config: dict[str, Any]) -> Family:
    """The family of an HF config (its ``model_type``)."""
    model_type = hf_config.get("model_type")
    if model_type not in FAMILIES:
        raise InteropError(f"config.json model_type={model_type!r} is not supported; xscale reads "
                           f"{', '.join(FAMILIES)}")
    return FAMILIES[model_type]


def model_fields(hf_config: dict[str, Any]) -> dict[str, Any]:
    """The ``model`` section (ModelConfig fields) an HF config describes."""
    return family_of(hf_config).config_from_hf(hf_config)


def exportable_family(model: ModelConfig) -> Family:
    """The family that expresses ``model`` exactly; otherwise an InteropError naming the first setting that has no
    HF equivalent in the closest family."""
    closest = min(FAMILIES.values(), key=lambda family: len(family.mismatches(model)))
    found = closest.mismatches(model)
    if found:
        raise InteropError(f"{found[0]} has no Hugging Face equivalent; export supports the families "
                           f"{', '.join(FAMILIES)} (the closest, {closest.model_type}, differs in {len(found)} "
                           "setting(s))")
    return closest


def laid_over(base: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``given`` laid over it, nested mappings merged key by key."""
    merged = dict(base)
    for key, value in given.items():
        nested = isinstance(value, dict) and isinstance(merged.get(key), dict)
        merged[key] = laid_over(merged[key], value) if nested else value
    return merged


def with_init_model(tree: dict[str, Any]) -> dict[str, Any]:
    """A config tree whose model section defaults to what ``checkpoint.init_from=hf:DIR`` describes; the ``model.*``
    keys the config or the overrides give still apply on top."""
    checkpoint = tree.get("checkpoint")
    source = checkpoint.get("init_from") if isinstance(checkpoint, dict) else None
    if not (isinstance(source, str) and source.startswith("hf:") and source[3:].strip()):
        return tree
    try:
        fields = model_fields(read_hf_config(source[3:]))
    except InteropError as error:
        raise ConfigError(f"checkpoint.init_from={source}: {error}") from error
    given = tree.get("model")
    return {**tree, "model": laid_over(fields, given if isinstance(given, dict) else {})}


register_completer(with_init_model)
