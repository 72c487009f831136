"""``xscale inspect CONFIG``: what a configuration costs before it is launched.

Parameters (built on the meta device: no memory), FLOPs per token, and the memory that
parameters, gradients, optimizer state and activations take on one device. ``--components`` lists every
registered component and every model choice by name.
"""

from __future__ import annotations

import dataclasses
import sys

import xscale.commands.registrations  # noqa: F401  (every layer's config checks and adapters)
import xscale.models.zoo  # noqa: F401  (registers every component, for --components)
from xscale.commands.parser import CommandParser
from xscale.config.check import validate
from xscale.config.load import load_config_from_cli
from xscale.config.schema import CHOICES, Config, ConfigError
from xscale.data import with_resolved_vocab
from xscale.data.objectives import OBJECTIVES
from xscale.data.sources import SOURCES
from xscale.estimate.measure import MeasureError, device_memory_bytes, measure_report, rank_memory
from xscale.estimate.memory import predicted_model_state_bytes, predicted_pipeline_state_bytes
from xscale.models.catalog import describe_option, options_catalog
from xscale.models.parameters import ModelCount, count_parameters, experts_per_token
from xscale.models.registry import REGISTRIES
from xscale.models.stacks import extra_blocks, stack_description
from xscale.parallel.checks import resolve_layout
from xscale.parallel.context import whole_sequence_kinds
from xscale.parallel.dims import rank_coordinates
from xscale.parallel.pipeline import SCHEDULES, ideal_bubble, stage_to_rank
from xscale.parallel.pipeline.cost import pipeline_costs, stage_layers
from xscale.parallel.pipeline.stages import pipeline_layers
from xscale.parallel.pipeline.vocabulary import (
    vocabulary_rows,
    vocabulary_shard,
    vocabulary_stage_count,
)
from xscale.train.metrics import flops_per_token
from xscale.train.step import TRAINING_STEP


def activation_bytes(config: Config, micro_batch: int) -> float:
    """Stored activations per micro-batch for backward (Korthikanti et al. 2022, eq. 1:
    s*b*h*(34 + 5*a*s/h) bytes per layer at 16-bit; doubled for fp32)."""
    model, seq = config.model, config.train.seq_len
    layers = model.total_layers + extra_blocks(model)
    if model.stack.kind == "reversible":
        layers = 1  # one block's, rebuilt in backward; the stack keeps only its two output halves
    per_layer = seq * micro_batch * model.d_model * (34 + 5 * model.n_heads * seq / model.d_model)
    scale = 1.0 if config.train.low_precision else 2.0
    if config.parallel.activation_checkpointing == "full":
        per_layer = seq * micro_batch * model.d_model * 2  # only each block's input is kept
    logits = seq * micro_batch * model.vocab_size * 4
    return layers * per_layer * scale + logits


def memory_report(config: Config, count: ModelCount) -> dict[str, float]:
    """Bytes on one device: fp32 weights + grads + AdamW (two fp32 moments), plus activations."""
    params = count.total * 4.0
    micro = config.train.micro_batch_size or config.train.global_batch_size
    return {
        "parameters": params,
        "gradients": count.total * 4.0,
        "optimizer": count.total * 8.0,
        "activations": activation_bytes(config, micro),
    }


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024:
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} PiB"


def _layers(first: int, last: int) -> str:
    return f"layer {first}" if first == last else f"layers {first}-{last}"


def _share(index: int, total: int, parts: int) -> str:
    """Rows [index * total/parts, (index+1) * total/parts) as 'a-b' (one row: 'a')."""
    size = total // parts
    return str(index) if size == 1 else f"{index * size}-{(index + 1) * size - 1}"


