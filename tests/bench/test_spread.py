"""The median and interquartile range the alternating benches print."""

from xscale.bench.spread import median_and_quartiles


def test_median_and_quartiles():
    assert median_and_quartiles([]) is None
    assert median_and_quartiles([1.2]) == (1.2, 1.2, 1.2)
    assert median_and_quartiles([4.0, 1.0, 3.0, 2.0, 5.0]) == (3.0, 2.0, 4.0)


def test_spearman_ranks_and_ties():
    import pytest

    from xscale.bench.spread import average_ranks, spearman

    assert average_ranks([30.0, 10.0, 20.0, 20.0]) == [4.0, 1.0, 2.5, 2.5]
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)  # any increasing map: 1
    assert spearman([1, 2, 3, 4], [9, 4, 1, 0]) == pytest.approx(-1.0)
    # one swapped pair of 4: 1 - 6 sum d^2 / (n (n^2 - 1)) = 1 - 6 * 2 / 60 = 0.8 (no ties: the textbook formula)
    assert spearman([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(0.8)
    assert spearman([1, 1, 1], [1, 2, 3]) == 0.0  # no spread in one list: no correlation
    with pytest.raises(ValueError):
        spearman([1.0], [2.0])
