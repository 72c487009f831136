"""Block-sparse softmax attention for any :mod:`patterns` layout, in memory and time proportional to its non-zero blocks.

Each (head, query block) row gathers the key/value blocks its layout row selects into a padded
(rows, width, block, hd) tensor; rows are grouped by their count of blocks (powers of two) so that padding
never more than doubles the work, and a dense row (a global token) does not pad every other row. A group
whose padding to the next wider group costs at most 1/8 of the listed blocks joins it (a band's first rows):
each group is a gather, and its backward a full-size scatter, so few groups are faster.
Inside the gathered blocks the exact token rule, causality and the sequence end are applied as a mask.
Autograd differentiates through the gathers (index_select backward is a scatter-add).
Attention dropout masks the gathered probabilities by their global (sample, head, query, key) position, the mask
dense attention's probabilities (B, H, T, T) would get (:meth:`xscale.models.dropout.Dropout.at`).
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import Tensor

from xscale.models.attention.patterns import Pattern
from xscale.models.dropout import Dropout
from xscale.runtime import StepContext


@dataclasses.dataclass
class RowGroup:
    """Rows (flat head * n_blocks + query block) that share one padded width of key blocks."""

    rows: Tensor  # (R,)
    first_row: int | None  # rows == first_row + arange(R) (then a slice replaces the gather), else None
    key_blocks: Tensor  # (R, W) flat kv-head * n_blocks + key block
    bias: Tensor  # (R or R / H, block, W * block): 0 where the token rule allows, -inf elsewhere (R / H: every
    # head has the same rows and rule, the bias is shared)
    every_query_has_key: bool  # else rows with no allowed key need their softmax zeroed
    has_key: Tensor  # (R, block, 1)
    query_index: Tensor  # (R, block): head * length + query position (the head local to the plan's heads)
    key_position: Tensor  # (R, W * block)
    # (R,) on CPU: key_blocks[r, 0] - r (> -R) where row r lists consecutive key blocks, else a value < -R that no
    # other row has.
    # Rows r0..r1 with one value read a sliding window of K and V: a strided view replaces the gather (bands).
    window_offset: Tensor | None = None


@dataclasses.dataclass
class BlockPlan:
    groups: list[RowGroup]
    n_blocks: int
    nonzero_blocks: int
    inverse: Tensor | None  # output row order after concatenating the groups; None: already in order


def build_plan(pattern: Pattern, length: int, block: int, causal: bool, n_heads: int, n_kv_heads: int,
               device: torch.device, dtype: torch.dtype = torch.float32,
               query_blocks: Tensor | None = None) -> BlockPlan:
    """Turn a pattern into gather indices and token masks for a sequence of ``length`` tokens; ``query_blocks``:
    plan only these query blocks (the other rows output zeros)."""
    n_blocks = math.ceil(length / block)
    layout = pattern.layout(n_blocks, n_blocks, block, causal)
    if causal:
        layout = layout & torch.ones(n_blocks, n_blocks, dtype=torch.bool).tril()
    if query_blocks is not None:
        held = torch.zeros(n_blocks, 1, dtype=torch.bool)
        held[query_blocks] = True
        layout = layout & held
    layout = layout.expand(n_heads, n_blocks, n_blocks).reshape(n_heads * n_blocks, n_blocks)
    counts = layout.sum(1)
    # Selected key blocks first, in increasing block order.
    order = torch.argsort((~layout).long() * n_blocks + torch.arange(n_blocks), dim=1)
    width_class = torch.ceil(torch.log2(counts.clamp_min(1).double())).long()
    width_class[counts == 0] = -1
    budget = int(counts.sum()) // 8
    classes = torch.unique(width_class[counts > 0]).tolist()
    for narrow, wide in zip(classes, classes[1:]):
        members = width_class == narrow
        padding = int(members.sum()) * int(counts[width_class == wide].max()) - int(counts[members].sum())
        if padding <= budget:
            width_class[members] = wide
            budget -= padding
    groups = []
    offsets = torch.arange(block)
    for cls in torch.unique(width_class[counts > 0]).tolist():
        rows = torch.nonzero(width_class == cls).flatten()
        width = int(counts[rows].max())
        blocks = order[rows, :width]
        head = rows // n_blocks
        query = (rows % n_blocks)[:, None] * block + offsets  # (R, block)
        key = (blocks[:, :, None] * block + offsets).reshape(len(rows), width * block)  # (R, W*block)
        slot_used = (torch.arange(width)[None, :] < counts[rows][:, None]).repeat_interleave(block, dim=1)
        mask = slot_used[:, None, :] & (key < length)[:, None, :]
        allowed = pattern.allows(head[:, None, None], query[:, :, None], key[:, None, :], block, causal, n_blocks)
        mask = mask & allowed
        if causal:
            mask = mask & (key[:, None, :] <= query[:, :, None])
        kv_head = head // (n_heads // n_kv_heads)
        has_key = mask.any(-1, keepdim=True)
        contiguous = bool((rows == rows[0] + torch.arange(len(rows))).all())
        # A query with no key gets a finite row (its probabilities are zeroed later) so no NaN reaches backward.
        bias = torch.zeros(mask.shape, dtype=dtype).masked_fill_(~mask & has_key, float("-inf"))
        per_head = bias.view(n_heads, -1, *bias.shape[1:]) if len(rows) % n_heads == 0 else None
        if per_head is not None and bool((head.view(n_heads, -1) == torch.arange(n_heads)[:, None]).all()) and \
                bool((per_head == per_head[:1]).all()):
            bias = per_head[0].clone()
        flat_blocks = kv_head[:, None] * n_blocks + blocks
        consecutive = (flat_blocks == flat_blocks[:, :1] + torch.arange(width)).all(1)
        # a value no row's window offset can take (offsets lie in [-R, H * n_blocks)) marks a gathered row
        window_offset = torch.where(consecutive, flat_blocks[:, 0] - torch.arange(len(rows)),
                                    -2 * len(rows) - torch.arange(len(rows)))
        groups.append(RowGroup(rows.to(device), int(rows[0]) if contiguous else None, flat_blocks.to(device),
                               bias.to(device), bool(has_key.all()), has_key.to(device),
                               (head[:, None] * length + query).to(device), key.to(device), window_offset))
    covered = torch.cat([g.rows.cpu() for g in groups]) if groups else torch.empty(0, dtype=torch.long)
    inverse = None
    if len(covered) == n_heads * n_blocks and not torch.equal(covered, torch.arange(len(covered))):
        inverse = torch.argsort(covered).to(device)
    elif len(covered) < n_heads * n_blocks:
        inverse = covered.to(device)  # partial cover: index_copy into zeros
    return BlockPlan(groups, n_blocks, int(counts.sum()), inverse)


# Elements of a score tile (query rows x key columns) the memory-lean path forms at once: ~4 MiB in fp32.
TILE_ELEMENTS = 1 << 20


def block_sparse_attention(q: Tensor, k: Tensor, v: Tensor, plan: BlockPlan, block: int, *,
                           dropout: Dropout | None = None, context: StepContext | None = None) -> Tensor:
    """q (B, H, T, hd), k/v (B, Hkv, T, hd) -> (B, H, T, hd); a query with no allowed key outputs zeros.

    Runs :class:`OnlineBlockSparse` (saves only the output and the row log-sum-exp). ``dropout`` (on the
    probabilities, when training) takes the gathering path: the context says which slice of the heads q holds
    (tensor parallelism), so that head h here is head shard_index * H + h of the whole model.
    """
    if dropout is not None and dropout.training and dropout.p > 0:
        return gathered_block_sparse_attention(q, k, v, plan, block, dropout=dropout, context=context)
    length, padded = q.shape[2], plan.n_blocks * block
    if padded != length:
        pad = (0, 0, 0, padded - length)
        q, k, v = F.pad(q, pad), F.pad(k, pad), F.pad(v, pad)
    # contiguous: the blocks are views of q, k, v (rotated or head-sliced ones arrive strided)
    out = OnlineBlockSparse.apply(q.contiguous(), k.contiguous(), v.contiguous(), plan, block)
    return out[:, :, :length] if padded != length else out


def _tiles(group: RowGroup, block: int) -> list[tuple[int, int, list[tuple[int, int]]]]:
    """(first row, end row, [(first slot, end slot), ...]) of the group: score tiles of about TILE_ELEMENTS.
    A bias shared by every head repeats every ``period`` rows; no tile crosses a period, so its bias is a slice."""
    n_rows, width = group.key_blocks.shape
    span = max(1, min(width, TILE_ELEMENTS // (block * block)))
    spans = [(s, min(s + span, width)) for s in range(0, width, span)]
    period = group.bias.shape[0]
    rows = max(1, TILE_ELEMENTS // (block * span * block))
    rows = math.ceil(period / math.ceil(period / rows))  # equal tiles per period
    return [(r, min(r + rows, p + period), spans) for p in range(0, n_rows, period)
            for r in range(p, min(p + period, n_rows), rows)]


class _Workspace:
    """Buffers that every tile of one call reuses: a fresh multi-MiB tensor per tile faults its pages in again
    (glibc returns large blocks to the system), which cost more than the tile's exponentials."""

    def __init__(self, like: Tensor, plan: BlockPlan, block: int, n_score_buffers: int, n_key_buffers: int):
        batch, head_dim = like.shape[0], like.shape[-1]
        scores = keys = 0
        for group in plan.groups:
            for first, end, spans in _tiles(group, block):
                slots = max(b - a for a, b in spans)
                scores = max(scores, batch * (end - first) * block * slots * block)
                keys = max(keys, batch * (end - first) * slots * block * head_dim)
        self.scores = [like.new_empty(scores) for _ in range(n_score_buffers)]
        self.keys = [like.new_empty(keys) for _ in range(n_key_buffers)]

    @staticmethod
    def view(buffer: Tensor, *shape: int) -> Tensor:
        return buffer[:math.prod(shape)].view(shape)


