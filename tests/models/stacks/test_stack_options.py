"""The stack variant as a component (``model.stack: {kind, options}``): set from YAML and dotted overrides, the flat
switches of the previous release read as it with one line each, refused by name, listed with its options."""

from __future__ import annotations

import pytest
import torch

import xscale.config.load as config_load
from xscale.cli import main
from xscale.config.load import load_config, read_config
from xscale.config.schema import ConfigError
from xscale.models import build_model
from xscale.models.registry import STACK
from xscale.models.stacks.plain import PlainStack
from xscale.models.traits import StackTraits

TINY = ["model.d_model=16", "model.n_heads=2", "model.vocab_size=32", "model.n_layers=2"]


def test_every_variant_declares_its_traits_and_builds(tmp_path):
    assert {"plain", "reversible", "act", "funnel", "early_exit"} <= set(STACK.names())
    for kind in STACK.names():
        assert isinstance(STACK.get(kind).stack_traits, StackTraits)
    path = tmp_path / "act.yaml"
    path.write_text("model:\n  share_layers: true\n  stack: {kind: act, options: {threshold: 0.5}}\n")
    config = load_config(path, TINY)
    assert (config.model.stack.kind, config.model.stack.options) == ("act", {"threshold": 0.5})
    model = build_model(config.model)
    assert type(model.stack) is STACK.get("act") and model.stack.act.threshold == 0.5


@pytest.mark.parametrize("flat, kind, options, lines", [
    (["model.act=true", "model.share_layers=true", "model.act_threshold=0.8", "model.ponder_cost=0.5"], "act",
     {"threshold": 0.8, "ponder_cost": 0.5},
     ["model.act is deprecated and will be removed in the next release; read as model.stack.kind=act",
      "model.act_threshold is deprecated and will be removed in the next release; read as "
      "model.stack.options.threshold",
      "model.ponder_cost is deprecated and will be removed in the next release; read as "
      "model.stack.options.ponder_cost"]),
    (["model.family=encoder", "model.position=learned", "model.funnel=[1,1]", "model.funnel_decoder_layers=0"],
     "funnel", {"groups": [1, 1], "decoder_layers": 0},
     ["model.funnel is deprecated and will be removed in the next release; read as model.stack.kind=funnel with "
      "model.stack.options.groups",
      "model.funnel_decoder_layers is deprecated and will be removed in the next release; read as "
      "model.stack.options.decoder_layers"]),
    (["model.reversible=true", "model.exit_entropy=0.3"], "reversible", {},
     ["model.reversible is deprecated and will be removed in the next release; read as model.stack.kind=reversible",
      "model.exit_entropy is deprecated and will be removed in the next release; read as nothing (model.stack is not "
      "early_exit: it was ignored)"]),
])
def test_the_flat_keys_of_the_previous_release_still_read(flat, kind, options, lines, capsys, monkeypatch):
    monkeypatch.setattr(config_load, "_ANNOUNCED", set())  # the lines are printed once per process
    config = load_config(None, [*TINY, *flat])
    assert (config.model.stack.kind, config.model.stack.options) == (kind, options)
    assert capsys.readouterr().err.strip().splitlines() == [f"xscale: {line}" for line in lines]


def test_two_switches_for_one_stack_are_refused():
    with pytest.raises(ConfigError, match="model.reversible and model.act each choose model.stack; keep one"):
        read_config(None, ["model.reversible=true", "model.act=true"])


@pytest.mark.parametrize("overrides, message", [
    (["model.stack=revresible"], r"model.stack='revresible' is not a known stack \(did you mean 'reversible'\?\)"),
    (["model.stack.options.threshold=0.5"], "stack 'plain' takes no options; remove model.stack.options.threshold"),
    (["model.stack=act", "model.share_layers=true", "model.stack.options.halt=1"],
     "unknown key 'model.stack.options.halt'"),
])
def test_a_bad_stack_is_refused_by_name(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [*TINY, *overrides])


def test_inspect_lists_the_stack_kinds_with_their_options(capsys):
    assert main(["inspect", "--components"]) == 0
    out = capsys.readouterr().out
    assert "model.stack" in out and ", ".join(sorted(STACK.names())) in out
    assert "model.stack: act" in out and "threshold=0.99 (a position halts once" in out
    assert "model.stack: funnel" in out and "decoder_layers=2" in out
    assert "model.stack: early_exit" in out and "patience=0" in out


def test_a_new_variant_is_one_registered_class(monkeypatch):
    """A variant registered here (the blocks run deepest first) is built and run by the Transformer as it is:
    nothing else names it."""
    class DeepestFirst(PlainStack):
        def run(self, x, position, memory, scores, context, layer_states):
            for depth, block in reversed(list(zip(self.depths, self.blocks()))):
                x, scores = self.run_block(depth, block, x, position, memory, scores, context)
            return x, scores

    monkeypatch.setitem(STACK._entries, "deepest_first", DeepestFirst)
    config = load_config(None, [*TINY, "model.stack=deepest_first"])
    model = build_model(config.model, seed=0)
    tokens = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(0))
    x = model.embedding(tokens)
    for block in reversed(model.stack.blocks()):
        x = block(x, model.stack.position)
    torch.testing.assert_close(model(tokens), model.output(model.stack.final_norm(x)))
