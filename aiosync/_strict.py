"""Strict construction of config dataclasses from plain mappings or OmegaConf nodes.

Unknown keys are errors naming the key and its path: a typo must never be ignored. Every
field's value is checked against its annotation (:func:`check_types`): a bool is not a number,
a number is not a string, a path is a string.
"""

from __future__ import annotations

import dataclasses
import sys
import types
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

from .errors import ConfigError

T = TypeVar("T")


def to_plain(obj: Any) -> Any:
    """Turn an OmegaConf node (or anything mapping-like) into plain dicts and lists."""
    # An OmegaConf node exists only once omegaconf is imported: a plain mapping never imports it
    # (a first import costs ~0.1 s, which must not stall an event loop that builds a Synchronizer).
    omegaconf = sys.modules.get("omegaconf")
    if omegaconf is not None and isinstance(obj, (omegaconf.DictConfig, omegaconf.ListConfig)):
        return omegaconf.OmegaConf.to_container(obj, resolve=True)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.asdict(obj)
    return obj


def from_mapping(cls: type[T], data: Any, path: str, *, hints: Mapping[str, str] | None = None) -> T:
    """Build dataclass ``cls`` from ``data``; nested dataclass fields are built recursively.

    ``hints`` maps a forbidden key to the message explaining where it belongs.
    """
    if isinstance(data, cls):
        return data
    data = to_plain(data)
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path} must be a mapping, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    types = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if hints and key in hints:
            raise ConfigError(f"{path}.{key}: {hints[key]}")
        if key not in fields:
            valid = ", ".join(sorted(fields))
            raise ConfigError(f"unknown key {path}.{key} (valid keys: {valid})")
        ftype = types[key]
        if dataclasses.is_dataclass(ftype):
            value = from_mapping(ftype, value, f"{path}.{key}")
        kwargs[key] = value
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{path}: {exc}") from exc


def check_seconds(name: str, value: Any) -> float:
    """A bound on a wait: a positive, finite number of seconds (``inf``, NaN and ``None`` are refused:
    nothing in aiosync waits forever). Returns it; :class:`ConfigError` naming ``name`` otherwise."""
    import math

    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ConfigError(f"{name} must be a positive, finite number of seconds, got {value!r} (every wait has a "
                          "bound; there is no 'wait forever': use a large finite number)")
    return value


_KINDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string", type(None): "null",
          list: "a list"}


def _accepts(kind: type, value: Any) -> bool:
    if kind is bool:
        return isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is type(None):
        return value is None
    return isinstance(value, kind)


def check_types(obj: Any, path: str, *, skip: tuple[str, ...] = ()) -> None:
    """Check every field of dataclass ``obj`` against its annotation (``bool``, ``int``,
    ``float``, ``str``, ``list[...]`` and their unions with ``None``; other annotations are
    left to the class): :class:`ConfigError` naming ``path.field``, what it must be and what
    it got. ``skip``: fields the class checks itself."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        if f.name in skip:
            continue
        hint = hints[f.name]
        args = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
        kinds = [typing.get_origin(a) or a for a in args]
        if not all(k in _KINDS for k in kinds):
            continue
        value = getattr(obj, f.name)
        if not any(_accepts(k, value) for k in kinds):
            want = " or ".join(_KINDS[k] for k in kinds)
            raise ConfigError(f"{path}.{f.name} must be {want}, got {value!r} ({type(value).__name__})")
