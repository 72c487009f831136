"""A key/value cache for autoregressive decoding: each attention layer keeps the keys and values of the tokens
already seen, so a step feeds only the new token (Vaswani et al. 2017 decode one position at a time; the cache is
the standard way to avoid recomputing the prefix, e.g. Pope et al. 2022, "Efficiently Scaling Transformer
Inference", sec. 2).

The cache travels in the forward's :class:`~xscale.runtime.StepContext` (``context.with_kv_cache(cache)``), never
in module state. It is also the context's ``sequence`` layout: a forward's T tokens sit at global positions
[length, length + T), so RoPE, learned/sinusoidal tables, ALiBi and T5 biases read their true positions through
the hooks context parallelism already uses. Attention then sees queries for some positions with the keys and values
of the whole prefix, and the causal mask as an additive bias over global positions: exactly what a core serving
context parallelism accepts (``cp`` in its ``parallel_traits``), so :func:`can_cache` reads that declaration.
Other cores (sparse patterns, linear, low-rank, RealFormer, ...) decode by recomputing the prefix.

Keys are stored after RoPE rotated them and before GQA expanded them: (B, Hkv, T, head_dim) per layer.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch
from torch import nn

from xscale.models.traits import traits_of
from xscale.runtime import StepContext


def can_cache(core: nn.Module) -> bool:
    """Whether an attention core is exact with cached keys/values and the causal mask given as a bias (the
    condition under which it also serves context parallelism, so the same declaration says it)."""
    return traits_of(core).cp


class KVCache:
    """Per-layer key and value buffers of a batch, grown as tokens are decoded.

    ``length``: tokens cached so far, the position of the next forward's first token. A forward writes each
    layer's new keys/values at [length, length + T); :meth:`advance` then moves ``length`` on (one call per
    forward, after it), so every layer of one forward sees the same offset.
    """

    def __init__(self, capacity: int = 0) -> None:
        self.capacity = capacity  # tokens to allocate room for at the first write (0: what the first write needs)
        self.length = 0
        self._keys: dict[Hashable, torch.Tensor] = {}
        self._values: dict[Hashable, torch.Tensor] = {}
        self._written: dict[Hashable, int] = {}

    # SequenceLayout: the forward's tokens come after the cached ones.
    def global_size(self, local_size: int) -> int:
        return self.length + local_size

    def coordinates(self, local_size: int, device: torch.device) -> torch.Tensor:
        return torch.arange(self.length, self.length + local_size, device=device)

    def extend(self, layer: Hashable, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``layer``'s new keys/values (B, Hkv, T, hd); returns those of the whole prefix, (B, Hkv, L + T, hd)."""
        if self._written.get(layer, 0) != self.length:
            raise ValueError(f"KV cache: layer {layer!r} holds {self._written.get(layer, 0)} tokens but the cache "
                             f"{self.length}; each layer must run once per forward, and advance() once after it")
        end = self.length + keys.shape[2]
        if layer not in self._keys or self._keys[layer].shape[2] < end:
            self._keys[layer] = self._grown(self._keys.get(layer), keys, end)
            self._values[layer] = self._grown(self._values.get(layer), values, end)
        self._keys[layer][:, :, self.length:end] = keys
        self._values[layer][:, :, self.length:end] = values
        self._written[layer] = end
        return self._keys[layer][:, :, :end], self._values[layer][:, :, :end]

    def _grown(self, buffer: torch.Tensor | None, new: torch.Tensor, needed: int) -> torch.Tensor:
        """A buffer with room for at least ``needed`` tokens (doubling), holding what ``buffer`` held."""
        held = 0 if buffer is None else buffer.shape[2]
        size = max(needed, 2 * held, self.capacity)
        grown = new.new_empty(*new.shape[:2], size, new.shape[3])
        if buffer is not None:
            grown[:, :, :self.length] = buffer[:, :, :self.length]
        return grown

    def advance(self, tokens: int) -> None:
        """The forward that wrote ``tokens`` new tokens in every layer is done."""
        self.length += tokens


def cached_forward(model: nn.Module, tokens: torch.Tensor, cache: KVCache,
                   context: StepContext | None = None) -> torch.Tensor:
    """Logits (B, T, vocab) of ``tokens`` (B, T) continuing the cached prefix; the cache then holds them too."""
    context = (StepContext() if context is None else context).with_kv_cache(cache)
    logits = model(tokens, context=context)
    cache.advance(tokens.shape[1])
    return logits
