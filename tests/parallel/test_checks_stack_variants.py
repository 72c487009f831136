"""Layouts refused for the stack variants (:func:`xscale.parallel.checks.check_layout`), each message naming the
layout setting and the way out (the layouts they take run at one-process parity in test_zoo_matrix.py)."""

from __future__ import annotations

import pytest
from parity_models import DECODER

from xscale.config.load import load_config_from_cli
from xscale.config.schema import ConfigError
from xscale.parallel.checks import resolve_dims

REVERSIBLE = ["model.reversible=true"]


@pytest.mark.parametrize("layout,world,message", [
    (["parallel.pp=2"], 2, r"parallel.pp=2 is refused with model.reversible=true: a pipeline stage"),
    (["parallel.zero_stage=3"], 2, r"parallel.zero_stage=3 is refused .* set parallel.zero_stage=2"),
    (["parallel.activation_checkpointing=full"], 1,
     r"parallel.activation_checkpointing=full is refused .* already recomputes"),
])
def test_reversible_refuses_layouts(layout, world, message):
    config = load_config_from_cli(None, [*DECODER, *REVERSIBLE, *layout])
    with pytest.raises(ConfigError, match=message):
        resolve_dims(config, world)


def test_reversible_takes_data_tensor_and_context_parallel_and_zero_1_2():
    for zero in (0, 1, 2):
        resolve_dims(load_config_from_cli(None, [*DECODER, *REVERSIBLE, f"parallel.zero_stage={zero}"]), 2)
    resolve_dims(load_config_from_cli(None, [*DECODER, *REVERSIBLE, "parallel.cp=2", "parallel.zero_stage=1"]), 2)
    resolve_dims(load_config_from_cli(None, [*DECODER, *REVERSIBLE, "parallel.tp=2", "parallel.sequence_parallel=true"]),
                 2)



ACT = ["model.share_layers=true", "model.act=true"]


@pytest.mark.parametrize("layout,world,message", [
    (["parallel.pp=2"], 2, r"parallel.pp=2 is refused with model.act=true: the depth is dynamic per position"),
    (["parallel.tp=2", "parallel.sequence_parallel=true"], 2,
     r"parallel.sequence_parallel=true is refused with model.act=true: .* set parallel.sequence_parallel=false"),
])
def test_act_refuses_layouts(layout, world, message):
    config = load_config_from_cli(None, [*DECODER, *ACT, *layout])
    with pytest.raises(ConfigError, match=message):
        resolve_dims(config, world)


def test_act_takes_data_tensor_context_parallel_and_zero3():
    resolve_dims(load_config_from_cli(None, [*DECODER, *ACT, "parallel.tp=2", "parallel.zero_stage=3"]), 4)
    resolve_dims(load_config_from_cli(None, [*DECODER, *ACT, "parallel.cp=2", "parallel.cp_load_balance=true"]), 2)
