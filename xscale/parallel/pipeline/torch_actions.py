"""The action order torch's multi-stage pipeline schedules run, without building stages: the one place xscale reads
torch's private schedule internals.

``PipelineScheduleMulti`` computes each rank's list of actions (stage, forward / backward / weight half, microbatch)
in its constructor, which needs live stages and a process group. The memory model only needs the order, so this
adapter sets the four sizes the computation reads on an unconstructed instance and calls torch's
``_calculate_single_rank_operations``, and gives the computations as xscale's :class:`Action`. A torch that computes
it otherwise gives None, and the caller falls back to the closed-form counts;
``tests/parallel/pipeline/test_torch_actions.py`` fails loudly if that happens to a schedule xscale offers, so a
torch upgrade cannot silently degrade the estimate. ``torch.distributed.pipelining`` (which loads ``torch._dynamo``,
seconds) is imported only for a multi-stage schedule.
"""

from __future__ import annotations

import enum
from typing import NamedTuple

from xscale.parallel.pipeline.schedules import SCHEDULES

__all__ = ["Action", "ComputationType", "rank_actions"]


class ComputationType(enum.Enum):
    """The computations of torch's ``_ComputationType`` the memory model reads, by torch's values."""

    FORWARD = "F"
    FULL_BACKWARD = "B"
    BACKWARD_INPUT = "I"
    BACKWARD_WEIGHT = "W"


class Action(NamedTuple):
    stage_index: int
    computation_type: ComputationType
    microbatch_index: int

    def __str__(self) -> str:  # as torch writes its actions: "1I2" is stage 1's input half of microbatch 2
        return f"{self.stage_index}{self.computation_type.value}{self.microbatch_index}"


COMPUTATIONS = {kind.value: kind for kind in ComputationType}


def rank_actions(schedule: str, pp: int, stages_per_rank: int, microbatches: int) -> dict[int, list[Action]] | None:
    """Each of the ``pp`` ranks' computations under ``parallel.pp_schedule=schedule``, or None for a
    one-stage-per-rank schedule (or a torch whose schedules compute the order otherwise)."""
    if SCHEDULES[schedule].single_stage:
        return None
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti

    schedule_class = SCHEDULES[schedule].cls
    if not issubclass(schedule_class, PipelineScheduleMulti):
        return None
    order = object.__new__(schedule_class)
    order.pp_group_size, order.n_local_stages = pp, stages_per_rank
    order._n_microbatches, order.num_stages = microbatches, pp * stages_per_rank
    order.number_of_rounds = max(1, microbatches // pp)
    order.microbatches_per_round = microbatches // order.number_of_rounds
    try:
        computations: dict[object, ComputationType] = {}  # torch's computation -> ours, read once per kind
        found = {}
        for rank in range(pp):
            actions = []
            for action in order._calculate_single_rank_operations(rank):
                if action is None:
                    continue
                kind = action.computation_type
                if kind not in computations:
                    computations[kind] = COMPUTATIONS.get(kind.value)
                if computations[kind] is not None:  # tuple.__new__: Action's own __new__ is Python, millions of calls
                    actions.append(tuple.__new__(Action, (action.stage_index, computations[kind],
                                                          action.microbatch_index)))
            found[rank] = actions
        return found
    except (AttributeError, TypeError):
        return None