def _model_slice(config: Config, dims, at: dict[str, int]) -> str:
    """What the rank at mesh coordinates ``at`` holds: its pipeline stages (layers, embedding, head) and its
    tensor- and expert-parallel shares (heads, vocabulary rows, experts)."""
    model, parallel = config.model, config.parallel
    parts, holds_vocabulary = [], True
    if dims.pp > 1:
        num_stages = dims.pp * parallel.pp_stages_per_rank
        layers = stage_layers(config, num_stages)
        ranks = stage_to_rank(num_stages, dims.pp, SCHEDULES[parallel.pp_schedule].placement)
        mine = [stage for stage in range(num_stages) if ranks[stage] == at["pp"]]
        vocabulary = vocabulary_stage_count(parallel)
        holds_vocabulary = 0 in mine or (num_stages - 1 in mine and not vocabulary)  # tp's embedding or head rows
        stages = []
        for stage in mine:
            place = vocabulary_shard(stage, ranks, vocabulary)
            if place is not None:  # a vocabulary stage: its rank's rows of the output projection and of the loss
                start, end = vocabulary_rows(model.vocab_size, place.rank, place.shards)
                if dims.tp > 1:  # this tp rank's share of them
                    start, end = (start + row for row in vocabulary_rows(end - start, at["tp"], dims.tp))
                stages.append(f"{stage} (vocabulary {start}-{end - 1})")
                continue
            held = ["embedding"] if stage == 0 else []
            encoder = [index for index in layers[stage] if index < model.n_layers]
            decoder = [index - model.n_layers for index in layers[stage] if index >= model.n_layers]
            if encoder:
                held.append(_layers(encoder[0], encoder[-1]))
            if decoder:  # an encoder-decoder's decoder blocks (the first decoder stage embeds with a copy)
                held.append(("embedding copy, " if 0 in decoder and stage else "") + "decoder "
                            + _layers(decoder[0], decoder[-1]))
            held += ["head"] if stage == num_stages - 1 else []
            held += ["final norm"] if vocabulary and stage == num_stages - vocabulary - 1 else []
            stages.append(f"{stage} ({', '.join(held)})")
        parts.append(f"stage{'s' if len(stages) > 1 else ''} {', '.join(stages)}")
    else:
        decoder = f", decoder {_layers(0, model.decoder_layers - 1)}" if model.family == "encoder_decoder" else ""
        parts.append(_layers(0, model.n_layers - 1) + decoder)
    if dims.tp > 1:
        parts.append(f"heads {_share(at['tp'], model.n_heads, dims.tp)}"
                     + (f", vocab {_share(at['tp'], model.vocab_size, dims.tp)}" if holds_vocabulary else ""))
    if dims.cp > 1:  # context parallelism: this rank's tokens of every sequence
        size = config.train.seq_len // (2 * dims.cp if parallel.cp_load_balance else dims.cp)
        chunks = (at["cp"], 2 * dims.cp - 1 - at["cp"]) if parallel.cp_load_balance else (at["cp"],)
        parts.append("tokens " + " + ".join(f"[{c * size}, {(c + 1) * size})" for c in chunks))
    if dims.ep > 1:
        experts = f"experts {_share(at['ep'], model.moe.num_experts, dims.ep)}"
        shards = dims.dp_expert * dims.cp  # ZeRO-3 shards them further over the ranks holding the same experts
        if dims.fsdp and shards > 1:
            over = f"dp_expert={dims.dp_expert}" + (f" x cp={dims.cp}" if dims.cp > 1 else "")
            experts += f" (at rest 1/{shards} of their weights, ZeRO-3 over {over})"
        parts.append(experts)
    return "; ".join(parts)


def _pipeline_line(config: Config, pp: int, auto: bool) -> str:
    """The schedule, its stages, the (resolved) microbatch count and the ideal bubble (p-1)/(m+p-1)."""
    parallel = config.parallel
    stages = pp * parallel.pp_stages_per_rank
    return (f"pipeline: {parallel.pp_schedule}, {stages} stages ({parallel.pp_stages_per_rank} per rank), "
            f"{parallel.microbatches} microbatch{'es' if parallel.microbatches != 1 else ''} per step"
            f"{' (auto)' if auto else ''}, "
            f"bubble (p-1)/(m+p-1) = {ideal_bubble(pp, parallel.microbatches):.3f}")


def _stage_cost_lines(config: Config, pp: int) -> list[str]:
    """Each stage's predicted cost (:mod:`xscale.parallel.pipeline.cost`) and its share of the slowest stage's."""
    parallel = config.parallel
    num_stages = pp * parallel.pp_stages_per_rank
    layers = stage_layers(config, num_stages)
    vocabulary = vocabulary_stage_count(parallel)
    costs = pipeline_costs(config).stage_costs(layers, vocabulary)
    ranks = stage_to_rank(num_stages, pp, SCHEDULES[parallel.pp_schedule].placement)
    split = "parallel.pp_split" if parallel.pp_split is not None else "balanced by the cost model"
    lines = [f"predicted cost per stage (training FLOPs per token; split {[len(held) for held in layers]}, {split}):"]
    for stage, cost in enumerate(costs):
        place = vocabulary_shard(stage, ranks, vocabulary)
        held = f"vocabulary shard {place.rank}" if place else f"{len(layers[stage])} blocks"
        lines.append(f"  stage {stage} (pp rank {ranks[stage]}, {held}): {cost:.3e} "
                     f"({cost / max(costs):.0%} of the slowest)")
    rank_costs = _rank_costs(costs, ranks, pp)
    if parallel.pp_stages_per_rank > 1:
        lines.append("  per pp rank: " + ", ".join(f"{cost:.3e} ({cost / max(rank_costs):.0%})"
                                                  for cost in rank_costs))
    hint = _vocabulary_hint(config, pp, rank_costs)
    return lines + ([hint] if hint else [])


