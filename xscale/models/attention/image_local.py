"""Image Transformer 2-D local attention (Parmar et al. 2018, "Image Transformer", sec. 3.2): the sequence is a
raster over a grid of pixels or patches, cut into rectangular query blocks of q_h x q_w positions; each block attends
to its memory block, the query block extended by h_m rows above and w_m columns left and right,

  q'_i = softmax(q_i K_M(i)^T / sqrt(d)) V_M(i)                                         (eq. 1, M(i) the memory block)

(the paper's layer norm and residual around it are the block's). Causal: the keys that come before the query in the
sequence's raster order (the paper generates block by block, raster order within a block; here the order is the
sequence's, so a block's memory is its rows above and the earlier positions of its own rows); bidirectional: the
memory block extends h_m rows below too. ``grid_width`` gives the grid's columns; the rows follow from the length
(the last row may be partial), so a patch grid of rows x cols is a sequence of rows * cols. The masked scores are
formed densely (O(T^2) memory; the paper's blocks compute only the memory block). Tensor parallelism splits the
heads; context parallelism runs it on the gathered sequence.
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
class ImageLocalOptions:
    grid_width: int = dataclasses.field(default=8, metadata={"help": "the grid's columns (rows: length / columns)"})
    query_block: list[int] = dataclasses.field(default_factory=lambda: [2, 4], metadata={
        "help": "[q_h, q_w]: rows and columns of a query block"})
    memory_margin: list[int] = dataclasses.field(default_factory=lambda: [2, 2], metadata={
        "help": "[h_m, w_m]: rows above (and below, bidirectional) and columns each side in the memory block"})

    def __post_init__(self) -> None:
        require(self.grid_width >= 1, f"model.attention.options.grid_width must be >= 1 for 'image_local' "
                                      f"(got {self.grid_width})")
        require(len(self.query_block) == 2 and min(self.query_block) >= 1,
                f"model.attention.options.query_block must be [rows, columns] >= 1 for 'image_local' "
                f"(got {self.query_block})")
        require(len(self.memory_margin) == 2 and min(self.memory_margin) >= 0,
                f"model.attention.options.memory_margin must be [rows, columns] >= 0 for 'image_local' "
                f"(got {self.memory_margin})")


def memory_block_mask(options: ImageLocalOptions, length: int, causal: bool, device: torch.device) -> Tensor:
    """Bool (T, T): key j lies in the memory block of query i's query block (and, causal, j <= i)."""
    position = torch.arange(length, device=device)
    row, column = position // options.grid_width, position % options.grid_width
    (block_rows, block_columns), (margin_rows, margin_columns) = options.query_block, options.memory_margin
    top = row // block_rows * block_rows  # the first row and column of each query's block
    left = column // block_columns * block_columns
    below = 0 if causal else margin_rows
    rows_in = (row[None, :] >= top[:, None] - margin_rows) & (row[None, :] < top[:, None] + block_rows + below)
    columns_in = ((column[None, :] >= left[:, None] - margin_columns)
                  & (column[None, :] < left[:, None] + block_columns + margin_columns))
    allowed = rows_in & columns_in
    return allowed & (position[None, :] <= position[:, None]) if causal else allowed


@ATTENTION.register("image_local", "local_2d")
class ImageLocalAttention(AttentionCore):
    """Query blocks over a 2-D grid attending to their memory blocks (Parmar et al. 2018, sec. 3.2)."""

    Options = ImageLocalOptions
    supports_bias = True
    takes_padding_mask = True
    parallel_traits = ParallelTraits(tp="split_heads", cp_whole_sequence=True)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, bias: Tensor | None = None,
                context: StepContext | None = None) -> Tensor:
        if q.shape[2] != k.shape[2]:
            raise ValueError(f"image_local attention places {q.shape[2]} queries on a grid of {k.shape[2]} keys; it "
                             "takes queries and keys of one sequence (no KV cache or memory)")
        allowed = memory_block_mask(self.options, k.shape[2], causal, q.device)
        mask = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill(~allowed, float("-inf"))
        if bias is not None:
            mask = mask + bias.to(q.dtype)
        return self.attend(q, expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1]), mask, context)
