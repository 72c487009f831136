"""Collective times by the alpha-beta model (Hockney 1994; Thakur, Rabenseifner & Gropp 2005), bandwidth as NCCL's
tests define bus bandwidth, so measured ``busbw`` figures go straight into a cluster file.

    time(collective, n ranks, bytes) = latency x steps(n) + factor(n) x bytes / busbw

    collective       steps(n)          factor(n)    bytes
    all_reduce       2 ceil(log2 n)    2 (n-1)/n    the buffer each rank holds (Rabenseifner: reduce-scatter + all-gather)
    all_gather       ceil(log2 n)      (n-1)/n      the gathered whole (recursive doubling)
    reduce_scatter   ceil(log2 n)      (n-1)/n      the whole input (recursive halving)
    all_to_all       n - 1             (n-1)/n      what one rank sends in all (pairwise exchange)
    send_recv        1                 1            the message

The bandwidth factors are the ring algorithms' (optimal); the latency steps the tree-like ones' (what NCCL and MPI
switch to at scale), so neither term is the worse algorithm's. A group whose ranks sit in one node uses the cluster's
``intra_node`` figures, any other its ``inter_node`` ones (:func:`spans_nodes`). Tensor parallelism's collectives
(:func:`tensor_parallel_seconds`) take the cluster's ``tensor_parallel`` figures where calibrated: the same formula
fitted to the redistributions as the implementation issues them (DTensor's dispatch and copies around each call).
"""

from __future__ import annotations

import math

from xscale.estimate.cluster import Cluster, LinkCost


def latency_steps(collective: str, ranks: int) -> int:
    """The algorithm steps, each paying the link's latency once (table above)."""
    if ranks <= 1:
        return 0
    log_steps = math.ceil(math.log2(ranks))
    return {"all_reduce": 2 * log_steps, "all_gather": log_steps, "reduce_scatter": log_steps,
            "all_to_all": ranks - 1, "send_recv": 1}[collective]


def bandwidth_factor(collective: str, ranks: int) -> float:
    """How many times the bytes cross each rank's link (table above)."""
    if ranks <= 1:
        return 0.0
    if collective == "send_recv":
        return 1.0
    share = (ranks - 1) / ranks
    return 2 * share if collective == "all_reduce" else share


def spans_nodes(ranks: int, stride: int, devices_per_node: int) -> bool:
    """Whether a group of ``ranks`` ranks ``stride`` apart (mesh order, nodes filled in rank order) crosses a node."""
    return ranks * stride > devices_per_node


def collective_seconds(cluster: Cluster, collective: str, ranks: int, size_bytes: float, stride: int = 1,
                       calls: int = 1) -> float:
    """The alpha-beta time of ``calls`` collectives moving ``size_bytes`` in all over ``ranks`` ranks (module
    docstring); 0 for a group of one."""
    if ranks <= 1 or size_bytes <= 0:
        return 0.0
    return alpha_beta_seconds(cluster.link(spans_nodes(ranks, stride, cluster.devices_per_node), collective),
                              collective, ranks, size_bytes, calls)


def tensor_parallel_seconds(cluster: Cluster, collective: str, ranks: int, size_bytes: float,
                            calls: int = 1) -> float:
    """:func:`collective_seconds` of one of tensor parallelism's groups (``ranks`` adjacent ranks, mesh
    innermost) with the cluster's tensor-parallel figures (module docstring)."""
    if ranks <= 1 or size_bytes <= 0:
        return 0.0
    link = cluster.tensor_parallel_link(spans_nodes(ranks, 1, cluster.devices_per_node), collective)
    return alpha_beta_seconds(link, collective, ranks, size_bytes, calls)


def alpha_beta_seconds(link: LinkCost, collective: str, ranks: int, size_bytes: float, calls: int = 1) -> float:
    """latency x steps(n) x calls + factor(n) x bytes / busbw on ``link`` (module docstring)."""
    return (calls * link.latency_s * latency_steps(collective, ranks)
            + bandwidth_factor(collective, ranks) * size_bytes / link.bandwidth)
