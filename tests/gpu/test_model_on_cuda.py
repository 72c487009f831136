"""The model core on CUDA: every attention core of the zoo (and MoE layers) forward and backward in fp32 against
the CPU result, and under bf16 autocast against CUDA fp32. On CUDA the norms, RoPE and gated activations take the
compiled Triton kernels (``train.kernels=auto``) and bf16 MoE experts ``torch._grouped_mm``."""

import copy
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from gpu_checks import BF16_TOLERANCE, DEVICE, DRY_RUN, FP32_TOLERANCE, cosine, gpu, relative_error

from xscale.config.schema import AttentionConfig, ModelConfig, MoEConfig
from xscale.models import build_model
from xscale.models.attention.sparse import PatternAttention
from xscale.models.registry import ATTENTION

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models" / "attention"))
from test_in_model import SMALL_OPTIONS, _cases  # noqa: E402  (the zoo's core matrix, one place)

pytestmark = gpu
CORES = [case for case in _cases() if case.values[2]]  # (kind, family, allowed): the allowed ones
MOE = {"switch": MoEConfig(num_experts=4, router="switch", capacity_factor=2.0),
       "top2-all": MoEConfig(num_experts=4, top_k=2, router="gshard", second_expert_policy="all"),
       "dropless": MoEConfig(num_experts=4, router="switch", dropless=True)}


def _config(kind: str = "dense", family: str = "decoder", moe: MoEConfig | None = None) -> ModelConfig:
    return ModelConfig(family=family, vocab_size=64, d_model=32, n_layers=2, n_heads=2, max_seq_len=48,
                       attention=AttentionConfig(kind=kind, options=dict(SMALL_OPTIONS)), moe=moe or MoEConfig())


def _run(model: torch.nn.Module, tokens: torch.Tensor, bf16: bool = False):
    model.zero_grad(set_to_none=True)
    with torch.autocast(tokens.device.type, dtype=torch.bfloat16, enabled=bf16):
        logits = model(tokens)
    loss = F.cross_entropy(logits.float().flatten(0, 1), tokens.flatten())
    loss.backward()
    return logits, loss, {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


def _compare_fp32(config: ModelConfig, sparse_attention: str = "gather") -> None:
    cpu_model = build_model(config)
    cuda_model = copy.deepcopy(cpu_model).to(DEVICE).use_kernels("auto", sparse_attention)
    tokens = torch.randint(0, 64, (2, 37), generator=torch.Generator().manual_seed(0))
    cpu_logits, cpu_loss, cpu_grads = _run(cpu_model, tokens)
    cuda_logits, cuda_loss, cuda_grads = _run(cuda_model, tokens.to(DEVICE))
    if sparse_attention == "flex":  # the CUDA model's pattern cores went through FlexAttention
        assert all(core._block_masks for core in cuda_model.modules() if isinstance(core, PatternAttention))
    assert relative_error(cuda_logits, cpu_logits) < FP32_TOLERANCE
    assert cuda_grads.keys() == cpu_grads.keys()
    for name, grad in cpu_grads.items():
        assert relative_error(cuda_grads[name], grad) < 10 * FP32_TOLERANCE, name


def _compare_bf16(config: ModelConfig, sparse_attention: str = "gather") -> None:
    model = build_model(config).to(DEVICE).use_kernels("auto", sparse_attention)
    tokens = torch.randint(0, 64, (2, 37), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    fp32_logits, fp32_loss, fp32_grads = _run(model, tokens)
    bf16_logits, bf16_loss, bf16_grads = _run(model, tokens, bf16=True)
    assert torch.isfinite(bf16_logits).all()
    assert relative_error(bf16_logits, fp32_logits) < BF16_TOLERANCE
    assert abs(bf16_loss.item() - fp32_loss.item()) < BF16_TOLERANCE * fp32_loss.item()
    every = list(fp32_grads)
    assert cosine(torch.cat([bf16_grads[n].flatten().float() for n in every]),
                  torch.cat([fp32_grads[n].flatten() for n in every])) > 0.99
    largest = max(grad.norm().item() for grad in fp32_grads.values())
    for name, grad in fp32_grads.items():
        if grad.norm().item() >= 1e-3 * largest:  # a gradient that small is rounding noise in both
            assert cosine(bf16_grads[name], grad) > 0.97, name
        else:
            assert (bf16_grads[name].float() - grad).norm().item() < 1e-2 * largest, name


@pytest.mark.parametrize("kind,family,allowed", CORES)
def test_core_on_cuda_matches_cpu_in_fp32(kind, family, allowed):
    _compare_fp32(_config(kind, family))


PATTERN_CORES = [case for case in CORES if issubclass(ATTENTION.get(case.values[0]), PatternAttention)]


@pytest.mark.parametrize("kind,family,allowed", PATTERN_CORES)
def test_pattern_core_through_flex_on_cuda_matches_the_gathered_cpu_core(kind, family, allowed):
    """train.sparse_attention=flex: FlexAttention's forward and backward on CUDA against the gathered path on CPU,
    in fp32, and under bf16 autocast against its own fp32."""
    if DRY_RUN:
        pytest.skip("FlexAttention trains on CUDA only")
    _compare_fp32(_config(kind, family), sparse_attention="flex")
    _compare_bf16(_config(kind, family), sparse_attention="flex")


@pytest.mark.parametrize("kind,family,allowed", CORES)
def test_core_under_bf16_autocast_stays_near_fp32(kind, family, allowed):
    _compare_bf16(_config(kind, family))


@pytest.mark.parametrize("name", list(MOE))
def test_moe_on_cuda_matches_cpu_and_bf16(name):
    _compare_fp32(_config(moe=MOE[name]))
    _compare_bf16(_config(moe=MOE[name]))


def test_bf16_moe_experts_take_grouped_mm(monkeypatch):
    if DRY_RUN:
        pytest.skip("torch._grouped_mm takes bf16 on CUDA only")
    from xscale.models.moe import experts

    taken = []
    real = experts.grouped_mm_applies
    monkeypatch.setattr(experts, "grouped_mm_applies", lambda *a: taken.append(real(*a)) or taken[-1])
    _compare_bf16(_config(moe=MOE["dropless"]))
    assert True in taken, "a bf16 MoE layer on CUDA should run its experts through torch._grouped_mm"
    assert False in taken, "and the fp32 one the per-expert path"


@pytest.mark.parametrize("name", ["switch", "top2-all"])
def test_a_bf16_moe_layer_makes_no_host_sync(name):
    """Static-rows routing (issue 47): forward and backward of a bf16 layer with local experts under
    ``torch.cuda.set_sync_debug_mode("error")``, which raises on any device-to-host synchronisation."""
    if DRY_RUN:
        pytest.skip("the static-rows path is chosen where torch._grouped_mm runs: bf16 on CUDA")
    from xscale.models.moe import build_moe
    from xscale.runtime import StepContext

    layer = build_moe(_config(moe=MOE[name]), 0).to(DEVICE, torch.bfloat16)
    x = torch.randn(2, 64, 32, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    layer(x, StepContext(seed=0)).float().sum().backward()  # lazy initialisation may synchronise once
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        layer(x, StepContext(seed=0)).float().sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
