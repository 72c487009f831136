"""Data parallelism and ZeRO: ``strategies`` (one replica, DDP-style all-reduce, ZeRO-1/2), ``fsdp`` (ZeRO-3 through
FSDP2) and ``grad_norm`` (the global gradient norm over every rank's pieces)."""

from xscale.parallel.data.fsdp import FullyShardedDataParallel, apply_fsdp
from xscale.parallel.data.strategies import (
    DataParallel,
    NamedParameter,
    ReplicatedDataParallel,
    ZeroDataParallel,
    is_expert_parameter,
    local_tensor,
)

__all__ = ["DataParallel", "FullyShardedDataParallel", "NamedParameter", "ReplicatedDataParallel",
           "ZeroDataParallel", "apply_fsdp", "is_expert_parameter", "local_tensor"]
