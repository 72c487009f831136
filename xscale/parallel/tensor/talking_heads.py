"""Talking-heads attention (Shazeer et al. 2020) under tensor parallelism: every rank gathers all heads' q and k.

The core mixes the heads' logits before the softmax (J' = J P_l) and the weights after it (W' = W P_w), so the
output head g reads every head's logits: out_g = (sum_h softmax(J P_l)_h P_w[h, g]) V_g, which a plain (Megatron)
head split cannot compute from its own heads. Here each rank:

  * all-gathers q and k over tp after its column-parallel projections (sequence parallel or not, they already
    hold the whole sequence): (B, T, H d) and (B, T, H_kv d), not T^2-sized; with one kv head (MQA) k is
    replicated already and only q is gathered;
  * computes J, J' = J P_l (+ position bias for all H heads: the context's heads are every head) and W = softmax(J') for every
    head, then only its own output heads' columns W'_g = sum_h W_h P_w[h, g], g in [r H/tp, (r + 1) H/tp), and
    out_g = W'_g V_g with its own v (not gathered); the row-parallel output projection follows as usual.

Extra cost per talking-heads layer, against a head-independent core under tp:
  * communication: forward, all-gather of q and k, (tp - 1)/tp of B T (H + H_kv) d elements received per rank;
    backward, a reduce-scatter of their gradients (every rank's J reads every head's q and k, and its share of the
    loss gives each a partial gradient), the same volume;
  * computation: Q K^T, the pre-softmax mix (H x H over T^2) and the softmax are done for all H heads on every
    rank (tp times the split work); the post-softmax mix (H x H/tp) and W' V are split;
  * memory: the (B, H, T, T) logits and weights of all heads per rank, against H/tp heads for a split core.
The alternative, each rank mixing its own heads' logits into partial sums for all H columns and all-reducing
them (the softmax and the post-softmax mix as above), keeps Q K^T split but moves B H T^2 elements each way, at
least T / (2 d) times the gathers: costlier whenever the sequence is longer than two head widths.

P_l and P_w (H x H) are replicated with gradients summed over tp like the other core parameters: each rank's
share of the loss reads all of P_l and its own columns of P_w.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from xscale.models.attention import Attention
from xscale.parallel.collectives import all_gather_flat, reduce_scatter_flat


class GatherHeads(torch.autograd.Function):
    """(B, T, H/tp * d) -> (B, T, H * d), ranks' heads in rank order; backward reduce-scatters (sums) the
    gradient: every rank's copy of the gathered tensor feeds its own share of the loss."""

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        world = dist.get_world_size(group)
        gathered = x.new_empty(world * x.shape[0], *x.shape[1:])
        all_gather_flat(gathered, x.contiguous(), group=group)
        return gathered.view(world, *x.shape).movedim(0, -2).flatten(-2)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        world = dist.get_world_size(ctx.group)
        per_rank = grad.unflatten(-1, (world, -1)).movedim(-2, 0).contiguous()
        local = grad.new_empty(per_rank.shape[1:])
        reduce_scatter_flat(local.view(-1), per_rank.view(-1), group=ctx.group)
        return local, None


def _gather_output(linear: nn.Linear, group: dist.ProcessGroup) -> None:
    linear.register_forward_hook(lambda module, args, out: GatherHeads.apply(out, group))


def gather_heads(attention: Attention, mesh: DeviceMesh, gather_keys: bool) -> None:
    """After the Megatron split of ``attention`` (q, k, v column-parallel; ``gather_keys``: k is split, not
    replicated), gather q and k to every head and let the core (``tp="gather_heads"``) compute this rank's
    output heads, which it reads from the forward's context (``StepContext.heads_held``)."""
    group = mesh.get_group()
    _gather_output(attention.wq, group)
    if gather_keys:
        _gather_output(attention.wk, group)
