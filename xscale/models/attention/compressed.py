"""Memory-compressed attention (Liu et al. 2018): a strided convolution (kernel = stride = c) turns
every c keys and values into one, and queries attend to the T/c compressed pairs: cost T * T/c.

The convolution acts on each head's d_head channels with weights shared by the heads (the paper's convolves
all d_model channels at once, which would mix heads and stop tensor parallelism). A kernel equal to its stride
is a linear map of each block of c tokens, which is how it is computed. A last partial block is zero-padded.

Causal form (ours; the paper's decoder does not say how it masks compressed slots): slot s summarises
positions [s*c, s*c + c), so query i may only see slots that end before its own block, s < floor(i / c); it
also sees the raw keys of its own block up to itself. Cost T * (T/c + c).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from xscale.config.schema import ModelConfig
from xscale.models.attention.core import AttentionCore, expand_kv
from xscale.models.attention.sparse import require, require_positive
from xscale.models.registry import ATTENTION
from xscale.models.traits import ParallelTraits
from xscale.runtime import StepContext


@dataclasses.dataclass
class CompressedOptions:
    compression: int = 3  # c: kernel and stride of the convolution (the paper's 3)

    def __post_init__(self) -> None:
        require_positive("memory_compressed", compression=self.compression)


def blocks_of(x: Tensor, size: int) -> Tensor:
    """(B, H, T, d) -> (B, H, ceil(T / size), size, d), zero-padded at the end."""
    batch, heads, length, dim = x.shape
    n_blocks = -(-length // size)
    x = F.pad(x, (0, 0, 0, n_blocks * size - length))
    return x.view(batch, heads, n_blocks, size, dim)


@ATTENTION.register("memory_compressed", "compressed")
class MemoryCompressedAttention(AttentionCore):
    Options = CompressedOptions
    parallel_traits = ParallelTraits(tp="split_heads", cp_whole_sequence=True)

    def __init__(self, model: ModelConfig, layer_index: int, options: CompressedOptions) -> None:
        super().__init__(model, layer_index, options)
        width = options.compression * model.head_dim
        self.key_compression = nn.Linear(width, model.head_dim)
        self.value_compression = nn.Linear(width, model.head_dim)

    def compress(self, x: Tensor, linear: nn.Linear) -> Tensor:
        """(B, H, T, d) -> (B, H, ceil(T / c), d): the strided convolution."""
        blocks = blocks_of(x, self.options.compression)
        return linear(blocks.flatten(-2).to(linear.weight.dtype)).to(x.dtype)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, bias: Tensor | None = None, context: StepContext | None = None) -> Tensor:
        heads = q.shape[1]
        scale = q.shape[-1] ** -0.5
        keys = expand_kv(self.compress(k, self.key_compression), heads)
        values = expand_kv(self.compress(v, self.value_compression), heads)
        if not causal:
            return self.attend(q, keys, values, context=context)  # dropout on the probabilities over the slots (B, H, T, T/c)
        require(q.shape[2] == k.shape[2], "causal memory_compressed attention is self-attention (equal lengths)")
        return self._causal(q, expand_kv(k, heads), expand_kv(v, heads), keys, values, scale, context)

    def _causal(self, q: Tensor, k: Tensor, v: Tensor, keys: Tensor, values: Tensor, scale: float,
                context: StepContext | None = None) -> Tensor:
        c, length = self.options.compression, q.shape[2]
        n_slots = keys.shape[2]
        position = torch.arange(length, device=q.device)
        compressed = (q @ keys.transpose(-1, -2)) * scale  # (B, H, T, n)
        slot_visible = torch.arange(n_slots, device=q.device)[None, :] < (position // c)[:, None]
        compressed = compressed.masked_fill(~slot_visible, float("-inf"))
        q_blocks, k_blocks, v_blocks = blocks_of(q, c), blocks_of(k, c), blocks_of(v, c)
        local = (q_blocks @ k_blocks.transpose(-1, -2)) * scale  # (B, H, n, c, c)
        own_past = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
        local = local.masked_fill(~own_past, float("-inf")).flatten(2, 3)[:, :, :length]  # (B, H, T, c)
        # (B, H, T, n_slots + c): each query's slots, then its own block's keys (dropped by that coordinate)
        probs = self.dropout(torch.softmax(torch.cat([compressed, local], dim=-1), dim=-1), context)
        from_slots = probs[..., :n_slots] @ values
        local_probs = F.pad(probs[..., n_slots:], (0, 0, 0, n_slots * c - length)).view(*local.shape[:2], n_slots, c, c)
        from_block = (local_probs @ v_blocks).flatten(2, 3)[:, :, :length]
        return from_slots + from_block
