"""MoE layers under context parallelism (parallel.cp with model.moe): the cp group routes the microbatch's whole
sequences, so capacity cuts, dropped tokens, auxiliary losses and gradients are one process's.

Module level (2 gloo ranks): for token-choice routers (Switch with position and probs drop policies, GShard's sampled
second expert, hash routing) and expert choice in an encoder, contiguous and load balanced, the summed loss and
gradients and the layer's tokens per expert equal the single-process model's, with tokens dropped at capacity.
Trainer level: 10-step loss and gradient-norm parity, with pipeline, tensor and data parallelism, and with expert
parallelism (ep x cp: losses and the logged MoE metrics of every step), and an ep x cp checkpoint resumed on one
process.
"""

from __future__ import annotations

import pytest
import torch
from parity_models import DECODER, assert_parity, assert_sums_equal_one_process
from spawned import WORLD, spawn

from tests.parallel.test_expert_layouts import (
    GSHARD,
    HASH,
    RESHARD_MODEL,
    SWITCH,
    TRAINING,
    assert_layouts_match,
)
from tests.parallel.test_resharding import check_resharding
from xscale.config.load import load_config

SEQ, BATCH, SEED = 16, 3, 11
SMALL = ["model.vocab_size=32", "model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.max_seq_len=16",
         "train.seq_len=16", "model.moe.num_experts=4", "model.moe.every=1", "model.moe.capacity_factor=1.0",
         "model.moe.min_capacity=0", "model.moe.aux_loss_coef=0.01", "model.moe.z_loss_coef=0.001",
         "model.moe.router_dtype=float32", "model.dropout=0.1", "model.moe.jitter=0.1"]
# (family, router overrides): capacity 1.0 drops tokens, so the order of the routing group's tokens matters.
CASES = [
    ("decoder", ["model.moe.router=switch", "model.moe.top_k=1", "model.moe.drop_policy=position"]),
    ("decoder", ["model.moe.router=switch", "model.moe.top_k=1", "model.moe.drop_policy=probs"]),
    ("decoder", ["model.moe.router=gshard", "model.moe.top_k=2", "model.moe.second_expert_policy=sampling"]),
    ("decoder", ["model.moe.router=hash", "model.moe.top_k=1", "model.moe.drop_policy=position"]),
    ("encoder", ["model.moe.router=expert_choice", "model.moe.top_k=1", "model.position=sinusoidal"]),
]


def _tokens_per_expert(model) -> list[torch.Tensor]:
    from xscale.models.moe import moe_layers

    return [layer.metrics["tokens_per_expert"].clone() for layer in moe_layers(model)]


def _run(model, loss_fn, batch, tokens, context):
    from xscale.parallel.loss import model_loss_sum

    loss = loss_fn(model_loss_sum, model, batch, context) / tokens
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}, _tokens_per_expert(model)


def _check_cases(rank: int) -> None:
    for load_balance in (False, True):
        _check_layout(rank, load_balance)


def _check_layout(rank: int, load_balance: bool) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from xscale.models import build_model
    from xscale.models.moe import moe_layers
    from xscale.parallel.context import apply_context_parallel
    from xscale.parallel.context_experts import ContextParallelTokens, moe_routing_over
    from xscale.runtime import StepContext

    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("cp",))
    generator = torch.Generator().manual_seed(SEED)
    for family, router in CASES:
        case = f"{family}/{' '.join(router)}/{'balanced' if load_balance else 'contiguous'}"
        config = load_config(None, [*SMALL, f"model.family={family}", *router])
        ids = torch.randint(0, 32, (BATCH, SEQ), generator=generator)
        labels = torch.randint(0, 32, (BATCH, SEQ), generator=generator)
        batch = {"input_ids": ids, "labels": labels}
        tokens = labels.numel()
        context = StepContext(SEED, step=2)

        reference = build_model(config.model, "cpu", seed=SEED).train()
        loss, grads, loads = _run(reference, lambda f, m, b, c: f(m, b, c), batch, tokens, context)
        dropped = [float(layer.metrics["dropped_fraction"]) for layer in moe_layers(reference)]
        assert max(dropped) > 0, f"{case}: no token dropped, so capacity is not exercised"

        model = build_model(config.model, "cpu", seed=SEED).train()
        layout = apply_context_parallel(model, mesh, load_balance=load_balance)
        place = moe_routing_over(ContextParallelTokens(mesh.get_group(), layout))

        def local(f, m, b, c, layout=layout, place=place):  # the trainer's step under cp
            return f(m, layout.shard_batch(b), place(c.with_sequence(layout)))

        local_loss, local_grads, local_loads = _run(model, local, batch, tokens, context)
        for got, expected in zip(local_loads, loads, strict=True):
            assert torch.equal(got, expected), f"{case}: tokens per expert {got.tolist()} != {expected.tolist()}"
        assert_sums_equal_one_process(case, mesh.get_group(), local_loss, loss, local_grads, grads)


