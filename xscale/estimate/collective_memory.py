"""The working buffers of a layout's collectives on one rank: what the process group allocates for a collective
beside its input and output (gloo's CPU algorithms keep receive and staging buffers of the message's size).

The cluster file gives, per collective, r = bytes held per byte of the message (``collective_buffers``, measured by
``xscale plan --calibrate``: the peak resident set a first call of a bucket-sized message adds). A layout's term is
sum over the collectives it issues of r x its largest message:

* data parallelism over dp x cp ranks (dense gradients G = 4 x parameters / tp on the pp rank, buckets of
  ``parallel.bucket_mb``): DDP all-reduces min(bucket, G); ZeRO-1/2 reduce-scatter min(bucket, G) and all-gather as
  much of the updated parameters; ZeRO-3 all-gathers one block's parameters in the compute dtype and
  reduce-scatters its fp32 gradients;
* tensor parallelism: t d activations (the compute dtype) all-reduced, or reduce-scattered and all-gathered under
  sequence parallelism.
"""

from __future__ import annotations

from xscale.estimate.cluster import Cluster
from xscale.estimate.layout import Layout
from xscale.estimate.model_shape import ModelShape
from xscale.estimate.placement import Placement, dense_parameters_per_tp_rank, rank_parameters

GRADIENT_BYTES = 4


def largest_messages(shape: ModelShape, layout: Layout, where: Placement, rank: int) -> dict[str, float]:
    """The largest message of each collective pp rank ``rank`` issues (module docstring)."""
    value = 2 if shape.config.train.low_precision else 4
    messages: dict[str, float] = {}

    def issue(collective: str, size: float) -> None:
        messages[collective] = max(messages.get(collective, 0.0), size)

    if layout.dp * layout.cp > 1:
        gradients = GRADIENT_BYTES * dense_parameters_per_tp_rank(rank_parameters(shape, where, rank, layout.tp),
                                                                  layout.tp)
        bucket = min(shape.config.parallel.bucket_mb * 2**20, gradients)
        if layout.zero_stage == 0:
            issue("all_reduce", bucket)
        elif layout.zero_stage in (1, 2):
            issue("reduce_scatter", bucket)
            issue("all_gather", bucket)
        else:
            block = max((shape.blocks[index].held for index in where.rank_blocks[rank]), default=0) / layout.tp
            issue("all_gather", value * block)
            issue("reduce_scatter", GRADIENT_BYTES * block)
    if layout.tp > 1:
        activations = value * layout.micro_batch * shape.seq_len / layout.cp * shape.model.d_model
        for collective in (("reduce_scatter", "all_gather") if layout.sequence_parallel else ("all_reduce",)):
            issue(collective, activations)
    return messages


def collective_buffer_bytes(shape: ModelShape, cluster: Cluster, layout: Layout, where: Placement) -> float:
    """The largest over the pp ranks of sum r x largest message (module docstring); 0 without calibrated ratios."""
    ratios = dict(cluster.collective_buffers)
    if not ratios:
        return 0.0
    return max(sum(ratios.get(collective, 0.0) * size
                   for collective, size in largest_messages(shape, layout, where, rank).items())
               for rank in range(layout.pp))
