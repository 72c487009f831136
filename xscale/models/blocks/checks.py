"""The block kind's checks of a config (registered with :mod:`xscale.config.check` when the zoo is imported): the
kind is registered, its options parse, the settings and layouts its traits refuse are refused with its reason, and
its sizes split over ``parallel.tp`` (a kind's ``check_tensor_parallel``);
``model.init=admin`` needs post-norm residuals."""

from __future__ import annotations

from collections.abc import Callable

from xscale.config.check import register_check
from xscale.config.schema import Config, ConfigError
from xscale.models.checks import check_registered
from xscale.models.registry import ATTENTION, BLOCK

# trait -> (whether the config sets it, the setting in words, how to lift the refusal)
SETTINGS: dict[str, tuple[Callable[[Config], bool], str, str]] = {
    "tp": (lambda config: config.parallel.tp > 1, "parallel.tp > 1", "set parallel.tp=1"),
    "cp": (lambda config: config.parallel.cp > 1, "parallel.cp > 1", "set parallel.cp=1"),
    "selective_checkpointing": (lambda config: config.parallel.activation_checkpointing == "selective",
                                "parallel.activation_checkpointing=selective",
                                "set parallel.activation_checkpointing=full or none"),
    "other_stacks": (lambda config: config.model.stack.kind != "plain", "model.stack other than plain",
                     "set model.stack=plain"),
    "encoder_decoder": (lambda config: config.model.family == "encoder_decoder", "model.family=encoder_decoder",
                        "use model.family=decoder or encoder"),
    "segment_memory": (lambda config: config.model.segment_memory > 0, "model.segment_memory > 0",
                       "set model.segment_memory=0"),
    "carried_scores": (lambda config: any(ATTENTION.get(kind).carries_scores for kind in
                                          config.model.attention.per_layer or [config.model.attention.kind]
                                          if kind in ATTENTION),
                       "an attention kind that carries scores (RealFormer)", "choose another model.attention.kind"),
    "share_layers": (lambda config: config.model.share_layers, "model.share_layers=true",
                     "set model.share_layers=false"),
}


def check_block(config: Config) -> None:
    """The block kind exists, its options parse, and nothing its traits refuse is set."""
    block = config.model.block
    check_registered("block", block.kind, "model.block")
    options = BLOCK.options(block, "model.block")
    kind = BLOCK.get(block.kind)
    for trait, refusal in kind.block_traits.refusals().items():
        applies, setting, fix = SETTINGS[trait]
        if applies(config):
            raise ConfigError(f"model.block={block.kind} does not take {setting}: {refusal.reason}; {fix} or "
                              "model.block=standard")
    check_options = getattr(kind, "check", None)
    if check_options is not None:
        check_options(config.model, options)
    check_split = getattr(kind, "check_tensor_parallel", None)  # its sizes against tp (also checked by the tp plan)
    if check_split is not None and config.parallel.tp > 1:
        check_split(config.model, options, config.parallel.tp)


def check_admin(config: Config) -> None:
    """Admin scales post-norm residuals (Liu et al. 2020): other placements have no omega to set."""
    model = config.model
    if model.init == "admin" and model.norm_placement != "post":
        raise ConfigError(f"model.init=admin scales post-norm residuals (Liu et al. 2020); set "
                          f"model.norm_placement=post (it is {model.norm_placement}) or model.init=normal")


register_check("xscale.models", check_block)
register_check("xscale.models", check_admin)
