"""The contract every attention variant implements.

Projections, positions and head bookkeeping live in :class:`xscale.models.attention.multihead.Attention`;
a *core* only mixes values: ``core(q, k, v, causal=..., bias=...)`` with q (B, H, Tq, hd) and
k, v (B, Hkv, Tk, hd), H a multiple of Hkv (GQA/MQA), returning (B, H, Tq, hd).
Tensor parallelism splits heads, so a core must treat heads independently (or own per-head state
that the TP plan slices: ``per_head_state`` names it, dim 0 = heads; :mod:`xscale.parallel.tensor.head_sharded`);
``mixes_heads`` cores cannot be split. Its ``parallel_traits`` (:mod:`xscale.models.traits`) say which plans may
run it and how; a core that declares none is refused by tensor and context parallelism.
A core that reads no queries (or keys) says so in ``uses_queries`` / ``uses_keys``: the module then builds no
projection for them and passes a (B, H, T, 0) placeholder that only carries the shape.
A core with ``takes_padding_mask`` serves padded batches: the key-padding mask arrives inside ``bias``.
A core with ``carries_scores`` (RealFormer) also takes ``previous_scores`` and returns ``(out, scores)``:
the scores travel from block to block beside the hidden state (:class:`xscale.models.transformer.Stack`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from xscale.config.load import from_dict
from xscale.config.schema import ConfigError, ModelConfig
from xscale.models.dropout import Dropout
from xscale.models.registry import ATTENTION
from xscale.models.traits import NO_TRAITS, ParallelTraits
from xscale.runtime import StepContext


@dataclasses.dataclass
class NoOptions:
    """A variant without options."""


class AttentionCore(nn.Module):
    """Base class: subclasses set the capability flags and implement ``forward``."""

    Options: ClassVar[type] = NoOptions
    causal_capable: ClassVar[bool] = True  # can run with a causal mask (decoders)
    bidirectional_capable: ClassVar[bool] = True  # can run without one (encoders)
    supports_bias: ClassVar[bool] = False  # accepts an additive logit bias (ALiBi, T5)
    # Takes a key-padding mask (padded batches: train.task=classify), passed as a -inf logit bias (B, 1, 1, Tk) on
    # the padded keys; the others are refused for padded batches.
    takes_padding_mask: ClassVar[bool] = False
    shares_qk: ClassVar[bool] = False  # keys are the queries (Reformer)
    mixes_heads: ClassVar[bool] = False  # heads exchange information: tensor parallelism must refuse it
    carries_scores: ClassVar[bool] = False  # takes and returns pre-softmax scores across layers (RealFormer)
    # Takes more keys than queries, the queries the last Tq (Transformer-XL's memory): a ``supports_bias`` core gets
    # the shifted causal mask in ``bias`` (causal=False), any other ``causal=True`` and aligns the queries at the end
    # itself (:func:`causal_over_longer_keys`).
    attends_to_memory: ClassVar[bool] = False
    exposes_probabilities: ClassVar[bool] = False  # has ``probabilities`` (for a position's value term: Shaw)
    per_head_state: ClassVar[tuple[str, ...]] = ()  # parameters/buffers whose dim 0 is the head (TP slices them)
    # Attention dropout drawn from torch's RNG (SDPA's dropout_p, F.dropout): its masks depend on the layout.
    # Every core here applies ``self.dropout`` to batch-first probabilities, (B, H, Tq, Tk) where tp splits
    # heads, through :meth:`attend` or directly (block-sparse: :meth:`Dropout.at` on the gathered blocks).
    rng_dropout: ClassVar[bool] = False
    parallel_traits: ClassVar[ParallelTraits] = NO_TRAITS  # what the parallel plans may do with it

    def __init__(self, model: ModelConfig, layer_index: int, options: Any) -> None:
        super().__init__()
        self.model_config = model
        self.layer_index = layer_index
        self.options = options
        self.uses_queries = True
        self.uses_keys = True
        self.dropout = Dropout(model.attention_dropout, token_dim=2)  # on probabilities (B, H, Tq, Tk)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
                bias: torch.Tensor | None = None, context: StepContext | None = None) -> torch.Tensor:
        raise NotImplementedError

    @classmethod
    def applies_attention_dropout(cls, causal: bool) -> bool:
        """Whether ``model.attention_dropout`` reaches this core's attention probabilities (a core that forms none,
        such as the kernel cores, says False; :func:`unused_attention_dropout` warns of it)."""
        return True

    @property
    def drops_probabilities(self) -> bool:
        """Training with attention dropout (then probabilities must be formed where ``self.dropout`` sees them)."""
        return self.training and self.dropout.p > 0

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
               context: StepContext | None = None) -> torch.Tensor:
        """dropout(softmax(Q K^T / sqrt(d) + mask)) V for q (B, H, Tq, d), k/v (B, H, Tk, d), mask broadcasting to
        (B, H, Tq, Tk). SDPA when nothing is dropped; else the probabilities are formed explicitly and masked by
        (sample, global head, query, key) like every dropout here (SDPA's fused dropout draws from each rank's RNG,
        so its masks would depend on the layout)."""
        if not self.drops_probabilities:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        scores = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
        probs = torch.softmax(scores if mask is None else scores + mask, dim=-1)
        return self.dropout(probs, context) @ v


def padding_bias(padding_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(B, Tk) True-at-real-tokens mask -> (B, 1, 1, Tk) logit bias: 0 at real keys, -inf at padded ones."""
    bias = torch.zeros(padding_mask.shape, dtype=dtype, device=padding_mask.device)
    return bias.masked_fill(~padding_mask, float("-inf"))[:, None, None, :]


