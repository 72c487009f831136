"""FP8 training of the blocks' linear layers through torchao (``train.precision=fp8``): which layers convert, the
numerics against bf16 autocast (torch's CPU FP8 GEMM), checkpoints unchanged, and the refusals."""

from __future__ import annotations

import copy
import sys

import pytest
import torch
import torch.nn.functional as F

from xscale.config.load import load_config
from xscale.config.schema import ConfigError
from xscale.models import build_model, float8
from xscale.models.float8 import float8_linears, float8_refusal, needs_reference_cpu_gemm, use_float8
from xscale.parallel.checks import resolve_dims

pytest.importorskip("torchao.float8", reason="train.precision=fp8 needs torchao (in the dev extras)")
CPU = torch.device("cpu")
TINY = ["model.vocab_size=48", "model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
        "model.ffn=swiglu"]


@pytest.fixture(autouse=True)
def onednn_restored():
    """A rowwise conversion on an AMX CPU turns oneDNN off for its process; the suite's process gets it back."""
    enabled = torch.backends.mkldnn.enabled
    yield
    torch.backends.mkldnn.enabled = enabled


def tiny_model(*overrides: str):
    return build_model(load_config(None, [*TINY, *overrides]).model, seed=0)


def loss_and_grads(model, tokens):
    model.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(tokens).float()
    loss = F.cross_entropy(logits.flatten(0, 1), tokens.flatten())
    loss.backward()
    return logits, loss, {name: param.grad.clone() for name, param in model.named_parameters()}


def test_the_blocks_linears_convert_and_the_checkpoint_names_do_not():
    model = tiny_model()
    converted = copy.deepcopy(model)
    names = use_float8(converted, "tensorwise", CPU)
    assert len(names) == float8_linears([converted]) == 2 * 7  # wq wk wv wo, w_gate w_up w_down per block
    assert all(".layers." in name for name in names) and "output" not in names
    assert type(converted.output).__name__ == "Linear"  # the head stays in bf16
    assert converted.state_dict().keys() == model.state_dict().keys()
    converted.load_state_dict(model.state_dict(), strict=True)  # a bf16 run's checkpoint loads, and back
    model.load_state_dict(converted.state_dict(), strict=True)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_forward_and_gradients_stay_near_bf16(recipe):
    """E4M3/E5M2 keep 3/2 mantissa bits: logits within 5% of bf16 autocast's, the loss within 1%, every gradient at
    cosine >= 0.98 (measured: 0.8% on the logits, 0.003% on the loss, cosine >= 0.991); and not equal to bf16's,
    so FP8 really ran."""
    model = tiny_model()
    fp8 = copy.deepcopy(model)
    use_float8(fp8, recipe, CPU)
    tokens = torch.randint(0, 48, (4, 16), generator=torch.Generator().manual_seed(0))
    want_logits, want_loss, want_grads = loss_and_grads(model, tokens)
    got_logits, got_loss, got_grads = loss_and_grads(fp8, tokens)
    relative = ((got_logits - want_logits).norm() / want_logits.norm()).item()
    assert 1e-4 < relative < 0.05, relative
    assert abs(got_loss.item() - want_loss.item()) <= 0.01 * want_loss.item()
    for name, want in want_grads.items():
        cosine = F.cosine_similarity(got_grads[name].flatten(), want.flatten(), dim=0).item()
        assert cosine >= 0.98, (name, cosine)


def test_a_gpu_without_fp8_tensor_cores_is_refused_with_what_to_use(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    why = float8_refusal(torch.device("cuda"))
    assert "compute capability 8.9 or later" in why and "A100-SXM4-80GB is 8.0" in why and "precision=bf16" in why
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert float8_refusal(torch.device("cuda")) is None
    assert "not on 'mps'" in float8_refusal(torch.device("mps"))


def test_without_torchao_the_refusal_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao.float8", None)  # import fails as if not installed
    with pytest.raises(ConfigError, match=r"pip install 'torchao>=0.18'"):
        use_float8(tiny_model(), "tensorwise", CPU)


def test_a_bad_recipe_a_model_with_no_aligned_linear_and_tensor_parallelism_are_refused():
    with pytest.raises(ConfigError, match="train.fp8_recipe='delayed' is not one of tensorwise, rowwise"):
        use_float8(tiny_model(), "delayed", CPU)
    with pytest.raises(ConfigError, match="no linear layer to run in FP8"):
        use_float8(tiny_model("model.d_model=24", "model.n_heads=3", "model.n_kv_heads=3"), "tensorwise", CPU)
    config = load_config(None, [*TINY, "train.precision=fp8", "parallel.tp=2"])
    with pytest.raises(ConfigError, match="train.precision=fp8 with parallel.tp=2"):
        resolve_dims(config, 2)


@pytest.mark.parametrize("amx", [False, True])
def test_rowwise_on_an_amx_cpu_bypasses_onednn_which_takes_one_scale_per_tensor(monkeypatch, amx):
    """On a CPU with AMX, torch sends float8 x float8 GEMMs to oneDNN, which asserts per-tensor scales; rowwise
    turns oneDNN off there (only there, and not for tensorwise), and the rowwise step then runs."""
    monkeypatch.setattr(float8, "cpu_flags", lambda: {"avx512f", *(["amx_int8"] if amx else [])})
    torch.backends.mkldnn.enabled = True
    use_float8(tiny_model(), "tensorwise", CPU)
    assert torch.backends.mkldnn.enabled
    assert needs_reference_cpu_gemm("rowwise", CPU) is amx
    assert not needs_reference_cpu_gemm("rowwise", torch.device("cuda"))
    model = tiny_model()
    use_float8(model, "rowwise", CPU)
    assert torch.backends.mkldnn.enabled is not amx
    _, loss, grads = loss_and_grads(model, torch.randint(0, 48, (2, 16), generator=torch.Generator().manual_seed(0)))
    assert torch.isfinite(loss) and all(torch.isfinite(grad).all() for grad in grads.values())
