"""The action order torch's multi-stage pipeline schedules run, without building stages: the one place xscale reads
torch's private schedule internals.

``PipelineScheduleMulti`` computes each rank's list of actions (stage, forward / backward / weight half, microbatch)
in its constructor, which needs live stages and a process group. The memory model only needs the order, so this
adapter sets the four sizes the computation reads on an unconstructed instance and calls torch's
``_calculate_single_rank_operations``. A torch that computes it otherwise gives None, and the caller falls back to
the closed-form counts; ``tests/parallel/pipeline/test_torch_actions.py`` fails loudly if that happens to a schedule
xscale offers, so a torch upgrade cannot silently degrade the estimate.
"""

from __future__ import annotations

from torch.distributed.pipelining.schedules import PipelineScheduleMulti, _Action, _ComputationType

__all__ = ["ComputationType", "rank_actions"]

ComputationType = _ComputationType  # FORWARD, FULL_BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, ...


def rank_actions(schedule_class: type, pp: int, stages_per_rank: int, microbatches: int) -> dict[int, list[_Action]] | None:
    """Each of the ``pp`` ranks' actions under ``schedule_class``, or None for a one-stage-per-rank schedule class
    (or a torch whose schedules compute the order otherwise)."""
    if not issubclass(schedule_class, PipelineScheduleMulti):
        return None
    schedule = object.__new__(schedule_class)
    schedule.pp_group_size, schedule.n_local_stages = pp, stages_per_rank
    schedule._n_microbatches, schedule.num_stages = microbatches, pp * stages_per_rank
    schedule.number_of_rounds = max(1, microbatches // pp)
    schedule.microbatches_per_round = microbatches // schedule.number_of_rounds
    try:
        return {rank: [action for action in schedule._calculate_single_rank_operations(rank) if action is not None]
                for rank in range(pp)}
    except (AttributeError, TypeError):
        return None
