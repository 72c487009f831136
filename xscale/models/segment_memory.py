"""Transformer-XL's segment-level recurrence (Dai et al. 2019, sec. 3.2).

Layer n of segment tau attends over its own inputs and the remembered inputs of the previous segment:

    h~_tau^{n-1} = [SG(m_tau^{n-1}) ; h_tau^{n-1}]
    q = h_tau^{n-1} W_q,   k = h~_tau^{n-1} W_k,   v = h~_tau^{n-1} W_v

with the causal mask shifted by M (query i sees every remembered state and the segment's keys up to i) and
relative positions spanning M + T: Transformer-XL's (``model.position=xl``, sec. 3.3), whose terms enter the scores
as a logit bias, so only for a core that takes one (dense), or RoPE's rotations (``model.position=rope``) over the
[memory ; segment] positions, the queries at the last T, for every core that takes the memory (dense, local,
dilated, linear, performer, rfa: the sparse patterns over the joined positions, the linear cores with the memory a
prefix of their causal sums). Absolute positions would give a remembered state and the segment's state at the same
index the same position (sec. 3.3's "temporal confusion"), so they are refused. The memory m^{n-1} holds the last M = ``model.
segment_memory`` inputs of layer n over the stream so far (SG: stop-gradient). It lives in a
:class:`SegmentMemory` the caller owns and passes in the forward's context; layers read the previous states and
record the new ones, which become current only when the caller calls :meth:`SegmentMemory.advance` (so a
forward re-run by activation checkpointing reads and writes the same states). Its tensors go by
:func:`memory_name`: a microbatch's first global batch row and the layer, so the memory saved by every rank of one
layout can be regrouped for another (:mod:`xscale.train.memory_reshard`).
"""

from __future__ import annotations

from typing import Any

import torch

from xscale.config.schema import Config, ConfigError
from xscale.models.registry import ATTENTION

MEMORY_POSITIONS = ("xl", "rope")  # relative over memory and segment; xl needs a core that takes a logit bias
# The model options that carry states from step to step (each has a layout-parity case in the zoo matrix).
MEMORY_OPTIONS = {"segment_memory": "Transformer-XL's segment recurrence (Dai et al. 2019)",
                  "compressed_memory": "the Compressive Transformer's compressed memory (Rae et al. 2020)"}
COMPRESSED = "/compressed"  # the suffix of a layer's compressed memory's name


def memory_name(first_row: int, layer: int, compressed: bool = False) -> str:
    """The name of the memory of a microbatch (its row 0 being global batch row ``first_row``) at ``layer``: the
    blocks' key ``(first_row, layer)`` as text, + ``/compressed`` for the compressed memory."""
    return f"{(first_row, layer)}{COMPRESSED if compressed else ''}"


class SegmentMemory:
    """The last ``length`` inputs of every layer, per key (a microbatch's first global row and the layer)."""

    def __init__(self, length: int, compressed_length: int = 0) -> None:
        if length <= 0:
            raise ValueError(f"a segment memory needs a positive length, got {length}")
        self.length, self.compressed_length = length, compressed_length
        self.current: dict[str, torch.Tensor] = {}  # what this step's forwards read
        self.recorded: dict[str, torch.Tensor] = {}  # what they leave for the next step
        self.left: dict[str, torch.Tensor] = {}  # the states this step's forwards pushed out of the memory

    def exchange(self, key: Any, inputs: torch.Tensor) -> torch.Tensor | None:
        """SG([compressed ; m]) for ``key`` (None at a stream's start); records the last ``length`` of
        [m ; inputs], detached (the states before them are :meth:`leaving`)."""
        name = str(key)
        remembered = self.current.get(name)
        if remembered is not None and remembered.shape[0] != inputs.shape[0]:
            raise ValueError(f"the memory of {name} holds {remembered.shape[0]} rows but the batch has "
                             f"{inputs.shape[0]}; keep each stream on its batch row (data.order=streams)")
        if remembered is not None:
            remembered = remembered.detach()  # SG(m): the previous segments get no gradient
        joined = inputs.detach() if remembered is None else torch.cat([remembered, inputs.detach()], dim=1)
        self.recorded[name] = joined[:, -self.length:]
        self.left.pop(name, None)
        if joined.shape[1] > self.length:
            self.left[name] = joined[:, :-self.length]
        compressed = self.current.get(f"{name}{COMPRESSED}")
        if compressed is None:
            return remembered
        self.recorded[f"{name}{COMPRESSED}"] = compressed.detach()  # kept unless record_compressed adds to it
        return torch.cat([compressed.detach().to(remembered.dtype), remembered], dim=1)

    def leaving(self, key: Any) -> torch.Tensor | None:
        """The states the last :meth:`exchange` of ``key`` pushed out of the memory (None: none)."""
        return self.left.get(str(key))

    def record_compressed(self, key: Any, compressed: torch.Tensor) -> None:
        """Append ``compressed`` (the leaving states compressed) to the compressed memory, keeping its last
        ``compressed_length``."""
        name = f"{key}{COMPRESSED}"
        previous = self.current.get(name)
        joined = compressed.detach() if previous is None else torch.cat([previous, compressed.detach()], dim=1)
        self.recorded[name] = joined[:, -self.compressed_length:]

    def advance(self) -> None:
        """The states recorded by this step's forwards become the memory of the next."""
        self.current, self.recorded, self.left = self.recorded, {}, {}

    def reset(self) -> None:
        """Forget everything (the streams restart)."""
        self.current, self.recorded, self.left = {}, {}, {}

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {name: tensor.detach().cpu().clone() for name, tensor in self.current.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor], device: torch.device | str = "cpu") -> None:
        self.current, self.recorded, self.left = {name: tensor.to(device) for name, tensor in state.items()}, {}, {}


