"""Dataclass configs that map one-to-one onto YAML files, with dotted command-line overrides.

A config is a tree of dataclasses whose leaves are int, float, str or bool (optionally `| None`).
`load_config(Config, "file.yaml", ["--train.lr", "3e-4"])` starts from the dataclass defaults,
applies the YAML file, then the overrides, and builds the dataclasses (so `__post_init__` checks
run on the final values). An unknown key or a value of the wrong type raises `ValueError` naming
the dotted key.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

ConfigT = TypeVar("ConfigT")


def load_config(cls: type[ConfigT], path: str | Path | None = None, overrides: list[str] = ()) -> ConfigT:
    """Defaults of `cls`, updated by the YAML file at `path`, then by `--dotted.key value` overrides."""
    values = dataclasses.asdict(cls())
    if path is not None:
        with open(path, encoding="utf-8") as f:
            from_file = yaml.safe_load(f) or {}
        if not isinstance(from_file, dict):
            raise ValueError(f"{path}: expected a mapping at the top level")
        _merge(cls, values, from_file, prefix="")
    for key, value in parse_overrides(overrides):
        _set_dotted(cls, values, key, value)
    return _build(cls, values)


def parse_overrides(args: list[str]) -> list[tuple[str, Any]]:
    """`["--a.b", "1", "--c=x"]` -> `[("a.b", 1), ("c", "x")]`, values parsed with `yaml.safe_load`."""
    pairs = []
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--"):
            raise ValueError(f"expected a --dotted.key, got {arg!r}")
        if "=" in arg:
            key, text = arg[2:].split("=", 1)
            i += 1
        else:
            if i + 1 >= len(args):
                raise ValueError(f"missing value for {arg}")
            key, text = arg[2:], args[i + 1]
            i += 2
        pairs.append((key, yaml.safe_load(text)))
    return pairs


def save_config(config: Any, path: str | Path) -> None:
    """Write a config as YAML that `load_config` reads back to an equal config."""
    Path(path).write_text(yaml.safe_dump(dataclasses.asdict(config), sort_keys=False), encoding="utf-8")


def config_differences(a: Any, b: Any, prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two configs of the same class."""
    a_values = a if isinstance(a, dict) else dataclasses.asdict(a)
    b_values = b if isinstance(b, dict) else dataclasses.asdict(b)
    keys = []
    for key in a_values.keys() | b_values.keys():
        x, y = a_values.get(key), b_values.get(key)
        if isinstance(x, dict) and isinstance(y, dict):
            keys += config_differences(x, y, prefix=f"{prefix}{key}.")
        elif x != y:
            keys.append(f"{prefix}{key}")
    return sorted(keys)


def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {field.name: hints[field.name] for field in dataclasses.fields(cls)}


def _merge(cls: type, values: dict, update: dict, prefix: str) -> None:
    types_ = _field_types(cls)
    for key, value in update.items():
        dotted = f"{prefix}{key}"
        if key not in types_:
            raise ValueError(f"unknown config key {dotted!r}")
        if dataclasses.is_dataclass(types_[key]):
            if not isinstance(value, dict):
                raise ValueError(f"config key {dotted!r} must be a mapping, got {value!r}")
            _merge(types_[key], values[key], value, prefix=f"{dotted}.")
        else:
            values[key] = _check_type(dotted, types_[key], value)


def _set_dotted(cls: type, values: dict, key: str, value: Any) -> None:
    *parents, leaf = key.split(".")
    update: dict = {leaf: value}
    for parent in reversed(parents):
        update = {parent: update}
    _merge(cls, values, update, prefix="")


def _check_type(key: str, expected: Any, value: Any) -> Any:
    allowed = typing.get_args(expected) if isinstance(expected, types.UnionType) else (expected,)
    if value is None and type(None) in allowed:
        return None
    for kind in allowed:
        if kind is bool and isinstance(value, bool):
            return value
        if kind is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if kind is float and isinstance(value, str):
            try:  # YAML 1.1 reads "3e-4" (no dot) as a string
                return float(value)
            except ValueError:
                pass
        if kind is str and isinstance(value, str):
            return value
    names = " | ".join(getattr(kind, "__name__", str(kind)) for kind in allowed)
    raise ValueError(f"config key {key!r} expects {names}, got {value!r}")


def _build(cls: type[ConfigT], values: dict) -> ConfigT:
    types_ = _field_types(cls)
    kwargs = {
        key: _build(types_[key], value) if dataclasses.is_dataclass(types_[key]) else value
        for key, value in values.items()
    }
    return cls(**kwargs)
