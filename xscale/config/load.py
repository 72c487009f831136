"""A :class:`~xscale.config.Config` from YAML and dotted overrides: nested mappings coerced into the typed sections
(and back to YAML, :func:`config_to_yaml`).

An unknown key names the closest valid key; a wrong type says what was expected. :func:`load_config` then checks
the values and runs every registered check (:func:`xscale.config.check.validate`). Layers above may register a
completer (:func:`register_completer`): a function that fills in what a tree implies before it is checked, such as
the model of ``checkpoint.init_from=hf:DIR``.
"""

from __future__ import annotations

import dataclasses
import sys
import types
import typing
from pathlib import Path
from typing import Any, Union

import yaml

from xscale.config.check import check_values, closest, validate
from xscale.config.schema import Component, Config, ConfigError

INT_LIMIT = 2**63
Completer = typing.Callable[[dict[str, Any]], dict[str, Any]]
_COMPLETERS: list[Completer] = []


def register_completer(completer: Completer) -> Completer:
    """Run ``completer`` on every tree :func:`load_config` reads, before it is checked (once per function)."""
    if completer not in _COMPLETERS:
        _COMPLETERS.append(completer)
    return completer


def coerce(value: Any, annotation: Any, where: str) -> Any:
    """Check ``value`` against a field annotation, converting int->float and nested dicts->dataclasses."""
    origin = typing.get_origin(annotation)
    if origin in (Union, types.UnionType):
        options = typing.get_args(annotation)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return coerce(value, option, where)
            except ConfigError as error:
                errors.append(str(error))
        raise ConfigError(errors[0] if errors else f"{where}: invalid value {value!r}")
    if annotation is Component and isinstance(value, str):  # model.norm: layernorm = {kind: layernorm}
        value = {"kind": value}
    if dataclasses.is_dataclass(annotation):
        if isinstance(value, annotation):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping of {annotation.__name__} fields, got {value!r}")
        return from_dict(annotation, value, where)
    if origin is list:
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        (item_type,) = typing.get_args(annotation) or (Any,)
        return [coerce(item, item_type, f"{where}[{i}]") for i, item in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        return dict(value)
    if annotation is Any:
        return value
    if annotation is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where}: expected true/false, got {value!r}")
    if annotation is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads '3e-4' (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{where}: expected a number, got {value!r}")
    if annotation is int:
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if not isinstance(value, int) or isinstance(value, bool):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        if not -INT_LIMIT <= value < INT_LIMIT:  # torch and numpy hold these as int64
            raise ConfigError(f"{where}={value:.3g} is out of range; integers must lie in [-2^63, 2^63)")
        return value
    if annotation is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{where}: expected a string, got {value!r}")
    return value


def from_dict(cls: type, values: dict[str, Any], where: str = "") -> Any:
    """An instance of dataclass ``cls`` from ``values``; unknown keys name the closest field."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    names = list(fields)
    kwargs = {}
    for key, value in values.items():
        path = f"{where}.{key}" if where else key
        if key not in names:
            raise ConfigError(f"unknown key '{path}'{closest(key, names)}; valid keys: {', '.join(names)}")
        if hints[key] is Component and isinstance(value, dict) and "kind" not in value:  # options of the default
            value = {"kind": fields[key].default_factory().kind, **value}
        kwargs[key] = coerce(value, hints[key], path)
    return cls(**kwargs)


def parse_override(text: str) -> tuple[list[str], Any]:
    """``a.b.c=value`` -> (['a','b','c'], value); the value is read as YAML (numbers, lists, true/false)."""
    if "=" not in text:
        raise ConfigError(f"override '{text}' must look like section.key=value (e.g. train.steps=50)")
    key, raw = text.split("=", 1)
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override '{text}': empty key part in '{key}'")
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError as error:
        problem = str(error).splitlines()[0]
        raise ConfigError(f"override '{text}': the value is not plain YAML ({problem}); give a number, string, "
                          "true/false or a [list]") from error
    return key.split("."), value


def set_path(tree: dict[str, Any], path: list[str], value: Any) -> None:
    """``tree[a][b][c] = value`` for ``path = [a, b, c]``, creating (or replacing non-mapping) parents; a component
    named by its kind alone (``norm: layernorm``) keeps it (``model.norm.options.eps=1e-6`` sets an option of it)."""
    node = tree
    for part in path[:-1]:
        child = node.get(part)
        if isinstance(child, str) and path[-1] != "kind":
            child = {"kind": child}
            node[part] = child
        if not isinstance(child, dict):
            child = {}
            node[part] = child
        node = child
    current = node.get(path[-1])
    if isinstance(current, dict) and ("kind" in current or "options" in current) and isinstance(value, str):
        node[path[-1]] = {**current, "kind": value}  # a component's kind set after its options: they stay
    else:
        node[path[-1]] = value


def read_config(path: str | Path | None = None, overrides: typing.Sequence[str] = ()) -> Config:
    """Read a YAML config (or the built-in default when ``path`` is None), apply overrides and the registered
    completers; checks values only (:func:`check_values`). :func:`load_config` adds the registered checks."""
    tree: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file '{path}' does not exist")
        try:
            loaded = yaml.safe_load(path.read_text())
        except yaml.YAMLError as error:
            raise ConfigError(f"config file '{path}' is not valid YAML: {error}") from error
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file '{path}' must hold a mapping of sections, got {type(loaded).__name__}")
        tree = loaded
    for text in overrides:
        keys, value = parse_override(text)
        set_path(tree, keys, value)
    for completer in _COMPLETERS:
        tree = completer(tree)
    return config_from_tree(tree)


def load_config(path: str | Path | None = None, overrides: typing.Sequence[str] = ()) -> Config:
    """Read a YAML config (or the built-in default when ``path`` is None), apply overrides, validate."""
    config = read_config(path, overrides)
    validate(config)
    return config


def load_config_from_cli(config: str | None, overrides: typing.Sequence[str]) -> Config:
    """CLI form: ``[CONFIG] [overrides...]`` where a first argument containing '=' is an override."""
    return load_config(*split_cli_arguments(config, overrides))


def config_from_dict(tree: dict[str, Any]) -> Config:
    """A validated :class:`Config` from nested mappings (e.g. the config a checkpoint saved)."""
    config = config_from_tree(tree)
    validate(config)
    return config


def split_cli_arguments(config: str | None, overrides: typing.Sequence[str]) -> tuple[str | None, list[str]]:
    """CLI form ``[CONFIG] [overrides...]``: a first argument containing '=' (and naming no file) is an override."""
    overrides = list(overrides)
    if config is not None and "=" in config and not Path(config).is_file():
        overrides.insert(0, config)
        config = None
    return config, overrides


def config_to_yaml(config: Config) -> str:
    """Every field of ``config`` as YAML, sections in declaration order: :func:`read_config` reads it back to an
    equal config (``xscale train --print-config``)."""
    return yaml.safe_dump(config.to_dict(), sort_keys=False, default_flow_style=False)


# Keys of earlier releases, read for one more release as what replaced them (the saved configs of older checkpoints,
# older YAML files), with one line saying so: old dotted key -> (new key under the same section, the component kind
# it belongs to or None for any).
DEPRECATED_KEYS = {
    "model.rope_theta": ("position.options.theta", "rope"),
    "model.norm_eps": ("norm.options.eps", None),
    "data.options": ("dataset.options", None),  # the whole mapping
    "model.act_threshold": ("stack.options.threshold", "act"),
    "model.ponder_cost": ("stack.options.ponder_cost", "act"),
    "model.funnel_decoder_layers": ("stack.options.decoder_layers", "funnel"),
    "model.exit_entropy": ("stack.options.entropy", "early_exit"),
    "model.exit_patience": ("stack.options.patience", "early_exit"),
}
# Switches of earlier releases that chose a component's kind: old dotted key -> (the component under the same
# section, the kind a set value chooses, the option that takes the value itself or None). A false or empty value
# chose nothing.
DEPRECATED_SWITCHES = {
    "model.reversible": ("stack", "reversible", None),
    "model.act": ("stack", "act", None),
    "model.funnel": ("stack", "funnel", "groups"),
    "model.early_exit": ("stack", "early_exit", None),
}
# Options of earlier releases that moved to another section's component: old dotted key -> new dotted key.
DEPRECATED_MOVES = {f"data.dataset.options.{name}": f"train.objective.options.{name}" for name in (
    "mask_probability", "noise_density", "mean_span_length", "mask_ratio", "poisson_lambda", "geometric_p",
    "max_span_words")}
DEFAULT_KINDS = {"position": "rope", "norm": "rmsnorm", "dataset": "stdlib_text", "stack": "plain", "objective": "auto"}
_ANNOUNCED: set[str] = set()


def _announce(old: str, use: str) -> None:
    if old not in _ANNOUNCED:
        _ANNOUNCED.add(old)
        print(f"xscale: {old} is deprecated and will be removed in the next release; read as {use}", file=sys.stderr)


def _upgrade_switches(tree: dict[str, Any]) -> None:
    """Move the :data:`DEPRECATED_SWITCHES` that ``tree`` sets to the kinds they chose (two set: refused)."""
    chosen: dict[str, str] = {}
    for old, (component, kind, option) in DEPRECATED_SWITCHES.items():
        section, key = old.split(".")
        branch = tree.get(section)
        if not isinstance(branch, dict) or key not in branch:
            continue
        branch = tree[section] = dict(branch)
        value = branch.pop(key)
        if not value:
            _announce(old, f"nothing ({old}={value!r} chose no {component})")
            continue
        if component in chosen:
            raise ConfigError(f"{chosen[component]} and {old} each choose {section}.{component}; keep one "
                              f"({section}.{component}.kind={kind} or another)")
        chosen[component] = old
        current = branch.get(component, DEFAULT_KINDS[component])
        current = {"kind": current} if isinstance(current, str) else dict(current)
        if current.get("kind", kind) not in (kind, DEFAULT_KINDS[component]):
            raise ConfigError(f"{old}={value} chooses {section}.{component}.kind={kind} but {section}.{component}."
                              f"kind={current['kind']} is set; keep {section}.{component} alone")
        options = dict(current.get("options") or {})
        if option is not None:
            options.setdefault(option, value)
        branch[component] = {**current, "kind": kind, "options": options}
        setting = f"{section}.{component}.kind={kind}"
        _announce(old, setting if option is None else f"{setting} with {section}.{component}.options.{option}")


def _component(branch: dict[str, Any], name: str) -> dict[str, Any]:
    """``branch[name]`` as a ``{kind, options}`` mapping (a bare kind, or the default kind when absent)."""
    current = branch.get(name, DEFAULT_KINDS[name])
    return {"kind": current} if isinstance(current, str) else dict(current)


def _move_options(tree: dict[str, Any]) -> None:
    """Move the :data:`DEPRECATED_MOVES` that ``tree`` sets to their new components (an option set at the new key
    too wins)."""
    for old, new in DEPRECATED_MOVES.items():
        section, name, _, key = old.split(".")
        branch = tree.get(section)
        current = branch.get(name) if isinstance(branch, dict) else None
        if not isinstance(current, dict) or not isinstance(current.get("options"), dict) \
                or key not in current["options"]:
            continue
        options = dict(current["options"])
        value = options.pop(key)
        tree[section] = {**branch, name: {**current, "options": options}}
        new_section, new_name, _, new_key = new.split(".")
        target_branch = dict(tree[new_section]) if isinstance(tree.get(new_section), dict) else {}
        target = _component(target_branch, new_name)
        target["options"] = {new_key: value, **(target.get("options") or {})}
        tree[new_section] = {**target_branch, new_name: target}
        _announce(old, new)


def upgrade_tree(tree: dict[str, Any]) -> dict[str, Any]:
    """``tree`` with the keys of :data:`DEPRECATED_KEYS` moved to their new places (printing one line per key, once
    per process); an old key whose component is not the one set (``rope_theta`` without rope) is dropped, as it was
    ignored then). The switches of :data:`DEPRECATED_SWITCHES` are read first, so the options they choose a kind for
    follow them, the options :data:`DEPRECATED_MOVES` moves to other sections last."""
    _upgrade_switches(tree)
    for old, (new, kind) in DEPRECATED_KEYS.items():
        section, key = old.split(".")
        branch = tree.get(section)
        if not isinstance(branch, dict) or key not in branch:
            continue
        branch = tree[section] = dict(branch)
        value = branch.pop(key)
        component, *rest = new.split(".")
        current = branch.get(component, DEFAULT_KINDS[component])
        current = {"kind": current} if isinstance(current, str) else dict(current)
        applies = kind is None or current.get("kind", DEFAULT_KINDS[component]) == kind
        if applies:
            options = dict(current.get("options") or {})
            if rest == ["options"]:  # a whole mapping of options: the new key's own win
                options = {**(value if isinstance(value, dict) else {}), **options}
            else:
                options.setdefault(rest[-1], value)
            branch[component] = {**current, "options": options}
        _announce(old, f"{section}.{new}" if applies
                  else f"nothing ({section}.{component} is not {kind}: it was ignored)")
    _move_options(tree)
    return tree


def config_from_tree(tree: dict[str, Any]) -> Config:
    """A :class:`Config` from nested mappings (a checkpoint's saved config, a parsed YAML), values checked."""
    config = from_dict(Config, upgrade_tree(tree))
    check_values(config)
    return config