def _tile(group: RowGroup, blocks: tuple[Tensor, Tensor, Tensor], rows: tuple[int, int], slots: tuple[int, int],
          scale: float, work: _Workspace) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Queries (B, r, block, hd) scaled, keys and values (B, r, s * block, hd) and scores (B, r, block, s * block)
    of ``rows`` x ``slots`` of the group, the token rule's bias added; keys, values and scores live in the
    workspace's first buffers."""
    q_blocks, k_blocks, v_blocks = q_blocks_of(group, blocks[0], rows), blocks[1], blocks[2]
    batch, n_rows, block, head_dim = q_blocks.shape[0], rows[1] - rows[0], q_blocks.shape[2], q_blocks.shape[3]
    first_block = _window_start(group, rows)
    if first_block is not None:  # rows r read key blocks first_block + (r - rows[0]) + slot: overlapping views
        first_block += slots[0]
        keys, values = (_sliding_window(x, first_block, n_rows, slots[1] - slots[0]) for x in (k_blocks, v_blocks))
    else:
        flat = group.key_blocks[rows[0]:rows[1], slots[0]:slots[1]].flatten()
        shape = (batch, len(flat), block, head_dim)
        keys = torch.index_select(k_blocks, 1, flat, out=work.view(work.keys[0], *shape))
        values = torch.index_select(v_blocks, 1, flat, out=work.view(work.keys[1], *shape))
        keys, values = keys.view(batch, n_rows, -1, head_dim), values.view(batch, n_rows, -1, head_dim)
    queries = q_blocks * scale
    period = group.bias.shape[0]
    bias = group.bias[rows[0] % period:(rows[1] - 1) % period + 1, :, slots[0] * block:slots[1] * block]
    scores = work.view(work.scores[0], batch, n_rows, block, keys.shape[2])
    torch.matmul(queries, keys.transpose(-1, -2), out=scores)
    return queries, keys, values, scores.add_(bias.to(queries.dtype))


