"""The Compressive Transformer's compressed memory (Rae et al. 2020, sec. 3), on top of Transformer-XL's memory.

The states that leave a layer's memory (``model.segment_memory``) are not dropped but compressed at rate c
(``model.compression_rate``) by f_c: R^{n x d} -> R^{n/c x d} and kept in a compressed memory of
``model.compressed_memory`` states; the layer attends over [SG(compressed) ; SG(memory) ; segment]. f_c is
``model.compression``: ``mean`` (mean pooling, stride c, nothing to learn) or ``conv`` (a 1-D convolution, kernel
and stride c). A conv is trained by the attention-reconstruction loss alone (sec. 3.2):

    L_attn = || attn(h, old) - attn(h, f_c(old)) ||^2

with the layer's own query, key and value projections, content attention only, every input and projection under
stop-gradient: only f_c learns from it, and the task loss reaches f_c nowhere (the memories are stop-gradient).
Here h and the memories are the layer's inputs (before a pre-norm), and the loss is added to the training loss
(weighted like the auxiliary losses: 1 / the step's forwards), so it joins the global gradient norm.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from xscale.config.schema import ModelConfig


class MemoryCompression(nn.Module):
    """f_c: (B, n, D) -> (B, n / c, D) by mean pooling or a 1-D convolution of kernel and stride c."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.rate = config.compression_rate
        self.conv = (nn.Conv1d(config.d_model, config.d_model, self.rate, stride=self.rate)
                     if config.compression == "conv" else None)

    @property
    def learns(self) -> bool:
        return self.conv is not None

    def forward(self, states: torch.Tensor) -> torch.Tensor:
        channels_first = states.transpose(1, 2)
        if self.conv is None:
            return F.avg_pool1d(channels_first, self.rate, stride=self.rate).transpose(1, 2)
        return self.conv(channels_first.to(self.conv.weight.dtype)).transpose(1, 2)


def content_attention(attention: nn.Module, queries: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v per head with ``attention``'s projections detached, q from ``queries``, k and v
    from ``states``: (B, H, Tq, hd)."""
    head_dim = attention.head_dim

    def project(linear: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        bias = None if linear.bias is None else linear.bias.detach()
        out = F.linear(x, linear.weight.detach(), bias)
        return out.view(x.shape[0], x.shape[1], -1, head_dim).transpose(1, 2)

    q = project(attention.wq, queries)
    k, v = project(attention.wk, states), project(attention.wv, states)
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return torch.softmax(q @ k.transpose(-1, -2) * head_dim**-0.5, dim=-1) @ v


def reconstruction_loss(attention: nn.Module, queries: torch.Tensor, old: torch.Tensor,
                        compressed: torch.Tensor) -> torch.Tensor:
    """L_attn (Rae et al. 2020, eq. in sec. 3.2): mean squared difference of the attention over the old memories and
    over their compression; its gradient reaches only ``compressed``'s graph (f_c)."""
    queries, old = queries.detach(), old.detach()
    with torch.no_grad():
        target = content_attention(attention, queries, old)
    return F.mse_loss(content_attention(attention, queries, compressed).float(), target.float())
