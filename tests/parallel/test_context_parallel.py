"""Context parallelism (parallel.cp): sequence-sharded attention equals one process.

Module level (2 gloo ranks): the hidden states of each rank's tokens, the loss and every gradient (summed over the
cp ranks) equal the single-process model's, for every position encoding, with residual and attention dropout,
contiguous and load-balanced; an encoder-decoder's loss and gradients likewise (its cross-attention gathers the
sharded memory). Trainer level: 10-step loss parity, checkpoints resharded across cp, and each
refusal's message.
"""

from __future__ import annotations

import pytest
import torch
from parity_models import (
    DECODER,
    DROPOUT,
    ENCODER,
    ENCODER_DECODER,
    assert_cores_under_cp_equal_one_process,
    assert_parity,
    assert_sums_equal_one_process,
)
from spawned import WORLD, spawn
from test_resharding import check_resharding

from xscale.config.load import load_config
from xscale.config.schema import ConfigError
from xscale.parallel.checks import resolve_dims

SEQ, BATCH, SEED = 16, 3, 7
SMALL = ["model.vocab_size=32", "model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.max_seq_len=16",
         "train.seq_len=16", "model.dropout=0.1", "model.attention_dropout=0.2"]
# (family, position, n_kv_heads): decoders with GQA / MQA / MHA, encoders with their absolute and bias encodings.
MODULE_CASES = [("decoder", "rope", 2), ("decoder", "alibi", 1), ("decoder", "t5_bias", 4), ("decoder", "learned", 2),
                ("decoder", "none", 2), ("encoder", "sinusoidal", 4), ("encoder", "t5_bias", 2), ("encoder", "rope", 4)]


def _module_config(family: str, position: str, kv_heads: int):
    return load_config(None, [*SMALL, f"model.family={family}", f"model.position={position}",
                              f"model.n_kv_heads={kv_heads}"])


def _run(model, loss_fn, batch, tokens, input_ids, layout=None):
    """(loss, hidden states of ``input_ids``, gradients) with dropout drawn at one position of a run; ``layout``:
    the global positions ``input_ids`` hold."""
    from xscale.runtime import StepContext

    context = StepContext(SEED, step=3)
    loss = loss_fn(model, batch, context) / tokens
    loss.backward()
    with torch.no_grad():
        hidden = model(input_ids, context=context.with_sequence(layout), project=False)
    return loss.detach(), hidden, {name: p.grad for name, p in model.named_parameters()}


def _check_module_parity(rank: int) -> None:
    for load_balance in (False, True):
        _check_layout(rank, load_balance)


def _check_layout(rank: int, load_balance: bool) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from xscale.models import build_model
    from xscale.parallel.context import apply_context_parallel
    from xscale.parallel.loss import model_loss_sum

    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("cp",))  # one group per layout: fine on 2 ranks
    generator = torch.Generator().manual_seed(SEED)
    for family, position, kv_heads in MODULE_CASES:
        case = f"{family}/{position}/kv{kv_heads}/{'balanced' if load_balance else 'contiguous'}"
        config = _module_config(family, position, kv_heads)
        ids = torch.randint(0, 32, (BATCH, SEQ), generator=generator)
        labels = torch.randint(0, 32, (BATCH, SEQ), generator=generator)
        labels[torch.rand(BATCH, SEQ, generator=generator) < 0.3] = -100
        batch = {"input_ids": ids, "labels": labels}
        tokens = (labels != -100).sum()
        reference = build_model(config.model, "cpu", seed=SEED).train()
        loss, hidden, grads = _run(reference, model_loss_sum, batch, tokens, ids)

        model = build_model(config.model, "cpu", seed=SEED).train()
        layout = apply_context_parallel(model, mesh, load_balance=load_balance)
        positions = layout.positions_of(rank, SEQ, torch.device("cpu"))
        def local_loss_sum(model, batch, context, layout=layout):  # the trainer's step under cp
            return model_loss_sum(model, layout.shard_batch(batch), context.with_sequence(layout))

        local_loss, local_hidden, local_grads = _run(model, local_loss_sum, batch, tokens, ids[:, positions], layout)
        torch.testing.assert_close(local_hidden, hidden[:, positions], rtol=1e-5, atol=1e-5,
                                   msg=lambda m, case=case: f"{case} hidden states: {m}")
        assert_sums_equal_one_process(case, mesh.get_group(), local_loss, loss, local_grads, grads)


