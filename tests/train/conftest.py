"""Fixtures of the training tests."""

import pytest
import torch


@pytest.fixture
def one_thread():
    """One intra-op thread for an in-process run: on a shared 2-core machine two threads contend and a tiny run
    takes several times as long."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
