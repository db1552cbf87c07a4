"""Strict construction of config dataclasses from plain mappings or OmegaConf nodes.

Unknown keys are errors naming the key and its path: a typo must never be ignored.
"""

from __future__ import annotations

import dataclasses
import sys
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