def _window_start(group: RowGroup, rows: tuple[int, int]) -> int | None:
    """The key block that row ``rows[0]`` starts at if the rows read one sliding window of blocks, else None."""
    if group.window_offset is None:
        return None
    offsets = group.window_offset[rows[0]:rows[1]]
    first = int(offsets[0])
    if first < -group.window_offset.shape[0] or not bool((offsets == first).all()):
        return None
    return first + rows[0]


def _sliding_window(blocks: Tensor, first_block: int, n_rows: int, width: int) -> Tensor:
    """(B, n_rows, width * block, hd) view of ``blocks`` (B, N, block, hd): row i = blocks first_block + i ..
    first_block + i + width - 1, the rows overlapping in memory (no copy)."""
    batch_stride, block_stride = blocks.stride(0), blocks.stride(1)
    return blocks.as_strided((blocks.shape[0], n_rows, width * blocks.shape[2], blocks.shape[3]),
                             (batch_stride, block_stride, blocks.stride(2), blocks.stride(3)),
                             blocks.storage_offset() + first_block * block_stride)


def q_blocks_of(group: RowGroup, q_blocks: Tensor, rows: tuple[int, int]) -> Tensor:
    """The group's query blocks ``rows[0]:rows[1]`` (B, r, block, hd)."""
    if group.first_row is not None:
        return q_blocks.narrow(1, group.first_row + rows[0], rows[1] - rows[0])
    return q_blocks.index_select(1, group.rows[rows[0]:rows[1]])


def _write_rows(target: Tensor, group: RowGroup, rows: tuple[int, int], value: Tensor) -> None:
    if group.first_row is not None:
        target.narrow(1, group.first_row + rows[0], rows[1] - rows[0]).copy_(value)
    else:
        target.index_copy_(1, group.rows[rows[0]:rows[1]], value.to(target.dtype))  # autocast may differ