def _rank_costs(costs: list[float], ranks: list[int], pp: int) -> list[float]:
    return [sum(cost for stage, cost in enumerate(costs) if ranks[stage] == rank) for rank in range(pp)]


VOCABULARY_LAYOUT = {"pp_schedule": "zero_bubble", "pp_stages_per_rank": 2, "pp_vocab_parallel": True}


def _vocabulary_hint(config: Config, pp: int, rank_costs: list[float]) -> str | None:
    """When the head leaves the ranks' costs more than 10% apart and a head split over the vocabulary would bring
    them closer: the setting, and the per-rank costs it predicts (unset ``pp_split``)."""
    parallel = config.parallel
    if parallel.pp_vocab_parallel or parallel.pp_split is not None or config.model.num_classes:
        return None
    if min(rank_costs) / max(rank_costs) >= 0.9 or pipeline_layers(config.model) < pp:  # balanced; too few blocks
        return None
    split = dataclasses.replace(config, parallel=dataclasses.replace(parallel, **VOCABULARY_LAYOUT))
    num_stages = pp * split.parallel.pp_stages_per_rank
    layers = stage_layers(split, num_stages)
    ranks = stage_to_rank(num_stages, pp, SCHEDULES[split.parallel.pp_schedule].placement)
    balanced = _rank_costs(pipeline_costs(split).stage_costs(layers, pp), ranks, pp)
    if min(balanced) / max(balanced) <= min(rank_costs) / max(rank_costs) + 0.05:
        return None
    settings = " ".join(f"parallel.{key}={str(value).lower()}" for key, value in VOCABULARY_LAYOUT.items())
    return (f"  the head (output projection and loss) unbalances the ranks: the lightest at "
            f"{min(rank_costs) / max(rank_costs):.0%} of the slowest;\n  split over the vocabulary ({settings}) they "
            f"would be at {', '.join(f'{cost / max(balanced):.0%}' for cost in balanced)}")


def layout_report(config: Config, world_size: int) -> list[str]:
    """The per-rank plan of ``config.parallel`` at ``world_size`` and each rank's predicted state bytes."""
    auto = config.parallel.microbatches is None
    dims, config = resolve_layout(config, world_size)  # a copy with an unset parallel.microbatches resolved
    lines = [f"layout: {dims.describe()}"]
    if dims.pp > 1:
        lines.append(_pipeline_line(config, dims.pp, auto))
        lines += _stage_cost_lines(config, dims.pp)
    cp = f" {'cp':>3}" if dims.cp > 1 else ""  # the cp column only in context-parallel layouts
    lines.append(f"  {'rank':>4} {'pp':>3} {'dp':>3}{cp} {'tp':>3} {'ep':>3}  holds")
    shown = list(range(min(world_size, 16)))
    for rank in shown:
        at = rank_coordinates(dims, rank)
        cp = f" {at['cp']:>3}" if dims.cp > 1 else ""
        lines.append(f"  {rank:>4} {at['pp']:>3} {at['dp']:>3}{cp} {at['tp']:>3} {at['ep']:>3}  "
                     f"{_model_slice(config, dims, at)}")
    if world_size > len(shown):
        lines.append(f"  ... {world_size - len(shown)} more ranks")
    if dims.pp > 1:  # the stages differ: the first holds the embedding, the last the head (and a tied copy)
        lines.append("per-rank model state (ZeRO formulas over each pp rank's stages, fp32 AdamW):")
        for pp_rank, state in enumerate(predicted_pipeline_state_bytes(config, dims)):
            lines.append(f"  pp {pp_rank}: " + ", ".join(f"{name} {_human(value)}" for name, value in state.items()))
        return lines
    state = predicted_model_state_bytes(config, dims)
    lines.append("per-rank model state (ZeRO formulas, fp32 AdamW):")
    lines += [f"  {name:<12} {_human(value)}" for name, value in state.items()]
    if dims.cp > 1:
        lines.append(f"  {'activations':<12} {_human(context_parallel_activation_bytes(config, dims))} "
                     f"(T/cp tokens per rank, plus the gathered K/V)")
        if whole := whole_sequence_kinds(config.model):
            lines.append(f"  (attention {', '.join(whole)} runs on the whole sequence on every cp rank: what the "
                         "core itself saves is not divided by cp, nor counted here)")
    return lines


