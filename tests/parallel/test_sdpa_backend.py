"""train.sdpa_backend: the pinned kernel is the one the step's forward runs, and bad choices are refused."""

import pytest
import torch
import torch.nn.functional as F

from xscale.config.schema import ConfigError
from xscale.parallel.model import ParallelModel
from xscale.parallel.sdpa_backend import check_sdpa_backend, sdpa_backend_context


def test_auto_pins_nothing_and_math_is_pinned():
    q = torch.randn(1, 2, 8, 4)
    with sdpa_backend_context("auto"):
        F.scaled_dot_product_attention(q, q, q)
    with sdpa_backend_context("math"):
        assert torch._C._get_math_sdp_enabled() and not torch._C._get_flash_sdp_enabled()
        F.scaled_dot_product_attention(q, q, q)
    assert torch._C._get_flash_sdp_enabled()  # restored on exit


def test_the_step_forward_runs_under_the_pinned_backend():
    model = ParallelModel([torch.nn.Linear(2, 2)], micro_batch_size=1, sdpa_backend="math")
    with model.autocast():
        assert not torch._C._get_flash_sdp_enabled()
    assert torch._C._get_flash_sdp_enabled()


@pytest.mark.parametrize("name,device,message", [("flashy", "cpu", "not one of"),
                                                 ("efficient", "cpu", "CUDA only"), ("cudnn", "cpu", "CUDA only")])
def test_bad_choices_are_refused_with_the_fix(name, device, message):
    with pytest.raises(ConfigError, match=message):
        check_sdpa_backend(name, device)
    check_sdpa_backend("flash", "cpu")
    check_sdpa_backend("cudnn", "cuda")
