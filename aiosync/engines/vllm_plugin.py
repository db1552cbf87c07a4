"""The ``vllm.general_plugins`` entry point of aiosync (see ``pyproject.toml``).

vLLM calls :func:`register` in every process it starts (the front end, engine-core and worker
processes), so an engine started with ``weight_transfer_config={"backend": "aiosync"}`` finds
the backend even in a spawned process. Registration is by module path: the backend
(:mod:`aiosync.engines.vllm_backend`) is imported only where an engine selects it.

**Plain weights on a CPU** (opt-in): with ``AIOSYNC_VLLM_PLAIN_WEIGHTS=1`` in the environment
of the engine's processes, :func:`register` turns vLLM-CPU's oneDNN re-packing of linear layers
off in each of them (``vllm._custom_ops._supports_onednn = False``, read when the model loads),
so that the parameters stay plain tensors laid out as on a GPU and patches can be written in
them in place (``VLLMTarget(..., inplace="auto")``). It is the only way to get that for an
engine in another process (an ``AsyncLLM``, ``vllm serve``); generation is slower without
oneDNN. Without the variable nothing changes. A GPU build never re-packs: not needed there.
"""

from __future__ import annotations

import os

#: The name engines select: ``weight_transfer_config={"backend": BACKEND}``.
BACKEND = "aiosync"
#: Every backend this plugin registers: name → (module, class). ``aiosync-faults`` is the same
#: backend with faults injected on purpose (:mod:`aiosync.engines.vllm_faults`).
BACKENDS = {BACKEND: ("aiosync.engines.vllm_backend", "AiosyncWeightTransferEngine"),
            "aiosync-faults": ("aiosync.engines.vllm_faults", "FaultyWeightTransferEngine")}
#: The environment variable that keeps a CPU engine's linear weights plain (see the module docstring).
PLAIN_WEIGHTS_ENV = "AIOSYNC_VLLM_PLAIN_WEIGHTS"


def register() -> None:
    """Register aiosync's weight-transfer backends with vLLM. Safe to call more than once."""
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory

    _shield_llvmlite()
    if os.environ.get(PLAIN_WEIGHTS_ENV, "") not in ("", "0"):
        import vllm._custom_ops as ops

        ops._supports_onednn = False  # read when a linear layer is built: plain weights from here on
    for name, (module, cls) in BACKENDS.items():
        try:
            WeightTransferEngineFactory.register_engine(name, module, cls)
        except ValueError:  # already registered: the plugin ran in this process before
            pass


def _shield_llvmlite() -> None:
    """Work around a vLLM 0.32 CPU start-up crash in a process that imports numba (aiosync's
    kernels do): vLLM's CPU worker scans every module for Triton kernels to replace and reads
    ``vars(value)`` of anything that has a ``__dict__``; llvmlite's ``ffi.lib`` answers every
    attribute, ``__dict__`` included, with a C-function wrapper, and the scan fails with
    ``AttributeError: '_lib_fn_wrapper' object has no attribute 'get'``. Giving ``lib`` an empty
    ``__dict__`` entry in its function table (consulted first) makes the scan skip it; llvmlite
    never looks that name up itself. Done here, in every vLLM process, whether numba is
    imported before or after the engine starts (importing llvmlite costs ~0.1 s)."""
    try:
        from llvmlite.binding import ffi
    except ImportError:  # no numba here: nothing to shield
        return
    table = getattr(getattr(ffi, "lib", None), "_fntab", None)
    if isinstance(table, dict):
        table.setdefault("__dict__", {})