# Scores are kept in base 2 (q scaled by log2(e) / sqrt(d)) and exponentiated with exp2: on CPU torch.exp takes a
# slow path ~10-90x slower for inputs of -inf or below about -88 (the masked and far entries of a tile), exp2 does
# not (FlashAttention-2 uses exp2 on GPU for its own reasons).
LOG2_E = 1.0 / math.log(2.0)


class OnlineBlockSparse(torch.autograd.Function):
    """Block-sparse softmax attention that saves only q, k, v, the output and each row's log-sum-exp
    (FlashAttention, Dao et al. 2022, alg. 1-2, over a block layout): the forward keeps a running max and sum
    over tiles of the layout's key blocks; the backward recomputes each tile's probabilities P and uses
    dS = P * (dP - rowsum(dO * O)). Memory beyond q, k, v, their gradients and the output: a few score tiles.
    Row maxima and log-sum-exps are in base 2 (see ``LOG2_E``)."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, plan: BlockPlan, block: int) -> Tensor:
        batch, n_heads, padded, head_dim = q.shape
        blocks = (q.view(batch, -1, block, head_dim), k.view(batch, -1, block, head_dim),
                  v.view(batch, -1, block, head_dim))
        out = q.new_zeros(blocks[0].shape)
        log_sum_exp = q.new_zeros(batch, blocks[0].shape[1], block, 1)
        scale = head_dim**-0.5 * LOG2_E
        work = _Workspace(q, plan, block, 1, 2)
        for group in plan.groups:
            for rows in _tiles(group, block):
                _forward_rows(group, blocks, rows, scale, out, log_sum_exp, work)
        ctx.save_for_backward(q, k, v, out, log_sum_exp)
        ctx.plan, ctx.block = plan, block
        return out.view(batch, n_heads, padded, head_dim)

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        q, k, v, out, log_sum_exp = ctx.saved_tensors
        plan, block = ctx.plan, ctx.block
        batch, _, _, head_dim = q.shape
        blocks = (q.view(batch, -1, block, head_dim), k.view(batch, -1, block, head_dim),
                  v.view(batch, -1, block, head_dim))
        grad_out = grad_out.contiguous().view(out.shape)
        grads = (torch.zeros_like(blocks[0]), torch.zeros_like(blocks[1]), torch.zeros_like(blocks[2]))
        scale = head_dim**-0.5 * LOG2_E
        work = _Workspace(q, plan, block, 2, 3)
        for group in plan.groups:
            for rows in _tiles(group, block):
                _backward_rows(group, blocks, rows, scale, (out, log_sum_exp, grad_out), grads, work)
        return grads[0].view(q.shape), grads[1].view(k.shape), grads[2].view(v.shape), None, None


def _forward_rows(group: RowGroup, blocks: tuple[Tensor, Tensor, Tensor], tile: tuple, scale: float,
                  out: Tensor, log_sum_exp: Tensor, work: _Workspace) -> None:
    """Online softmax of one row range over its spans of key blocks; writes its output and log-sum-exp rows."""
    first, end, spans = tile
    running_max = running_sum = acc = None
    for slots in spans:
        _, _, values, scores = _tile(group, blocks, (first, end), slots, scale, work)
        tile_max = scores.amax(-1, keepdim=True)
        new_max = tile_max if running_max is None else torch.maximum(running_max, tile_max)
        new_max = new_max.masked_fill(new_max == float("-inf"), 0.0)  # a row with no key here yet
        probs = scores.sub_(new_max).exp2_()
        if running_max is None:
            running_sum, acc = probs.sum(-1, keepdim=True), torch.matmul(probs, values)
        else:
            correction = torch.exp2(running_max - new_max)
            running_sum = running_sum * correction + probs.sum(-1, keepdim=True)
            acc = acc * correction + torch.matmul(probs, values)
        running_max = new_max
    result = acc / running_sum
    if not group.every_query_has_key:
        result = result * group.has_key[first:end]
    _write_rows(out, group, (first, end), result)
    _write_rows(log_sum_exp, group, (first, end), running_max + torch.log2(running_sum))


def _backward_rows(group: RowGroup, blocks: tuple[Tensor, Tensor, Tensor], tile: tuple, scale: float,
                   saved: tuple[Tensor, Tensor, Tensor], grads: tuple[Tensor, Tensor, Tensor],
                   work: _Workspace) -> None:
    """Gradients of one row range: recomputed P per span, dV += P^T dO, dS = P (dP - rowsum(dO O)), dQ, dK.
    ``scale`` includes ``LOG2_E`` (the scores are base 2): dK's tile and dQ are scaled back by ln 2."""
    first, end, spans = tile
    out, log_sum_exp, grad_out = (q_blocks_of(group, x, (first, end)) for x in saved)
    delta = (grad_out * out).sum(-1, keepdim=True)
    grad_q = None
    for slots in spans:
        queries, keys, values, scores = _tile(group, blocks, (first, end), slots, scale, work)
        probs = scores.sub_(log_sum_exp).exp2_()
        if not group.every_query_has_key:
            probs = probs * group.has_key[first:end]
        flat = group.key_blocks[first:end, slots[0]:slots[1]].flatten()
        head_dim = keys.shape[-1]
        grad_kv = work.view(work.keys[2], *keys.shape)
        grad_v = torch.matmul(probs.transpose(-1, -2), grad_out, out=grad_kv)
        grads[2].index_add_(1, flat, grad_v.view(grad_v.shape[0], -1, blocks[2].shape[2], head_dim))
        grad_probs = torch.matmul(grad_out, values.transpose(-1, -2), out=work.view(work.scores[1], *probs.shape))
        grad_scores = probs.mul_(grad_probs.sub_(delta))
        grad_k = torch.matmul(grad_scores.transpose(-1, -2), queries, out=grad_kv).mul_(math.log(2.0))
        grads[1].index_add_(1, flat, grad_k.view(grad_k.shape[0], -1, blocks[1].shape[2], head_dim))
        part = torch.matmul(grad_scores, keys)
        grad_q = part if grad_q is None else grad_q.add_(part)
    _write_rows(grads[0], group, (first, end), grad_q.mul_(scale * math.log(2.0)))


