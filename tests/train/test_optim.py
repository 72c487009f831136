"""AdamW's three update modes: fused (the default wherever torch has the kernel), per parameter and ``foreach`` give the
same result; fused allocates nothing, per parameter a few of the largest parameter, ``foreach`` one of every parameter."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker

from xscale.config.schema import TrainConfig
from xscale.ops.optimizer_update import update_mode
from xscale.train.optim import build_optimizer


def _parameters(seed: int = 0) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    shapes = [(64, 64)] * 12 + [(64,), (32, 64)]
    return [torch.nn.Parameter(torch.randn(*shape, generator=generator)) for shape in shapes]


def _set_gradients(params: list[torch.nn.Parameter], step: int) -> None:
    generator = torch.Generator().manual_seed(100 + step)
    for param in params:
        param.grad = torch.randn(param.shape, generator=generator)


def test_auto_is_fused_on_cpu_and_cuda():
    assert update_mode("auto", "cpu") == "fused"
    assert update_mode("auto", "cuda") == "fused"
    assert update_mode("auto", "a-device-without-kernels") == "per_parameter"
    assert update_mode(True, "cpu") == "foreach" and update_mode(False, "cuda") == "per_parameter"
    optimizer = build_optimizer(_parameters(), TrainConfig())
    assert optimizer.defaults["fused"] is True and not optimizer.defaults["foreach"]
    assert not build_optimizer(_parameters(), dataclasses.replace(TrainConfig(), optimizer_foreach=False)).defaults["fused"]


@pytest.mark.parametrize("setting", ["auto", True])
def test_update_modes_equal_the_per_parameter_update(setting):
    """Three steps with weight decay on the matrices: bitwise for foreach, to float32 rounding for fused."""
    results = {}
    for mode in (setting, False):
        params = _parameters()
        optimizer = build_optimizer(params, dataclasses.replace(TrainConfig(), optimizer_foreach=mode))
        for step in range(3):
            _set_gradients(params, step)
            optimizer.step()
        results[mode] = params
    for other, single, start in zip(results[setting], results[False], _parameters()):
        # 2 ulps of float32 (values reach ~1.2, where one ulp is 1.19e-7: the AVX2 kind's fused kernel rounds there)
        torch.testing.assert_close(other, single, rtol=2.4e-7, atol=1e-7)
        assert (single - start).abs().mean() > 1e-4  # the parameters moved: the comparison is of real updates


def _step_temporaries(setting: bool | str) -> tuple[int, int]:
    """Peak bytes the second ``step()`` allocates beyond what lives before and after it (MemTracker, real tensors),
    and the largest parameter's bytes."""
    params = _parameters()
    optimizer = build_optimizer(params, dataclasses.replace(TrainConfig(), optimizer_foreach=setting))
    _set_gradients(params, 0)
    optimizer.step()  # the moments exist from here on
    _set_gradients(params, 1)
    tracker = MemTracker()
    tracker.track_external(*params, optimizer)
    with tracker:
        optimizer.step()
    peak, current = (next(iter(tracker.get_tracker_snapshot(kind).values())) for kind in ("peak", "current"))
    total = next(key for key in peak if getattr(key, "value", key) == "Total")
    return peak[total] - current[total], max(p.numel() * p.element_size() for p in params)


def test_fused_step_allocates_nothing():
    temporaries, largest = _step_temporaries("auto")
    assert temporaries == 0, (temporaries, largest)


def test_per_parameter_temporaries_are_bounded_by_the_largest_parameter():
    temporaries, largest = _step_temporaries(False)
    assert 0 < temporaries <= 4 * largest, (temporaries, largest)


def test_foreach_temporaries_grow_with_all_parameters():
    """The contrast that makes the bound above mean something: foreach holds a temporary of every parameter."""
    temporaries, largest = _step_temporaries(True)
    assert temporaries >= 12 * largest
