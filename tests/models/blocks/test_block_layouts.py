"""The block kinds and Admin under the layouts they take, at one-process parity (10 steps, dropout 0.1, gradient
norms too): each kind under dp_shard=2 x ZeRO-3 (FSDP2 gathers each block's parameters, whatever it holds), with
recomputation on for the kinds that take it, DeLighT under pp2 x cp2 too; Admin's omega under tp=2 with sequence
parallelism (the plan replicates a residual's gain on the stream). Each kind but DeLighT (which refuses tp by name:
test_block_checks.py) under tp=2, with and without sequence parallelism, in one spawned pair of ranks: loss, every
gradient and three AdamW steps against one process, dropout on (the split of each kind's parts:
``tensor_parallel_parts`` in xscale/models/blocks/)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from parity_models import DECODER, DROPOUT, assert_parity
from spawned import spawn
from test_tensor_parallel import (
    ADAM_EPS,
    LOSS_RTOL,
    LR,
    SEED,
    compare_gradients,
    compare_parameters,
    make_batch,
    tensor_parallel_model,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from xscale.config.schema import Component, ConfigError, ModelConfig
from xscale.models import build_model
from xscale.models.block import TransformerBlock
from xscale.models.blocks.gtrxl import GatedBlock
from xscale.models.registry import BLOCK
from xscale.parallel.loss import model_loss_sum
from xscale.parallel.tensor import apply_tensor_parallel, tensor_parallel_context
from xscale.runtime import StepContext

DELIGHT = ["model.position=learned", "model.block={kind: delight, options: {min_depth: 2, max_depth: 4, max_groups: 4}}"]
CASES = {
    "macaron-admin": (["model.block=macaron", "model.norm=layernorm", "model.norm_placement=post",
                       "model.init=admin"], "dp_shard=2,zero_stage=3"),
    "sandwich": (["model.block={kind: sandwich, options: {pattern: ssff}}"],
                 "dp_shard=2,zero_stage=3,activation_checkpointing=full"),
    "gtrxl": (["model.block=gtrxl"], "dp_shard=2,zero_stage=3"),
    "evolved": (["model.block=evolved"], "dp_shard=2,zero_stage=3,activation_checkpointing=selective"),
    "lite": (["model.block={kind: lite, options: {kernel_size: 3, conv_heads: 2}}"],
             "dp_shard=2,zero_stage=3,activation_checkpointing=full"),
    "macaron-cp": (["model.block=macaron"], "cp=2"),  # the per-token kinds under cp (lite and evolved refuse it)
    "gtrxl-cp": (["model.block=gtrxl"], "cp=2"),
    "delight": (DELIGHT, "dp_shard=2,zero_stage=3,activation_checkpointing=full"),
    "delight-pp-cp": (DELIGHT, "pp=2,cp=2,microbatches=4"),
    "admin-tp": (["model.norm=layernorm", "model.norm_placement=post", "model.init=admin"],
                 "tp=2,sequence_parallel=true"),
}


def test_every_block_kind_has_a_layout_case() -> None:
    """A kind registered without a case here would never be checked against the single process (standard: every
    other parity test runs it)."""
    covered = {override.split("=", 1)[1].removeprefix("{kind: ").split(",")[0].rstrip("}")
               for overrides, _ in CASES.values() for override in overrides if override.startswith("model.block=")}
    assert covered == set(BLOCK.names()) - {"standard"}, "block kinds without a layout case"


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_block_kind_under_the_layouts_it_takes(case, tmp_path) -> None:
    overrides, layout = CASES[case]
    assert_parity([*DECODER, *DROPOUT, "model.max_seq_len=16", *overrides], [layout], tmp_path, same_grad_norms=True)


# A Llama-style decoder with GQA (Lite's attention half then has one kv head, replicated) and every dropout on.
TP_MODEL = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32, position="rope",
                ffn="swiglu", norm="rmsnorm", dropout=0.1, attention_dropout=0.1)
TP_CASES = {
    "macaron": dict(block="macaron"),
    "sandwich": dict(block=Component("sandwich", {"pattern": "ssff"})),  # blocks with no FFN, and no attention
    "gtrxl": dict(block="gtrxl"),
    "lite": dict(block=Component("lite", {"kernel_size": 3, "conv_heads": 2})),
    "evolved-encoder": dict(block="evolved", family="encoder", position="learned"),  # centred convolutions
}
TP_STEPS = 3


def test_every_block_kind_has_a_tensor_parallel_case() -> None:
    """Every kind that takes tp has a case; the others declare a refusal (test_block_checks.py says it is named)."""
    refusing = {name for name in BLOCK.names() if BLOCK.get(name).block_traits.tp is not None}
    assert refusing == {"delight"}
    assert {str(case["block"]) for case in TP_CASES.values()} == set(BLOCK.names()) - {"standard"} - refusing


def test_a_parameter_no_part_holds_is_refused_by_name(monkeypatch) -> None:
    """A kind whose tensor_parallel_parts leave a module out (here GTrXL without its gates) is refused by the plan,
    not trained with an unsplit parameter (on a one-rank mesh: the check does not depend on the degree)."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    monkeypatch.setattr(GatedBlock, "tensor_parallel_parts", TransformerBlock.tensor_parallel_parts)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = build_model(ModelConfig(**TP_MODEL | TP_CASES["gtrxl"]), materialize=False)
        with pytest.raises(ConfigError, match=r"no split for attention\.gate, feed_forward\.gate of a GatedBlock"):
            apply_tensor_parallel(model, init_device_mesh("cpu", (1,), mesh_dim_names=("tp",)))
    finally:
        dist.destroy_process_group()


def block_kind_under_tensor_parallelism(rank: int, case: str) -> None:
    """On each of the two ranks: tp=2 without, then with sequence parallelism, against one process; raises with
    every mismatch once both ranks are past their collectives."""
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    config = ModelConfig(**TP_MODEL | TP_CASES[case])
    batch = make_batch(config)
    tokens = (batch["labels"] != -100).sum()
    problems = []
    for sequence_parallel in (False, True):
        layout = "tp+sp" if sequence_parallel else "tp"
        single = build_model(config, seed=SEED)
        parallel = tensor_parallel_model(config, mesh, sequence_parallel)
        optimizers = [torch.optim.AdamW(model.parameters(), lr=LR, eps=ADAM_EPS) for model in (single, parallel)]
        for step in range(TP_STEPS):
            context = StepContext(SEED, step=step)  # dropout masks by position, alike in every layout
            expected = model_loss_sum(single, batch, context) / tokens
            expected.backward()
            loss = model_loss_sum(parallel, batch, tensor_parallel_context(mesh, sequence_parallel)(context)) / tokens
            loss.backward()
            if not torch.isclose(loss.detach(), expected.detach(), rtol=LOSS_RTOL, atol=0):
                problems.append(f"{layout} step {step}: loss {loss.item():.8f} != one process {expected.item():.8f}")
            problems += [f"{layout}: {problem}" for problem in compare_gradients(single, parallel, step)]
            for optimizer in optimizers:
                optimizer.step()
                optimizer.zero_grad()
        problems += [f"{layout}: {problem}" for problem in compare_parameters(single, parallel, TP_STEPS - 1)]
        assert all(isinstance(param, DTensor) for param in parallel.parameters())
    assert not problems, f"rank {rank}, {case}:\n" + "\n".join(problems[:20])


@pytest.mark.slow
@pytest.mark.parametrize("case", list(TP_CASES))
def test_block_kind_under_tensor_parallelism(case) -> None:
    spawn(block_kind_under_tensor_parallelism, case)