def check_segment_memory_config(config: Config) -> None:
    """Refuse what segment recurrence cannot run with, each with what to change."""
    model, parallel = config.model, config.parallel
    if model.compressed_memory and not model.segment_memory:
        raise ConfigError(f"model.compressed_memory={model.compressed_memory} compresses what leaves the segment "
                          "memory: set model.segment_memory > 0 (and model.position=xl, data.order=streams)")
    if not model.segment_memory:
        return
    where = f"model.segment_memory={model.segment_memory}"
    if model.family != "decoder":
        raise ConfigError(f"{where} serves model.family=decoder (a causal stream); set model.segment_memory=0")
    if model.position.kind not in MEMORY_POSITIONS:
        raise ConfigError(f"{where} needs relative positions that span memory and segment: set model.position=xl "
                          f"(Transformer-XL's, dense attention) or rope (model.position={model.position} is not "
                          "supported with a memory)")
    check_memory_cores(config)
    if model.share_layers:
        raise ConfigError(f"{where} does not combine with model.share_layers=true (one block at every depth); set "
                          "one of them off")
    if model.stack.kind != "plain":
        raise ConfigError(f"{where} does not combine with model.stack={model.stack.kind} (it keeps the inputs of "
                          "each layer run once, in order); set model.stack=plain or model.segment_memory=0")
    if config.train.task != "lm":
        raise ConfigError(f"{where} trains a language model; set train.task=lm")
    if config.data.order != "streams":
        raise ConfigError(f"{where} carries the memory from step to step, which needs consecutive windows of each "
                          "stream on the same batch row: set data.order=streams")
    for name, reason in (("pp", "a pipeline stage would have to keep the memory of its layers per microbatch"),
                         ("cp", "context parallelism splits the segment, the memory would have to follow")):
        if getattr(parallel, name) > 1:
            raise ConfigError(f"{where} is not supported with parallel.{name}={getattr(parallel, name)}: {reason}; "
                              f"set parallel.{name}=1")
    if model.compressed_memory:
        check_compressed_memory(config)
    if parallel.sequence_parallel:
        raise ConfigError(f"{where} is not supported with parallel.sequence_parallel=true (the residual stream "
                          "the memory keeps is split over the tp ranks); set it to false")


def check_memory_cores(config: Config) -> None:
    """Every layer's core must take the memory as extra keys, and the position's relative term."""
    model = config.model
    where = f"model.segment_memory={model.segment_memory}"
    for kind in dict.fromkeys(model.attention.per_layer or [model.attention.kind]):
        if kind not in ATTENTION.names():
            continue
        core = ATTENTION.get(kind)
        if not core.attends_to_memory:
            able = [name for name in ATTENTION.names() if ATTENTION.get(name).attends_to_memory]
            raise ConfigError(f"{where}: attention '{kind}' cannot take the memory as extra keys; use one of "
                              f"{', '.join(able)}")
        if model.position.kind == "xl" and not core.supports_bias:
            raise ConfigError(f"{where}: attention '{kind}' cannot add Transformer-XL's relative terms (a logit "
                              "bias) to its scores; set model.position=rope (relative by rotation over memory and "
                              "segment) or use model.attention.kind=dense")
        if model.compressed_memory and core is not ATTENTION.get("dense"):
            raise ConfigError(f"model.compressed_memory={model.compressed_memory}: its attention-reconstruction loss "
                              f"is softmax attention (Rae et al. 2020, eq. 2), attention '{kind}' is not; use "
                              "model.attention.kind=dense")


def check_compressed_memory(config: Config) -> None:
    """The Compressive Transformer's settings (on top of a segment memory)."""
    model, rate = config.model, config.model.compression_rate
    where = f"model.compressed_memory={model.compressed_memory}"
    if config.train.seq_len % rate or model.segment_memory % rate:
        raise ConfigError(f"{where}: train.seq_len={config.train.seq_len} and model.segment_memory="
                          f"{model.segment_memory} must be multiples of model.compression_rate={rate} (the states "
                          "leaving the memory are compressed c at a time)")
    if config.parallel.tp > 1:
        raise ConfigError(f"{where} is not supported with parallel.tp={config.parallel.tp}: the reconstruction "
                          "loss reads every head's projections; set parallel.tp=1")
