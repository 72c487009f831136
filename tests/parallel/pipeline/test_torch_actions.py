"""The one adapter over torch's private schedule internals: for every multi-stage schedule xscale offers it gives an
action order (a torch upgrade that moved the internals fails here, not silently in the memory estimate), and that
order does what a pipeline must: every stage runs each microbatch's forward once and its backward after it."""

import pytest

from xscale.parallel.pipeline.schedules import SCHEDULES
from xscale.parallel.pipeline.torch_actions import ComputationType, rank_actions

MULTI_STAGE = [name for name, spec in SCHEDULES.items() if not spec.single_stage]


def test_one_stage_schedules_have_no_action_list():
    assert rank_actions("1f1b", 2, 1, 4) is None


@pytest.mark.parametrize("name", MULTI_STAGE)
@pytest.mark.parametrize("pp,microbatches", [(2, 4), (4, 8)])
def test_every_multi_stage_schedule_gives_an_order(name, pp, microbatches):
    spec = SCHEDULES[name]
    stages = spec.min_stages_per_rank
    actions = rank_actions(name, pp, stages, microbatches)
    assert actions is not None, f"torch no longer exposes {name}'s action order the way torch_actions reads it"
    forwards, backwards = {}, {}
    for ordered in actions.values():
        for position, action in enumerate(ordered):
            key = (action.stage_index, action.microbatch_index)
            if action.computation_type == ComputationType.FORWARD:
                forwards.setdefault(key, []).append(position)
            elif action.computation_type in (ComputationType.FULL_BACKWARD, ComputationType.BACKWARD_INPUT):
                backwards[key] = position
    every = {(stage, mb) for stage in range(pp * stages) for mb in range(microbatches)}
    assert set(forwards) == every and all(len(at) == 1 for at in forwards.values())
    assert set(backwards) == every and all(forwards[key][0] < backwards[key] for key in every)
