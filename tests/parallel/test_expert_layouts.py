"""Expert parallelism inside the trainer's layouts: loss parity with one process, the auxiliary losses as the mean
over routing groups, per-layer MoE metrics, and checkpoints that reshard over ep.

The single process routes one microbatch at a time, so its micro_batch_size is set to the sequences of one routing
group of the layout (ep x the per-rank microbatch): then capacity and load-balancing decisions match exactly.
Router noise (Switch's jitter, GShard's sampled second expert) is drawn from each token's place in the global batch,
as dropout masks are, so layouts with it on match the single process too (test_router_noise_matches_one_process).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from tests.parallel.test_resharding import GLOBAL_BATCH, SAMPLES, check_resharding
from tests.parallel.test_resharding import STEPS as RESHARD_STEPS
from xscale.commands.parity import (
    PARITY_SETTINGS,
    layout_overrides,
    max_relative_difference,
    run_local,
    train_losses,
    world_size_of,
)
from xscale.config.load import load_config
from xscale.data import GlobalSampler
from xscale.estimate.memory import predicted_state_bytes
from xscale.models import build_model
from xscale.models.moe import moe_layers
from xscale.models.parameters import count_parameters
from xscale.parallel.checks import resolve_dims
from xscale.parallel.loss import model_loss_sum
from xscale.parallel.model import ParallelModel
from xscale.runtime import StepContext
from xscale.train.step import forward_backward_step

# tiny-switch at test size: d_model 32, 2 layers (both MoE), 4 experts, capacity 1.0 so tokens get dropped.
ARCHITECTURE = ["model.vocab_size=48", "model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.position=rope",
                "model.norm=rmsnorm", "model.ffn=gelu", "model.d_ff=64", "model.moe.num_experts=4",
                "model.moe.every=1", "model.moe.capacity_factor=1.0", "model.moe.min_capacity=0",
                "model.moe.aux_loss_coef=0.01", "model.moe.z_loss_coef=0.001", "model.moe.router_dtype=float32",
                "train.seq_len=16", "train.warmup_steps=2", "train.lr=3e-3", "data.dataset=copy",
                "data.eval_fraction=0.0"]
SWITCH = ["model.moe.router=switch", "model.moe.top_k=1"]
GSHARD = ["model.moe.router=gshard", "model.moe.top_k=2", "model.moe.second_expert_policy=all"]
HASH = ["model.moe.router=hash", "model.moe.top_k=1"]
TRAINING = [*ARCHITECTURE, "train.global_batch_size=8", "data.num_samples=256"]
RTOL = 1e-5
STEPS = 10
METRICS_RTOL = 1e-4  # aux/z losses and dropped fractions of weights that agree to ~1e-6


def _losses(overrides: list[str], layout: str, output_dir: Path) -> list[float]:
    config = load_config(None, [*overrides, *PARITY_SETTINGS, f"train.steps={STEPS}", *layout_overrides(layout),
                                f"train.output_dir={output_dir}"])
    return train_losses(config, world_size_of(config))


def _moe_metrics(output_dir: Path) -> list[dict[str, float]]:
    """Per step, the gradient norm and the MoE layer metrics rank 0 logged (keys ``<layer>/<metric>``)."""
    records = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    return [{key: value for key, value in record.items() if ".feed_forward." in key or key == "train/grad_norm"}
            for record in records]


def assert_layouts_match(overrides: list[str], routing_group: int, layouts: list[str], tmp_path: Path, *,
                         dropless: bool = False, layout_overrides_too: tuple[str, ...] = ()) -> None:
    """Each layout's 10 losses and MoE metrics equal the single process routing ``routing_group`` sequences at once.
    ``dropless``: the run must drop no token (else it must drop some, so that capacity is exercised);
    ``layout_overrides_too``: settings of the layouts' runs only (the reference runs without them)."""
    reference_dir = tmp_path / "single"
    reference = _losses([*overrides, f"train.micro_batch_size={routing_group}"], "single", reference_dir)
    assert len(reference) == STEPS and reference[-1] < reference[0], "the reference run must train"
    reference_metrics = _moe_metrics(reference_dir)
    assert {key.rsplit("/", 1)[1] for key in reference_metrics[0]} >= {
        "dropped_fraction", "aux_loss", "z_loss", "max_load", "expert0_tokens", "expert3_tokens"}
    assert len({key.rsplit("/", 1)[0] for key in reference_metrics[0]} - {"train"}) == 2, "two MoE layers report"
    assert reference_metrics[0]["train/grad_norm"] > 1.0, "clipping at 1.0 must act, so the global norm is checked"
    dropped = max(step[key] for step in reference_metrics for key in step if key.endswith("dropped_fraction"))
    if dropless:
        assert dropped == 0, "a dropless layer dropped tokens"
    else:
        assert dropped > 0, "the case must drop tokens, so capacity over the routing group is exercised"
    for index, layout in enumerate(layouts):
        layout_dir = tmp_path / f"layout{index}"
        losses = _losses([*overrides, *layout_overrides_too], layout, layout_dir)
        difference = max_relative_difference(reference, losses)
        assert difference <= RTOL, f"{layout}: max relative loss difference {difference}"
        for step, (expected, got) in enumerate(zip(reference_metrics, _moe_metrics(layout_dir)), start=1):
            assert got == pytest.approx(expected, rel=METRICS_RTOL, abs=1e-7), f"{layout}: MoE metrics of step {step}"


