"""FlexAttention's BlockMask path vs the dense masked reference (CPU: forward; training runs on CUDA, tests/gpu)."""

import pytest
import torch

from xscale.ops import block_sparse_attention
from xscale.ops.block_sparse_attention import block_sparse_attention_reference, build_layout
from xscale.ops.flex_block_sparse import block_mask_from_layout

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def _local_layout(seq: int, block: int, heads: int, window_blocks: int, empty_row: int | None = None):
    """Each query block sees the ``window_blocks`` before it (a head h sees h more) and block 0 (a global key)."""
    n = -(-seq // block)
    mask = torch.zeros(heads, n, n, dtype=torch.bool)
    for head in range(heads):
        for row in range(n):
            mask[head, row, max(0, row - window_blocks - head):row + 1] = True
    mask[:, :, 0] = True
    if empty_row is not None:
        mask[:, empty_row] = False
    count = mask.sum(-1)
    index = torch.where(mask, torch.arange(n), n).sort(-1).values[..., :int(count.max())].clamp_max(n - 1)
    if heads == 1:
        index, count = index[0], count[0]
    return build_layout(index, count, block, seq, seq)


@pytest.mark.parametrize("seq,block,causal,heads", [(256, 32, True, 1), (250, 32, True, 1), (200, 64, False, 3)],
                         ids=["causal", "ragged-causal", "per-head-ragged"])
def test_flex_matches_the_masked_reference(seq, block, causal, heads):
    layout = _local_layout(seq, block, heads, window_blocks=2, empty_row=None if causal else 2)
    q, k, v = (torch.randn(2, 3, seq, 16) for _ in range(3))
    with torch.no_grad():
        got = block_sparse_attention(q, k, v, layout, causal=causal, backend="flex")
    want = block_sparse_attention_reference(q, k, v, layout, causal)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    if not causal:  # the row that sees no key gives 0
        assert got[:, :, 2 * block:3 * block].abs().max() == 0


def test_block_mask_marks_full_and_partial_blocks():
    layout = _local_layout(1024, 128, 1, window_blocks=2)
    block_mask = block_mask_from_layout(layout, 1024, 1024, causal=True, device=torch.device("cpu"))
    assert torch.equal(block_mask.to_dense()[0, 0].bool(), layout.mask[0])
    assert block_mask.kv_num_blocks[0, 0].tolist() == [1] * 8  # the diagonal: masked key <= query
    assert block_mask.full_kv_num_blocks[0, 0].tolist() == [0, 1, 2, 3, 3, 3, 3, 3]


def test_a_layout_finer_than_the_kernel_tile_is_described_in_128_blocks():
    """The compiled kernel needs blocks that are multiples of its 128-row tile (an H200 refused 64)."""
    layout = _local_layout(1000, 32, 1, window_blocks=2)
    block_mask = block_mask_from_layout(layout, 1000, 1000, causal=True, device=torch.device("cpu"))
    assert block_mask.BLOCK_SIZE == (128, 128)
    fine = torch.nn.functional.pad(layout.mask[0], (0, 32 - 1000 // 32 - 1, 0, 32 - 1000 // 32 - 1))
    coarse = fine.view(8, 4, 8, 4).any(3).any(1)
    assert torch.equal(block_mask.to_dense()[0, 0].bool(), coarse)
    assert block_mask.full_kv_num_blocks[0, 0].sum() == 0  # no 128-block is all listed: each is masked by mask_mod


def test_flex_refuses_to_train_on_cpu_with_a_clear_error():
    layout = _local_layout(64, 32, 1, window_blocks=1)
    q = torch.randn(1, 1, 64, 16, requires_grad=True)
    with pytest.raises(NotImplementedError, match="trains on CUDA only"):
        block_sparse_attention(q, q, q, layout, causal=True, backend="flex")
