"""Telling a lost peer from a bug: the errors a collective raises when another rank of the job died or hung up."""

from __future__ import annotations

import re

# gloo's transport (pair.cc) and NCCL's watchdog/abort say so in their messages; torch raises them as RuntimeError
# (gloo) or torch.distributed.DistError subclasses (NCCL, the store), so the message is what tells them apart.
_PEER_LOST = re.compile(r"Connection (reset|closed) by peer|Broken pipe|transport/tcp/pair\.cc|NCCL communicator was "
                        r"aborted|ncclRemoteError|Socket Timeout|failed to recv, got 0 bytes")


def lost_peer(error: BaseException) -> bool:
    """Whether ``error`` is a collective that failed because another rank of the job went away."""
    return isinstance(error, RuntimeError) and bool(_PEER_LOST.search(str(error)))


def peer_loss_line(error: BaseException, rank: int) -> str:
    """One line for the log: which rank noticed, the transport's own words (first line), and what happens next."""
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    where = first.split("] ", 1)[-1]  # drop gloo's source-file prefix
    return (f"xscale train: rank {rank} lost a peer ({where[:160]}); another rank of the job stopped or died: see its "
            f"own line above. Under torchrun --max-restarts or a Slurm requeue the job resumes from the last "
            f"checkpoint (checkpoint.resume=auto)")
