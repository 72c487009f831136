"""``train.precision=fp8`` end to end: 10 steps of the parity decoder on one process follow bf16's losses, and
under data parallelism, ZeRO and the pipeline they follow the one-process fp8 run, as bf16's layouts follow its.

FP8's scales are the amax of what each GEMM sees, so a layout that cuts the batch into other microbatches scales
differently: layouts agree to FP8's rounding, not bit for bit. Measured on this machine (AVX-512, max relative loss
difference over 10 steps): tensorwise 5.8e-4 (ZeRO-3) / 3.5e-4 (ZeRO-1, pp=2); rowwise 1.8e-4 / 6.8e-5; bf16's
own layouts 1.6e-4 / 4.7e-5; fp8 vs bf16 on one process 5.1e-4 (tensorwise), 2.5e-4 (rowwise)."""

from __future__ import annotations

from pathlib import Path

import pytest
from parity_models import DECODER

from xscale.commands.parity import (
    PARITY_SETTINGS,
    layout_overrides,
    max_relative_difference,
    run_local,
    world_size_of,
)
from xscale.config.load import load_config_from_cli
from xscale.models.float8 import float8_linears

pytest.importorskip("torchao.float8", reason="train.precision=fp8 needs torchao (in the dev extras)")
LAYOUT_RTOL = 2e-3  # 3.4x the largest measured (tensorwise under ZeRO-3)
BF16_RTOL = 2e-3


def _train_counting_fp8(config) -> dict:
    from xscale.train.trainer import Trainer

    trainer = Trainer(config)
    fp8_linears = float8_linears(trainer.model.parts)
    return {"losses": trainer.fit()["losses"], "fp8_linears": fp8_linears}


def losses(tmp_path: Path, name: str, precision: list[str], layout: str | None = None,
           fp8_linears: int | None = None) -> list[float]:
    """The run's losses; ``fp8_linears``: the FP8 linear layers every rank must hold."""
    config = load_config_from_cli(None, [*DECODER, *PARITY_SETTINGS, "train.steps=10", *precision,
                                         *(layout_overrides(layout) if layout else []),
                                         f"train.output_dir={tmp_path / name}"])
    ranks = run_local(_train_counting_fp8, world_size_of(config), config)
    if fp8_linears is not None:
        assert [rank["fp8_linears"] for rank in ranks] == [fp8_linears] * len(ranks), (layout, ranks)
    return ranks[0]["losses"]


def check_layouts(tmp_path, recipe: str, layouts: list[str], against_bf16: bool) -> None:
    fp8 = ["train.precision=fp8", f"train.fp8_recipe={recipe}"]
    reference = losses(tmp_path, "fp8", fp8, fp8_linears=14)  # 2 blocks x (wq wk wv wo w_gate w_up w_down)
    assert reference[-1] < reference[0], "the fp8 run must train"
    if against_bf16:
        bf16 = losses(tmp_path, "bf16", ["train.precision=bf16"], fp8_linears=0)
        assert 0 < max_relative_difference(bf16, reference) <= BF16_RTOL, (bf16, reference)
    for index, layout in enumerate(layouts):
        got = losses(tmp_path, f"layout{index}", fp8, layout, fp8_linears=7 if layout == "pp=2" else 14)
        assert max_relative_difference(reference, got) <= LAYOUT_RTOL, (layout, reference, got)


def test_fp8_follows_bf16_on_one_process_and_one_process_under_zero3(tmp_path):
    check_layouts(tmp_path, "tensorwise", ["dp_shard=2,zero_stage=3"], against_bf16=True)


@pytest.mark.slow
def test_fp8_under_zero1_and_the_pipeline_and_the_rowwise_recipe(tmp_path):
    check_layouts(tmp_path, "tensorwise", ["dp_shard=2,zero_stage=1", "pp=2"], against_bf16=False)
    check_layouts(tmp_path / "rowwise", "rowwise", ["dp_shard=2,zero_stage=3", "pp=2"], against_bf16=True)


@pytest.mark.slow
def test_compiled_blocks_in_fp8_follow_eager_fp8_on_one_process_and_under_zero3(tmp_path):
    """``train.compile=true`` with fp8 (the GPU bench's setting: inductor fuses the scale and cast passes into the
    neighbouring kernels) follows the eager fp8 run, on one process and under ZeRO-3 (measured: the last losses
    equal to 4 digits on one process, 1.9e-4 apart under ZeRO-3)."""
    fp8 = ["train.precision=fp8", "train.fp8_recipe=tensorwise"]
    eager = losses(tmp_path, "eager", fp8, fp8_linears=14)
    compiled = losses(tmp_path, "compiled", [*fp8, "train.compile=true"], fp8_linears=14)
    assert max_relative_difference(eager, compiled) <= LAYOUT_RTOL, (eager, compiled)
    sharded = losses(tmp_path, "zero3", [*fp8, "train.compile=true"], "dp_shard=2,zero_stage=3", fp8_linears=14)
    assert max_relative_difference(compiled, sharded) <= LAYOUT_RTOL, (compiled, sharded)