def test_data_split_follows_microbatches():
    """Microbatch m of all data-parallel ranks together is the m-th contiguous slice of the global batch, so an ep
    group's routing group is a run of samples the single process reads as one microbatch."""
    batch = list(range(100, 116))
    pieces = [GlobalSampler.shard(batch, rank, 2, microbatches=4) for rank in range(2)]
    assert pieces == [[100, 101, 104, 105, 108, 109, 112, 113], [102, 103, 106, 107, 110, 111, 114, 115]]
    assert GlobalSampler.shard(batch, 1, 2) == list(range(108, 116))
    assert GlobalSampler.shard(batch, 0, 1, microbatches=4) == batch


def test_switch_ep2_with_zero_stages_matches_one_process(tmp_path):
    """ep=2 over dp_shard=2: one routing group per step (all 8 sequences), with DDP, ZeRO-1 and ZeRO-3."""
    assert_layouts_match([*TRAINING, *SWITCH], 8, ["dp_shard=2,ep=2", "dp_shard=2,ep=2,zero_stage=1",
                                                   "dp_shard=2,ep=2,zero_stage=3"], tmp_path)


@pytest.mark.slow
def test_compiled_blocks_under_tp2_and_ep2_match_eager_one_process(tmp_path):
    """train.compile=true against an eager single process. Under tp the MoE layer is replicated and forward hooks
    swap its parameters' local tensors in; traced into the compiled block, the swap was baked into the graph and
    the second step's backward ran through the first step's freed graph (the hooks now run eagerly)."""
    assert_layouts_match([*TRAINING, *SWITCH], 8, ["tp=2", "dp_shard=2,ep=2"], tmp_path,
                         layout_overrides_too=("train.compile=true",))


def test_switch_zero1_with_a_bucket_per_parameter_matches_one_process(tmp_path):
    """ZeRO-1 over 2 ranks (a routing group of 4 sequences each) in ~1 KiB buckets: the stacked experts' weights,
    which the layer reads without calling their modules, arrive in buckets of their own during the next forward."""
    assert_layouts_match([*TRAINING, *SWITCH], 4, ["dp_shard=2,zero_stage=1,bucket_mb=0.001"], tmp_path)


def test_gshard_ep2_matches_one_process(tmp_path):
    assert_layouts_match([*TRAINING, *GSHARD], 8, ["dp_shard=2,ep=2,zero_stage=2,activation_checkpointing=full"],
                         tmp_path)


