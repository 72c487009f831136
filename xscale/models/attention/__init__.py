"""Attention: the multi-head module and the registry of cores (dense and the efficient zoo)."""

from xscale.models.attention import (
    dense,  # noqa: F401  (registers "dense")
    sparse,  # noqa: F401  (position-sparse patterns)
)
from xscale.models.attention.core import AttentionCore, build_core, expand_kv
from xscale.models.attention.multihead import Attention

__all__ = ["Attention", "AttentionCore", "build_core", "expand_kv"]