def check_padding_mask(core: AttentionCore) -> None:
    """Refuse a padded batch for a core that would attend to the padding."""
    if not core.takes_padding_mask:
        raise ValueError(f"attention core {type(core).__name__} takes no key-padding mask, so padded batches "
                         "(train.task=classify) would attend to the padding; use a core that does "
                         f"({', '.join(padding_mask_kinds())})")


def padding_mask_kinds() -> list[str]:
    """The registered attention kinds whose cores take a key-padding mask."""
    return [name for name in ATTENTION.names() if ATTENTION.get(name).takes_padding_mask]


def causal_over_longer_keys(attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
                            q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal ``attend`` when the Tq queries are the last Tq of Tk >= Tq keys (a segment memory's keys first, Dai et
    al. 2019, sec. 3.2): the queries padded in front with Tk - Tq zero rows, ``attend`` run causally over the Tk
    positions, the padded rows' outputs dropped. Query i then sees key j when j <= i + Tk - Tq, every remembered key
    included, whatever else the core's pattern or kernel restricts."""
    extra = k.shape[2] - q.shape[2]
    if extra < 0:
        raise ValueError(f"causal attention over {k.shape[2]} keys cannot place {q.shape[2]} queries at their end")
    if extra == 0:
        return attend(q, k, v)
    return attend(F.pad(q, (0, 0, extra, 0)), k, v)[:, :, extra:]


def held_query_positions(q: torch.Tensor, k: torch.Tensor, context: StepContext | None) -> torch.Tensor | None:
    """Under context parallelism (a ``cp_positions`` core: this rank's queries, every rank's keys), where the
    queries sit in the sequence of the keys (their global positions); None when the queries are the keys' own."""
    sequence = None if context is None else context.sequence
    if sequence is None or q.shape[2] == k.shape[2]:
        return None
    return sequence.coordinates(q.shape[2], q.device)


def expand_kv(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """(B, Hkv, T, hd) -> (B, H, T, hd) by repeating each kv head for its H/Hkv query heads."""
    groups = n_heads // x.shape[1]
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def check_heads(core: AttentionCore, state: torch.Tensor, n_heads: int) -> None:
    """Per-head state must match the heads this core sees (all of them, or a tensor-parallel slice)."""
    if state.shape[0] != n_heads:
        raise ValueError(f"{type(core).__name__} holds state for {state.shape[0]} heads but got {n_heads}; a "
                         f"tensor-parallel plan must slice its per-head state {core.per_head_state or '(none)'} "
                         "by head, or refuse the core when it mixes heads")


def build_core(kind: str, model: ModelConfig, layer_index: int, options: dict[str, Any], causal: bool,
               uses_bias: bool, mixes_values: bool = False) -> AttentionCore:
    """Build the registered core ``kind``, refusing uses the method cannot serve."""
    cls = ATTENTION.get(kind)
    known = {f.name for f in dataclasses.fields(cls.Options)}
    parsed = from_dict(cls.Options, {k: v for k, v in options.items() if k in known}, f"model.attention.options[{kind}]")
    if causal and not cls.causal_capable:
        raise ConfigError(f"attention '{kind}' cannot be causally masked; use it in an encoder (model.family=encoder)")
    if not causal and not cls.bidirectional_capable:
        raise ConfigError(f"attention '{kind}' is decoder-only; use model.family=decoder")
    if uses_bias and not cls.supports_bias:
        raise ConfigError(
            f"attention '{kind}' cannot add a logit bias, so model.position={model.position} does not combine with it; "
            f"use model.position=rope, learned or sinusoidal"
        )
    if mixes_values and not cls.exposes_probabilities:
        raise ConfigError(
            f"attention '{kind}' ({cls.__name__}) does not expose its attention probabilities, which "
            f"model.position={model.position} adds relative value embeddings with; use model.attention.kind=dense"
        )
    return cls(model, layer_index, parsed)


def unused_attention_dropout(model: ModelConfig) -> str | None:
    """One warning line when ``model.attention_dropout`` > 0 but some layers' cores form no attention probabilities
    for it to drop (it then does nothing there), naming them; else None."""
    if model.attention_dropout <= 0:
        return None
    causal = {"decoder": (True,), "encoder": (False,)}.get(model.family, (True, False))
    layers = model.total_layers
    kinds = sorted({kind for kind in map(model.attention.kind_for_layer, range(layers))
                    if not all(ATTENTION.get(kind).applies_attention_dropout(mask) for mask in causal)})
    if not kinds:
        return None
    return (f"xscale: warning: model.attention_dropout={model.attention_dropout} has no effect on the layers with "
            f"attention {', '.join(kinds)}: they form no attention probabilities to drop (model.dropout still applies)")
