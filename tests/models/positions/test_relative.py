"""The clipped relative-distance rows that Shaw's, DeBERTa's and the Music Transformer's tables share: against loops
over (i, j) with queries at the end of the keys, and the options' one-line refusal."""

from __future__ import annotations

import pytest
import torch

from xscale.config.schema import ConfigError
from xscale.models.positions.music import MusicOptions
from xscale.models.positions.relative import pair_rows
from xscale.models.positions.shaw import ShawOptions


@pytest.mark.parametrize("query_minus_key", [False, True], ids=["j-i", "i-j"])
@pytest.mark.parametrize("q_len,k_len,below,above", [(6, 6, 2, 2), (3, 8, 3, 2), (5, 5, 4, 0)])
def test_pair_rows_match_a_loop(q_len: int, k_len: int, below: int, above: int, query_minus_key: bool) -> None:
    offset = k_len - q_len
    expected = torch.tensor([[min(max((i + offset - j) if query_minus_key else (j - i - offset), -below), above) + below
                              for j in range(k_len)] for i in range(q_len)])
    torch.testing.assert_close(pair_rows(q_len, k_len, torch.device("cpu"), below, above,
                                         query_minus_key=query_minus_key), expected)


def test_each_encoding_refuses_distances_below_its_least() -> None:
    with pytest.raises(ConfigError, match="max_distance must be >= 1, got 0"):
        ShawOptions(max_distance=0)
    assert MusicOptions(max_distance=0).max_distance == 0  # 0: every distance
    with pytest.raises(ConfigError, match="max_distance must be >= 0, got -1"):
        MusicOptions(max_distance=-1)
