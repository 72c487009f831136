"""Where a layout puts the model (:mod:`xscale.estimate.placement`): the parameters each pp rank holds are those of
the real pipeline stages (:func:`xscale.estimate.memory.pipeline_rank_parameters` cuts them on the meta device),
for tied and untied heads, learned position tables, an encoder's embedding norm and head transform, an
encoder-decoder with MoE layers, and every stage placement (1F1B, interleaved, V)."""

from __future__ import annotations

import pytest

import xscale.commands.registrations  # noqa: F401  (every layer's config checks)
from xscale.config.load import load_config
from xscale.estimate.layout import Layout
from xscale.estimate.memory import pipeline_rank_parameters
from xscale.estimate.model_shape import model_shape
from xscale.estimate.placement import placement, rank_parameters
from xscale.models.parameters import count_parameters
from xscale.parallel.checks import resolve_layout

SMALL = ["model.vocab_size=256", "model.d_model=32", "model.n_heads=4", "model.d_ff=64", "train.seq_len=16",
         "train.global_batch_size=8", "data.dataset=copy"]
MODELS = {
    "tied, learned positions": ("configs/tiny-gpt.yaml", ["model.n_layers=8", "model.position=learned",
                                                          "model.tie_embeddings=true"]),
    "untied": ("configs/tiny-gpt.yaml", ["model.n_layers=8", "model.tie_embeddings=false"]),
    "encoder, embedding norm and head transform": ("configs/tiny-bert.yaml", ["model.n_layers=8"]),
    "encoder-decoder, MoE, relative positions": ("configs/tiny-t5.yaml", [
        "model.n_layers=4", "model.n_decoder_layers=4", "model.moe.num_experts=4", "model.moe.every=2"]),
}
PIPELINES = [Layout(pp=2, micro_batch=1, microbatches=4, schedule="1f1b"),
             Layout(pp=2, micro_batch=1, microbatches=4, schedule="interleaved_1f1b", stages_per_rank=2),
             Layout(pp=2, micro_batch=1, microbatches=4, schedule="zero_bubble", stages_per_rank=2),
             Layout(pp=4, micro_batch=1, microbatches=4, schedule="zero_bubble", stages_per_rank=2),
             Layout(pp=2, tp=2, micro_batch=1, microbatches=4, schedule="1f1b", sequence_parallel=True)]


@pytest.fixture(scope="module", params=list(MODELS))
def shape(request):
    path, overrides = MODELS[request.param]
    return model_shape(load_config(path, [*SMALL, *overrides]))


def test_one_rank_holds_every_parameter(shape):
    assert rank_parameters(shape, placement(shape.config), 0) == (
        count_parameters(shape.config).total, count_parameters(shape.config).expert, 0)


@pytest.mark.parametrize("layout", PIPELINES, ids=lambda layout: layout.describe())
def test_pipeline_ranks_hold_what_their_stages_hold(shape, layout):
    config = layout.apply(shape.config)
    dims, config = resolve_layout(config, layout.world_size)
    where = placement(config)
    assert [rank_parameters(shape, where, rank, layout.tp)
            for rank in range(layout.pp)] == pipeline_rank_parameters(config, dims)
