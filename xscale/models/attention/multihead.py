"""Multi-head attention: projections, positions and heads around a pluggable core.

MHA, GQA and MQA differ only in ``n_kv_heads`` (Ainslie et al. 2023; Shazeer 2019).
Heads are inferred from the projection widths, so a tensor-parallel plan that shards
``wq/wk/wv`` column-wise and ``wo`` row-wise needs no change here; the forward's context says which heads
this rank holds, so that per-head position biases (ALiBi, T5) pick them. While decoding, the context's
``kv_cache`` holds the keys and values of the tokens before this forward's (:mod:`xscale.models.kv_cache`).
With ``remembered`` (Transformer-XL's memory, :mod:`xscale.models.segment_memory`) the keys and values are read
from [memory ; x] and the causal mask is shifted by the memory's length.
"""

from __future__ import annotations

import torch
from torch import nn

from xscale.config.schema import ModelConfig
from xscale.models.attention.core import build_core, check_padding_mask, expand_kv, padding_bias
from xscale.models.attention.dense import causal_bias
from xscale.models.kv_cache import can_cache
from xscale.models.position import PositionEncoding
from xscale.runtime import StepContext


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int, *, causal: bool, cross: bool = False,
                 uses_bias: bool = False, mixes_values: bool = False) -> None:
        super().__init__()
        d, hd = config.d_model, config.head_dim
        self.head_dim = hd
        self.causal = causal and not cross
        self.cross = cross
        kind = "dense" if cross else config.attention.kind_for_layer(layer_index)
        self.core = build_core(kind, config, layer_index, config.attention.options, self.causal,
                               uses_bias and not cross, mixes_values and not cross)
        if self.core.uses_queries:
            self.wq = nn.Linear(d, config.n_heads * hd, bias=config.bias)
        if self.projects_keys:
            self.wk = nn.Linear(d, config.kv_heads * hd, bias=config.bias)
        self.wv = nn.Linear(d, config.kv_heads * hd, bias=config.bias)
        self.wo = nn.Linear(config.n_heads * hd, d, bias=config.bias)
        self.n_heads = config.n_heads

    @property
    def projects_keys(self) -> bool:
        """Whether keys have a projection of their own, ``wk`` (not when the core reads no keys or shares q and k)."""
        return self.core.uses_keys and not self.core.shares_qk

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        # heads from the width, not -1: a sequence of no tokens (the Feedback Transformer's first memory) has one
        return x.view(batch, length, x.shape[-1] // self.head_dim, self.head_dim).transpose(1, 2)

    def _placeholder(self, x: torch.Tensor, n_heads: int) -> torch.Tensor:
        """(B, H, T, 0): the shape of heads a core does not read."""
        return x.new_empty(x.shape[0], n_heads, x.shape[1], 0)

    def forward(self, x: torch.Tensor, position: PositionEncoding | None = None,
                memory: torch.Tensor | None = None, scores: torch.Tensor | None = None,
                context: StepContext | None = None,
                remembered: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x: (B, T, D); memory: (B, S, D) encoder output for cross-attention, or for self-attention the keys' and
        values' sequence when the queries are a pooled one (Funnel-Transformer, :mod:`xscale.models.stacks.funnel`);
        ``scores``: the previous layer's pre-softmax scores for a ``carries_scores`` core, which then returns
        ``(out, scores)``; ``remembered``: (B, M, D) the previous segments' inputs to this layer (stop-gradient),
        extra keys (Transformer-XL, :mod:`xscale.models.segment_memory`)."""
        source = x if memory is None else memory
        if remembered is not None:
            source = torch.cat([remembered.to(x.dtype), source], dim=1)
        v = self._heads(self.wv(source))
        core = self.core
        local_heads = self.n_heads // (1 if context is None else context.tensor_size)
        q = self._heads(self.wq(x)) if core.uses_queries else self._placeholder(x, local_heads)
        if core.shares_qk:
            k = q
        else:
            k = self._heads(self.wk(source)) if core.uses_keys else self._placeholder(source, v.shape[1])
        bias = None
        if position is not None and not self.cross:
            if position.rotates_qk and core.uses_queries and core.uses_keys:
                q, k = position.rotate(q, k, context)
            if position.biases_logits:
                bias = position.bias(q.shape[2], k.shape[2], self._heads_held(q.shape[1], context), context)
                bias = bias.to(v.device)
        if context is not None and context.padding_mask is not None:
            bias = self._with_padding(bias, source, context.padding_mask, v.dtype)
        causal = self.causal
        if remembered is not None:
            bias, causal = self._shift_causal_mask(q, k, bias, context)
        if context is not None and context.kv_cache is not None and not self.cross:
            k, v, bias = self._extend_from_cache(q, k, v, bias, context)
            causal = False  # now in the bias, over global positions
        if position is not None and not self.cross and position.biases_from_content:
            heads = self._heads_held(q.shape[1], context)
            content = position.content_bias(q, k, heads, context)
            bias = content if bias is None else bias + content
            if position.mixes_values:
                probs = core.probabilities(q, k, causal=causal, bias=bias, context=context)
                out = probs @ expand_kv(v, q.shape[1]) + position.value_term(probs, heads, context)
                return self._merge(out)
        if core.carries_scores:
            out, scores = core(q, k, v, causal=causal, bias=bias, previous_scores=scores, context=context)
            return self._merge(out), scores
        return self._merge(core(q, k, v, causal=causal, bias=bias, context=context))

    def _with_padding(self, bias: torch.Tensor | None, source: torch.Tensor, padding_mask: torch.Tensor,
                      dtype: torch.dtype) -> torch.Tensor:
        """``bias`` plus -inf on the padded keys (``padding_mask``: (B, Tk), True at real tokens)."""
        check_padding_mask(self.core)
        if padding_mask.shape != source.shape[:2]:
            raise ValueError(f"the padding mask has shape {tuple(padding_mask.shape)} but the keys' tokens "
                             f"{tuple(source.shape[:2])}; pass one (batch, length) mask of the input ids")
        keys = padding_bias(padding_mask, dtype)
        return keys if bias is None else bias + keys

    def _shift_causal_mask(self, q: torch.Tensor, k: torch.Tensor, bias: torch.Tensor | None,
                           context: StepContext | None) -> tuple[torch.Tensor | None, bool]:
        """(bias, causal) for queries that follow M remembered keys, query i seeing keys j <= i + M: the mask added
        to ``bias`` for a core that takes one, else left to the core (causal, queries aligned at the keys' end)."""
        if not self.core.attends_to_memory:
            raise ValueError(f"attention core {type(self.core).__name__} cannot take a segment memory as extra keys")
        if context is not None and context.kv_cache is not None:
            raise ValueError("a segment memory and a KV cache do not combine; decode without the memory")
        if not self.causal or not self.core.supports_bias:
            return bias, self.causal
        mask = causal_bias(q.shape[2], k.shape[2], q.device, q.dtype)
        return (mask if bias is None else bias + mask), False

    def _extend_from_cache(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None,
                           context: StepContext) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The whole prefix's keys and values (the cached ones, then this forward's), and the causal mask of this
        forward's queries (the last of the prefix) added to ``bias``."""
        if not can_cache(self.core):
            raise ValueError(f"attention core {type(self.core).__name__} cannot decode from a KV cache (it does not "
                             "declare cp in its parallel_traits); decode by recomputing the prefix instead")
        layer = (self.core.layer_index, context.depth)  # a block shared across depths caches each depth's keys
        k, v = context.kv_cache.extend(layer, k, v)
        if self.causal:
            mask = causal_bias(q.shape[2], k.shape[2], q.device, q.dtype)
            bias = mask if bias is None else bias + mask
        return k, v, bias

    def _heads_held(self, heads: int, context: StepContext | None) -> slice:
        """The global heads of the ``heads`` query heads computed here (all, or a tensor-parallel rank's)."""
        if heads == self.n_heads:
            return slice(None)
        if context is None or context.tensor_size == 1:
            raise ValueError(f"this attention computes {heads} of {self.n_heads} heads (a tensor-parallel split) but "
                             "its StepContext does not say which: pass the context the trainer's step builds, or "
                             "StepContext().with_tensor_parallel(rank, size)")
        return context.heads_held(self.n_heads)

    def _merge(self, out: torch.Tensor) -> torch.Tensor:
        batch, _, length, _ = out.shape
        return self.wo(out.transpose(1, 2).reshape(batch, length, -1))
