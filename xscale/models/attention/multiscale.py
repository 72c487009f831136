"""Multi-scale attention (Guo et al. 2020, "Multi-Scale Self-Attention for Text Classification"): each head attends
within its own window, head h over the context C(x_i, w_h) = [x_{i - w_h}, ..., x_{i + w_h}] (sec. 3, eq. 6-7),

  head_h(i) = softmax_{|i - j| <= w_h}(q_i k_j^T / sqrt(d)) V,

so some heads see local n-gram-like features and others the whole sequence. ``windows`` lists the scales, given to
the heads in order in equal groups (head h of H gets windows[h * S // H]); a window of 0 is the whole sequence (the
paper's scale N). Causal: the window's left half, j in [i - w_h, i]. The paper also gives lower layers more small
scales (sec. 4.3); here every layer takes the same list (set ``model.attention.per_layer`` with other kinds to mix).

A head's window is read from its global index (``StepContext.heads_held``), so tensor parallelism splits the heads
and each rank applies its heads' windows; the pattern depends on positions, so context parallelism runs it on the
gathered sequence. The masked scores are formed densely (O(T^2) memory, like ``dense`` with a mask).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from xscale.models.attention.core import AttentionCore, expand_kv
from xscale.models.attention.sparse import require
from xscale.models.registry import ATTENTION
from xscale.models.traits import ParallelTraits
from xscale.runtime import StepContext


@dataclasses.dataclass
class MultiScaleOptions:
    windows: list[int] = dataclasses.field(default_factory=lambda: [1, 2, 4, 0], metadata={
        "help": "each head group's window w (keys within distance w; 0: the whole sequence), in head order"})

    def __post_init__(self) -> None:
        require(len(self.windows) >= 1 and all(w >= 0 for w in self.windows),
                f"model.attention.options.windows must list windows >= 0 for 'multiscale' (got {self.windows})")


def head_windows(windows: list[int], n_heads: int, heads: slice) -> list[int]:
    """The window of each head in ``heads`` (global indices) of ``n_heads``."""
    return [windows[h * len(windows) // n_heads] for h in range(heads.start, heads.stop)]


def multiscale_mask(windows: list[int], q_len: int, k_len: int, causal: bool, device: torch.device) -> Tensor:
    """Bool (len(windows), Tq, Tk): key j allowed for query i of head h (queries the last Tq of Tk positions)."""
    distance = torch.arange(k_len, device=device)[None, :] - torch.arange(k_len - q_len, k_len, device=device)[:, None]
    limit = torch.tensor([w if w > 0 else k_len for w in windows], device=device)[:, None, None]
    allowed = distance.abs()[None] <= limit
    return allowed & (distance <= 0)[None] if causal else allowed


@ATTENTION.register("multiscale")
class MultiScaleAttention(AttentionCore):
    """Softmax attention with a window per head (Guo et al. 2020)."""

    Options = MultiScaleOptions
    supports_bias = True
    takes_padding_mask = True
    parallel_traits = ParallelTraits(tp="split_heads", cp_whole_sequence=True)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, bias: Tensor | None = None,
                context: StepContext | None = None) -> Tensor:
        n_heads = self.model_config.n_heads
        heads = slice(0, q.shape[1]) if context is None else context.heads_held(n_heads)
        allowed = multiscale_mask(head_windows(self.options.windows, n_heads, heads), q.shape[2], k.shape[2], causal,
                                  q.device)
        mask = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill(~allowed, float("-inf"))
        if bias is not None:
            mask = mask + bias.to(q.dtype)
        return self.attend(q, expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1]), mask, context)
