"""AdamW's per-parameter update: the same result as ``foreach``, without temporaries the size of all parameters."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker

from xscale.config import TrainConfig
from xscale.train.optim import build_optimizer, update_mode


def _parameters(seed: int = 0) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    shapes = [(64, 64)] * 12 + [(64,), (32, 64)]
    return [torch.nn.Parameter(torch.randn(*shape, generator=generator)) for shape in shapes]


def _set_gradients(params: list[torch.nn.Parameter], step: int) -> None:
    generator = torch.Generator().manual_seed(100 + step)
    for param in params:
        param.grad = torch.randn(param.shape, generator=generator)


def test_auto_is_per_parameter_on_cpu_and_fused_on_cuda():
    assert update_mode("auto", "cpu") == "per_parameter"
    assert update_mode("auto", "cuda") == "fused"
    assert update_mode(True, "cpu") == "foreach" and update_mode(False, "cuda") == "per_parameter"
    optimizer = build_optimizer(_parameters(), TrainConfig())
    assert optimizer.defaults["foreach"] is False and not optimizer.defaults["fused"]


def test_per_parameter_update_equals_foreach():
    results = {}
    for setting in (True, False):
        params = _parameters()
        optimizer = build_optimizer(params, dataclasses.replace(TrainConfig(), optimizer_foreach=setting))
        for step in range(3):
            _set_gradients(params, step)
            optimizer.step()
        results[setting] = params
    for foreach, single in zip(results[True], results[False]):
        torch.testing.assert_close(single, foreach, rtol=0, atol=1e-7)


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


@pytest.mark.parametrize("setting", ["auto", False])
def test_step_temporaries_are_bounded_by_the_largest_parameter(setting):
    temporaries, largest = _step_temporaries(setting)
    assert 0 < temporaries <= 4 * largest, (temporaries, largest)


def test_foreach_temporaries_grow_with_all_parameters():
    """The contrast that makes the bound above mean something: foreach holds a temporary of every parameter."""
    temporaries, largest = _step_temporaries(True)
    assert temporaries >= 12 * largest
