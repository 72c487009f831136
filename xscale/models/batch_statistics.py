"""Which models compute something over a rank's whole microbatch, so that splitting it changes the numbers."""

from __future__ import annotations

from xscale.config.schema import ModelConfig
from xscale.models.registry import ATTENTION
from xscale.models.traits import traits_of


def statistics_over_the_microbatch(model: ModelConfig) -> str | None:
    """What in ``model`` reads a microbatch as a whole (None: nothing, its loss sums over samples): Mixture-of-Experts
    routing (capacity, load-balancing and z-loss statistics are taken over the tokens routed together) or a core
    with running statistics (``dp_statistics``: routing attention's k-means sums). Gradient accumulation over smaller
    microbatches changes both, so an elastic resume keeps one microbatch per rank for them."""
    if model.moe.num_experts > 0:
        return "Mixture-of-Experts routing statistics"
    kinds = sorted({kind for kind in map(model.attention.kind_for_layer, range(model.total_layers))
                    if kind in ATTENTION and traits_of(ATTENTION.get(kind)).dp_statistics})
    return f"{', '.join(kinds)} attention's running statistics" if kinds else None
