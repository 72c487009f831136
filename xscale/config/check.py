"""Checks of a :class:`~xscale.config.schema.Config` before anything is built: the choices and ranges of every
field (:func:`check_values`), cross-section rules that need nothing else, and the checks other layers register
(:func:`register_check`: the zoo's component names and options, the data objectives, the loggers). Each refusal
names the field and what to set instead.

Layers above ``config`` contribute their checks by registering them when they are imported, so this package imports
nothing of xscale's but itself; :func:`validate` runs them all, in registration order.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import typing
from typing import Any

from xscale.config.schema import (
    CHOICES,
    SOURCE_KINDS,
    Config,
    ConfigError,
    TrainConfig,
)

Check = typing.Callable[[Config], None]
# provider (the registering package, e.g. "xscale.models") -> its checks, in registration order
_CHECKS: dict[str, list[Check]] = {}


def register_check(provider: str, check: Check) -> Check:
    """Add ``check`` to what :func:`validate` runs; ``provider`` names the registering package (listed by
    :func:`check_providers`). Registering the same function twice is a no-op."""
    checks = _CHECKS.setdefault(provider, [])
    if check not in checks:
        checks.append(check)
    return check


def check_providers() -> list[str]:
    """The packages whose checks :func:`validate` runs (those imported so far)."""
    return list(_CHECKS)


def validate(config: Config) -> None:
    """Refuse configurations that cannot run: values (:func:`check_values`), then every registered check."""
    check_values(config)
    check_sparse_attention(config)
    check_compiled_layout(config)
    for checks in _CHECKS.values():
        for check in checks:
            check(config)


def check_sparse_attention(config: Config) -> None:
    """train.sparse_attention=flex compiles its own FlexAttention kernel; inside blocks that train.compile traces,
    the BlockMask would be built during tracing, a path not yet run on a GPU: one of the two until it is."""
    if config.train.sparse_attention == "flex" and config.train.compile:
        raise ConfigError("train.sparse_attention=flex with train.compile=true is not supported yet (the compiled "
                          "blocks would trace FlexAttention's BlockMask construction): set train.compile=false, or "
                          "train.sparse_attention=gather")


def check_compiled_layout(config: Config) -> None:
    """train.compile where torch 2.13's compiler fails under tensor parallelism (both compile in one process, under
    dp_shard and pp): an encoder-decoder, whose first decoder block's trace recursed without end in AOTAutograd
    (RecursionError, also with a recursion limit of 20,000), and Transformer-XL's segment memory, whose backward
    through the remembered states' concatenation failed to trace ("unhashable type: non-nested SymInt")."""
    if not config.train.compile or config.parallel.tp <= 1:
        return
    if config.model.family == "encoder_decoder":
        what = "an encoder-decoder (torch's compiler recurses without end tracing the decoder's cross-attention)"
    elif config.model.segment_memory:
        what = "model.segment_memory (torch's compiler fails to trace the remembered states' concatenation)"
    else:
        return
    raise ConfigError(f"train.compile=true with {what} under parallel.tp>1 is not supported: set "
                      "train.compile=false, or keep parallel.tp=1 (dp_shard, dp_replicate and pp compile)")


# --------------------------------------------------------------------------- building from dicts

def closest(name: str, choices: typing.Iterable[str]) -> str:
    match = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.5)
    return f" (did you mean '{match[0]}'?)" if match else ""


# --------------------------------------------------------------------------- validation

def _value(config: Config, dotted: str) -> Any:
    node: Any = config
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


def _check_choice(config: Config, dotted: str) -> None:
    value = _value(config, dotted)
    allowed = CHOICES[dotted]
    if isinstance(value, bool) != isinstance(allowed[-1], bool) and not isinstance(value, list):
        value = str(value)  # True is not 1, and 'true' not True: a bool field's choices end with a bool
    if isinstance(value, list):
        for item in value:
            if item not in allowed:
                raise ConfigError(f"{dotted}: '{item}' is not one of {', '.join(allowed)}{closest(str(item), allowed)}")
        if len(set(value)) < len(value):
            raise ConfigError(f"{dotted}={value} names an entry twice; list each once")
    elif value not in allowed:
        names = [str(choice).lower() if isinstance(choice, bool) else choice for choice in allowed]
        raise ConfigError(f"{dotted}='{value}' is not one of {', '.join(names)}{closest(str(value), names)}")


