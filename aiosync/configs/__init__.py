"""Config groups shipped with aiosync.

The folder is a Hydra config source: add ``pkg://aiosync.configs`` to
``hydra.searchpath`` and use ``- weight_syncer/patch_syncer@weight_syncer`` in a defaults
list. Without Hydra, :func:`load_config` reads a file of the group as a plain dict.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

CONFIG_DIR = Path(__file__).resolve().parent


def config_path(name: str) -> Path:
    """Path of ``<group>/<option>.yaml``, e.g. ``config_path("weight_syncer/patch_syncer")``."""
    path = CONFIG_DIR / f"{name.removesuffix('.yaml')}.yaml"
    if not path.is_file():
        options = sorted(str(p.relative_to(CONFIG_DIR).with_suffix("")) for p in CONFIG_DIR.rglob("*.yaml"))
        raise FileNotFoundError(f"no shipped config {name!r}; available: {', '.join(options)}")
    return path


def load_config(name: str) -> dict[str, Any]:
    """Load a shipped config (e.g. ``"weight_syncer/patch_syncer"``) as a plain dict."""
    from omegaconf import OmegaConf

    data = OmegaConf.to_container(OmegaConf.load(config_path(name)), resolve=True)
    assert isinstance(data, dict)
    return data
