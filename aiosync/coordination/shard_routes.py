"""An explorer's data lane with direct routes: the parts of a sharded trainer's ranks fetched in place of their refs.

With direct routes (:mod:`aiosync.syncers.patch.shards_direct`) the synchronizer's rank sends an
explorer :class:`~aiosync.syncers.common.payloads.ShardRef` s where other ranks' parts would be;
:class:`RoutedLane` reads the explorer's data lane and hands the applier every packet, streamed
part and init message with those parts fetched from their ranks — so the syncer and the applier
see what they would have seen with relayed routes.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ..syncers.patch.shards_direct import ShardRoutes
from ..messages import payload_nbytes
from ..transports.base import Transport
from .protocol import Packet, Part


class RoutedLane(Transport):
    """``lane`` (an explorer's data lane) with every ref resolved through ``routes``."""

    def __init__(self, lane: Transport, routes: ShardRoutes) -> None:
        self.lane, self.routes = lane, routes

    async def send(self, payload: Any) -> None:
        await self.lane.send(payload)

    async def recv(self) -> Any:
        msg = await self.lane.recv()
        if isinstance(msg, Packet) and isinstance(msg.payloads, list):
            self.routes.packet_bytes += payload_nbytes(msg.payloads)  # as it came from the synchronizer's rank
            return replace(msg, payloads=[await self.routes.resolve(p) for p in msg.payloads])
        if isinstance(msg, Part):
            return replace(msg, payload=await self.routes.resolve(msg.payload))
        return await self.routes.resolve(msg)  # an init conversation's bucket, or anything else as it is

    def statistics(self):
        return self.lane.statistics()
