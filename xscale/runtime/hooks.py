"""What the training loop may ask of a model's components, as protocols rather than attribute probing.

A component implements one by defining the method; ``isinstance`` checks (``runtime_checkable``) find it, and a
type checker checks the signature. The loop calls them, never the other way round.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable


@runtime_checkable
class PerStepComponent(Protocol):
    """Behaviour defined per optimizer step, not per forward (Performer redraws, the adaptive-span penalty): called
    once per step before its first forward; ``forwards``: the forwards the step runs (microbatches x replicas)."""

    def begin_training_step(self, forwards: int) -> None: ...


@runtime_checkable
class ReportsLayerMetrics(Protocol):
    """Per-layer statistics of the last step (MoE load, ...), as ``{name: value}``; the trainer logs them."""

    def layer_metrics(self) -> dict[str, float]: ...


@runtime_checkable
class ResetsBuffers(Protocol):
    """Non-persistent or derived buffers (position tables, projections, centroids) refilled after materialising."""

    def reset_buffers(self) -> None: ...


@runtime_checkable
class DrawsNoise(Protocol):
    """A module drawing layout-independent randomness keyed by ``site``, the id of its name in the model."""

    site: int


@runtime_checkable
class CallsFusedOps(Protocol):
    """A module whose fused ops run through the backend in ``kernels`` (``Transformer.use_kernels``)."""

    kernels: str


@runtime_checkable
class RunsSparseAttention(Protocol):
    """A position-sparse attention core whose kernel is ``sparse_attention`` (``Transformer.use_kernels``)."""

    sparse_attention: str


__all__ = ["RunsSparseAttention", "CallsFusedOps", "DrawsNoise", "PerStepComponent", "ReportsLayerMetrics", "ResetsBuffers"]
