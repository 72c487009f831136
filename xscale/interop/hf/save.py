"""Write an xscale checkpoint as a Hugging Face model folder: ``config.json``, safetensors shards (with
``model.safetensors.index.json`` when there is more than one), ``generation_config.json`` and the tokenizer when the
run had one, with the files HF tools read it by (:mod:`xscale.interop.hf.tokenizer_export`).

The shards are written one at a time, each assembled from the DCP checkpoint by loading only the tensors it needs
(DCP reads any layout's shards into full tensors), so the export never holds the whole model in memory. torch's
``HuggingFaceStorageWriter`` writes one ``dcp.save`` of a whole state dict, which would be that second copy; the
shards here are plain ``safetensors.torch.save_file`` files with HF's names and index format.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from xscale.checkpoint.checkpointer import Checkpointer, check_fingerprint, load_state, shape_fingerprint
from xscale.checkpoint.integrity import read_metadata_safely
from xscale.config.load import config_from_dict
from xscale.config.schema import Config
from xscale.data.load_tokenizer import META_KEY as TOKENIZER_META_KEY
from xscale.interop.hf.families import exportable_family
from xscale.interop.hf.load import INDEX, SINGLE
from xscale.interop.hf.rules import Family, Rule
from xscale.interop.hf.tokenizer_export import write_generation_config, write_tokenizer_files
from xscale.models import build_model

DEFAULT_SHARD_BYTES = 5 * 2**30  # transformers' save_pretrained default (5 GB)
# Files a Hugging Face tokenizer is saved as (AutoTokenizer.save_pretrained), copied as they are.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "tokenizer.model", "vocab.txt", "vocab.json", "merges.txt")
HF_TOKENIZER_NAMES = {".model": "tokenizer.model", ".json": "tokenizer.json"}  # a carried file's name in HF
TOKENIZER_FOLDER = "tokenizer"  # inside a step directory: the files of the model it came from (xscale convert)


def plan_shards(rules: list[Rule], sizes: dict[str, int], max_bytes: int) -> list[list[Rule]]:
    """Consecutive rules grouped into shards of at most ``max_bytes`` (a larger single tensor gets its own)."""
    shards: list[list[Rule]] = [[]]
    used = 0
    for rule in rules:
        nbytes = sum(sizes[name] for name in rule.ours)
        if shards[-1] and used + nbytes > max_bytes:
            shards.append([])
            used = 0
        shards[-1].append(rule)
        used += nbytes
    return shards


def _write_shard(step_dir: Path, rules: list[Rule], shapes: dict[str, Any], path: Path) -> list[str]:
    """Load the xscale tensors ``rules`` read, convert them and write one safetensors file; returns its HF names."""
    names = [name for rule in rules for name in rule.ours]
    model_state = {name: torch.empty(shapes[name][0], dtype=shapes[name][1]) for name in names}
    load_state({"model": model_state}, step_dir)
    tensors = {}
    for rule in rules:
        for hf_name, tensor in zip(rule.hf, rule.to_hf(*(model_state[name] for name in rule.ours))):
            tensors[hf_name] = tensor.contiguous()
    save_file(tensors, str(path), metadata={"format": "pt"})
    return list(tensors)


def _checked_config(step_dir: Path) -> tuple[Config, Family, dict[str, Any]]:
    meta = Checkpointer.read_meta(step_dir, verify="full")
    config = config_from_dict(meta["config"])
    family = exportable_family(config.model)  # refuses a variant HF cannot express, before anything is written
    meta_model = build_model(config.model, materialize=False)  # shapes only: no memory
    check_fingerprint(meta.get("fingerprint", {}), shape_fingerprint(meta_model.state_dict()), step_dir)
    return config, family, meta


def export_hf(step_dir: str | Path, output: str | Path, max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> Path:
    """Write checkpoint ``step_dir`` as an HF model folder ``output`` (``from_pretrained`` loads it)."""
    step_dir, output = Path(step_dir), Path(output)
    config, family, meta = _checked_config(step_dir)
    stored = read_metadata_safely(step_dir / ".metadata").state_dict_metadata
    shapes = {key.removeprefix("model."): (tuple(value.size), value.properties.dtype)
              for key, value in stored.items() if key.startswith("model.") and hasattr(value, "size")}
    sizes = {name: torch.Size(shape).numel() * dtype.itemsize for name, (shape, dtype) in shapes.items()}
    shards = plan_shards(family.rules(config.model), sizes, max_shard_bytes)
    output.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    for index, rules in enumerate(shards, start=1):
        name = SINGLE if len(shards) == 1 else f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        weight_map.update(dict.fromkeys(_write_shard(step_dir, rules, shapes, output / name), name))
    if len(shards) > 1:
        total = sum(sizes[name] for rules in shards for rule in rules for name in rule.ours)
        index_json = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (output / INDEX).write_text(json.dumps(index_json, indent=2) + "\n")
    dtype = shapes["embedding.weight"][1]
    copied = copy_tokenizer(config, meta, step_dir, output)
    ids = write_tokenizer_files(output, copied, config.model.max_seq_len)  # {} when the run had no tokenizer file
    hf_config = {**family.config_to_hf(config.model), "dtype": str(dtype).removeprefix("torch."), **ids}
    (output / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
    if family.auto_class == "AutoModelForCausalLM" or ids:
        write_generation_config(output, ids)
    return output


def copy_tokenizer(config: Config, meta: dict[str, Any], step_dir: Path, output: Path) -> list[str]:
    """The run's tokenizer beside the weights: the tokenizer file the checkpoint carries (a SentencePiece ``.model``
    as ``tokenizer.model``, a ``tokenizer.json`` as it is), the other HF tokenizer files a converted checkpoint
    carries, or else the ``.model`` of ``data.tokenizer``. Returns the names copied."""
    copied = []
    recorded = step_dir / str(meta.get(TOKENIZER_META_KEY) or "-")
    if recorded.is_file() and recorded.suffix in HF_TOKENIZER_NAMES:
        shutil.copyfile(recorded, output / HF_TOKENIZER_NAMES[recorded.suffix])
        copied.append(HF_TOKENIZER_NAMES[recorded.suffix])
    carried = step_dir / TOKENIZER_FOLDER
    for name in TOKENIZER_FILES:
        if (carried / name).is_file() and name not in copied:
            shutil.copyfile(carried / name, output / name)
            copied.append(name)
    if not copied and config.data.tokenizer and Path(config.data.tokenizer).suffix == ".model" \
            and Path(config.data.tokenizer).is_file():
        shutil.copyfile(config.data.tokenizer, output / "tokenizer.model")
        copied.append("tokenizer.model")
    return copied
