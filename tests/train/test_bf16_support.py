"""bf16 on a CPU without AMX is slower than fp32 (emulated without AVX512_BF16, half fp32's rate with it): one
warning at the start of a run says so."""

from __future__ import annotations

import pytest

from xscale.train import bf16_support
from xscale.train.bf16_support import bf16_warning


@pytest.fixture
def cpu(monkeypatch):
    def set_cpu(capability: str, flags: set[str]):
        monkeypatch.setattr(bf16_support.torch.backends.cpu, "get_cpu_capability", lambda: capability)
        monkeypatch.setattr(bf16_support, "cpu_flags", lambda: flags)
    return set_cpu


def test_bf16_on_an_avx2_cpu_warns(cpu):
    cpu("AVX2", {"avx2", "fma"})
    warning = bf16_warning("bf16", "cpu")
    assert warning is not None and "AVX2" in warning and "AVX512_BF16" in warning


@pytest.mark.parametrize(("capability", "flags"), [("AVX512", {"avx512f", "avx512_bf16"}), ("AVX512_BF16", set())])
def test_avx512_bf16_without_amx_warns_that_fp32_is_faster(cpu, capability, flags):
    cpu(capability, flags)
    warning = bf16_warning("bf16", "cpu")
    assert warning is not None and "no AMX" in warning and "fp32 is likely faster" in warning


@pytest.mark.parametrize(("capability", "flags"), [("AVX512", {"avx512_bf16", "amx_bf16"}), ("AMX", set())])
def test_amx_does_not_warn(cpu, capability, flags):
    cpu(capability, flags)
    assert bf16_warning("bf16", "cpu") is None


def test_fp32_and_gpus_do_not_warn(cpu):
    cpu("AVX2", set())
    assert bf16_warning("fp32", "cpu") is None
    assert bf16_warning("bf16", "cuda") is None
