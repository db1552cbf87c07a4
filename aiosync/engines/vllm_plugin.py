"""The ``vllm.general_plugins`` entry point of aiosync (see ``pyproject.toml``).

vLLM calls :func:`register` in every process it starts (the front end, engine-core and worker
processes), so an engine started with ``weight_transfer_config={"backend": "aiosync"}`` finds
the backend even in a spawned process. Registration is by module path: the backend
(:mod:`aiosync.engines.vllm_backend`) is imported only where an engine selects it.
"""

from __future__ import annotations

#: The name engines select: ``weight_transfer_config={"backend": BACKEND}``.
BACKEND = "aiosync"


def register() -> None:
    """Register the ``aiosync`` weight-transfer backend with vLLM. Safe to call more than once."""
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory

    try:
        WeightTransferEngineFactory.register_engine(BACKEND, "aiosync.engines.vllm_backend",
                                                    "AiosyncWeightTransferEngine")
    except ValueError:  # already registered: the plugin ran in this process before
        pass
