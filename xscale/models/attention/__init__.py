"""Attention: the multi-head module and the registry of cores (dense and the efficient zoo)."""

from xscale.models.attention import (  # noqa: F401  (each module registers its cores)
    average,
    binary_partition,
    clustered,
    compressed,
    cosformer,
    dense,
    entmax,
    external_global,
    fnet,
    gmlp,
    image_local,
    inducing,
    linear,
    long_short,
    lowrank,
    lsh,
    luna,
    mlp_mixer,
    multiscale,
    persistent,
    predictive,
    priors,
    probsparse,
    random_features,
    residual,
    routing,
    sinkhorn,
    skyformer,
    sparse,
    synthesizer,
    talking_heads,
)
from xscale.models.attention.core import AttentionCore, build_core, expand_kv
from xscale.models.attention.multihead import Attention

__all__ = ["Attention", "AttentionCore", "build_core", "expand_kv"]
