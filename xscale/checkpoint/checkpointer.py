"""Sharded checkpoints with torch.distributed.checkpoint (DCP): complete or invisible.

Layout of ``<dir>``::

    step_00000020/          DCP shards (model, optimizer) + meta.json + rng/rank_*.pt
    latest                  text file naming the newest complete step directory

A save checks the free space first, writes into ``.tmp-step_N`` and is renamed into place only after every rank
finished and meta.json (with the size and SHA-256 of every file, :mod:`~xscale.checkpoint.integrity`) is written;
``latest`` is replaced atomically afterwards. A crash mid-save therefore leaves the previous checkpoint and
``latest`` untouched, and the next start removes the partial ``.tmp-*`` directory. On load, the files are checked
against meta.json (``checkpoint.verify``: full = SHA-256, size, none), the model's parameter shapes against the
checkpoint's, and DCP's pickled ``.metadata`` is read with an allow-list, never running code, so a damaged file, a
crafted file or a checkpoint of another model fails with a message that names the file and the mismatch.
``checkpoint.resume=auto`` (:meth:`Checkpointer.newest_intact`) moves a damaged newest checkpoint aside to
``damaged-step_N`` and resumes the newest one that verifies.
DCP reshards on load: a checkpoint saved at one parallel layout loads at another.
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import shutil
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from xscale.checkpoint.integrity import (
    VERIFY_CHOICES,
    CheckpointError,
    SafeFileSystemReader,
    checkpoint_files,
    parse_meta,
    read_metadata_safely,
    sealed_meta,
    shared_digests,
    verify_files,
)
from xscale.checkpoint.sizes import readable_size

# DCP warns on every single-process save/load; that is a supported use here.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")

STEP_PREFIX = "step_"
META = "meta.json"
FREE_SPACE_MARGIN = 1.1  # a save needs the state's bytes plus DCP's metadata and the RNG files
__all__ = ["Checkpointer", "CheckpointError", "VERIFY_CHOICES", "check_fingerprint", "load_per_rank",
           "per_rank_file", "rng_state", "set_rng_state", "shape_fingerprint"]


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


def _barrier() -> None:
    if _distributed():
        dist.barrier()


def step_dir_name(step: int) -> str:
    return f"{STEP_PREFIX}{step:08d}"


def _write_atomic(path: Path, text: str) -> None:
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(temporary, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)


def _state_bytes(state: Any) -> int:
    """Bytes of the tensors this rank holds in ``state`` (its local shards)."""
    if isinstance(state, dict):
        return sum(_state_bytes(value) for value in state.values())
    if isinstance(state, (list, tuple)):
        return sum(_state_bytes(value) for value in state)
    if isinstance(state, torch.Tensor):
        local = state.to_local() if hasattr(state, "to_local") else state
        return local.numel() * local.element_size()
    return 0


def _space_for(directory: Path, state: dict[str, Any]) -> tuple[int, int]:
    """(bytes a save of ``state`` needs over every rank, the fewest bytes free on any rank's disk); collective."""
    directory.mkdir(parents=True, exist_ok=True)
    needed = [_state_bytes(state), shutil.disk_usage(directory).free]
    if _distributed() and dist.get_world_size() > 1:
        everyone: list[list[int]] = [[] for _ in range(dist.get_world_size())]
        dist.all_gather_object(everyone, needed)
        needed = [sum(part[0] for part in everyone), min(part[1] for part in everyone)]
    return int(needed[0] * FREE_SPACE_MARGIN), needed[1]


def shape_fingerprint(model_state: dict[str, Any]) -> dict[str, list[int]]:
    """Parameter name -> global shape over every rank (pipeline stages hold different names), the identity of
    a model for resume checks. Collective when a process group is up."""
    fingerprint = {name: list(value.shape) for name, value in model_state.items() if isinstance(value, torch.Tensor)}
    if _distributed() and dist.get_world_size() > 1:
        everyone: list[dict[str, list[int]]] = [{} for _ in range(dist.get_world_size())]
        dist.all_gather_object(everyone, fingerprint)
        for other in everyone:
            fingerprint.update(other)
    return dict(sorted(fingerprint.items()))


class Checkpointer:
    def __init__(self, directory: str | Path, keep: int = 3, async_save: bool = False, verify: str = "full",
                 carry: dict[str, Path] | None = None) -> None:
        """``carry``: name inside each checkpoint -> a file copied into every checkpoint (e.g. the tokenizer)."""
        self.directory = Path(directory)
        self.carry = dict(carry or {})
        self.keep = keep
        self.async_save = async_save
        self.verify = verify
        self._pending: tuple[Any, Path, Path, dict[str, Any]] | None = None
        self._saving: _SaveAttempt | None = None
        self.protected: Path | None = None  # a step directory retention keeps beyond ``keep`` (the last healthy one)
        self._verified: Path | None = None  # the checkpoint newest_intact just verified (load need not hash it again)
        if _rank() == 0:
            self.recover_interrupted_saves()

    def recover_interrupted_saves(self) -> None:
        """Remove what a save cut short left behind (``.tmp-step_N``); a step directory that was being replaced
        (``.old-step_N`` without ``step_N``) is put back."""
        if not self.directory.is_dir():
            return
        for partial in self.directory.glob(f".tmp-{STEP_PREFIX}*"):
            shutil.rmtree(partial, ignore_errors=True)
            print(f"removed {partial}: a checkpoint save that did not finish", flush=True)
        for previous in self.directory.glob(f".old-{STEP_PREFIX}*"):
            final = previous.with_name(previous.name.removeprefix(".old-"))
            if final.exists():
                shutil.rmtree(previous, ignore_errors=True)
            else:
                previous.rename(final)

    # ------------------------------------------------------------------ save
    def save(self, step: int, state: dict[str, Any], meta: dict[str, Any],
             per_rank: dict[str, dict[str, torch.Tensor]] | None = None) -> None:
        """Save DCP ``state`` (model/optimizer) and ``meta`` (JSON; written by rank 0) for ``step``; the ``carry``
        files are copied in by rank 0 and checksummed with the rest. ``per_rank``: name -> tensors this rank alone
        holds (a recurrent memory), saved as ``<name>/rank_N.pt`` beside the RNG states."""
        self.wait()
        final = self.directory / step_dir_name(step)
        staging = self.directory / f".tmp-{step_dir_name(step)}"
        previous = self._previous_intact()
        needed, free = _space_for(self.directory, state)
        if needed > free:  # refused before writing: a full disk mid-write would leave a partial copy
            raise CheckpointError(f"not enough free space to save step {step} in {self.directory}: it needs about "
                                  f"{readable_size(needed)}, {readable_size(free)} are free; free some space or set "
                                  f"checkpoint.dir elsewhere ({previous})")
        self._saving = _SaveAttempt(step, self.directory, needed, free, previous)
        if _rank() == 0:
            if staging.exists():
                shutil.rmtree(staging)
            (staging / "rng").mkdir(parents=True)
            for name, source in self.carry.items():
                with _save_errors(staging, self._saving):
                    (staging / name).parent.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(source, staging / name)
        _barrier()
        meta = {**meta, "step": step, "fingerprint": shape_fingerprint(state.get("model", {}))}
        with _save_errors(staging, self._saving):
            torch.save(rng_state(), staging / "rng" / f"rank_{_rank():05d}.pt")
            for name, tensors in (per_rank or {}).items():
                (staging / name).mkdir(exist_ok=True)
                torch.save(tensors, per_rank_file(staging, name))
            if self.async_save:
                future = dcp.async_save(state, checkpoint_id=str(staging))
                self._pending = (future, staging, final, meta)
            else:
                dcp.save(state, checkpoint_id=str(staging))
        if not self.async_save:
            self._finalize(staging, final, meta)

    def wait(self) -> None:
        """Finish an asynchronous save (collective: every rank calls it)."""
        if self._pending is None:
            return
        future, staging, final, meta = self._pending
        self._pending = None
        with _save_errors(staging, self._saving):
            future.result()
        self._finalize(staging, final, meta)

    def _finalize(self, staging: Path, final: Path, meta: dict[str, Any]) -> None:
        _barrier()
        names = checkpoint_files(staging, exclude=META)
        digests = shared_digests(staging, names)
        if _rank() == 0:
            meta = {**meta, "files": {name: (staging / name).stat().st_size for name in names}, "sha256": digests}
            _write_atomic(staging / META, json.dumps(sealed_meta(meta), indent=1))
            previous = final.with_name(f".old-{final.name}")
            if final.exists():
                final.rename(previous)
            staging.rename(final)
            _write_atomic(self.directory / "latest", final.name + "\n")
            if previous.exists():
                shutil.rmtree(previous)
            self._retain()
        _barrier()

    def _previous_intact(self) -> str:
        """What a failed save leaves, in words: the previous checkpoint named by ``latest``."""
        marker = self.directory / "latest"
        name = marker.read_text().strip() if marker.is_file() else ""
        step = step_of(self.directory / name) if name else None
        return (f"the previous checkpoint (step {step}) is intact" if step is not None
                else "no earlier checkpoint exists in it")

    def _retain(self) -> None:
        steps = sorted(p for p in self.directory.glob(f"{STEP_PREFIX}*") if p.is_dir())
        protected = self.protected.resolve() if self.protected is not None else None
        for old in steps[: -self.keep]:
            if old.resolve() != protected:
                shutil.rmtree(old, ignore_errors=True)

    def set_aside_later_steps(self, resumed: Path) -> Path | None:
        """A rollback (resuming at a step older than the directory's newest) moves every later step directory into
        ``abandoned-<time>/`` beside them, never deleting one: retention keeps the newest steps, so they would
        otherwise make it delete what this run writes. ``latest`` then names ``resumed`` when it lies here. Rank 0
        moves (the other ranks wait); returns the folder, or None when nothing was later."""
        step = step_of(resumed)
        later = [] if step is None else [p for p in self.directory.glob(f"{STEP_PREFIX}*")
                                         if p.is_dir() and (step_of(p) or 0) > step]
        if not later:
            return None
        folder = self.directory / f"abandoned-{time.strftime('%Y%m%d-%H%M%S')}"
        if _rank() == 0:
            folder.mkdir()
            for path in sorted(later):
                path.rename(folder / path.name)
            marker = self.directory / "latest"
            if resumed.parent.resolve() == self.directory.resolve():
                _write_atomic(marker, resumed.name + "\n")
            elif marker.exists() and (folder / marker.read_text().strip()).exists():
                marker.unlink()  # it named a step moved aside; the next save writes it anew
        _barrier()
        return folder

    # ------------------------------------------------------------------ load
    def latest(self) -> Path | None:
        """The newest complete checkpoint, or None when there is none yet."""
        marker = self.directory / "latest"
        if not marker.exists():
            return None
        name = marker.read_text().strip()
        path = self.directory / name
        if not (path / META).is_file():
            raise CheckpointError(
                f"{marker} names '{name}', but {path / META} does not exist: the checkpoint directory was "
                f"removed or damaged; point checkpoint.resume at another step directory or delete {marker}"
            )
        return path

    def latest_step(self) -> int | None:
        """The step of the checkpoint ``latest`` names (unverified), or None when there is none."""
        marker = self.directory / "latest"
        return step_of(self.directory / marker.read_text().strip()) if marker.is_file() else None

    def newest_intact(self) -> Path | None:
        """``checkpoint.resume=auto``: the newest checkpoint whose files verify (``checkpoint.verify``), or None when
        there is none yet. A newer damaged one (truncated, corrupt, meta.json unreadable, or ``latest`` naming a
        missing directory) is moved to ``damaged-<name>/`` beside it (never deleted) with one warning line each, and
        ``latest`` then names the one found. With no intact checkpoint left, the newest's error is raised and
        nothing is moved: a restart never silently starts the run over. Collective when a process group is up."""
        marker = self.directory / "latest"
        if not marker.exists():
            return None
        damaged: list[tuple[Path, CheckpointError]] = []
        try:
            named = self.latest()
        except CheckpointError as error:  # latest names a directory that is gone
            named = self.directory / marker.read_text().strip()
            damaged.append((named, error))
        else:
            if (problem := self._verify(named)) is None:
                self._verified = named
                return named
            damaged.append((named, problem))
        newest_step = step_of(named)
        for older in sorted((p for p in self.directory.glob(f"{STEP_PREFIX}*") if p.is_dir()), reverse=True):
            if newest_step is not None and (step_of(older) or 0) >= newest_step:
                continue
            if (problem := self._verify(older)) is None:
                self._set_aside_damaged(damaged, older)
                self._verified = older
                return older
            damaged.append((older, problem))
        raise damaged[0][1]

    def _verify(self, path: Path) -> CheckpointError | None:
        """What is wrong with checkpoint ``path`` (its meta.json and files), or None when it verifies."""
        try:
            self.read_meta(path, self.verify)
        except CheckpointError as error:
            return error
        return None

    def _set_aside_damaged(self, damaged: list[tuple[Path, CheckpointError]], intact: Path) -> None:
        """Rank 0 moves each damaged checkpoint to ``damaged-<name>/``, says so in one line and points ``latest`` at
        ``intact``; the other ranks wait."""
        if _rank() == 0:
            for path, error in damaged:
                kept = "it does not exist"
                if path.exists():
                    target = path.with_name(f"damaged-{path.name}")
                    if target.exists():
                        target = path.with_name(f"damaged-{path.name}-{time.strftime('%Y%m%d-%H%M%S')}")
                    path.rename(target)
                    kept = f"moved to {target} (kept, not deleted)"
                print(f"xscale: warning: checkpoint {path.name} is damaged ({_first_line(error)}); {kept}; resuming "
                      f"from {intact}", flush=True)
            _write_atomic(self.directory / "latest", intact.name + "\n")
        _barrier()

    @staticmethod
    def read_meta(path: str | Path, verify: str = "size") -> dict[str, Any]:
        """meta.json of checkpoint ``path``, after checking its files (``verify``: full, size or none; collective
        when a process group is up)."""
        path = Path(path)
        meta_file = path / META
        if not meta_file.is_file():
            raise CheckpointError(f"{path} is not a complete xscale checkpoint: {meta_file} is missing")
        meta = parse_meta(meta_file)
        verify_files(path, meta.get("files", {}), meta.get("sha256", {}), verify)
        return meta

    def load(self, path: str | Path, state: dict[str, Any]) -> dict[str, Any]:
        """Load into ``state`` in place (resharding to its layout); returns the checkpoint's meta."""
        path = Path(path)
        meta = self.read_meta(path, "none" if path == self._verified else self.verify)
        check_fingerprint(meta.get("fingerprint", {}), shape_fingerprint(state.get("model", {})), path)
        load_state(state, path)
        rng_file = path / "rng" / f"rank_{_rank():05d}.pt"
        if rng_file.is_file():
            try:
                set_rng_state(torch.load(rng_file, weights_only=True))
            except (pickle.UnpicklingError, RuntimeError, KeyError, EOFError) as error:
                raise CheckpointError(f"{rng_file} is not an RNG state saved by xscale ({_first_line(error)}); it was "
                                      "not loaded (weights_only=True)") from error
        return meta


def per_rank_file(path: str | Path, name: str, rank: int | None = None) -> Path:
    """Where rank ``rank`` (default: this one) keeps its ``per_rank`` tensors ``name`` in checkpoint ``path``."""
    return Path(path) / name / f"rank_{_rank() if rank is None else rank:05d}.pt"


def load_per_rank(path: str | Path, name: str, rank: int | None = None,
                  mmap: bool = False) -> dict[str, torch.Tensor] | None:
    """Rank ``rank``'s (default: this rank's) ``per_rank`` tensors ``name`` of a checkpoint (None if it has none),
    read with weights_only; ``mmap``: mapped from the file, so only the parts used are read."""
    file = per_rank_file(path, name, rank)
    if not file.is_file():
        return None
    try:
        return torch.load(file, weights_only=True, mmap=mmap)
    except (pickle.UnpicklingError, RuntimeError, EOFError) as error:
        raise CheckpointError(f"{file} is not a tensor file saved by xscale ({_first_line(error)}); it was not "
                              "loaded (weights_only=True)") from error


def load_state(state: dict[str, Any], path: Path) -> None:
    """``dcp.load`` into ``state`` with the safe metadata reader; any failure is a one-line CheckpointError."""
    read_metadata_safely(path / ".metadata")  # refused here, before DCP would log its fallbacks' tracebacks
    try:
        dcp.load(state, checkpoint_id=str(path), storage_reader=SafeFileSystemReader(str(path)))
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as error:  # DCP's CheckpointException is a BaseException
        if isinstance(error, CheckpointException) and any(isinstance(cause, CheckpointError)
                                                          for cause, _ in error.failures.values()):
            raise CheckpointError(_first_line(error)) from error  # the safe reader's refusal, as it is
        raise CheckpointError(f"could not read checkpoint {path}: {_first_line(error)}") from error


class _SaveAttempt:
    """The save in progress, for its failure message: step, directory, bytes needed and free at its start, and
    what the previous checkpoint is."""

    def __init__(self, step: int, directory: Path, needed: int, free: int, previous: str) -> None:
        self.step, self.directory, self.needed, self.free, self.previous = step, directory, needed, free, previous


@contextmanager
def _save_errors(staging: Path, attempt: _SaveAttempt | None) -> Iterator[None]:
    """A failed write (disk full, permissions, DCP's errors) becomes one clear line; the partial copy is removed.
    A full disk is named as such, whether it came as ENOSPC or as torch.save's ``unexpected pos`` RuntimeError."""
    try:
        yield
    except (OSError, RuntimeError, CheckpointException) as error:  # torch.save reports a full disk as RuntimeError
        left = shutil.disk_usage(staging.parent).free  # before the partial copy is removed
        if _rank() == 0:
            shutil.rmtree(staging, ignore_errors=True)
        step = attempt.step if attempt else staging.name.removeprefix(f".tmp-{STEP_PREFIX}")
        previous = attempt.previous if attempt else "the previous checkpoint is intact"
        if _out_of_space(error) or left < DISK_FULL_BYTES:
            sizes = (f" (about {readable_size(attempt.needed)} needed, {readable_size(attempt.free)} free)"
                     if attempt and attempt.needed else f" ({readable_size(left)} left)")
            raise CheckpointError(f"no space left on device while saving step {step} to {staging.parent}{sizes}; "
                                  f"{previous}; free some space or set checkpoint.dir elsewhere") from error
        raise CheckpointError(f"could not write checkpoint step {step} in {staging.parent}: {_first_line(error)}; "
                              f"{previous}") from error


DISK_FULL_BYTES = 1 << 20  # a write that failed with less than this left on its disk failed for want of space


def _out_of_space(error: BaseException | None, depth: int = 0) -> bool:
    """ENOSPC (or EDQUOT) anywhere in ``error``'s causes, DCP's per-rank failures included."""
    if error is None or depth > 8:
        return False
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    if isinstance(error, CheckpointException) and any(_out_of_space(cause, depth + 1)
                                                      for cause, _ in error.failures.values()):
        return True
    return _out_of_space(error.__cause__ or error.__context__, depth + 1)


def _first_line(error: BaseException) -> str:
    """The cause in one line: for DCP's CheckpointException, the first failing rank's own exception."""
    if isinstance(error, CheckpointException) and error.failures:
        rank, (cause, _) = min(error.failures.items(), key=lambda item: item[0])
        if isinstance(cause, CheckpointError):
            return str(cause)
        return f"rank {rank}: {type(cause).__name__}: {_first_line(cause)}"
    text = str(error).strip()
    return text.splitlines()[0] if text else "no message"


def step_of(path: Path) -> int | None:
    """The step of a ``step_<n>`` directory (None for any other name)."""
    digits = path.name.removeprefix(STEP_PREFIX)
    return int(digits) if path.name.startswith(STEP_PREFIX) and digits.isdigit() else None


def check_fingerprint(saved: dict[str, list[int]], current: dict[str, list[int]], path: Path) -> None:
    """Refuse a checkpoint of another model: name the first parameters that differ."""
    missing = sorted(set(current) - set(saved))
    unexpected = sorted(set(saved) - set(current))
    different = [(n, saved[n], current[n]) for n in sorted(set(saved) & set(current)) if saved[n] != current[n]]
    if not (missing or unexpected or different):
        return
    lines = [f"checkpoint {path} was saved from another model:"]
    if different:
        lines += [f"  {name}: checkpoint has shape {s}, this model {c}" for name, s, c in different[:5]]
        if any(s == [] and c == [1] for _, s, c in different):
            lines.append("  a 0-d parameter that is now [1] is ScaleNorm's gain, reshaped so that ZeRO-3 (FSDP2) can "
                         "shard it: resume this run with the xscale version that wrote it; its weights still load into this "
                         "version's model with load_state_dict, which accepts the 0-d gain (e.g. after "
                         "torch.distributed.checkpoint.format_utils.dcp_to_torch_save)")
    if missing:
        lines.append(f"  parameters missing from the checkpoint: {', '.join(missing[:5])}")
    if unexpected:
        lines.append(f"  parameters only in the checkpoint: {', '.join(unexpected[:5])}")
    lines.append("  check model.* in the config against the run that wrote it (its config is in meta.json)")
    raise CheckpointError("\n".join(lines))


def rng_state() -> dict[str, torch.Tensor]:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
