"""A run configuration checked against the component registries, before anything is built.

:mod:`xscale.config_loading` reads YAML and overrides, :mod:`xscale.config` checks values that need nothing else (choices, ranges);
here the names a config gives (attention kinds, norms, routers, ...) are looked up in the zoo's registries and
the MoE layout is checked. The layout's own checks, which need the world size, are
:func:`xscale.parallel.checks.resolve_dims`.
"""

from __future__ import annotations

import typing
from pathlib import Path

from xscale.config import Config, ConfigError
from xscale.config_loading import config_from_tree, read_config, split_cli_arguments
from xscale.config_values import check_values, closest, resolve_objective
from xscale.data import TEXT_DATASETS
from xscale.data.lra import PAD_AS_CONTENT
from xscale.data.objectives import check_bart_config, span_corruption_lengths
from xscale.interop.hf.families import with_init_model
from xscale.models.act import check_act_config
from xscale.models.early_exit import check_early_exit_config
from xscale.models.funnel import check_funnel_config
from xscale.models.moe import check_moe_config
from xscale.models.patch_embedding import check_patch_config
from xscale.models.registry import REGISTRIES
from xscale.models.reversible import check_reversible_config
from xscale.models.segment_memory import check_segment_memory_config
from xscale.train.loggers import check_installed


def check_registered(kind: str, name: str, where: str) -> None:
    """Refuse a component name that no module registered, naming the closest and every available one."""
    registry = REGISTRIES[kind]
    if name not in registry:
        raise ConfigError(
            f"{where}='{name}' is not a known {kind}{closest(name, registry.names())}; "
            f"available: {', '.join(registry.names())}"
        )


def check_padding_masks(config: Config) -> None:
    """train.task=classify pads variable-length examples: every attention kind must take a key-padding mask
    (unless a generated task reads its pads as content: ``data.options.pad_as_content``)."""
    if config.data.dataset.startswith("lra_") and config.data.options.get(PAD_AS_CONTENT) is True:
        return
    attention = REGISTRIES["attention"]
    able = [name for name in attention.names() if attention.get(name).takes_padding_mask]
    for kind in dict.fromkeys(config.model.attention.per_layer or [config.model.attention.kind]):
        if not attention.get(kind).takes_padding_mask:
            raise ConfigError(f"attention '{kind}' takes no key-padding mask, so it would attend to the padding of "
                              f"train.task=classify's variable-length examples; use one that does: {', '.join(able)} (or, for "
                              f"the generated lra_* tasks, data.options.{PAD_AS_CONTENT}=true)")


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


def check_context_parallel_lengths(config: Config) -> None:
    """Context parallelism cuts each stack's sequences into cp (2cp) chunks: span corruption of text windows gives
    an encoder-decoder shorter encoder inputs and decoder targets than train.seq_len, and both must split."""
    parallel = config.parallel
    if parallel.cp <= 1 or config.model.family != "encoder_decoder" or config.data.dataset not in TEXT_DATASETS \
            or resolve_objective(config) != "span":
        return
    chunks = 2 * parallel.cp if parallel.cp_load_balance else parallel.cp
    options = config.data.options
    density = float(options.get("noise_density", 0.15))
    mean_span = float(options.get("mean_span_length", 3.0))

    def split(seq_len: int) -> bool:
        lengths = (seq_len, *span_corruption_lengths(seq_len, density, mean_span))
        return all(length % chunks == 0 for length in lengths)

    if split(config.train.seq_len):
        return
    encoder, decoder = span_corruption_lengths(config.train.seq_len, density, mean_span)
    nearby = [n for n in range(max(chunks, config.train.seq_len - 32 * chunks), config.train.seq_len + 32 * chunks)
              if split(n)]
    nearest = sorted(nearby, key=lambda n: (n > config.model.max_seq_len, abs(n - config.train.seq_len), n))[:3]
    hint = f"use train.seq_len={' or '.join(map(str, nearest))}" if nearest else "change data.options.noise_density"
    raise ConfigError(f"parallel.cp={parallel.cp} cuts every sequence into {chunks} chunks, but span corruption of "
                      f"train.seq_len={config.train.seq_len} windows gives {encoder} encoder and {decoder} decoder "
                      f"tokens: {hint}")


def validate(config: Config) -> None:
    """Refuse configurations that cannot run: values (:func:`xscale.config_values.check_values`), then component names."""
    check_values(config)
    model = config.model
    check_registered("position", model.position, "model.position")
    check_registered("norm", model.norm, "model.norm")
    check_registered("ffn", model.ffn, "model.ffn")
    for kind in dict.fromkeys(model.attention.per_layer or [model.attention.kind]):
        where = "model.attention.per_layer" if model.attention.per_layer else "model.attention.kind"
        check_registered("attention", kind, where)
    if config.train.task == "classify":
        check_padding_masks(config)
    check_registered("router", model.moe.router, "model.moe.router")  # a typo is refused even while MoE is off
    if model.moe.num_experts:
        check_moe_config(model, config.parallel.ep)
    check_reversible_config(model)
    check_act_config(model)
    check_patch_config(config)
    check_bart_config(config)
    check_funnel_config(model)
    check_early_exit_config(model, config.train.task)
    check_segment_memory_config(config)
    check_sparse_attention(config)
    check_compiled_layout(config)
    check_context_parallel_lengths(config)
    check_installed(config.train.logger_names())  # an optional logger's package (wandb), before anything runs


def load_config(path: str | Path | None = None, overrides: typing.Sequence[str] = ()) -> Config:
    """Read a YAML config (or the built-in default when ``path`` is None), apply overrides, validate."""
    config = read_config(path, overrides, complete=with_init_model)
    validate(config)
    return config


def load_config_from_cli(config: str | None, overrides: typing.Sequence[str]) -> Config:
    """CLI form: ``[CONFIG] [overrides...]`` where a first argument containing '=' is an override."""
    return load_config(*split_cli_arguments(config, overrides))


def config_from_dict(tree: dict[str, typing.Any]) -> Config:
    """A validated :class:`Config` from nested mappings (e.g. the config a checkpoint saved)."""
    config = config_from_tree(tree)
    validate(config)
    return config
