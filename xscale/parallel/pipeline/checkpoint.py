"""Checkpoints of a pipeline rank under the single-process names.

:func:`merged_view` shows this rank's stages as one module with the single-process parameter names, which DCP's
state-dict functions walk. Two kinds of copy (:mod:`~xscale.parallel.pipeline.shared`) need renaming so that a
checkpoint has one entry per single-process name and resumes on any layout: a module that two stages of this rank
both hold under the same name (T5's position table) appears in the view a second time under an alias, dropped on
save and re-added on load (:func:`drop_aliases`, :func:`add_aliases`); a copy held under another name
(a tied ``output.weight``) is saved under its source's name, unless this rank holds the source
itself (:func:`copies_to_sources`, :func:`sources_to_copies`).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from xscale.models.init import canonical_name
from xscale.parallel.pipeline.stages import TIED_COPY

# Where merged_view puts a second copy of a shared module held by this rank (two stages of one rank).
SHARED_ALIAS = "_pipeline_copy"


def merged_view(stages: Iterable[nn.Module], shared: Iterable[str] = ()) -> nn.Module:
    """A module whose parameter and buffer names are the single-process ones, over this rank's stages.

    Leaves (modules owning parameters or buffers) are shared with the stages; the containers above
    them are fresh, so building the view changes no stage. DCP's ``get_state_dict`` / ``set_state_dict``
    then see one model holding every parameter the optimizer steps. Wrapper names (activation
    checkpointing's) are left out of the view's paths: DCP strips them before it walks the names.
    A module under a ``shared`` path (e.g. ``stack.position``) that two stages of this rank both hold
    appears once under its name and again under ``SHARED_ALIAS<k>.<name>``: the copies are equal, and
    :func:`drop_aliases` / :func:`add_aliases` keep the second out of checkpoints.
    """
    view = nn.Module()
    shared = set(shared)
    for stage in stages:
        for name, module in stage.named_modules():
            if not name or (not module._parameters and not module._buffers):
                continue
            name = canonical_name(f"{name}.").rstrip(".")
            path = name
            for count in range(1, 64):
                existing = _lookup(view, path)
                if existing is None or existing is module or name not in shared:
                    break
                path = f"{SHARED_ALIAS}{count}.{name}"
            parent, leaf = view, path.rsplit(".", 1)[-1]
            for part in path.split(".")[:-1]:
                child = parent._modules.get(part)
                if child is None:
                    child = nn.Module()
                    parent.add_module(part, child)
                parent = child
            existing = parent._modules.get(leaf)
            if existing is None:
                parent.add_module(leaf, module)
            elif existing is not module and _owns_state(existing):
                raise ValueError(f"two pipeline stages on one rank both hold '{name}'")
    return view


def _lookup(view: nn.Module, path: str) -> nn.Module | None:
    module = view
    for part in path.split("."):
        module = module._modules.get(part)
        if module is None:
            return None
    return module


def _is_alias(key: str) -> bool:
    return key.startswith(SHARED_ALIAS) or key.split(".", 1)[-1].startswith(SHARED_ALIAS)


def drop_aliases(state: dict) -> dict:
    """A model or (flattened) optimizer state dict without :func:`merged_view`'s second copies."""
    return {key: value for key, value in state.items() if not _is_alias(key)}


def add_aliases(state: dict, view: nn.Module, flat_optimizer: bool = False) -> dict:
    """The inverse of :func:`drop_aliases` for ``view``: each second copy gets a clone of its original's entries
    (``flat_optimizer``: keys are DCP's flattened optimizer ones, ``state.<name>.<key>``)."""
    aliases = [name for name, _ in [*view.named_parameters(), *view.named_buffers()] if name.startswith(SHARED_ALIAS)]
    result = dict(state)
    for alias in aliases:
        original = alias.split(".", 1)[1]
        for key, value in state.items():
            section, rest = key.split(".", 1) if flat_optimizer else ("", key)
            if rest == original or rest.startswith(f"{original}."):
                renamed = f"{alias}{rest[len(original):]}"
                result[f"{section}.{renamed}" if flat_optimizer else renamed] = (
                    value.clone() if isinstance(value, torch.Tensor) else value)
    return result


def _owns_state(module: nn.Module) -> bool:
    return any(True for _ in module.parameters()) or any(True for _ in module.buffers())


def copies_to_sources(model_state: dict, optimizer_state: dict, copies: dict[str, str], held: set[str]) -> None:
    """Save each renamed copy's state (``copies``: its name -> its source's) under its source's single-process
    name, in place; a rank that also holds the source (``held``: the names of this rank's other parameters) drops
    the copy's entries (the two are bitwise equal). ``output.weight`` keeps its model-state entry: the
    single-process state dict names the tied output projection too."""
    for copy_name, source in copies.items():
        for key in [key for key in optimizer_state if names_param(key, copy_name)]:
            value = optimizer_state.pop(key)
            if source not in held:
                optimizer_state.setdefault(renamed_key(key, copy_name, source), value)
        if copy_name != TIED_COPY and copy_name in model_state:
            value = model_state.pop(copy_name)
            if source not in held:
                model_state.setdefault(source, value)


def sources_to_copies(model_state: dict, optimizer_state: dict, copies: dict[str, str],
                      held: set[str]) -> tuple[dict, dict]:
    """The inverse of :func:`copies_to_sources`: each renamed copy gets its own clone of its source's state."""
    model_state, optimizer_state = dict(model_state), dict(optimizer_state)
    for copy_name, source in copies.items():
        for key in [key for key in optimizer_state if names_param(key, source)]:
            value = optimizer_state[key]
            optimizer_state[renamed_key(key, source, copy_name)] = (value.clone() if isinstance(value, torch.Tensor)
                                                                 else value)
        if copy_name != TIED_COPY and source in model_state:
            model_state[copy_name] = model_state[source]
    for source in set(copies.values()) - held:
        for key in [key for key in optimizer_state if names_param(key, source)]:
            del optimizer_state[key]
        model_state.pop(source, None)
    return model_state, optimizer_state


def names_param(key: str, name: str) -> bool:
    """Whether a flattened optimizer key (``state.<name>.<key>``, ``param_groups.<name>.<key>``) is ``name``'s."""
    return key.startswith((f"state.{name}.", f"param_groups.{name}."))


def renamed_key(key: str, old: str, new: str) -> str:
    """A flattened optimizer key of parameter ``old`` as parameter ``new``'s."""
    section, rest = key.split(".", 1)
    return f"{section}.{new}{rest[len(old):]}"
