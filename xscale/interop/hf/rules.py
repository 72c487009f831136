"""What a Hugging Face family is to xscale: a config map both ways and tensor rules that run both ways.

A :class:`Rule` ties one or more HF tensors to one or more xscale tensors (GPT-2's fused ``c_attn`` is three of
ours); import and export walk the same rules, so the two directions cannot drift. A family also lists the xscale
settings it can express (:attr:`Family.requires`); export refuses any other setting, naming it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from xscale.config.schema import ModelConfig
from xscale.models.registry import NORM, POSITION

Tensors = tuple[torch.Tensor, ...]


class InteropError(ValueError):
    """A checkpoint or model that cannot cross to or from Hugging Face; the message says what and why."""


@dataclass(frozen=True)
class Rule:
    """HF tensors ``hf`` <-> xscale tensors ``ours``; ``to_ours``/``to_hf`` map the tuples (identity by default)."""

    hf: tuple[str, ...]
    ours: tuple[str, ...]
    to_ours: Callable[..., Tensors] = lambda *tensors: tensors
    to_hf: Callable[..., Tensors] = lambda *tensors: tensors


def same(hf: str, ours: str) -> Rule:
    return Rule((hf,), (ours,))


def transposed(hf: str, ours: str) -> Rule:
    """HF's ``Conv1D`` (GPT-2) stores (in, out), our ``nn.Linear`` (out, in)."""
    return Rule((hf,), (ours,), lambda w: (w.t(),), lambda w: (w.t(),))


def fused(hf: str, ours: tuple[str, ...], transpose: bool = False) -> Rule:
    """One HF tensor holding ours concatenated along the output dimension (GPT-2's q, k, v in ``c_attn``)."""

    def split(w: torch.Tensor) -> Tensors:
        return tuple((w.t() if transpose else w).chunk(len(ours), dim=0))

    def join(*parts: torch.Tensor) -> Tensors:
        whole = torch.cat(parts, dim=0)
        return (whole.t() if transpose else whole,)

    return Rule((hf,), ours, split, join)


def scaled(hf: str, ours: str, factor: float) -> Rule:
    """Ours = HF x ``factor`` (exact both ways when ``factor`` is a power of two)."""
    return Rule((hf,), (ours,), lambda w: (w * factor,), lambda w: (w / factor,))


def linear(hf: str, ours: str, bias: bool) -> list[Rule]:
    """A linear layer's weight and (when the model has biases) bias, under the same names on both sides."""
    return [same(f"{hf}.weight", f"{ours}.weight")] + ([same(f"{hf}.bias", f"{ours}.bias")] if bias else [])


@dataclass(frozen=True)
class Family:
    """One HF architecture: its ``model_type``, the class ``from_pretrained`` builds, the config maps and rules.

    ``requires``: xscale ``model.*`` settings and the values this family can express (the first is what export writes
    for a setting HF has no field for); ``base_prefix``: the prefix a bare base-model checkpoint lacks
    (``transformer.`` for a ``GPT2Model`` file).
    """

    model_type: str
    architecture: str
    auto_class: str
    base_prefix: str
    requires: dict[str, tuple[Any, ...]]
    config_from_hf: Callable[[dict[str, Any]], dict[str, Any]]
    config_to_hf: Callable[[ModelConfig], dict[str, Any]]
    rules: Callable[[ModelConfig], list[Rule]]

    def mismatches(self, model: ModelConfig) -> list[str]:
        """The settings of ``model`` this family cannot express, one phrase each."""
        found = []
        for dotted, allowed in {**COMMON_REQUIREMENTS, **self.requires}.items():
            value = setting(model, dotted)
            if value not in allowed:
                wanted = " or ".join(repr(each) for each in allowed)
                shown = dotted.removesuffix(".kind") if dotted.split(".")[0] in model.COMPONENTS else dotted
                found.append(f"model.{shown}={value!r} ({self.model_type} needs {wanted})")
        return found


# What every family needs: dense attention in every layer, no experts, one block per depth, a plain residual stack.
COMMON_REQUIREMENTS: dict[str, tuple[Any, ...]] = {
    "attention.kind": ("dense",), "attention.per_layer": (None,), "moe.num_experts": (0,),
    "share_layers": (False,), "stack.kind": ("plain",),
}


def setting(model: ModelConfig, dotted: str) -> Any:
    node: Any = model
    for part in dotted.split("."):
        node = getattr(node, part)
    if dotted == "n_kv_heads" and node == model.n_heads:
        return None  # as many kv heads as heads: plain multi-head attention, as unset
    return node


def require(hf_config: dict[str, Any], key: str, allowed: tuple[Any, ...], default: Any = None) -> Any:
    """``hf_config[key]`` when it is one of ``allowed``; else an InteropError naming the key."""
    value = hf_config.get(key, default)
    if value not in allowed:
        wanted = " or ".join(repr(each) for each in allowed)
        raise InteropError(f"config.json {key}={value!r} has no xscale equivalent (xscale supports {wanted})")
    return value


def norm_eps(model: ModelConfig) -> float:
    """The norms' eps (``model.norm.options.eps``, its default when unset)."""
    return NORM.options(model.norm, "model.norm").eps


def position_options(model: ModelConfig) -> Any:
    """``model.position``'s options, defaults filled in."""
    return POSITION.options(model.position, "model.position")


def rope_theta(model: ModelConfig) -> float:
    """RoPE's base (``model.position.options.theta``)."""
    return position_options(model).theta
