"""A collective that fails because another rank died is told apart from a bug, by the transport's real words."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from xscale.runtime.peer_loss import lost_peer, peer_loss_line


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank(rank: int, port: int, errors) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    tensor = torch.ones(1)
    dist.all_reduce(tensor)
    if rank == 1:
        os._exit(0)  # the peer goes away without a word, as a killed worker does
    try:
        dist.all_reduce(tensor)
    except RuntimeError as error:
        errors.put((lost_peer(error), str(error).splitlines()[0]))
    else:
        errors.put((None, "the collective did not fail"))


def test_gloo_error_after_a_peer_died_is_a_lost_peer():
    context = mp.get_context("spawn")
    errors = context.Queue()
    port = _free_port()
    processes = [context.Process(target=_rank, args=(rank, port, errors)) for rank in (0, 1)]
    for process in processes:
        process.start()
    lost, message = errors.get(timeout=120)
    for process in processes:
        process.join(timeout=60)
    assert lost is True, message


@pytest.mark.parametrize("message", ["CUDA out of memory", "shape mismatch", "Connection refused to the tracker"])
def test_other_runtime_errors_are_not_a_lost_peer(message):
    assert not lost_peer(RuntimeError(message))
    assert not lost_peer(ValueError("Connection reset by peer"))  # only collectives' RuntimeErrors


def test_the_line_names_the_rank_and_the_transport_words_without_its_source_prefix():
    error = RuntimeError("[/x/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:1: Connection reset by peer. "
                         "This is typically caused by a remote worker hanging\nmore")
    line = peer_loss_line(error, 3)
    assert "\n" not in line and line.startswith("xscale train: rank 3 lost a peer (Read error")
    assert "pair.cc" not in line and "checkpoint.resume=auto" in line
