"""Mixture-of-Experts FFNs; routers register themselves in ``xscale.models.registry.ROUTER``."""

from xscale.models.moe import base_router, expert_choice, hash_router, routers  # noqa: F401  (register the routers)
from xscale.models.moe.layer import (
    AttachAuxiliaryLoss,
    MoELayer,
    attach_auxiliary_loss,
    build_moe,
    check_moe_config,
    collect_moe_metrics,
    moe_layers,
    routing_summary,
)

__all__ = ["AttachAuxiliaryLoss", "MoELayer", "attach_auxiliary_loss", "build_moe", "check_moe_config",
           "collect_moe_metrics", "moe_layers", "routing_summary"]
