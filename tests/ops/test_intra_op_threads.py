"""intra_op_threads: the count inside the block, and the caller's restored after it, also when the block raises."""

import pytest
import torch

from xscale.ops.intra_op_threads import intra_op_threads


def test_the_block_runs_with_the_count_and_the_callers_comes_back(two_threads):
    with intra_op_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == 2
    with pytest.raises(RuntimeError, match="inside"):
        with intra_op_threads(1):
            raise RuntimeError("inside")
    assert torch.get_num_threads() == 2


def test_the_same_count_leaves_it_alone(two_threads):
    with intra_op_threads(2):
        assert torch.get_num_threads() == 2
    assert torch.get_num_threads() == 2
