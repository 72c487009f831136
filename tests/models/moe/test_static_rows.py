"""The MoE layer without host syncs (issue 47, item 1): static-rows routing into grouped GEMMs with the groups' ends
on the device. On CPU the path is forced (it is chosen where the grouped GEMM runs: CUDA, bf16); torch's CPU
``_grouped_mm`` computes it, and fake tensors (no data, so no host read can succeed) prove there is no sync."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from xscale.config.schema import ModelConfig, MoEConfig
from xscale.models.moe import build_moe
from xscale.models.moe.experts import StackedExperts
from xscale.models.moe.routing import count_by_index
from xscale.runtime import StepContext

CASES = {  # name: MoE options; each drops tokens unless dropless
    "switch": dict(router="switch", top_k=1, capacity_factor=1.0),
    "switch-dropless": dict(router="switch", top_k=1, dropless=True),
    "gshard-sampling": dict(router="gshard", top_k=2, capacity_factor=0.75, second_expert_policy="sampling"),
    "gshard-probs": dict(router="gshard", top_k=2, capacity_factor=0.75, drop_policy="probs",
                         second_expert_policy="all"),
    "hash": dict(router="hash", top_k=1, capacity_factor=1.0),
}


def moe_layer(ffn: str, bias: bool = False, **moe):
    config = ModelConfig(family="encoder", d_model=16, d_ff=32, ffn=ffn, n_layers=2, n_heads=2, vocab_size=50,
                         bias=bias, moe=MoEConfig(num_experts=4, min_capacity=0, aux_loss_coef=0.1,
                                                  z_loss_coef=0.01, **moe))
    layer = build_moe(config, 0)
    torch.manual_seed(0)
    with torch.no_grad():
        for param in layer.parameters():
            param.normal_(0, 0.5)
    return layer


@pytest.fixture
def static_rows(monkeypatch):
    """Force the static-rows path (on CPU it is otherwise never chosen)."""
    def force(on: bool) -> None:
        monkeypatch.setattr(StackedExperts, "static_rows_apply", lambda self, tokens: on)
    return force


def run(layer, x, context):
    x = x.clone().requires_grad_()
    out = layer(x, context)
    upstream = torch.linspace(-1, 1, out.numel()).reshape(out.shape)
    grads = torch.autograd.grad((out * upstream).sum(), [x, *layer.parameters()])
    return out, grads, {name: value.clone() for name, value in layer.metrics.items()}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("ffn,bias", [("gelu", True), ("swiglu", False)])
def test_static_rows_equal_the_kept_rows_path(static_rows, case, ffn, bias):
    """Outputs, every gradient (router through the gates and both losses, experts, input) and the routing metrics
    equal the kept-rows path's, dropped tokens included (fp32: the same sums, other GEMM blocking)."""
    layer = moe_layer(ffn, bias, **CASES[case])
    x = torch.randn(2, 24, 16)
    context = StepContext(seed=3, token_ids=torch.randint(0, 50, (2, 24)))
    static_rows(False)
    want_out, want_grads, want_metrics = run(layer, x, context)
    static_rows(True)
    got_out, got_grads, got_metrics = run(layer, x, context)
    if case != "switch-dropless":
        assert float(want_metrics["dropped_fraction"]) > 0, "the case should drop tokens"
    torch.testing.assert_close(got_out, want_out, rtol=1e-5, atol=1e-5)
    for name, got, want in zip(["x", *dict(layer.named_parameters())], got_grads, want_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
    assert got_metrics.keys() == want_metrics.keys()
    for name in want_metrics:
        torch.testing.assert_close(got_metrics[name], want_metrics[name], msg=name)


@pytest.mark.parametrize("case", ["switch", "gshard-sampling"])
def test_the_static_layer_runs_forward_and_backward_on_tensors_without_data(static_rows, case):
    """Under fake tensors every host read (``.item()``, ``.tolist()``) and every output sized by data (``nonzero``,
    ``bincount``, ``repeat_interleave`` without a size) raises: the static path runs through; the kept-rows path,
    checked the same way, does not (its ``nonzero``), so the check can fail."""
    layer = moe_layer("swiglu", **CASES[case]).to(torch.bfloat16)  # the grouped GEMM's shape rules want bf16
    for static, error in [(True, None), (False, "nonzero")]:
        static_rows(static)
        with FakeTensorMode(allow_non_fake_inputs=True):
            x = torch.randn(2, 24, 16, dtype=torch.bfloat16, requires_grad=True)
            if error is None:
                out = layer(x, StepContext(seed=1))
                grads = torch.autograd.grad(out.float().sum(), [x, *layer.parameters()])
                assert out.shape == x.shape and len(grads) == 1 + len(list(layer.parameters()))
            else:
                with pytest.raises(Exception, match=error):
                    layer(x, StepContext(seed=1))


def test_counting_by_index_is_bincount_without_its_sync():
    index = torch.tensor([3, 0, 3, 1, 3])
    assert count_by_index(index, 5).tolist() == torch.bincount(index, minlength=5).tolist() == [1, 1, 0, 3, 0]
    with FakeTensorMode():
        assert count_by_index(torch.zeros(7, dtype=torch.long), 4).shape == (4,)


def test_the_static_layer_compiles_as_one_graph(static_rows):
    """``torch.compile(fullgraph=True)`` traces the routed path without a graph break (no data-dependent shape, no
    host read) and gives the eager output; the kept-rows path cannot (its threaded expert pass stays eager). Under
    autograd the auxiliary loss's attachment runs eagerly by design (:func:`attach_auxiliary_loss`), so the check
    is of inference."""
    layer = moe_layer("swiglu", **CASES["gshard-sampling"]).to(torch.bfloat16).eval()
    x = torch.randn(2, 24, 16, dtype=torch.bfloat16)
    for static in (True, False):
        static_rows(static)
        torch._dynamo.reset()
        compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
        with torch.no_grad():
            if static:
                torch.testing.assert_close(compiled(x), layer(x), rtol=0, atol=0)
            else:
                with pytest.raises(Exception, match="Unsupported|graph break|skipped"):
                    compiled(x)
    torch._dynamo.reset()
