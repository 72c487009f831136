"""A step's costs beside its GEMMs and collectives: the eager memory-bound ops, the loss's softmax, and the fixed
dispatch time of each block and of the step. Each is given as the forward's share of one microbatch (the step model
takes backward as twice the forward, :mod:`~xscale.estimate.step_time`), on one device at full rate; figures from the
cluster file, measured by ``xscale plan --calibrate`` (:mod:`xscale.bench.calibrate`).

* Memory-bound ops (norms, activation functions, residual adds, softmax, dropout): a block's stored activations A
  (:func:`~xscale.estimate.activations.block_activation_bytes`, the rank's share) are written once in the forward
  and read twice in the backward, at the elementwise bandwidth B_e: forward A / B_e, step 3 A / B_e. The calibration
  measures B_e in the same terms: a chain of such ops, its saved tensors' bytes x 3 over its forward + backward.
* The loss: t tokens x V / tp logits, c seconds each for max, exp, sum, log and the softmax gradient together
  (forward + backward): forward t V c / 3 tp.
* Dispatch: o_b seconds of fixed cost per block forward + backward (operator dispatch, autograd bookkeeping, the
  Python of the block's modules, independent of the tensors' sizes): forward o_b / 3, so full recomputation repeats
  a third; o_s once per step (the trainer's step outside the blocks, optimizer dispatch).
"""

from __future__ import annotations

from xscale.estimate.cluster import Cluster

ELEMENTWISE_PASSES = 3  # a block's stored activations: written in the forward, read twice in the backward


def elementwise_forward_seconds(cluster: Cluster, stored_bytes: float) -> float:
    """Forward share of the memory-bound ops over ``stored_bytes`` of stored activations: A / B_e."""
    return stored_bytes * ELEMENTWISE_PASSES / 3 / cluster.elementwise_bandwidth


def loss_forward_seconds(cluster: Cluster, tokens: float, vocab_per_rank: float) -> float:
    """Forward share of the loss's softmax work over ``tokens`` x ``vocab_per_rank`` logits: t V c / 3."""
    return tokens * vocab_per_rank * cluster.loss_seconds_per_logit / 3


def block_dispatch_forward_seconds(cluster: Cluster) -> float:
    """Forward share of one block's fixed dispatch cost: o_b / 3."""
    return cluster.block_overhead_s / 3


def step_dispatch_seconds(cluster: Cluster) -> float:
    """The step's fixed cost outside the blocks: o_s."""
    return cluster.step_overhead_s