def context_parallel_activation_bytes(config: Config, dims) -> float:
    """Stored activations per rank and microbatch under context parallelism: every term of
    :func:`activation_bytes` is per local token (the scores are (T/cp) x T), plus each layer's gathered K and V
    (all T tokens, the other ranks' share kept for backward) unless full recomputation drops them."""
    model = config.model
    micro = config.train.micro_batch_size or config.train.global_batch_size // dims.dp
    local = activation_bytes(config, micro) / dims.cp
    if config.parallel.activation_checkpointing == "full":
        return local
    value_bytes = 2 if config.train.low_precision else 4
    gathered = 2 * config.train.seq_len * micro * model.kv_heads * model.head_dim * value_bytes * (1 - 1 / dims.cp)
    return local + model.n_layers * gathered


def report(config: Config) -> str:
    count = count_parameters(config)
    flops = flops_per_token(config.model, config.train.seq_len, count.matmul_per_token)
    memory = f"segment memory {config.model.segment_memory} (Transformer-XL), " if config.model.segment_memory else ""
    decoder_blocks = extra_blocks(config.model)
    funnel = f" + {decoder_blocks} funnel decoder blocks" if decoder_blocks else ""
    lines = [
        f"model: {config.model.family}, {config.model.n_layers} layers{funnel}, d_model {config.model.d_model}, "
        f"{config.model.n_heads} heads ({config.model.kv_heads} kv), ffn {config.model.ffn} {config.model.ffn_hidden}, "
        f"attention {config.model.attention.kind}, position {config.model.position}, {memory}"
        f"stack {stack_description(config.model)}",
        f"parameters: {count.total:,} ({count.total / 1e6:.2f}M; non-embedding {count.non_embedding:,})",
    ]
    for name, value in sorted(count.per_component.items(), key=lambda kv: -kv[1]):
        lines.append(f"  {name:<48} {value:>14,}")
    if count.expert:  # MoE: a token uses its experts' share of the expert weights, not all of them
        lines.append(f"active per token: {count.active_non_embedding:,.0f} non-embedding parameters "
                     f"({experts_per_token(config.model.moe):g} of {config.model.moe.num_experts} experts)")
    lines.append(f"training FLOPs per token: {flops:.3e} (6N + 12*L*T*d, N the weights a token multiplies by: "
                 f"non-embedding and LM head, at T={config.train.seq_len})")
    lines.append("memory on one device:")
    memory = memory_report(config, count)
    for name, value in memory.items():
        lines.append(f"  {name:<12} {_human(value)}")
    lines.append(f"  {'total':<12} {_human(sum(memory.values()))}")
    return "\n".join(lines)


def _changed(config: Config, overrides: dict[str, object]) -> Config:
    """``config`` with ``section.key`` overrides (of parallel and train) applied."""
    sections = {"parallel": config.parallel, "train": config.train}
    for dotted, value in overrides.items():
        section, key = dotted.split(".")
        sections[section] = dataclasses.replace(sections[section], **{key: value})
    return dataclasses.replace(config, **sections)


