"""switch_gate: Switch's top-1 gate as one autograd node equals the composite (softmax, max, the two loss statistics),
values and gradients of x and the router weight, on one thread or many."""

import pytest
import torch

import xscale.ops.switch_gate as switch_gate_module
from xscale.ops.switch_gate import switch_gate


def composite(x, weight):
    logits = x @ weight.t()
    log_normaliser = torch.logsumexp(logits, -1)
    probs = torch.exp(logits - log_normaliser[:, None])
    gate, expert = probs.max(-1)
    return gate, expert, probs.sum(0), log_normaliser


def leaves(n=40, d=12, experts=5, dtype=torch.float64):
    torch.manual_seed(0)
    return (torch.randn(n, d, dtype=dtype, requires_grad=True),
            torch.randn(experts, d, dtype=dtype, requires_grad=True))


def loss(outputs, upstream, which):
    gate, _expert, prob_sum, log_normaliser = outputs[:4]
    terms = {"gate": (gate * upstream[0]).sum(), "prob_sum": (prob_sum * upstream[1]).sum(),
             "log_normaliser": (log_normaliser * upstream[2]).sum()}
    return sum(terms[name] for name in which)


@pytest.mark.parametrize("which", [("gate", "prob_sum", "log_normaliser"), ("gate",), ("prob_sum",),
                                   ("log_normaliser",), ("gate", "log_normaliser")])
def test_values_and_gradients_equal_the_composite(which):
    x, weight = leaves()
    got, want = switch_gate(x, weight), composite(x, weight)
    assert torch.equal(got.expert, want[1])
    for got_value, want_value in zip((got.gate, got.prob_sum, got.log_normaliser), (want[0], want[2], want[3])):
        torch.testing.assert_close(got_value, want_value, rtol=1e-12, atol=1e-12)
    upstream = (torch.randn(40, dtype=torch.float64), torch.randn(5, dtype=torch.float64),
                torch.randn(40, dtype=torch.float64))
    got_grads = torch.autograd.grad(loss(got, upstream, which), (x, weight))
    want_grads = torch.autograd.grad(loss(want, upstream, which), (x, weight))
    for got_grad, want_grad in zip(got_grads, want_grads):
        torch.testing.assert_close(got_grad, want_grad, rtol=1e-10, atol=1e-12)


def test_gradcheck():
    x, weight = leaves(n=9, d=4, experts=3)
    assert torch.autograd.gradcheck(
        lambda x, weight: tuple(t for i, t in enumerate(switch_gate(x, weight)[:4]) if i != 1), (x, weight))


def test_float32_router_matches_the_composite_and_keeps_float32():
    x, weight = leaves(n=64, d=16, experts=8, dtype=torch.float32)
    got, want = switch_gate(x, weight), composite(x, weight)
    assert got.gate.dtype == torch.float32 and got.log_normaliser.dtype == torch.float32
    assert torch.equal(got.expert, want[1])
    torch.testing.assert_close(got.gate, want[0])
    torch.testing.assert_close(got.log_normaliser, want[3])


def test_one_thread_and_all_threads_agree(monkeypatch):
    x, weight = leaves(n=300, d=8, experts=6)
    upstream = (torch.randn(300, dtype=torch.float64), torch.randn(6, dtype=torch.float64),
                torch.randn(300, dtype=torch.float64))
    results = []
    for limit in (0, 1 << 30):  # 0: every pass on all threads; 2^30: on one
        monkeypatch.setattr(switch_gate_module, "ONE_THREAD_ELEMENTS", limit)
        outputs = switch_gate(x, weight)
        results.append((outputs.gate, *torch.autograd.grad(loss(outputs, upstream, ("gate", "prob_sum",
                                                                                    "log_normaliser")), (x, weight))))
    threads = torch.get_num_threads()
    for one, many in zip(*results):
        torch.testing.assert_close(one, many, rtol=1e-12, atol=1e-12)
    assert torch.get_num_threads() == threads


def test_x_without_grad_has_no_shared_gradient():
    x, weight = leaves()
    assert switch_gate(x.detach(), weight).input_gradient is None
    assert switch_gate(x, weight).input_gradient is not None


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match=r"x \[n, d\] and weight \[E, d\]"):
        switch_gate(torch.randn(4, 3), torch.randn(2, 5))
