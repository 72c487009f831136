"""Is a checkpoint sound and safe to open? Per-file SHA-256 digests, and DCP metadata read without running code.

Digests: every file of a checkpoint (DCP shards, ``.metadata``, RNG states) gets a SHA-256 written to ``meta.json``
when the checkpoint is finalised and checked before it loads, so flipped bytes inside a shard are refused instead of
training on garbage. The ranks share the hashing (file i goes to rank i mod world), on a save and on a load, so its
cost falls with the number of ranks.

Safe metadata: DCP's ``.metadata`` is a pickle, and ``pickle.load`` runs whatever a crafted file names.
:class:`SafeFileSystemReader` unpickles it with an allow-list of the classes DCP's metadata is made of (its
dataclasses, ``torch.Size``, dtypes, paths); anything else is refused before it is constructed.
"""

from __future__ import annotations

import collections
import hashlib
import json
import pickle
import re
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint.metadata as dcp_metadata
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

HASH_CHUNK = 8 << 20
VERIFY_CHOICES = ("full", "size", "none")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded; the message names the file and what is wrong."""


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _gather(mine: dict[str, Any]) -> dict[str, Any]:
    """The union of every rank's dict (collective when a process group is up)."""
    rank, world = _world()
    if world == 1:
        return mine
    everyone: list[dict[str, Any]] = [{} for _ in range(world)]
    dist.all_gather_object(everyone, mine)
    return {key: value for part in everyone for key, value in part.items()}


def checkpoint_files(directory: Path, exclude: str) -> list[str]:
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file() and p.name != exclude)


def shared_digests(directory: Path, names: list[str]) -> dict[str, str]:
    """SHA-256 of each named file, hashed by the ranks in turn (collective when a process group is up)."""
    rank, world = _world()
    return _gather({name: sha256_of(directory / name) for index, name in enumerate(names) if index % world == rank})


def verify_files(directory: Path, sizes: dict[str, int], digests: dict[str, str], level: str) -> None:
    """Refuse a checkpoint whose files are missing, resized or (``level="full"``) changed since they were written.
    Every rank checks its share and all raise the same error (collective when a process group is up)."""
    if level == "none":
        return
    rank, world = _world()
    problems = {}
    for index, (name, size) in enumerate(sorted(sizes.items())):
        if index % world != rank:
            continue
        file = directory / name
        if not file.is_file():
            problems[name] = f"checkpoint file {file} is missing"
        elif file.stat().st_size != size:
            problems[name] = (f"checkpoint file {file} has {file.stat().st_size} bytes but {size} were written: "
                              "it is truncated or corrupt")
        elif level == "full" and name in digests and sha256_of(file) != digests[name]:
            problems[name] = (f"checkpoint file {file} does not match the SHA-256 recorded when it was written: it "
                              "is corrupt (damaged storage or a partial copy); resume from another step directory")
    problems = _gather(problems)
    if problems:
        raise CheckpointError("\n".join(problems[name] for name in sorted(problems)[:5]))


# ---------------------------------------------------------------------------------------------- safe metadata


META_DIGEST = "meta_sha256"  # meta.json's own checksum, over every other key


def meta_digest(meta: dict[str, Any]) -> str:
    """SHA-256 of meta.json's content without its own checksum, keys sorted (what was written is what is read)."""
    body = {key: value for key, value in meta.items() if key != META_DIGEST}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def sealed_meta(meta: dict[str, Any]) -> dict[str, Any]:
    """``meta`` as JSON will hold it (values JSON cannot hold as text), with its checksum added."""
    plain = json.loads(json.dumps(meta, default=str))
    return {**plain, META_DIGEST: meta_digest(plain)}


def parse_meta(meta_file: Path) -> dict[str, Any]:
    """meta.json of a checkpoint, refused in one line when it is not JSON, was edited after the save (its checksum;
    a checkpoint written before checksums were kept has none), or names a step other than its directory's."""
    try:
        meta = json.loads(meta_file.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as error:
        raise CheckpointError(f"{meta_file} is corrupt (not JSON: {str(error).splitlines()[0]}); resume from another "
                              "checkpoint (checkpoint.resume=DIR)") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{meta_file} is corrupt (a JSON {type(meta).__name__}, not a mapping); resume from "
                              "another checkpoint (checkpoint.resume=DIR)")
    if META_DIGEST in meta and meta[META_DIGEST] != meta_digest(meta):
        raise CheckpointError(f"{meta_file} was changed after the save (its checksum {META_DIGEST} no longer matches "
                              "its content): its step, data position or config cannot be trusted; restore it or resume "
                              "from another checkpoint (checkpoint.resume=DIR)")
    named = re.fullmatch(r"step_0*(\d+)", meta_file.parent.name)
    if named and "step" in meta and str(meta["step"]) != named.group(1):
        raise CheckpointError(f"{meta_file} says step {meta['step']} but its directory is {meta_file.parent.name}: "
                              "meta.json was edited or moved; restore it or resume from another checkpoint")
    return meta


def _metadata_classes() -> dict[tuple[str, str], Any]:
    allowed = {(dcp_metadata.__name__, name): value for name, value in vars(dcp_metadata).items()
               if isinstance(value, type) and value.__module__ == dcp_metadata.__name__}
    allowed.update({(torch.__name__, name): value for name, value in vars(torch).items()
                    if isinstance(value, (torch.dtype, torch.layout, torch.memory_format))})
    allowed.update({
        ("torch", "Size"): torch.Size,
        ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
        (dcp_filesystem.__name__, "_StorageInfo"): dcp_filesystem._StorageInfo,
        ("pathlib", "PosixPath"): Path().__class__, ("pathlib", "PurePosixPath"): Path().__class__,
        ("collections", "OrderedDict"): collections.OrderedDict,
        ("builtins", "set"): set, ("builtins", "frozenset"): frozenset, ("builtins", "slice"): slice,
    })
    return allowed


class _MetadataUnpickler(pickle.Unpickler):
    allowed = _metadata_classes()

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in self.allowed:
            raise pickle.UnpicklingError(f"{module}.{name} is not part of DCP checkpoint metadata")
        return self.allowed[(module, name)]


def read_metadata_safely(path: Path) -> Metadata:
    """DCP's ``Metadata`` from a ``.metadata`` file, unpickled with the allow-list (CheckpointError otherwise)."""
    try:
        with open(path, "rb") as handle:
            metadata = _MetadataUnpickler(handle).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError, IndexError) as error:
        raise CheckpointError(f"{path} is not a DCP checkpoint's metadata or is damaged ({error}); it was not "
                              "loaded: only DCP's own metadata classes are accepted") from error
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{path} holds a {type(metadata).__name__}, not DCP checkpoint metadata")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader with the metadata unpickled through the allow-list (tensors already load with
    ``weights_only=True`` in DCP)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        metadata = read_metadata_safely(Path(self._get_metadata_path(rank)))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