def fitting_changes(config: Config, world_size: int) -> list[tuple[dict[str, object], int]]:
    """The changes that lower each rank's peak, cheapest first, each with the world size it runs on: a higher ZeRO
    stage (with data parallelism), full recomputation, a smaller micro-batch (more accumulation), then twice the
    tensor-parallel degree (twice the processes)."""
    dims, _ = resolve_layout(config, world_size)
    parallel, model = config.parallel, config.model
    changes: list[tuple[dict[str, object], int]] = []
    if dims.dp > 1:
        changes += [({"parallel.zero_stage": stage}, world_size) for stage in range(parallel.zero_stage + 1, 4)]
    if parallel.activation_checkpointing != "full":
        changes.append(({"parallel.activation_checkpointing": "full"}, world_size))
    micro = config.train.micro_batch_size or config.train.global_batch_size // max(dims.dp, 1)
    while micro > 1:
        micro //= 2
        changes.append(({"train.micro_batch_size": micro}, world_size))
    tp = parallel.tp * 2
    if model.n_heads % tp == 0 and model.kv_heads % tp == 0:
        changes.append(({"parallel.tp": tp}, world_size * tp // parallel.tp))
    return changes


def _peak_if_valid(config: Config, world_size: int) -> float | None:
    """The largest predicted rank peak of ``config`` at ``world_size``, None when the layout is refused."""
    try:
        validate(config)
        return max(rank.peak for rank in rank_memory(config, world_size, TRAINING_STEP))
    except (ConfigError, MeasureError):
        return None


def what_would_fit(config: Config, world_size: int, device_memory_gib: float | None) -> str:
    """The line that follows a 'does not fit': the cheapest single change of :func:`fitting_changes` that fits, else
    the fewest of them, taken in that order, that fit together, else that none does (measured as the verdict is)."""
    changes = fitting_changes(config, world_size)
    for overrides, world in changes:
        peak = _peak_if_valid(_changed(config, overrides), world)
        if peak is not None and peak <= device_memory_bytes(world, device_memory_gib)[0]:
            return f"would fit: {_settings(overrides, world, world_size)} (peak {_human(peak)})"
    together: dict[str, object] = {}
    for overrides, world in changes:
        candidate = {**together, **overrides}
        peak = _peak_if_valid(_changed(config, candidate), world)
        if peak is None:
            continue
        together = candidate
        if peak <= device_memory_bytes(world, device_memory_gib)[0]:
            return f"would fit: {_settings(together, world, world_size)} (peak {_human(peak)})"
    tried = ", ".join(sorted({key for overrides, _ in changes for key in overrides})) or "nothing to change"
    return (f"no single change fits, nor all together ({tried}): more processes with a larger tp or pp, a shorter "
            "train.seq_len, or bf16 (train.precision)")


def _settings(overrides: dict[str, object], world: int, world_size: int) -> str:
    text = " ".join(f"{key}={str(value).lower() if isinstance(value, bool) else value}"
                    for key, value in overrides.items())
    return text + (f" on {world} processes (--world-size {world})" if world != world_size else "")


def components_report() -> str:
    """Every registered component (``model.<kind>``; router: ``model.moe.router``; the stack variants:
    ``model.stack``), every ``model.*`` choice and the objectives and tasks (``train.objective``, ``train.task``)."""
    keys = {"attention": "model.attention.kind", "router": "model.moe.router"}
    lines = ["components:"]
    for kind, registry in REGISTRIES.items():
        lines.append(f"  {keys.get(kind, f'model.{kind}'):<32} {', '.join(registry.names())}")
    lines.append(f"  {'train.objective':<32} {', '.join(OBJECTIVES.names())}")
    for key, values in CHOICES.items():
        if key.startswith("model.") or key == "train.task":
            lines.append(f"  {key:<32} {', '.join(values)}")
    lines.append("options (KEY: {kind: NAME, options: {OPTION: VALUE}}; the default after each =):")
    objectives = [("train.objective", kind, ", ".join(map(describe_option, dataclasses.fields(
        OBJECTIVES.options_class(kind))))) for kind in OBJECTIVES.names()]
    for key, kind, described in [*options_catalog(), *objectives]:
        if described:
            lines.append(f"  {key + ': ' + kind:<32} {described}")
    for name in SOURCES.names():
        source = SOURCES.get(name)
        if source.options:
            lines.append(f"  {'data.dataset.options: ' + name:<32} {', '.join(source.options)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = CommandParser(prog="xscale inspect", description=__doc__.splitlines()[0])
    parser.add_argument("config", nargs="?", help="YAML config; omit for the built-in default")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--world-size", type=int, default=None,
                        help="processes to plan for (default: the product of the config's degrees)")
    parser.add_argument("--measure", action="store_true",
                        help="run one training step on fake tensors and say whether each rank's peak fits")
    parser.add_argument("--device-memory", type=float, default=None, metavar="GiB",
                        help="with --measure: each rank's memory (default: the GPU's, or host RAM / processes)")
    parser.add_argument("--components", action="store_true",
                        help="list every registered component and model choice by name, and exit")
    args = parser.parse_args(argv)
    if args.components:
        print(components_report())
        return 0
    if args.device_memory is not None and not args.device_memory > 0:
        print(f"xscale inspect: --device-memory {args.device_memory} must be a positive number of GiB", file=sys.stderr)
        return 2
    try:
        config = with_resolved_vocab(load_config_from_cli(args.config, args.overrides))
        text = report(config)
        parallel = config.parallel
        world_size = args.world_size or (parallel.pp * parallel.dp_replicate * max(parallel.dp_shard, 1) * parallel.tp)
        if world_size > 1:
            text += "\n" + "\n".join(layout_report(config, world_size))
        if args.measure:
            lines = measure_report(config, world_size, TRAINING_STEP, args.device_memory)
            if any("does not fit" in line for line in lines):
                lines.append("  " + what_would_fit(config, world_size, args.device_memory))
            text += "\n" + "\n".join(lines)
    except ConfigError as error:
        print(f"xscale inspect: invalid configuration: {error}", file=sys.stderr)
        return 2
    except MeasureError as error:
        print(f"xscale inspect: {error}", file=sys.stderr)
        return 2
    print(text)
    return 0
