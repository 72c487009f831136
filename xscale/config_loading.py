"""A :class:`~xscale.config.Config` from YAML and dotted overrides: nested mappings coerced into the typed sections
(and back to YAML, :func:`config_to_yaml`).

An unknown key names the closest valid key; a wrong type says what was expected. Values are then checked by
:func:`xscale.config_values.check_values` (and against the registries by :mod:`xscale.validate`).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, Union

import yaml

from xscale.config import Config, ConfigError
from xscale.config_values import check_values, closest

INT_LIMIT = 2**63


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
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in values.items():
        path = f"{where}.{key}" if where else key
        if key not in names:
            raise ConfigError(f"unknown key '{path}'{closest(key, names)}; valid keys: {', '.join(names)}")
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
    """``tree[a][b][c] = value`` for ``path = [a, b, c]``, creating (or replacing non-mapping) parents."""
    node = tree
    for part in path[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = {}
            node[part] = child
        node = child
    node[path[-1]] = value


def read_config(path: str | Path | None = None, overrides: typing.Sequence[str] = (),
                complete: typing.Callable[[dict[str, Any]], dict[str, Any]] | None = None) -> Config:
    """Read a YAML config (or the built-in default when ``path`` is None) and apply overrides; checks values
    only (:func:`check_values`). :func:`xscale.validate.load_config` adds the checks against the registries.
    ``complete``: fills in what the tree implies before it is checked (the model of ``checkpoint.init_from``)."""
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
    return config_from_tree(complete(tree) if complete is not None else tree)


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


def config_from_tree(tree: dict[str, Any]) -> Config:
    """A :class:`Config` from nested mappings (a checkpoint's saved config, a parsed YAML), values checked."""
    config = from_dict(Config, tree)
    check_values(config)
    return config