@pytest.mark.slow
def test_gshard_ep2_with_zero3_matches_one_process(tmp_path):
    assert_layouts_match([*TRAINING, *GSHARD], 8, ["dp_shard=2,ep=2,zero_stage=3"], tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("router", [SWITCH, GSHARD], ids=["switch", "gshard"])
def test_ep2_by_dp2_matches_one_process(router, tmp_path):
    """Two routing groups of 4 sequences per step: the single process runs 2 microbatches, ep2 x dp2 two ep groups,
    plain data parallelism (ep=1) two ranks; the auxiliary losses are their mean in all three."""
    assert_layouts_match([*TRAINING, *router], 4, ["dp_shard=4,ep=2", "dp_replicate=2,dp_shard=2,ep=2,zero_stage=3",
                                                   "dp_shard=2"], tmp_path)


# ---------------------------------------------------------------------------------------------------- aux losses

def test_auxiliary_losses_are_the_mean_over_microbatches():
    """One process, 2 microbatches: the gradients are those of CE / tokens + mean over microbatches of each layer's
    (aux_coef * aux + z_coef * z), with the auxiliary terms taken from the routers' own outputs."""
    config = load_config(None, [*ARCHITECTURE, *SWITCH, "model.moe.aux_loss_coef=0.5", "model.moe.z_loss_coef=0.1"])
    torch.manual_seed(0)
    engine_model = build_model(config.model, seed=3)
    manual_model = copy.deepcopy(engine_model)
    ids = torch.randint(0, 48, (8, 16))
    batch = {"input_ids": ids, "labels": ids.roll(-1, dims=1)}
    engine = ParallelModel([engine_model], micro_batch_size=4)
    forward_backward_step(engine, batch)

    routings = {layer.layer_index: [] for layer in moe_layers(manual_model)}
    for layer in moe_layers(manual_model):
        layer.router.register_forward_hook(
            lambda module, args, routing, index=layer.layer_index: routings[index].append(routing))
    unweighted = StepContext(moe_loss_scale=0.0)  # the explicit sum below replaces the layers' own auxiliary terms
    loss = sum(model_loss_sum(manual_model, {k: v[rows] for k, v in batch.items()}, unweighted)
               / batch["labels"].numel() for rows in (slice(0, 4), slice(4, 8)))
    assert [len(found) for found in routings.values()] == [2, 2]  # 2 layers x 2 microbatches
    auxiliary = sum(0.5 * r.aux_loss + 0.1 * r.z_loss for found in routings.values() for r in found)
    (loss + auxiliary / 2).backward()
    for (name, got), (_, expected) in zip(engine_model.named_parameters(), manual_model.named_parameters()):
        torch.testing.assert_close(got.grad, expected.grad, rtol=1e-5, atol=1e-7, msg=name)

    for layer in moe_layers(engine_model):  # the step's statistics: tokens summed, the rest averaged
        first, second = routings[layer.layer_index]
        step = engine.routing_groups.step_metrics[layer]
        torch.testing.assert_close(step["tokens_per_expert"],
                                   (first.tokens_per_expert + second.tokens_per_expert).float())
        for name in ("dropped_fraction", "aux_loss", "z_loss"):
            expected = (getattr(first, name) + getattr(second, name)).detach().float() / 2
            torch.testing.assert_close(step[name], expected, msg=name)
        # the layer itself keeps its last forward's (the second microbatch's) and is not written by the step
        torch.testing.assert_close(layer.metrics["tokens_per_expert"], second.tokens_per_expert.detach())


# ---------------------------------------------------------------------------------------------------- memory

def _measure_state_bytes(config) -> dict:
    from xscale.estimate.memory import measured_state_bytes
    from xscale.train.trainer import Trainer

    trainer = Trainer(config)
    trainer.train_step()  # creates the optimizer state
    forward_backward_step(trainer.model, trainer.next_batch())  # gradients of the next step, before its optimizer step
    return {"measured": measured_state_bytes(trainer.model, trainer.optimizer)}


def _check_expert_memory(dp_shard: int, ep: int, stage: int, tmp_path: Path, tp: int = 1) -> None:
    """Measured per-rank bytes vs the ZeRO formulas with experts divided by ep and sharded over edp (the dense
    weights divided by tp too: the norms and routers it replicates are < 3% of a rank's bytes here)."""
    config = load_config(None, [*TRAINING, *SWITCH, f"parallel.dp_shard={dp_shard}", f"parallel.ep={ep}",
                                f"parallel.tp={tp}", f"parallel.zero_stage={stage}", f"train.output_dir={tmp_path}",
                                *PARITY_SETTINGS])
    count = count_parameters(config)
    assert count.expert > count.total / 2, "experts must dominate for the check to tell ep apart"
    predicted = predicted_state_bytes(count.total, resolve_dims(config, dp_shard * tp), count.expert)
    for rank, result in enumerate(run_local(_measure_state_bytes, dp_shard * tp, config)):
        for kind, expected in predicted.items():
            measured = result["measured"][kind]
            assert abs(measured - expected) <= 0.03 * expected, \
                f"ep={ep} ZeRO-{stage}, rank {rank}: {kind} {measured} bytes vs formula {expected:.0f}"


def test_per_rank_state_bytes_under_ep2_zero1(tmp_path):
    """Each rank holds half the experts (their weights, gradients and moments) and half the dense moments."""
    _check_expert_memory(2, 2, 1, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_per_rank_state_bytes_under_ep2_by_dp2(stage, tmp_path):
    _check_expert_memory(4, 2, stage, tmp_path)


@pytest.mark.slow
def test_per_rank_state_bytes_under_ep2_by_edp2_by_tp2_zero3(tmp_path):
    """ZeRO-3 with experts replicated over tp and FSDP-sharded over dp_expert=2: each rank holds a quarter of the
    expert weights, gradients and moments (E / ep / edp), the dense ones / (tp x dp)."""
    _check_expert_memory(4, 2, 3, tmp_path, tp=2)


# ---------------------------------------------------------------------------------------------------- resharding

RESHARD_MODEL = [*ARCHITECTURE, *SWITCH, f"train.global_batch_size={GLOBAL_BATCH}", f"data.num_samples={SAMPLES}",
                 f"train.steps={RESHARD_STEPS}"]


def test_expert_checkpoint_saved_at_ep2_resumes_on_one_process(tmp_path):
    """ZeRO-3 x ep2 writes each expert tensor (weights and AdamW moments) as one [E, ...] tensor."""
    check_resharding("dp_shard=2,ep=2,zero_stage=3", "single", tmp_path, model=RESHARD_MODEL)


@pytest.mark.slow
@pytest.mark.parametrize("save_layout,resume_layout", [
    ("dp_shard=2,ep=2", "dp_shard=2,ep=2,zero_stage=1"),
    ("dp_shard=2,ep=2,zero_stage=1", "dp_shard=4,ep=4"),
    ("single", "dp_shard=4,ep=4,zero_stage=3"),
    ("dp_shard=4,ep=4,zero_stage=2", "dp_shard=2,ep=2,zero_stage=3"),
    ("dp_shard=2,ep=2,tp=2,zero_stage=1", "single"),
    ("pp=2,dp_shard=2,ep=2,pp_schedule=gpipe,zero_stage=1", "dp_shard=2,ep=2"),
])
def test_expert_checkpoint_resumes_at_another_ep(save_layout, resume_layout, tmp_path):
    check_resharding(save_layout, resume_layout, tmp_path, model=RESHARD_MODEL)


@pytest.mark.slow
@pytest.mark.parametrize("save_layout,resume_layout", [
    ("dp_shard=4,ep=2,zero_stage=3", "dp_shard=2"),
    ("dp_shard=2,zero_stage=1", "dp_shard=4,ep=2,tp=2,zero_stage=3"),
])
def test_expert_checkpoint_with_experts_sharded_over_edp2_reshards(save_layout, resume_layout, tmp_path):
    """Expert slices FSDP-sharded over dp_expert=2 are gathered into [E, ...] tensors on save and cut back into
    FSDP shards on load. Every layout here routes groups of 4 sequences (ep2 x 2 per rank; 4 per rank at dp2), so
    the uninterrupted reference does too."""
    check_resharding(save_layout, resume_layout, tmp_path, model=RESHARD_MODEL, reference=("train.micro_batch_size=4",))


# ---------------------------------------------------------------------------------------------------- ep x tp

@pytest.mark.slow
@pytest.mark.parametrize("router", [SWITCH, GSHARD], ids=["switch", "gshard"])
def test_ep2_with_tp2_attention_matches_one_process(router, tmp_path):
    """ep=2 x tp=2 (4 ranks): attention split over tp, every tp rank routing the same tokens through its ep group;
    one routing group per step, as in ep=2 alone. Switch also under sequence parallelism with ZeRO-3."""
    layouts = ["dp_shard=2,ep=2,tp=2"]
    if router is SWITCH:
        layouts.append("dp_shard=2,ep=2,tp=2,sequence_parallel=true,zero_stage=3")
    assert_layouts_match([*TRAINING, *router], 8, layouts, tmp_path)


# ---------------------------------------------------------------------------------------------------- pp x ep

@pytest.mark.slow
@pytest.mark.parametrize("router", [SWITCH, GSHARD], ids=["switch", "gshard"])
def test_pp2_by_ep2_matches_one_process(router, tmp_path):
    """pp=2 x ep=2 (4 ranks, 2 microbatches): each stage's MoE layer exchanges tokens over its ep group inside the
    schedule's forwards and backwards, and its auxiliary losses reach the gradients on that stage. A step has
    2 routing groups of 4 sequences (microbatches x dp / ep), each a contiguous run of the global batch."""
    layouts = ["pp=2,dp_shard=2,ep=2,microbatches=2"]
    if router is SWITCH:
        layouts.append("pp=2,dp_shard=2,ep=2,microbatches=2,pp_schedule=gpipe,zero_stage=1")
    assert_layouts_match([*TRAINING, *router], 4, layouts, tmp_path)


@pytest.mark.slow
def test_pp2_by_ep2_zero_bubble_matches_one_process(tmp_path):
    """ZB-V (2 stages per rank, backward split into input and weight halves) over 4 layers, MoE in every other one:
    stages without an MoE layer hold no experts."""
    assert_layouts_match([*TRAINING, "model.n_layers=4", "model.moe.every=2", *SWITCH], 4,
                         ["pp=2,dp_shard=2,ep=2,microbatches=2,pp_schedule=zero_bubble,pp_stages_per_rank=2"], tmp_path)


# ---------------------------------------------------------------------------------------------------- pp x tp x ep

@pytest.mark.slow
@pytest.mark.parametrize("router", [SWITCH, GSHARD], ids=["switch", "gshard"])
def test_pp2_by_tp2_by_ep2_matches_one_process(router, tmp_path):
    """pp=2 x dp_shard=2 x tp=2 x ep=2 (8 ranks, 2 microbatches): in each stage attention is split over tp and
    the MoE layer, replicated over tp, exchanges tokens over the ep group of its tp coordinate. Routing groups as
    in pp x ep (2 per step, 4 sequences each). Switch also with sequence parallelism and ZeRO-3."""
    layouts = ["pp=2,dp_shard=2,ep=2,tp=2,microbatches=2"]
    if router is SWITCH:
        layouts.append("pp=2,dp_shard=2,ep=2,tp=2,microbatches=2,sequence_parallel=true,zero_stage=3")
    assert_layouts_match([*TRAINING, *router], 4, layouts, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("layout,routing_group", [
    ("pp=2,dp_shard=2,ep=2,tp=2,microbatches=2,pp_schedule=zero_bubble,pp_stages_per_rank=2", 4),
    ("pp=2,dp_shard=2,ep=2,tp=2,microbatches=4,pp_schedule=interleaved_1f1b,pp_stages_per_rank=2,zero_stage=3", 2),
], ids=["zero_bubble", "interleaved_zero3"])
def test_pp2_by_tp2_by_ep2_with_two_stages_per_rank_matches_one_process(layout, routing_group, tmp_path):
    """4 layers, MoE in every other one, 2 stages per rank: ZB-V (weight gradients split from input gradients,
    with tp-replicated experts) and interleaved 1F1B under ZeRO-3 (4 microbatches of one sequence per rank)."""
    assert_layouts_match([*TRAINING, "model.n_layers=4", "model.moe.every=2", *SWITCH], routing_group, [layout],
                         tmp_path)


# ---------------------------------------------------------------------------------------------------- ep x ZeRO-3 over edp

@pytest.mark.slow
@pytest.mark.parametrize("router", [SWITCH, GSHARD], ids=["switch", "gshard"])
def test_ep2_with_experts_fsdp_sharded_over_edp2_matches_one_process(router, tmp_path):
    """ZeRO-3 with dp_shard=4, ep=2: each expert slice [E/ep, ...] is an FSDP unit sharded over dp_expert=2 (the
    edp ranks, reduce-scattered there), the dense blocks over all 4 dp_shard ranks; also with tp=2 (8 ranks), where
    the experts are Replicate DTensors on tp sharded over dp_expert. Two routing groups of 4 sequences per step.
    (The bytes each rank holds: test_per_rank_state_bytes_under_ep2_by_dp2[3] and ..._by_edp2_by_tp2_zero3.)"""
    assert_layouts_match([*TRAINING, *router], 4, ["dp_shard=4,ep=2,zero_stage=3", "dp_shard=4,ep=2,tp=2,zero_stage=3"],
                         tmp_path)


@pytest.mark.slow
def test_ep2_with_experts_fsdp_sharded_over_replicate_and_dp_expert_matches_one_process(tmp_path):
    """8 ranks, one sequence per rank and microbatch, so 4 routing groups of 2 sequences per step: experts sharded
    over dp_expert=2 and replicated over dp_replicate=2 (HSDP over edp = 2 x 2), and under pp=2 over dp_expert=2."""
    assert_layouts_match([*TRAINING, *SWITCH], 2, ["dp_replicate=2,dp_shard=4,ep=2,zero_stage=3",
                                                   "pp=2,dp_shard=4,ep=2,microbatches=2,zero_stage=3"], tmp_path)


# ---------------------------------------------------------------------------------------------------- hash routing

@pytest.mark.slow
@pytest.mark.parametrize("layouts,routing_group", [
    (["dp_shard=2,ep=2", "dp_shard=2,ep=2,tp=2,sequence_parallel=true,zero_stage=3"], 8),
    (["pp=2,dp_shard=2,ep=2,microbatches=2,activation_checkpointing=full"], 4),
], ids=["ep_tp_sp", "pp_ep_recomputed"])
def test_hash_routing_matches_one_process(layouts, routing_group, tmp_path):
    """Hash layers route by token id: under ep each rank routes its own sequences' ids, under sequence parallelism the
    gathered sequence's, and each pipeline stage microbatch k's, also when the backward recomputes the blocks after
    other microbatches' forwards."""
    assert_layouts_match([*TRAINING, *HASH], routing_group, layouts, tmp_path)


# ---------------------------------------------------------------------------------------------------- other options

@pytest.mark.slow
def test_dropless_routing_matches_one_process(tmp_path):
    """Dropless: expert batches of any size, so the all-to-all splits vary freely, over ep alone, with ZeRO-3, and under
    pp x ep."""
    assert_layouts_match([*TRAINING, *GSHARD, "model.moe.dropless=true"], 8,
                         ["dp_shard=2,ep=2", "dp_shard=2,ep=2,zero_stage=3"], tmp_path / "ep", dropless=True)
    assert_layouts_match([*TRAINING, *SWITCH, "model.moe.dropless=true"], 4, ["pp=2,dp_shard=2,ep=2,microbatches=2"],
                         tmp_path / "pp", dropless=True)


@pytest.mark.slow
def test_shared_expert_and_expert_choice_match_one_process(tmp_path):
    """A shared expert beside the routed ones (replicated over ep and tp, its gradients reduced over all data
    parallel), and expert choice in an encoder (each expert takes its top-c tokens of the ep group's)."""
    assert_layouts_match([*TRAINING, *SWITCH, "model.moe.shared_expert=true"], 8,
                         ["dp_shard=2,ep=2", "dp_shard=2,ep=2,tp=2"], tmp_path / "shared")
    assert_layouts_match([*TRAINING, "model.family=encoder", "model.moe.router=expert_choice"], 8,
                         ["dp_shard=2,ep=2", "dp_shard=2,ep=2,zero_stage=3"], tmp_path / "expert_choice")


@pytest.mark.slow
def test_router_noise_matches_one_process(tmp_path):
    """Jitter and GShard's sampled second expert draw the same numbers for the same token in every layout: ep, ep with
    tp and sequence parallelism, and pp x ep (microbatches drawn at their rows of the global batch)."""
    noisy = [*TRAINING, "model.moe.router=gshard", "model.moe.top_k=2", "model.moe.second_expert_policy=sampling",
             "model.moe.jitter=0.1"]
    assert_layouts_match(noisy, 8, ["dp_shard=2,ep=2", "dp_shard=2,ep=2,tp=2,sequence_parallel=true"],
                         tmp_path / "ep")
    assert_layouts_match(noisy, 4, ["pp=2,dp_shard=2,ep=2,microbatches=2,activation_checkpointing=full"],
                         tmp_path / "pp")
