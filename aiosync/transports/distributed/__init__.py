"""torch.distributed transport (T2): gloo on CPU, NCCL on GPU, awaited without blocking the loop.

Syncers and the synchronizer keep seeing one ``send(payload)`` / ``recv()`` pair;
:class:`DistributedTransport` carries payloads between two ranks of a process group started
by ``torchrun`` or ``torch.multiprocessing``. :class:`WeightSyncGroup` makes the groups it
rides on and :meth:`WeightSyncGroup.broadcast` fans one payload out to every rank at once.

* :mod:`.bytestring` — one message as one byte string (an HTTP body), over the frame codec;
* :mod:`.wire` — the frame codec (prefix, JSON header, host and device bodies) and the one
  place a received prefix is validated; the wire format is documented there;
* :mod:`.ops` — waiting on posted work: gloo through a waiter thread, NCCL polled;
* :mod:`.transport` — :class:`DistributedTransport`, point to point, with its timeout and
  broken-channel semantics;
* :mod:`.group` — :class:`WeightSyncGroup`: the groups, ``transport(peer)``, ``broadcast``;
* :mod:`.multicast` — :class:`Multicast`: one version to several peers, shared bodies broadcast
  once over a group of the ranks involved (the fan-out's rounds).

Only *registered* dataclasses travel (:func:`aiosync.messages.message`; ``register_message``
is the same decorator under the name earlier releases exported). This package knows no
protocol above it: it imports nothing from the coordination layer or the syncers.
"""

from ...messages import register_message
from .group import WeightSyncGroup
from .multicast import Multicast, MulticastStatistics
from .transport import DEFAULT_TAG, DistributedTransport, DistributedTransportStatistics
from .wire import MAGIC, MAX_HEADER_BYTES, Frame, Prefix, decode_message, encode_message

__all__ = ["DistributedTransport", "DistributedTransportStatistics", "WeightSyncGroup", "Multicast",
           "MulticastStatistics", "Frame", "Prefix",
           "encode_message", "decode_message", "register_message", "MAGIC", "MAX_HEADER_BYTES", "DEFAULT_TAG"]
