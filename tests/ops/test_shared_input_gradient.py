"""SharedInputGradient: the top-1 MoE layer's experts leave their input gradient for the router's backward to add to;
the input's gradient equals autograd's sum of the two, and the hand-off is skipped wherever the router read other
rows (a jittered or autocast copy)."""

import pytest
import torch

from xscale.config.schema import ModelConfig, MoEConfig
from xscale.models.moe import build_moe
from xscale.ops.shared_input_gradient import SharedInputGradient


def layer(**moe):
    torch.manual_seed(0)
    config = ModelConfig(d_model=8, d_ff=16, ffn="gelu", moe=MoEConfig(num_experts=4, router="switch", top_k=1,
                                                                       capacity_factor=1.0, **moe))
    module = build_moe(config, 0)
    with torch.no_grad():
        for param in module.parameters():
            param.normal_(0, 0.5)
    return module


@pytest.fixture
def hand_offs(monkeypatch):
    """Counts the gradients left and taken (the real methods run)."""
    counts = {"left": 0, "taken": 0}
    leave, take = SharedInputGradient.leave, SharedInputGradient.take

    def counting_leave(self, grad):
        counts["left"] += 1
        leave(self, grad)

    def counting_take(self):
        grad = take(self)
        counts["taken"] += grad is not None
        return grad

    monkeypatch.setattr(SharedInputGradient, "leave", counting_leave)
    monkeypatch.setattr(SharedInputGradient, "take", counting_take)
    return counts


def input_gradient(module, x, upstream):
    x = x.detach().requires_grad_()
    (module(x) * upstream).sum().backward()
    return x.grad


@pytest.mark.parametrize("shape", [(24, 8), (2, 12, 8)])
def test_input_gradient_equals_autograds_sum(shape, hand_offs, monkeypatch):
    module = layer(aux_loss_coef=0.5, z_loss_coef=0.25)
    x, upstream = torch.randn(shape), torch.randn(shape)
    shared = input_gradient(module, x, upstream)
    assert hand_offs == {"left": 1, "taken": 1}
    monkeypatch.setattr(SharedInputGradient, "serves", lambda self, rows: False)
    summed = input_gradient(module, x, upstream)
    assert hand_offs == {"left": 1, "taken": 1}  # the second backward summed the two itself
    torch.testing.assert_close(shared, summed, rtol=1e-6, atol=1e-7)


def test_no_hand_off_when_the_router_reads_a_jittered_copy(hand_offs):
    module = layer(jitter=0.1).train()
    input_gradient(module, torch.randn(24, 8), torch.randn(24, 8))
    assert hand_offs == {"left": 0, "taken": 0}


def test_no_hand_off_when_the_experts_read_an_autocast_copy(hand_offs):
    module = layer()
    x = torch.randn(24, 8, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = module(x)
    out.float().sum().backward()
    assert hand_offs == {"left": 0, "taken": 0}
    assert x.grad is not None and x.grad.abs().sum() > 0


def test_only_the_same_rows_of_the_same_tensor_are_served():
    x = torch.randn(6, 4, requires_grad=True)
    shared = SharedInputGradient(x.reshape(-1, 4))
    assert shared.serves(x.view(6, 4))
    assert not shared.serves(x.detach())  # same storage, no gradient wanted
    assert not shared.serves(x.detach().requires_grad_())  # same storage, another autograd tensor
    assert not shared.serves(x[1:])
    assert not shared.serves(x.t())


def test_a_gradient_left_twice_is_refused():
    shared = SharedInputGradient(torch.randn(2, 2, requires_grad=True))
    shared.leave(torch.ones(2, 2))
    with pytest.raises(RuntimeError, match="left twice"):
        shared.leave(torch.ones(2, 2))
    assert shared.take() is not None and shared.take() is None
