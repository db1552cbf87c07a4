"""Transports: where payloads travel. Syncers only ever see ``send`` / ``recv``.

* :mod:`.base` — the :class:`Transport` interface and ``payload_nbytes``
* :mod:`.inproc` — in-process, zero copy (T1)
* :mod:`.simulated` — latency, bandwidth, jitter, injected failures (T4)
* :mod:`.checkpoint` — a directory of safetensors files with atomic publish (T3)
* :mod:`.distributed` — torch.distributed point-to-point and broadcast, gloo or NCCL (T2)
"""

from .base import Transport, payload_nbytes
from .checkpoint import CheckpointDir
from .distributed import (DistributedTransport, Frame, WeightSyncGroup, decode_message, encode_message,
                          gather_full_state, register_message)
from .inproc import InProcTransport, inproc_pair
from .simulated import FAULT_KINDS, FaultProfile, SimulatedTransport, simulated_pair

__all__ = ["Transport", "payload_nbytes", "InProcTransport", "inproc_pair", "SimulatedTransport", "simulated_pair",
           "CheckpointDir", "FaultProfile", "FAULT_KINDS", "DistributedTransport", "WeightSyncGroup", "register_message",
           "gather_full_state", "encode_message", "decode_message", "Frame"]
