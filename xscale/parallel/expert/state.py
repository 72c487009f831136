"""Expert tensors in checkpoints: shown in their global [E, ...] shape, so a checkpoint reshards over ep.

Under expert parallelism rank r of an ep group of size P holds rows [r E/P, (r + 1) E/P) of every expert tensor
(parameters and their optimizer moments) under the single-process name. Saved as they are, DCP would see P
different tensors with one name and keep one of them. :func:`globalize_expert_state` wraps each local slice as a
DTensor sharded on dim 0 over the ep mesh, with the global shape [E, ...]: DCP writes the P slices as pieces of
one tensor and reads them back into any ep degree (ep=1: a plain tensor), and the checkpoint's shape fingerprint
is the single-process one. Under ZeRO-3 the slice is itself sharded over dp_expert by FSDP2; it is gathered to
[E/P, ...] first, and :func:`localize_expert_state` cuts this rank's FSDP shard back out after loading.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from xscale.models.init import canonical_name
from xscale.parallel.data import is_expert_parameter
from xscale.parallel.row_pieces import as_held, as_piece

StateDict = dict[str, Any]


def _map_expert_tensors(state: StateDict, convert) -> StateDict:
    """Apply ``convert(name, tensor)`` to the expert tensors of a {"model", "optimizer"} state (new dicts);
    the optimizer state is DCP's flattened form, moments under ``state.<name>.<key>``."""
    model = {name: convert(name, value) if is_expert_parameter(name) and isinstance(value, torch.Tensor) else value
             for name, value in state["model"].items()}
    optimizer = {}
    for key, value in state["optimizer"].items():
        if key.startswith("state.") and isinstance(value, torch.Tensor) and value.ndim > 0:  # not the step count
            name = key[len("state."):].rsplit(".", 1)[0]
            if is_expert_parameter(name):
                value = convert(name, value)
        optimizer[key] = value
    return {**state, "model": model, "optimizer": optimizer}


def globalize_expert_state(state: StateDict, ep_mesh: DeviceMesh) -> StateDict:
    """Wrap every expert tensor (model weights, optimizer moments) as a global [E, ...] DTensor over ``ep_mesh``.

    Without ZeRO-3 the DTensors share storage with the parameters, so a DCP load into them is in place.
    """
    return _map_expert_tensors(state, lambda name, value: as_piece(value, ep_mesh))


def localize_expert_state(state: StateDict, model: nn.Module | list[nn.Module]) -> StateDict:
    """Undo :func:`globalize_expert_state` after a load: each expert tensor back to this rank's local form."""
    parts = model if isinstance(model, list) else [model]
    params = {canonical_name(name): param for part in parts for name, param in part.named_parameters()}
    return _map_expert_tensors(state, lambda name, value: as_held(value, params[name]))
