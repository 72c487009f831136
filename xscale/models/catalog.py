"""What the zoo offers, read from the registries: each registered component's options with their defaults and help
(``xscale inspect --components``). The one place a component's settings are written is its ``Options`` dataclass."""

from __future__ import annotations

import dataclasses

from xscale.models.registry import REGISTRIES

# The config key that names each registry's component.
CONFIG_KEYS = {"attention": "model.attention", "position": "model.position", "norm": "model.norm", "ffn": "model.ffn",
               "router": "model.moe.router", "stack": "model.stack",
               "block": "model.block", "objective_head": "model.objective_head"}


def describe_option(field: dataclasses.Field) -> str:
    """``name=default (help)`` of one option."""
    if field.default is not dataclasses.MISSING:
        default = field.default
    elif field.default_factory is not dataclasses.MISSING:
        default = field.default_factory()
    else:
        default = "required"
    text = f"{field.name}={default}"
    return f"{text} ({field.metadata['help']})" if "help" in field.metadata else text


def options_catalog() -> list[tuple[str, str, str]]:
    """(config key, kind, its options described) for every registered component that takes options."""
    rows = []
    for registry_name, registry in REGISTRIES.items():
        for kind in registry.names():
            fields = dataclasses.fields(registry.options_class(kind))
            if fields:
                rows.append((CONFIG_KEYS[registry_name], kind, ", ".join(map(describe_option, fields))))
    return rows