def check_values(config: Config) -> None:
    """Refuse values that cannot run (choices, ranges); the checks that need the component
    registries are registered by the layers that own them (:func:`register_check`)."""
    _check_filled(config)
    for dotted in CHOICES:
        _check_choice(config, dotted)
    model, train = config.model, config.train
    if model.vocab_size < 0:
        raise ConfigError(f"model.vocab_size must be positive (or 0: the tokenizer's), got {model.vocab_size}")
    for name, value in (("d_model", model.d_model), ("n_layers", model.n_layers),
                        ("n_heads", model.n_heads), ("max_seq_len", model.max_seq_len)):
        if value <= 0:
            raise ConfigError(f"model.{name} must be positive, got {value}")
    if model.d_model % model.n_heads:
        raise ConfigError(
            f"model.n_heads={model.n_heads} does not divide model.d_model={model.d_model}; "
            f"pick heads from {[h for h in range(1, 65) if model.d_model % h == 0][:12]}"
        )
    if model.n_kv_heads is not None and (model.n_kv_heads <= 0 or model.n_heads % model.n_kv_heads):
        raise ConfigError(
            f"model.n_kv_heads={model.n_kv_heads} must divide model.n_heads={model.n_heads} (1 = MQA, n_heads = MHA)"
        )
    if model.position.kind == "rope" and model.head_dim % 2:
        raise ConfigError(f"rope needs an even head dimension; d_model/n_heads = {model.head_dim}")
    for name, value in (("dropout", model.dropout), ("attention_dropout", model.attention_dropout)):
        if not 0.0 <= value < 1.0:
            raise ConfigError(f"model.{name} must be in [0, 1), got {value}")
    if model.family == "decoder" and model.position.kind == "none":
        pass  # decoders may run without positions (causal masking leaks order)
    elif model.position.kind == "none":
        raise ConfigError("model.position=none only works for decoders; encoders need a position encoding")
    if model.position.kind in ("learned", "sinusoidal") and train.seq_len > model.max_seq_len:
        raise ConfigError(
            f"train.seq_len={train.seq_len} exceeds model.max_seq_len={model.max_seq_len} for "
            f"{model.position} positions; raise model.max_seq_len or lower train.seq_len"
        )
    if train.steps <= 0:
        raise ConfigError(f"train.steps must be positive, got {train.steps}")
    if train.seq_len <= 1:
        raise ConfigError(f"train.seq_len must be at least 2, got {train.seq_len}")
    if train.warmup_steps < 0:
        raise ConfigError(f"train.warmup_steps must be >= 0, got {train.warmup_steps}")
    if train.global_batch_size <= 0:
        raise ConfigError(f"train.global_batch_size must be positive, got {train.global_batch_size}")
    _check_schedule(train)
    _check_ranges(config)
    _check_moe_values(config)
    _check_classify(config)
    init_from = config.checkpoint.init_from
    if init_from != "none" and not (init_from.startswith("hf:") and init_from[3:].strip()):
        raise ConfigError(f"checkpoint.init_from='{init_from}' must be none or hf:DIR (a Hugging Face model folder)")
    if config.checkpoint.keep < 1:
        raise ConfigError(f"checkpoint.keep must be at least 1, got {config.checkpoint.keep}")
    _check_sources(config)


def _check_sources(config: Config) -> None:
    """Each entry of data.sources / data.eval_sources: a path, a positive finite weight, a known kind."""
    for key in ("sources", "eval_sources"):
        for index, source in enumerate(getattr(config.data, key)):
            where = f"data.{key}[{index}]"
            if not source.path.strip():
                raise ConfigError(f"{where}.path is empty; give the file, folder or .bin/.idx prefix of the corpus")
            if not (math.isfinite(source.weight) and source.weight > 0):
                raise ConfigError(f"{where}.weight must be a positive number, got {source.weight}")
            if source.kind not in SOURCE_KINDS:
                raise ConfigError(f"{where}.kind='{source.kind}' is not one of {', '.join(SOURCE_KINDS)}"
                                  f"{closest(source.kind, SOURCE_KINDS)}")
            if source.name is not None and not source.name.strip():
                raise ConfigError(f"{where}.name is empty; leave it out for the file name")
    if config.data.sources and config.data.path:
        raise ConfigError("data.path and data.sources are both set; put the corpus in data.sources (one entry "
                          "per corpus) and leave data.path out")
    if config.data.eval_sources and not config.data.sources:
        raise ConfigError("data.eval_sources needs data.sources (the training corpora) as well")


