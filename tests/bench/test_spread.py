"""The median and interquartile range the alternating benches print."""

from xscale.bench.spread import median_and_quartiles


def test_median_and_quartiles():
    assert median_and_quartiles([]) is None
    assert median_and_quartiles([1.2]) == (1.2, 1.2, 1.2)
    assert median_and_quartiles([4.0, 1.0, 3.0, 2.0, 5.0]) == (3.0, 2.0, 4.0)
