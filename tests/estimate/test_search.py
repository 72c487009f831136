"""The layout search (:mod:`xscale.estimate.search`): what it returns passes the validator and fits, ranked by
tokens/s with ties to the simpler layout; nothing fitting is one clear error."""

from __future__ import annotations

import dataclasses

import pytest

from xscale.config.load import load_config
from xscale.estimate.cluster import load_cluster
from xscale.estimate.collective_memory import collective_buffer_bytes
from xscale.estimate.in_flight import blocks_in_flight
from xscale.estimate.layout import Layout
from xscale.estimate.layout_memory import peak_bytes
from xscale.estimate.model_shape import model_shape
from xscale.estimate.placement import placement
from xscale.estimate.search import (
    MEMORY_USABLE,
    Plan,
    PlanError,
    Planner,
    accepted,
    candidate_layouts,
    rank_key,
    search,
)
from xscale.estimate.step_time import step_time
from xscale.parallel.checks import resolve_layout
from xscale.parallel.pipeline import SCHEDULES, stage_to_rank
from xscale.parallel.pipeline.cost import stage_layers

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


def _every_plan(shape, cluster, devices: int) -> list[tuple[Plan, ...]]:
    """Each candidate layout under each recomputation (a dense core's: none, full), predicted from the cost model's
    own terms: no planner, no cache, no layout or rank skipped."""
    every, split = [], {}
    for layout in candidate_layouts(shape, cluster, devices):
        plans = []
        for checkpointing in ("none", "full"):
            chosen = dataclasses.replace(layout, checkpointing=checkpointing)
            config = chosen.apply(shape.config)
            stages = chosen.pp * chosen.stages_per_rank
            if stages not in split:  # the pipeline's own split (it depends on the stage count only)
                split[stages] = stage_layers(config, stages)
            where = placement(config, split[stages])
            held = [float(len(where.rank_blocks[0]))]
            if chosen.pp > 1:
                held = blocks_in_flight(config, chosen.pp, stage_to_rank(stages, chosen.pp, SCHEDULES[
                    chosen.schedule].placement), split[stages])
            peak = (peak_bytes(shape, config, chosen, where, held) + collective_buffer_bytes(shape, cluster, chosen, where)
                    + cluster.runtime_memory_bytes)
            step = step_time(shape, cluster, chosen, where)
            plans.append(Plan(chosen, step, peak, shape.global_batch * shape.seq_len / step.total, 0.0))
        every.append(tuple(plans))
    return every


PIPELINED = [*SMALL, "train.global_batch_size=8", "parallel.bucket_mb=1"]


@pytest.fixture(scope="module")
def pipelined():
    """A 4-block model on 8 devices (pp up to 4, whose middle ranks are alike), every layout predicted whole."""
    shape = model_shape(load_config(overrides=PIPELINED))
    return shape, _every_plan(shape, load_cluster(H100), 8)


@pytest.mark.parametrize("quantile", [0.5, 0.75, 1.0])
def test_search_agrees_with_every_layout_predicted(pipelined, quantile):
    """The search skips layouts whose model state alone does not fit, compares one pp rank of each kind and
    caches what layouts share: on a device sized so that a share of the layouts is skipped, it returns every
    accepted layout that fits, in the order of all layouts predicted whole."""
    shape, every = pipelined
    h100 = load_cluster(H100)
    planner = Planner(shape, h100, 8)
    floors = sorted(planner.state_floor(plans[0].layout) for plans in every)
    cluster = dataclasses.replace(h100, memory_bytes=0.999 * floors[int(quantile * (len(floors) - 1))] / MEMORY_USABLE)
    usable = MEMORY_USABLE * cluster.memory_bytes
    fitting = sorted((next(plan for plan in plans if plan.peak_bytes <= usable) for plans in every
                      if any(plan.peak_bytes <= usable for plan in plans)), key=rank_key)
    expected = [plan for plan in fitting if accepted(plan.layout.apply(shape.config), 8)]
    assert len(expected) > 1 and any(floor > usable for floor in floors)
    found = search(shape, cluster, 8, top=len(expected))
    assert [(plan.layout, plan.peak_bytes, plan.tokens_per_s, plan.step) for plan in found] == [
        (plan.layout, plan.peak_bytes, plan.tokens_per_s, plan.step) for plan in expected]


def test_nothing_fits_names_the_least_peak_of_every_layout(pipelined):
    shape, every = pipelined
    smallest = min((plan for plans in every for plan in plans), key=lambda plan: plan.peak_bytes)  # the first least
    cluster = dataclasses.replace(load_cluster(H100), memory_bytes=0.99 * smallest.peak_bytes / MEMORY_USABLE)
    with pytest.raises(PlanError) as error:
        search(shape, cluster, 8)
    assert f"{smallest.peak_bytes / 2**30:.1f} GiB per rank ({smallest.layout.describe()})" in str(error.value)
