"""Transports: where payloads travel. Syncers only ever see ``send`` / ``recv``.

* :mod:`.base` — the :class:`Transport` interface, :class:`TransportStatistics` and
  ``payload_nbytes`` (from :mod:`aiosync.messages`)
* :mod:`.inproc` — in-process, zero copy (T1)
* :mod:`.simulated` — latency, bandwidth, jitter, injected failures (T4); the faults
  themselves in :mod:`.faults`
* :mod:`.distributed` — torch.distributed point-to-point and broadcast, gloo or NCCL (T2);
  imported on first use of one of its names, so ``import aiosync.transports`` stays light
* :mod:`.ray` — between two Ray actors: actor calls, large tensors through the object store
  (R1); needs Ray (``pip install 'aiosync[ray]'``), imported on first use of its names

The checkpoint directory (T3) is not a transport: :mod:`aiosync.checkpoints`. Transports know
no protocol above them: nothing here imports the coordination layer or
:mod:`aiosync.syncers`.
"""

from __future__ import annotations

import importlib
from typing import Any

from .base import Transport, TransportStatistics, payload_nbytes
from .faults import FAULT_KINDS, FaultProfile
from .inproc import InProcTransport, inproc_pair
from .simulated import SimulatedTransport, simulated_pair

#: Names served lazily from :mod:`.distributed` (PEP 562).
_DISTRIBUTED = ("DistributedTransport", "WeightSyncGroup", "Frame", "encode_message", "decode_message",
                "register_message")

#: Names served lazily from :mod:`.ray`: they need Ray, so they stay out of ``__all__`` (a
#: ``from aiosync.transports import *`` works without it).
_RAY = ("RayChannel", "RayEndpoint", "RayChannelStatistics")

__all__ = ["Transport", "TransportStatistics", "payload_nbytes", "InProcTransport", "inproc_pair",
           "SimulatedTransport", "simulated_pair", "FaultProfile", "FAULT_KINDS", *_DISTRIBUTED]


def __getattr__(name: str) -> Any:
    for module, names in ((".distributed", _DISTRIBUTED), (".ray", _RAY)):
        if name in names:
            value = getattr(importlib.import_module(module, __name__), name)
            globals()[name] = value
            return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_DISTRIBUTED) | set(_RAY))