def gathered_block_sparse_attention(q: Tensor, k: Tensor, v: Tensor, plan: BlockPlan, block: int, *,
                                    dropout: Dropout | None = None, context: StepContext | None = None) -> Tensor:
    """The reference path: each group's key blocks gathered at once, autograd through the gathers (its saved
    probabilities grow with the layout's non-zero blocks); the path dropout takes."""
    batch, n_heads, length, head_dim = q.shape
    n_kv_heads, padded = k.shape[1], plan.n_blocks * block
    if padded != length:
        pad = (0, 0, 0, padded - length)
        q, k, v = F.pad(q, pad), F.pad(k, pad), F.pad(v, pad)
    q_blocks = (q * head_dim**-0.5).reshape(batch, n_heads * plan.n_blocks, block, head_dim)
    k_blocks = k.reshape(batch, n_kv_heads * plan.n_blocks, block, head_dim)
    v_blocks = v.reshape(batch, n_kv_heads * plan.n_blocks, block, head_dim)
    outputs = []
    for group in plan.groups:
        n_rows, width = group.key_blocks.shape
        flat = group.key_blocks.flatten()
        keys = k_blocks.index_select(1, flat).reshape(batch, n_rows, width * block, head_dim)
        values = v_blocks.index_select(1, flat).reshape(batch, n_rows, width * block, head_dim)
        if group.first_row is not None:
            queries = q_blocks.narrow(1, group.first_row, n_rows)
        else:
            queries = q_blocks.index_select(1, group.rows)
        if group.bias.shape[0] != n_rows:  # one bias for every head: rows as (head, row of the head)
            queries, keys, values = (x.reshape(batch, n_heads, n_rows // n_heads, *x.shape[2:])
                                     for x in (queries, keys, values))
        scores = torch.matmul(queries, keys.transpose(-1, -2))
        scores += group.bias.to(scores.dtype)
        probs = torch.softmax(scores, dim=-1)
        if not group.every_query_has_key:
            probs = torch.where(group.has_key.view(*probs.shape[1:-1], 1), probs, 0.0)
        if dropout is not None and dropout.training and dropout.p > 0:
            first = dropout.shard_index(context) * n_heads * length  # this rank's first head, as query_index counts
            index = ((group.query_index + first)[:, :, None] * length + group.key_position[:, None, :])
            probs = dropout.at(probs, index.view(probs.shape[1:]), context)
        outputs.append(torch.matmul(probs, values).view(batch, n_rows, block, head_dim))
    if not outputs:
        return q.new_zeros(batch, n_heads, length, head_dim)
    out = torch.cat(outputs, dim=1) if len(outputs) > 1 else outputs[0]
    if plan.inverse is not None and out.shape[1] == n_heads * plan.n_blocks:
        out = out.index_select(1, plan.inverse)
    elif plan.inverse is not None:
        out = q_blocks.new_zeros(q_blocks.shape, dtype=out.dtype).index_copy(1, plan.inverse, out)
    return out.reshape(batch, n_heads, padded, head_dim)[:, :, :length]
