"""The corpora of ``data.sources`` (and ``data.dataset=text``'s ``data.path``): each becomes a memory-mapped
``.bin/.idx`` token file and a name, so training never holds a tokenized corpus in memory.

An ``indexed`` source is read where it lies. A ``text``/``jsonl`` source is tokenized once into
``<output_dir>/data_cache/<name>-<key>.bin/.idx``, the key a digest of what the tokens depend on (the input
files' paths, sizes and modification times, the kind, ``data.text_field`` and the tokenizer file's bytes), so a
changed corpus or tokenizer builds a new cache and an unchanged one is reused. Under a process group rank 0
builds and the others wait, then open it (a rank that cannot see rank 0's file builds its own).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from xscale.config.schema import ConfigError, DataSource
from xscale.data.corpus import text_documents
from xscale.data.indexed import IndexedDataError, IndexedTokens
from xscale.data.preprocess import tokenize_to_indexed

CACHE_FOLDER = "data_cache"


@dataclass(frozen=True)
class ResolvedSource:
    """A source ready to read: its metrics name, token file prefix and weight."""

    name: str
    prefix: str
    weight: float
    where: str  # data.sources[i], for error messages


def source_kind(source: DataSource, where: str) -> str:
    """``source.kind``, or for ``auto`` the kind its path shows; a missing path is an error naming ``where``."""
    path = Path(source.path)
    if source.kind == "indexed" or (source.kind == "auto" and Path(source.path + ".idx").is_file()):
        return "indexed"
    if not path.exists():
        raise ConfigError(f"{where}.path={source.path} does not exist; give a .txt/.jsonl file or folder, or the "
                          ".bin/.idx prefix (without the suffix) of an indexed corpus")
    if source.kind != "auto":
        return source.kind
    return "jsonl" if path.suffix == ".jsonl" else "text"


def source_names(sources: list[DataSource]) -> list[str]:
    """Each source's ``name``, or its file name without suffixes; repeated names get ``_2``, ``_3``, ..."""
    names: list[str] = []
    for source in sources:
        base = source.name or Path(source.path.rstrip("/")).name.split(".")[0] or "source"
        name, copy = base, 1
        while name in names:
            copy += 1
            name = f"{base}_{copy}"
        names.append(name)
    return names


def resolve_sources(sources: list[DataSource], key: str, tokenizer_path: str | None, text_field: str,
                    cache_dir: Path) -> list[ResolvedSource]:
    """Token files for ``data.<key>``: indexed sources checked, text/jsonl sources tokenized (cached)."""
    resolved = []
    for index, (source, name) in enumerate(zip(sources, source_names(sources))):
        where = f"data.{key}[{index}]"
        kind = source_kind(source, where)
        if kind == "indexed":
            prefix = source.path
        else:
            if tokenizer_path is None:
                raise ConfigError(f"{where} is {kind}: tokenizing it needs data.tokenizer (a .model, tokenizer.json "
                                  "or .tiktoken file)")
            prefix = cached_tokens(source.path, kind, name, tokenizer_path, text_field, cache_dir, where,
                                   path_key=f"{where}.path")
        try:
            IndexedTokens(prefix)
        except (OSError, IndexedDataError) as error:
            raise ConfigError(f"{where}: {error}") from error
        resolved.append(ResolvedSource(name, prefix, source.weight, where))
    return resolved


def cache_key(path: str, kind: str, tokenizer_path: str, text_field: str) -> str:
    """A digest of everything the cached tokens of a text/jsonl source depend on."""
    digest = hashlib.sha256(f"{Path(path).resolve()}|{kind}|{text_field}".encode())
    root = Path(path)
    files = sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else [root]
    for file in files:
        stat = file.stat()
        digest.update(f"|{file}|{stat.st_size}|{stat.st_mtime_ns}".encode())
    digest.update(Path(tokenizer_path).read_bytes())
    return digest.hexdigest()[:16]


def cached_tokens(path: str, kind: str, name: str, tokenizer_path: str, text_field: str, cache_dir: Path,
                  where: str, path_key: str) -> str:
    """The ``.bin/.idx`` prefix of ``path``'s tokens in ``cache_dir``, tokenized on first use (rank 0 builds).
    Errors name ``where`` (the config key of the source) and ``path_key`` (the key holding its path)."""
    prefix = str(cache_dir / f"{name}-{cache_key(path, kind, tokenizer_path, text_field)}")
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    if distributed and dist.get_rank() != 0:
        dist.barrier()  # rank 0 builds first
    try:
        if not Path(prefix + ".idx").is_file():
            cache_dir.mkdir(parents=True, exist_ok=True)
            documents = text_documents(path, text_field, jsonl=kind == "jsonl")
            counts = tokenize_to_indexed(documents, tokenizer_path, prefix)
            if counts["tokens"] == 0:
                raise ConfigError(f"{path_key}={path} holds no text (empty or blank files)")
    except (OSError, ValueError, ImportError) as error:
        if isinstance(error, ConfigError):
            raise
        raise ConfigError(f"{where}: {error}") from error
    finally:
        if distributed and dist.get_rank() == 0:
            dist.barrier()
    return prefix


def shared_cache_dir(output_dir: str | os.PathLike) -> Path:
    return Path(output_dir) / CACHE_FOLDER