def test_moe_under_context_parallelism_equals_one_process():
    """Every router case, contiguous and load balanced, in one pair of processes."""
    spawn(_check_cases)


def _check_gather_order(rank: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from xscale.parallel.context import SequenceSlice
    from xscale.parallel.context_experts import ContextParallelTokens

    group = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("cp",)).get_group()
    for load_balance in (False, True):
        layout = SequenceSlice(WORLD, rank, load_balance)
        positions = layout.positions_of(rank, 8, torch.device("cpu"))
        rows = torch.stack([100 * b + positions for b in range(2)]).unsqueeze(-1).float()  # value = 100 b + t
        everyone, member_rows = ContextParallelTokens(group, layout).gather(rows)
        assert everyone.squeeze(-1).tolist() == [100 * b + t for b in range(2) for t in range(8)]
        assert torch.equal(everyone[member_rows], rows.reshape(-1, 1))
        with pytest.raises(ValueError, match=r"batch first \[B, T/cp, c\].*token_shape"):
            ContextParallelTokens(group, layout).gather(rows.reshape(-1, 1))


def test_gathered_routing_rows_are_in_global_token_order():
    spawn(_check_gather_order)


# ------------------------------------------------------------------------------------------------ trainer level
MOE = ["model.moe.num_experts=4", "model.moe.every=1", "model.moe.capacity_factor=1.0", "model.moe.min_capacity=0",
       "model.moe.router=switch", "model.moe.top_k=1", "model.moe.aux_loss_coef=0.01", "model.moe.z_loss_coef=0.001",
       "model.moe.router_dtype=float32", "train.micro_batch_size=2"]


def test_loss_parity_moe_context_parallel_load_balanced(tmp_path):
    assert_parity(DECODER + MOE, ["cp=2,cp_load_balance=true,zero_stage=1"], tmp_path, same_grad_norms=True)


@pytest.mark.slow
def test_loss_parity_moe_context_parallel_with_pipeline_tensor_and_data(tmp_path):
    """pp=2 x cp=2 (1F1B), tp=2 x cp=2 with sequence parallelism (the MoE input gathered over tp first), and
    dp_shard=2 x cp=2 under ZeRO-3 (4 processes each)."""
    assert_parity(DECODER + MOE, ["pp=2,cp=2,microbatches=4", "tp=2,cp=2,sequence_parallel=true",
                                  "dp_shard=2,cp=2,zero_stage=3,cp_load_balance=true"], tmp_path, same_grad_norms=True)


# ------------------------------------------------------------------------------------- with expert parallelism
# ep x cp: an ep group's routing group is its ranks' whole sequences (each gathered over its cp group), so the single
# process routes ep x (per-rank microbatch) sequences at once; tokens and MoE metrics are compared step by step.
def test_switch_ep2_by_cp2_matches_one_process(tmp_path):
    """dp_shard=2 = ep=2 x cp=2 (4 processes), load balanced, ZeRO-1: expert states sharded over dp_expert x cp."""
    assert_layouts_match([*TRAINING, *SWITCH], 8, ["dp_shard=2,ep=2,cp=2,cp_load_balance=true,zero_stage=1"],
                         tmp_path)


@pytest.mark.slow
def test_gshard_and_hash_ep_by_cp_match_one_process(tmp_path):
    """GShard top-2 at ep=2 x cp=2 under ZeRO-3 (the experts FSDP units over dp_expert x cp); hash routing at
    dp_shard=4 (dp_expert=2 x ep=2) x cp=2 under ZeRO-2 (8 processes: dp_expert x cp is a strided mesh view)."""
    assert_layouts_match([*TRAINING, *GSHARD], 8, ["dp_shard=2,ep=2,cp=2,zero_stage=3"], tmp_path / "gshard")
    assert_layouts_match([*TRAINING, *HASH], 4, ["dp_shard=4,ep=2,cp=2,zero_stage=2,cp_load_balance=true"],
                         tmp_path / "hash")


@pytest.mark.slow
def test_checkpoint_saved_at_ep_by_cp_resumes_on_one_process(tmp_path):
    check_resharding("dp_shard=2,ep=2,cp=2,zero_stage=3", "single", tmp_path, model=RESHARD_MODEL)


def test_inspect_reports_experts_sharded_over_dp_expert_and_cp():
    from xscale.commands.inspect import layout_report
    from xscale.estimate.memory import predicted_state_bytes
    from xscale.parallel.checks import resolve_dims

    config = load_config(None, [*TRAINING, *SWITCH, "parallel.dp_shard=2", "parallel.ep=2", "parallel.cp=2",
                                "parallel.zero_stage=3"])
    dims = resolve_dims(config, 4)
    assert (dims.dp_expert, dims.edp, dims.cp) == (1, 1, 2)
    state = predicted_state_bytes(1000, dims, expert_params=600)
    assert state["parameters"] == 4 * (400 / 4 + 600 / 2 / 2)  # dense over dp x cp; experts / ep, over edp x cp
    assert "ZeRO-3 over dp_expert=1 x cp=2" in "\n".join(layout_report(config, 4))
