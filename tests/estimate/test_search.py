"""The layout search (:mod:`xscale.estimate.search`): what it returns passes the validator and fits, ranked by
tokens/s with ties to the simpler layout; nothing fitting is one clear error."""

from __future__ import annotations

import pytest

from xscale.config.load import load_config
from xscale.estimate.cluster import load_cluster
from xscale.estimate.layout import Layout
from xscale.estimate.model_shape import model_shape
from xscale.estimate.search import MEMORY_USABLE, PlanError, candidate_layouts, search
from xscale.parallel.checks import resolve_layout

SMALL = ["model.vocab_size=512", "model.d_model=64", "model.n_layers=4", "model.n_heads=4", "model.n_kv_heads=2",
         "train.seq_len=64", "train.global_batch_size=16"]
CPU = "configs/clusters/cpu-2core.yaml"
H100 = "configs/clusters/h100-ib.yaml"


@pytest.fixture(scope="module")
def small():
    return model_shape(load_config(overrides=SMALL))


@pytest.mark.parametrize("devices", [1, 2, 4])
def test_plans_pass_the_validator_and_fit(small, devices):
    cluster = load_cluster(CPU)
    plans = search(small, cluster, devices, top=8)
    speeds = [plan.tokens_per_s for plan in plans]
    assert speeds == sorted(speeds, reverse=True) or len({f"{s:.3g}" for s in speeds}) < len(speeds)
    for plan in plans:
        dims, _ = resolve_layout(plan.layout.apply(small.config), devices)
        assert dims.world_size == devices == plan.layout.world_size
        assert plan.peak_bytes <= MEMORY_USABLE * cluster.memory_bytes
        assert 0 < plan.mfu < 1


def test_enumeration_respects_heads_and_batch(small):
    layouts = candidate_layouts(small, load_cluster(H100), 16)
    assert layouts and all(2 % layout.tp == 0 for layout in layouts)  # 2 kv heads: tp 1 or 2
    assert all(16 % layout.dp == 0 for layout in layouts)
    assert all(layout.world_size == 16 for layout in layouts)


def test_ties_go_to_the_simpler_layout():
    assert Layout(dp=8).complexity() < Layout(dp=4, tp=2).complexity()
    assert Layout(dp=8, zero_stage=1).complexity() < Layout(dp=8, zero_stage=3).complexity()


def test_nothing_fits_is_one_line(small):
    huge = model_shape(load_config(overrides=[*SMALL, "model.d_model=4096", "model.n_layers=8"]))
    with pytest.raises(PlanError, match="nothing fits on 1 devices") as error:
        search(huge, load_cluster(CPU), 1)
    assert "\n" not in str(error.value)


def test_more_devices_than_the_batch_can_use(small):
    with pytest.raises(PlanError, match="no layout uses 4096 devices"):
        search(small, load_cluster(CPU), 4096)


def test_ties_prefer_fewer_microbatches():
    assert Layout(dp=2, micro_batch=8, microbatches=1).complexity() < Layout(dp=2, micro_batch=4,
                                                                            microbatches=2).complexity()
    assert Layout(dp=2, microbatches=4).complexity() < Layout(dp=1, pp=2, microbatches=2).complexity()
