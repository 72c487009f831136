"""Readable byte counts: the unit that keeps the number above 1, three significant figures."""

import pytest

from xscale.checkpoint.sizes import readable_size


@pytest.mark.parametrize("count, text", [
    (0, "0 B"), (598, "598 B"), (1024, "1.00 KiB"), (3.2 * 2**20, "3.20 MiB"), (1.1 * 2**20, "1.10 MiB"),
    (45.67 * 2**20, "45.7 MiB"), (512 * 2**20, "512 MiB"), (1023.4 * 2**20, "1023 MiB"), (2**30 * 1.05, "1.05 GiB"),
    (7 * 2**40, "7.00 TiB"),
])
def test_readable_size(count, text):
    assert readable_size(count) == text