def _check_classify(config: Config) -> None:
    """train.task=classify: an encoder reading labelled examples (data.dataset=labeled) under data parallelism."""
    if config.train.task != "classify":
        return
    if config.model.family != "encoder":
        raise ConfigError(f"train.task=classify needs model.family=encoder (bidirectional attention over the padded "
                          f"example), got {config.model.family}")
    parallel = config.parallel
    for name in ("tp", "pp", "cp"):
        if getattr(parallel, name) > 1:
            raise ConfigError(f"train.task=classify runs under data parallelism only (ZeRO included); "
                              f"parallel.{name}={getattr(parallel, name)} is not supported: set parallel.{name}=1")


def _check_schedule(train: TrainConfig) -> None:
    """The decay must fit in the schedule, and decay_steps means something only for wsd."""
    if train.decay_steps is not None and train.schedule != "wsd":
        raise ConfigError(f"train.decay_steps={train.decay_steps} applies to train.schedule=wsd only (got "
                          f"train.schedule={train.schedule}); remove it or set train.schedule=wsd")
    length = train.schedule_steps or train.steps
    if train.schedule == "wsd" and train.decay_steps is not None and train.decay_steps + train.warmup_steps > length:
        raise ConfigError(f"train.decay_steps={train.decay_steps} plus train.warmup_steps={train.warmup_steps} exceed "
                          f"the schedule's {length} steps (train.schedule_steps, default train.steps); lower them or "
                          "raise train.schedule_steps")


def _check_filled(node: Any, where: str = "") -> None:
    """Every float finite and every string non-empty, in every section: no setting means NaN, inf or ''."""
    for item in dataclasses.fields(node):
        dotted = f"{where}.{item.name}" if where else item.name
        value = getattr(node, item.name)
        if dataclasses.is_dataclass(value):
            _check_filled(value, dotted)
        elif isinstance(value, float) and not math.isfinite(value):
            rule = f"; {dotted} must be {RANGES[dotted][0]}" if dotted in RANGES else ""
            raise ConfigError(f"{dotted}={value} is not a finite number{rule}")
        elif isinstance(value, str) and not value.strip():
            raise ConfigError(f"{dotted} is empty; give a value, or leave the key out for its default")
        elif isinstance(value, list) and any(isinstance(each, str) and not each.strip() for each in value):
            raise ConfigError(f"{dotted}={value!r} holds an empty string; remove it")


def _positive(value: float) -> bool:
    return value > 0


def _non_negative(value: float) -> bool:
    return value >= 0


def _fraction(value: float) -> bool:
    return 0 <= value < 1


YEAR_S = 365 * 24 * 3600


