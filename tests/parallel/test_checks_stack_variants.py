"""Layouts refused for the stack variants (:func:`xscale.parallel.checks.check_layout`) by the traits each declares,
each message naming the layout setting and the way out (the layouts they take run at one-process parity in
test_zoo_matrix.py)."""

from __future__ import annotations

import dataclasses

import pytest
from parity_models import DECODER

from xscale.config.load import load_config_from_cli
from xscale.config.schema import ConfigError
from xscale.models.registry import STACK
from xscale.models.stacks.plain import PlainStack
from xscale.models.traits import Refusal, StackTraits
from xscale.parallel.checks import STACK_LAYOUT_SETTINGS, resolve_dims

REVERSIBLE = ["model.stack=reversible"]


@pytest.mark.parametrize("layout,world,message", [
    (["parallel.pp=2"], 2, r"parallel.pp=2 is refused with model.stack=reversible: a pipeline stage"),
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


ACT = ["model.share_layers=true", "model.stack=act"]


@pytest.mark.parametrize("layout,world,message", [
    (["parallel.pp=2"], 2, r"parallel.pp=2 is refused with model.stack=act: the depth is dynamic per position"),
    (["parallel.tp=2", "parallel.sequence_parallel=true"], 2,
     r"parallel.sequence_parallel=true is refused with model.stack=act: .* set parallel.sequence_parallel=false"),
])
def test_act_refuses_layouts(layout, world, message):
    config = load_config_from_cli(None, [*DECODER, *ACT, *layout])
    with pytest.raises(ConfigError, match=message):
        resolve_dims(config, world)


def test_act_takes_data_tensor_context_parallel_and_zero3():
    resolve_dims(load_config_from_cli(None, [*DECODER, *ACT, "parallel.tp=2", "parallel.zero_stage=3"]), 4)
    resolve_dims(load_config_from_cli(None, [*DECODER, *ACT, "parallel.cp=2", "parallel.cp_load_balance=true"]), 2)


# A layout that sets each trait's setting (the degrees fit a world of 2).
LAYOUTS = {"pp": ["parallel.pp=2"], "tp": ["parallel.tp=2"], "sequence_parallel": ["parallel.tp=2",
                                                                                 "parallel.sequence_parallel=true"],
           "cp": ["parallel.cp=2"], "zero3": ["parallel.zero_stage=3"],
           "activation_checkpointing": ["parallel.activation_checkpointing=full"]}


def test_every_trait_names_a_layout_setting():
    layout_traits = {field.name for field in dataclasses.fields(StackTraits) if field.type == "Refusal | None"}
    assert set(LAYOUTS) == set(STACK_LAYOUT_SETTINGS) == layout_traits


@pytest.mark.parametrize("trait", sorted(LAYOUTS))
def test_a_new_variant_is_refused_by_its_traits_alone(trait, monkeypatch):
    """A variant registered here, with one refusal declared, is refused by name under that layout and takes the
    rest: no table in xscale/parallel names it."""
    refusing = type("RefusingStack", (PlainStack,), {"stack_traits": StackTraits(**{trait: Refusal("it cannot")})})
    monkeypatch.setitem(STACK._entries, "refusing", refusing)
    config = load_config_from_cli(None, [*DECODER, "model.stack=refusing", *LAYOUTS[trait]])
    name = STACK_LAYOUT_SETTINGS[trait][0]
    with pytest.raises(ConfigError, match=rf"parallel.{name}=\S+ is refused with model.stack=refusing: it cannot; "
                                          rf"set parallel.{name}=\S+ or model.stack=plain"):
        resolve_dims(config, 2)
    other = next(name for name in sorted(LAYOUTS) if name not in (trait, "sequence_parallel", "tp"))
    resolve_dims(load_config_from_cli(None, [*DECODER, "model.stack=refusing", *LAYOUTS[other]]), 2)
