"""ZeRO-3's FSDP2 units on gloo CPU ranks: their all-gathers and reduce-scatters are xscale's direct transfers, the
next block's all-gather starts before a block runs, and the gradients left are the sums of the ranks' gradients (the
layouts' loss parity is test_data_parallel's)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from spawned import WORLD, spawn
from torch import nn
from torch.distributed.tensor import DTensor

from xscale.parallel.collectives import GLOO_DIRECT
from xscale.parallel.data import fsdp
from xscale.parallel.dims import ParallelDims


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 5), nn.Tanh(), nn.Linear(5, 3))


def _loss(model: nn.Module, rank: int) -> torch.Tensor:
    torch.manual_seed(100 + rank)
    return model(torch.randn(4, 6)).square().sum()


def check_direct_collectives_sum_the_gradients(rank: int) -> None:
    calls = {"all_gather": 0, "reduce_scatter": 0}
    events = []
    originals = fsdp.all_gather_flat, fsdp.reduce_scatter_flat

    def counted(name, function):
        def call(*args, **kwargs):
            calls[name] += 1
            events.append(name)
            return function(*args, **kwargs)
        return call

    fsdp.all_gather_flat = counted("all_gather", originals[0])
    fsdp.reduce_scatter_flat = counted("reduce_scatter", originals[1])
    try:
        dims = ParallelDims(dp_shard=WORLD, zero_stage=3)
        model = _model()
        fsdp.apply_fsdp(model, dims.build_mesh("cpu"), dims, None, blocks=[model[0], model[2]])
        for index in (0, 2):  # after FSDP's own pre-forward hook, which gathers the block (and prefetches)
            model[index].register_forward_pre_hook(lambda module, args, index=index: events.append(f"forward {index}"))
        _loss(model, rank).backward()
    finally:
        fsdp.all_gather_flat, fsdp.reduce_scatter_flat = originals
    # forward: each of the 2 blocks and the root; backward: the first block again (the last one stays gathered from
    # its forward to its backward); one reduce-scatter a unit
    assert calls == {"all_gather": 4, "reduce_scatter": 3}, calls
    # the second block's all-gather was started before the first block ran (prefetched), not after it
    assert events[:5] == ["all_gather"] * 3 + ["forward 0", "forward 2"], events

    reference = _model()
    for source in range(WORLD):
        _loss(reference, source).backward()
    for param, expected in zip(model.parameters(), reference.parameters()):
        assert isinstance(param.grad, DTensor)
        torch.testing.assert_close(param.grad.full_tensor(), expected.grad, rtol=1e-5, atol=1e-6)
    dist.barrier()


def test_fsdp_units_use_the_direct_collectives_and_sum_the_gradients():
    assert GLOO_DIRECT, "run without XSCALE_GLOO_DIRECT=0: this checks the direct transfers"
    spawn(check_direct_collectives_sum_the_gradients)
