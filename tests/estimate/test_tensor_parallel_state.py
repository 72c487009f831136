"""The predicted model state of a tp rank (``xscale inspect``) against the parameters that rank holds once the real
tensor-parallel plan is applied: for every block kind that takes tp, with and without sequence parallelism, and for
the parts outside the blocks that tp leaves whole (norms, position tables, BERT's head transform, MQA's kv head,
MoE layers, the parameters attention cores share across heads) or splits by head (per-head state, cross-attention),
per pipeline rank too.

The plan runs in this one process on the meta device over a 2-rank mesh of torch's fake process group (its
collectives do nothing, and on the meta device the plan needs none), so each parameter's local shard is rank 0's.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.testing._internal.distributed.fake_pg import FakeStore

from xscale.config.load import load_config
from xscale.estimate.memory import (
    BYTES_PER_VALUE,
    predicted_model_state_bytes,
    predicted_pipeline_state_bytes,
    unit_sizes,
)
from xscale.models import build_model
from xscale.models.registry import BLOCK
from xscale.parallel.checks import resolve_dims
from xscale.parallel.pipeline import SCHEDULES
from xscale.parallel.pipeline.cost import stage_layers
from xscale.parallel.pipeline.stages import cut_stage, stage_to_rank
from xscale.parallel.tensor import apply_tensor_parallel

TP = 2
# test_block_layouts.py's tp model (GQA: Lite's attention half then has one kv head, replicated).
MODEL = ["model.vocab_size=64", "model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
         "model.max_seq_len=32", "model.position=rope", "model.ffn=swiglu", "model.norm=rmsnorm",
         "train.seq_len=16", "train.global_batch_size=2", "data.dataset=copy"]
BLOCK_CASES = {
    "standard": ["model.block=standard"],
    "macaron": ["model.block=macaron"],
    "sandwich": ["model.block={kind: sandwich, options: {pattern: ssff}}"],
    "gtrxl": ["model.block=gtrxl"],
    "lite": ["model.block={kind: lite, options: {kernel_size: 3, conv_heads: 2}}"],
    "evolved": ["model.block=evolved", "model.family=encoder", "model.position=learned"],
}
OTHER_CASES = {
    "bert": ["model.family=encoder", "model.position=learned", "model.norm=layernorm", "model.norm_placement=post",
             "model.embedding_norm=true", "model.ffn=gelu", "model.bias=true", "model.lm_head_transform=true",
             "model.lm_head_bias=true", "model.n_kv_heads=4"],
    "mqa-untied": ["model.n_kv_heads=1", "model.tie_embeddings=false"],
    "moe": ["model.moe.num_experts=4", "model.moe.router=switch", "model.moe.every=2"],
    "t5-cross-attention": ["model.family=encoder_decoder", "model.position=t5_bias", "model.ffn=relu",
                           "model.n_decoder_layers=2"],
    "linformer-shared-projections": ["model.family=encoder", "model.position=learned", "model.attention.kind=linformer",
                                     "model.attention.options.projected_length=8"],
    "synthesizer-per-head-state": ["model.family=encoder", "model.position=learned",
                                   "model.attention.kind=synthesizer", "model.attention.options.mode=random"],
    "talking-heads": ["model.attention.kind=talking_heads"],
}


@pytest.fixture(scope="module")
def tp_mesh():
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=TP)
    try:
        yield init_device_mesh("cpu", (TP,), mesh_dim_names=("tp",))
    finally:
        dist.destroy_process_group()


def held_bytes(module, mesh, sequence_parallel: bool) -> int:
    """Bytes of the parameters rank 0 holds once the plan has split ``module`` (a model or a stage)."""
    apply_tensor_parallel(module, mesh, sequence_parallel=sequence_parallel)
    assert all(isinstance(param, DTensor) for param in module.parameters())
    return local_bytes(module)


def local_bytes(module) -> int:
    return BYTES_PER_VALUE * sum(param.to_local().numel() for param in module.parameters())


def test_every_block_kind_that_takes_tp_has_a_case() -> None:
    takes_tp = {name for name in BLOCK.names() if BLOCK.get(name).block_traits.tp is None}
    assert set(BLOCK_CASES) == takes_tp


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("case", [*BLOCK_CASES, *OTHER_CASES])
def test_predicted_parameters_are_what_the_plan_leaves_each_rank(case, sequence_parallel, tp_mesh) -> None:
    overrides = BLOCK_CASES.get(case) or OTHER_CASES[case]
    config = load_config(None, [*MODEL, *overrides, f"parallel.tp={TP}",
                                f"parallel.sequence_parallel={str(sequence_parallel).lower()}"])
    predicted = predicted_model_state_bytes(config, resolve_dims(config, TP))
    whole = BYTES_PER_VALUE * sum(param.numel() for param in build_model(config.model, materialize=False).parameters())
    model = build_model(config.model, materialize=False)
    held = held_bytes(model, tp_mesh, sequence_parallel)
    assert held > whole / TP or case == "standard", "the case must hold parameters that tp leaves whole"
    assert predicted["parameters"] == held
    assert (predicted["gradients"], predicted["optimizer"]) == (held, 2 * held)  # one process: no ZeRO
    # ZeRO-3 gathers each FSDP unit (the root and each block) as a tp rank holds it
    root, blocks = unit_sizes(config, tp=TP).per_tp_rank(TP)
    held_blocks = [local_bytes(block) for stack in (model.stack, getattr(model, "decoder", None)) if stack is not None
                   for block in stack.layers.values()]
    assert [BYTES_PER_VALUE * block for block in blocks] == held_blocks
    assert BYTES_PER_VALUE * root == held - sum(held_blocks)


@pytest.mark.parametrize("case", ["gtrxl", "evolved"])
def test_predicted_parameters_of_each_pipeline_rank(case, tp_mesh) -> None:
    config = load_config(None, [*MODEL, *BLOCK_CASES[case], "model.n_layers=4", f"parallel.tp={TP}",
                                "parallel.pp=2", "parallel.microbatches=2"])
    dims = resolve_dims(config, 2 * TP)
    num_stages = dims.pp * config.parallel.pp_stages_per_rank
    ranks = stage_to_rank(num_stages, dims.pp, SCHEDULES[config.parallel.pp_schedule].placement)
    held = [0] * dims.pp
    for index, layers in enumerate(stage_layers(config, num_stages)):
        stage = cut_stage(build_model(config.model, materialize=False), layers, None, False)
        held[ranks[index]] += held_bytes(stage, tp_mesh, sequence_parallel=False)
    assert [state["parameters"] for state in predicted_pipeline_state_bytes(config, dims)] == held
