"""The zoo's checks of a config, registered with :mod:`xscale.config.check` when the zoo is imported: every
component name is looked up in its registry (naming the closest and every available one), and each variant's
options are checked by the variant."""

from __future__ import annotations

from xscale.config.check import closest, register_check
from xscale.config.schema import Config, ConfigError
from xscale.models.moe import check_moe_config
from xscale.models.patch_embedding import check_patch_config
from xscale.models.registry import FFN, NORM, OBJECTIVE_HEAD, POSITION, REGISTRIES, ROUTER, STACK
from xscale.models.segment_memory import check_segment_memory_config


def check_registered(kind: str, name: str, where: str) -> None:
    """Refuse a component name that no module registered, naming the closest and every available one."""
    registry = REGISTRIES[kind]
    if name not in registry:
        raise ConfigError(
            f"{where}='{name}' is not a known {kind}{closest(name, registry.names())}; "
            f"available: {', '.join(registry.names())}"
        )


def check_component_names(config: Config) -> None:
    """Every component the model section names is registered (a router typo is refused even while MoE is off)."""
    model = config.model
    check_registered("position", model.position.kind, "model.position")
    check_registered("norm", model.norm.kind, "model.norm")
    check_registered("ffn", model.ffn.kind, "model.ffn")
    for kind in dict.fromkeys(model.attention.per_layer or [model.attention.kind]):
        where = "model.attention.per_layer" if model.attention.per_layer else "model.attention.kind"
        check_registered("attention", kind, where)
    check_registered("router", model.moe.router.kind, "model.moe.router")
    check_registered("stack", model.stack.kind, "model.stack")
    check_registered("objective_head", model.objective_head.kind, "model.objective_head")


def check_component_options(config: Config) -> None:
    """Every named component's options read into its ``Options`` dataclass: an unknown option is refused naming the
    valid ones, a value out of range by the option's own check."""
    model = config.model
    for registry, component, where in ((POSITION, model.position, "model.position"), (NORM, model.norm, "model.norm"),
                                       (FFN, model.ffn, "model.ffn"), (ROUTER, model.moe.router, "model.moe.router"),
                                       (STACK, model.stack, "model.stack"),
                                       (OBJECTIVE_HEAD, model.objective_head, "model.objective_head")):
        registry.options(component, where)


def check_stack_serves(config: Config) -> None:
    """The stack variant serves this model's family and task (its traits' ``serves``), or is refused saying which
    models it serves."""
    kind, family, task = config.model.stack.kind, config.model.family, config.train.task
    traits = STACK.get(kind).stack_traits
    if traits.serves and not any(serves.admits(family, task) for serves in traits.serves):
        settings = ", or ".join(serves.setting() for serves in traits.serves)
        raise ConfigError(f"model.stack={kind} {traits.serves_reason} (got model.family={family}, train.task={task}); "
                          f"set {settings}")


def check_variants(config: Config) -> None:
    """Each variant's own option checks (MoE, the stack variant, patches, segment memory)."""
    model = config.model
    if model.moe.num_experts:
        check_moe_config(model, config.parallel.ep)
    check_stack_serves(config)
    STACK.get(model.stack.kind).check(config, STACK.options(model.stack, "model.stack"))
    check_patch_config(config)
    check_segment_memory_config(config)


register_check("xscale.models", check_component_names)
register_check("xscale.models", check_component_options)
register_check("xscale.models", check_variants)