def test_sharded_attention_equals_one_process():
    """Every case, contiguous and load balanced, in one pair of processes."""
    spawn(_check_module_parity)


def _check_encoder_decoder(rank: int) -> None:
    """Encoder and decoder both sharded (16 and 8 tokens): the decoder's self-attention gathers its K/V, its
    cross-attention the encoder memory's; the loss and every gradient equal one process's."""
    from torch.distributed.device_mesh import init_device_mesh

    from xscale.models import build_model
    from xscale.parallel.context import apply_context_parallel
    from xscale.parallel.loss import model_loss_sum
    from xscale.runtime import StepContext

    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("cp",))
    generator = torch.Generator().manual_seed(SEED)
    for position, load_balance in (("t5_bias", True), ("learned", False), ("rope", True)):
        case = f"encoder_decoder/{position}/{'balanced' if load_balance else 'contiguous'}"
        config = load_config(None, [*SMALL, "model.family=encoder_decoder", "model.n_decoder_layers=2",
                                    f"model.position={position}", "model.n_kv_heads=2"])
        ids = torch.randint(0, 32, (BATCH, SEQ), generator=generator)
        decoder_ids = torch.randint(0, 32, (BATCH, SEQ // 2), generator=generator)
        labels = torch.randint(0, 32, (BATCH, SEQ // 2), generator=generator)
        labels[torch.rand(BATCH, SEQ // 2, generator=generator) < 0.3] = -100
        batch = {"input_ids": ids, "decoder_input_ids": decoder_ids, "labels": labels}
        tokens = (labels != -100).sum()
        context = StepContext(SEED, step=3)
        reference = build_model(config.model, "cpu", seed=SEED).train()
        loss = model_loss_sum(reference, batch, context) / tokens
        loss.backward()

        model = build_model(config.model, "cpu", seed=SEED).train()
        layout = apply_context_parallel(model, mesh, load_balance=load_balance)
        local = layout.shard_batch(batch)
        assert local["decoder_input_ids"].shape[1] == SEQ // 4 and local["input_ids"].shape[1] == SEQ // 2
        local_loss = model_loss_sum(model, local, context.with_sequence(layout)) / tokens
        local_loss.backward()
        assert_sums_equal_one_process(case, mesh.get_group(), local_loss.detach(), loss.detach(),
                                      {name: p.grad for name, p in model.named_parameters()},
                                      {name: p.grad for name, p in reference.named_parameters()})


def test_encoder_decoder_under_context_parallelism_equals_one_process():
    spawn(_check_encoder_decoder)


ACT = ["model.share_layers=true", "model.stack=act", "model.n_layers=3", "model.stack.options.ponder_cost=0.05"]
REVERSIBLE = ["model.stack=reversible"]
FUNNEL = ["model.stack=funnel", "model.stack.options.groups=[1,1]", "model.n_layers=2", "model.position=learned"]


def _check_stack_variants(rank: int) -> None:
    """ACT's ponder cost: each rank's mean over its T/cp positions, shared out over one forward per cp rank, sums
    to the mean over the whole sequence (equal shares); every step runs on every rank. The reversible stack's
    backward re-runs each block, its attention's K/V exchange included, in the same order on every rank. The
    funnel pools each rank's even chunks on their own and its pooled queries read the gathered unpooled keys."""
    small = ["model.vocab_size=32", "model.d_model=32", "model.n_heads=4", "model.max_seq_len=32", "train.seq_len=32",
             "model.dropout=0.1"]
    cases = [("dense", "decoder", ACT), ("local", "encoder", ACT), ("dense", "decoder", REVERSIBLE),
             ("performer", "decoder", REVERSIBLE), ("nystrom", "encoder", REVERSIBLE), ("dense", "encoder", FUNNEL)]
    assert_cores_under_cp_equal_one_process(rank, cases, small, seq=32, batch_size=2, seed=3)


def test_act_reversible_and_funnel_stacks_under_context_parallelism_equal_one_process():
    spawn(_check_stack_variants)


STACK_LAYOUTS = {"act": (DECODER, ACT, "cp=2,cp_load_balance=true"),
                 "reversible": (DECODER, REVERSIBLE, "cp=2,cp_load_balance=true,zero_stage=1"),
                 "funnel": (ENCODER, ["model.stack=funnel", "model.stack.options.groups=[1,1]"], "cp=2")}


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(STACK_LAYOUTS))
def test_loss_parity_stack_variants_under_context_parallelism(variant, tmp_path):
    base, overrides, layout = STACK_LAYOUTS[variant]
    assert_parity([*base, *DROPOUT, *overrides], [layout], tmp_path, same_grad_norms=True)


# ------------------------------------------------------------------------------------------------ trainer level
def test_loss_parity_with_dropout_load_balanced_zero3(tmp_path):
    assert_parity(DECODER + DROPOUT, ["cp=2,cp_load_balance=true,zero_stage=3"], tmp_path)


def test_loss_parity_encoder_decoder_load_balanced_with_dropout(tmp_path):
    """A T5-style encoder-decoder (copy task, span objective: 16 encoder and 8 decoder tokens), cp=2 load balanced."""
    assert_parity(ENCODER_DECODER + DROPOUT, ["cp=2,cp_load_balance=true,zero_stage=1"], tmp_path,
                  same_grad_norms=True)


@pytest.mark.slow
def test_loss_parity_encoder_decoder_under_pipeline_and_tensor_parallelism(tmp_path):
    """pp=2 x cp=2 (1F1B: the memory travels the stages as this rank's slice) and tp=2 x cp=2 with sequence
    parallelism, 4 processes each."""
    assert_parity(ENCODER_DECODER, ["pp=2,cp=2,microbatches=4", "tp=2,cp=2,sequence_parallel=true"], tmp_path,
                  same_grad_norms=True)


@pytest.mark.slow
def test_loss_parity_with_compiled_blocks(tmp_path):
    """train.compile=true: each block compiled, the attention cores' K/V gathers (forward pre-hooks around a
    collective) included; both runs compiled."""
    assert_parity(DECODER + ["train.compile=true"], ["cp=2,cp_load_balance=true"], tmp_path, same_grad_norms=True)


@pytest.mark.slow
def test_loss_parity_contiguous_and_data_x_context_parallel(tmp_path):
    """cp=2 with contiguous slices (DDP-style reduction over dp x cp); dp_shard=2 x cp=2 (4 processes) with ZeRO-2;
    a load-balanced encoder (MLM) with full recomputation (the backward re-gathers K/V)."""
    assert_parity(DECODER + DROPOUT, ["cp=2", "dp_shard=2,cp=2,zero_stage=2,cp_load_balance=true"],
                  tmp_path / "decoder")
    assert_parity(ENCODER + DROPOUT, ["cp=2,cp_load_balance=true,activation_checkpointing=full"], tmp_path / "encoder")


def test_loss_parity_under_pipeline_parallelism(tmp_path):
    """pp=2 x cp=2 (4 processes): every stage's attention gathers K/V over the cp ranks, the pipeline runs each cp
    rank's tokens; 1F1B with contiguous slices, and ZB-V with vocabulary stages (their labels cut alike) load
    balanced, with dropout."""
    assert_parity(DECODER + DROPOUT, ["pp=2,cp=2,microbatches=4",
                                      "pp=2,cp=2,cp_load_balance=true,microbatches=4,pp_schedule=zero_bubble,"
                                      "pp_stages_per_rank=2,pp_vocab_parallel=true"], tmp_path, same_grad_norms=True)


def test_loss_parity_under_tensor_and_sequence_parallelism(tmp_path):
    """tp=2 x cp=2 (4 processes): each tp rank's heads gather their K/V over the cp ranks; with sequence parallelism
    tp rank t holds slice t of its cp rank's (load-balanced) tokens, dropout included."""
    assert_parity(DECODER + DROPOUT, ["tp=2,cp=2,cp_load_balance=true,sequence_parallel=true"], tmp_path,
                  same_grad_norms=True)


@pytest.mark.slow
def test_loss_parity_tensor_x_context_parallel_encoder_and_every_dimension(tmp_path):
    """tp x cp without sequence parallelism for a BERT-style encoder with dropout and full recomputation; pp x tp x cp
    with sequence parallelism (8 processes)."""
    assert_parity(ENCODER + DROPOUT, ["tp=2,cp=2,activation_checkpointing=full"], tmp_path / "encoder",
                  same_grad_norms=True)
    assert_parity(DECODER, ["pp=2,tp=2,cp=2,microbatches=2,sequence_parallel=true"], tmp_path / "pipeline",
                  same_grad_norms=True)


@pytest.mark.slow
def test_loss_parity_data_x_pipeline_x_context_parallel(tmp_path):
    """dp_shard=2 x pp=2 x cp=2 (8 processes), ZeRO-3 over dp x cp on every stage."""
    assert_parity(DECODER, ["dp_shard=2,pp=2,cp=2,microbatches=2,zero_stage=3"], tmp_path, same_grad_norms=True)


@pytest.mark.slow
@pytest.mark.parametrize("save_layout", ["cp=2", "pp=2,cp=2,microbatches=2,cp_load_balance=true",
                                         "tp=2,cp=2,sequence_parallel=true"])
def test_checkpoint_saved_under_context_parallelism_resumes_on_one_process(save_layout, tmp_path):
    check_resharding(save_layout, "single", tmp_path)


@pytest.mark.slow
def test_checkpoint_saved_at_cp2_zero3_resumes_at_dp_x_cp(tmp_path):
    check_resharding("cp=2,zero_stage=3,cp_load_balance=true", "dp_shard=2,cp=2,zero_stage=1", tmp_path)


# ------------------------------------------------------------------------------------------------------ refusals
REFUSALS = [
    (["model.position=shaw"], 2, r"model.position=shaw has no context-parallel plan.*or parallel.cp=1"),
    (["model.position=xl"], 2, r"model.position=xl has no context-parallel plan.*or parallel.cp=1"),
    (["train.seq_len=15"], 2, "cut.* into cp=2 equal slices; make train.seq_len=15 a multiple of 2"),
    (["train.seq_len=18", "parallel.cp_load_balance=true"], 2,
     r"2 x cp = 4 chunks \(parallel.cp_load_balance=true\); make train.seq_len=18 a multiple of 4"),
]


@pytest.mark.parametrize("overrides, world, message", REFUSALS, ids=[r[2].split()[0] + str(i) for i, r in
                                                                    enumerate(REFUSALS)])
def test_refusals_say_what_to_change(overrides, world, message):
    config = load_config(None, [*DECODER, "parallel.cp=2", *overrides])
    with pytest.raises(ConfigError, match=message):
        resolve_dims(config, world)


def test_layout_world_size_and_inspect_report():
    from xscale.commands.inspect import layout_report
    from xscale.estimate.memory import predicted_state_bytes

    config = load_config(None, [*DECODER, "parallel.cp=2", "parallel.cp_load_balance=true", "parallel.zero_stage=3"])
    dims = resolve_dims(config, 4)
    assert (dims.dp_shard, dims.cp, dims.dp_cp) == (2, 2, 4)
    state = predicted_state_bytes(1000, dims)
    assert state["parameters"] == 4 * 1000 / 4  # ZeRO-3 shards over dp x cp
    report = "\n".join(layout_report(config, 4))
    assert "cp=2" in report and "tokens [0, 4) + [12, 16)" in report and "tokens [4, 8) + [8, 12)" in report
    assert "activations" in report.split("per-rank model state")[1]  # per-rank activations: T/cp tokens
    assert "whole sequence" not in report
    nystrom = load_config(None, [*ENCODER, "parallel.cp=2", "model.attention.per_layer=[dense,nystrom]"])
    assert "(attention nystrom runs on the whole sequence on every cp rank" in "\n".join(layout_report(nystrom, 2))