# Numeric fields and the range each must lie in (an unset optional field is not checked; NaN and the infinities
# are refused first, as no setting means them).
RANGES: dict[str, tuple[str, typing.Callable[[float], bool]]] = {
    "model.d_ff": ("positive", _positive),
    "model.init_std": ("positive", _positive),
    "model.num_classes": (">= 0 (0: no classification head)", _non_negative),
    **{f"model.{name}": ("positive", _positive) for name in ("image_size", "image_channels", "patch_size")},
    "model.segment_memory": (">= 0 (0: no memory)", _non_negative),
    "model.compressed_memory": (">= 0 (0: no compressed memory)", _non_negative),
    "model.compression_rate": ("in [1, 64]", lambda value: 1 <= value <= 64),
    "train.lr": ("positive", _positive),
    "train.min_lr_ratio": ("in [0, 1]", lambda value: 0 <= value <= 1),
    "train.weight_decay": (">= 0", _non_negative),
    "train.beta1": ("in [0, 1)", _fraction),
    "train.beta2": ("in [0, 1)", _fraction),
    "train.eps": ("positive", _positive),
    "train.grad_clip": (">= 0 (0 disables)", _non_negative),
    "train.eval_every": (">= 0 (0 disables; unset: about 10 evaluations over the run)", _non_negative),
    "train.eval_batches": ("positive", _positive),
    "train.log_every": ("positive", _positive),
    "train.max_skipped": ("positive", _positive),
    "train.schedule_steps": ("positive", _positive),
    "train.decay_steps": ("positive", _positive),
    "train.profile_steps": (">= 0 (0: off)", _non_negative),
    "train.profile_start": ("at least 1 (steps count from 1)", _positive),
    "train.step_timeout_s": (f">= 0 (0: auto) and at most a year ({YEAR_S})", lambda value: 0 <= value <= YEAR_S),
    "train.first_step_timeout_s": (f">= 0 (0: the first steps, saves and evaluations unwatched) and at most a year "
                                   f"({YEAR_S})", lambda value: 0 <= value <= YEAR_S),
    "parallel.bucket_mb": ("positive and at most 4096", lambda value: 0 < value <= 4096),
    "parallel.timeout_s": (f"positive and at most a year ({YEAR_S})", lambda value: 0 < value <= YEAR_S),
    "train.peak_flops": ("positive", _positive),
    "data.eval_fraction": ("in [0, 1)", _fraction),
    "checkpoint.every": (">= -1 (0: only at the end; -1: none, for throwaway runs)", lambda value: value >= -1),
    "checkpoint.memory_every": (">= 0 (0: no memory snapshots)", _non_negative),
    "model.n_decoder_layers": ("positive", _positive),
    "model.moe.num_experts": (">= 0 (0: a dense FFN)", _non_negative),
    "model.moe.top_k": ("at least 1", _positive),
    "model.moe.capacity_factor": ("positive", _positive),
    "model.moe.eval_capacity_factor": ("positive", _positive),
    "model.moe.min_capacity": (">= 0", _non_negative),
    "model.moe.aux_loss_coef": (">= 0", _non_negative),
    "model.moe.z_loss_coef": (">= 0", _non_negative),
    "model.moe.jitter": ("in [0, 1) (inputs scaled by 1 +- jitter)", _fraction),
    "model.moe.every": ("at least 1", _positive),
    # The same words as xscale.parallel.checks.resolve_dims, which needs the world size for the rest.
    **{f"parallel.{name}": (">= 1", _positive)
       for name in ("dp_replicate", "tp", "pp", "ep", "cp", "pp_stages_per_rank")},
    "parallel.dp_shard": (">= 1, or -1 for what the world size leaves", lambda value: value == -1 or value >= 1),
    "parallel.zero_stage": ("0 (DDP), 1, 2 or 3 (FSDP2)", lambda value: value in (0, 1, 2, 3)),
    "train.micro_batch_size": ("positive", _positive),
    "train.seed": (">= 0", _non_negative),
    "train.spike_factor": ("0 (off) or above 1", lambda value: value == 0 or value > 1),
    "train.spike_window": ("positive", _positive),
    "train.health_window": ("positive", _positive),
    "train.health_loss_factor": ("above 1", lambda value: value > 1),
    "train.health_grad_collapse": ("in [0, 1) (0: not checked)", _fraction),
    "data.tokenizer_vocab_size": ("positive", _positive),
    "data.num_samples": (">= 0 (0: the task's default)", _non_negative),
    "launch.nodes": ("at least 1", _positive),
    "launch.gpus_per_node": (">= 0 (0: CPU processes)", _non_negative),
    "launch.nproc_per_node": ("at least 1", _positive),
    "launch.requeue_signal_seconds": ("in [0, 65535] (Slurm's limit)", lambda value: 0 <= value <= 65535),
    "launch.max_restarts": (">= 0", _non_negative),
    "launch.max_requeues": (">= 0", _non_negative),
    "launch.min_nodes": (">= 0 (0: exactly launch.nodes)", _non_negative),
}


def _check_ranges(config: Config) -> None:
    for dotted, (rule, holds) in RANGES.items():
        value = _value(config, dotted)
        if value is None:
            continue
        if not math.isfinite(value):
            raise ConfigError(f"{dotted}={value} is not a finite number; {dotted} must be {rule}")
        if not holds(value):
            raise ConfigError(f"{dotted} must be {rule}, got {value}")


def _check_moe_values(config: Config) -> None:
    """What only an MoE model (``num_experts`` > 0) needs; each value's own range is in :data:`RANGES`."""
    moe = config.model.moe
    if moe.num_experts == 0:
        return
    if moe.top_k > moe.num_experts:
        raise ConfigError(f"model.moe.top_k={moe.top_k} must be in [1, num_experts={moe.num_experts}]")
    for name in ("capacity_factor", "eval_capacity_factor"):
        if not moe.dropless and getattr(moe, name) > moe.num_experts:  # capacity would exceed every token
            raise ConfigError(f"model.moe.{name}={getattr(moe, name):g} exceeds model.moe.num_experts="
                              f"{moe.num_experts}, where no token is dropped already; lower it, or set "
                              "model.moe.dropless=true for no capacity limit")
