"""The process groups aiosync talks over, and one-to-all broadcast (T2).

:class:`WeightSyncGroup` is made collectively by every rank (:meth:`WeightSyncGroup.init`): a
gloo group for frames, control messages and CPU tensors, with a long timeout so that an idle
channel never trips gloo's own, and an NCCL data group for CUDA tensors on GPUs. It hands out
point-to-point :class:`~.transport.DistributedTransport` ends (:meth:`WeightSyncGroup.transport`)
and fans one payload out to every rank (:meth:`WeightSyncGroup.broadcast`), framed and
validated exactly like a point-to-point message (:mod:`.wire`). W4's communication options
are honoured where the backend has them, and ``comm_report`` says how.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ...errors import ConfigError, PeerTimeoutError, TransportError
from .multicast import Multicast
from .ops import _Op, is_gloo
from .transport import DEFAULT_TAG, DistributedTransport
from .wire import Prefix, allocate_frame, decode_message, encode_cached

__all__ = ["WeightSyncGroup"]

log = logging.getLogger("aiosync.transport")


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


@dataclass(eq=False)
class WeightSyncGroup:
    """The process groups aiosync talks over, made collectively by every rank.

    * ``group``: gloo, for frames, control messages and CPU tensors, with a long timeout so that
      an idle channel (an explorer waiting for the next version) never trips gloo's own timeout.
    * ``data_group``: NCCL on GPUs (CUDA tensors travel device to device), else ``group``.

    Build it with :meth:`init` on every rank, in the same order as other collectives.
    """

    group: Any
    data_group: Any
    backend: str
    device: torch.device | None
    timeout: float | None
    #: How each W4 communication option was honoured, e.g. ``{"use_ring_sync": "NCCL_ALGO=Ring ..."}``.
    comm_report: dict[str, str] = field(default_factory=dict)
    #: The W4 options the NCCL data communicator was made with (``None``: the defaults).
    comm_options: Any = None
    #: This process's multicast rounds (:mod:`.multicast`): the transports of this group receive
    #: routed messages through it, and a fan-out sends one version to several of them with it.
    multicast: Multicast | None = None

    def __post_init__(self) -> None:
        if self.multicast is None:  # half the transports' bound: a round's fallback still fits a delivery's
            self.multicast = Multicast(timeout=(self.timeout if self.timeout is not None else 600.0) / 2)

    @property
    def rank(self) -> int:
        return dist.get_rank()

    @property
    def world_size(self) -> int:
        return dist.get_world_size()

    @classmethod
    def init(cls, *, backend: str = "auto", comm_options: Any = None, timeout: float | None = 600.0,
             group_timeout: timedelta = timedelta(days=1), ranks: Iterable[int] | None = None,
             init_timeout: timedelta = timedelta(seconds=300), data_timeout: timedelta | None = None
             ) -> "WeightSyncGroup":
        """Create the weight-sync groups (a collective: call it on every rank).

        Initialises the default process group from the ``torchrun`` environment first if needed
        (``MASTER_ADDR`` / ``MASTER_PORT`` / ``RANK`` / ``WORLD_SIZE``). ``backend``: ``auto``
        (NCCL data when CUDA and NCCL are available, else gloo), ``gloo`` or ``nccl``.
        ``comm_options`` (:class:`aiosync.syncers.config.CommOptions`, e.g.
        ``WeightSyncerConfig.from_any(cfg).comm_options``) is honoured where the backend has it
        (W4), for the weight-sync communicator only: NCCL gets ``max_ctas`` / ``min_ctas`` in
        its communicator config, and ``use_ring_sync`` the ring algorithm — NCCL reads that only
        from ``NCCL_ALGO`` when a communicator is made, so the communicator is made eagerly here
        with ``NCCL_ALGO=Ring`` set just for that call and restored at once: no other
        communicator of the process sees it. gloo has none of these options: they are accepted,
        have no effect, and ``comm_report`` says so. The synchronizer and explorers check that a
        channel's group was made with their syncer's options
        (:meth:`~.transport.DistributedTransport.use_comm_options`).
        ``timeout``: the per-call bound of the transports it makes.

        NCCL (issue 18): the data communicator is made eagerly and warmed up here with a barrier
        (collectively, at init, never on the event loop at the first send); its own timeout is
        ``data_timeout`` (default: ``2 × timeout``, at least 5 minutes), not the control group's
        day: NCCL work stuck on a dead peer is ended by NCCL's watchdog within that bound (what
        the process does then follows ``TORCH_NCCL_ASYNC_ERROR_HANDLING``). Gloo waits for the
        next version idly, so the control group keeps ``group_timeout``.
        """
        if not dist.is_available():
            raise TransportError("torch.distributed is not available in this torch build")
        if backend not in ("auto", "gloo", "nccl"):
            raise ConfigError(f"backend must be auto, gloo or nccl, got {backend!r}")
        if backend == "auto":
            backend = "nccl" if (torch.cuda.is_available() and dist.is_nccl_available()) else "gloo"
        if backend == "nccl" and not (torch.cuda.is_available() and dist.is_nccl_available()):
            raise ConfigError("backend nccl needs CUDA and a torch build with NCCL; use backend: gloo on CPU")
        if not dist.is_initialized():
            default = "cpu:gloo,cuda:nccl" if backend == "nccl" else "gloo"
            dist.init_process_group(default, timeout=init_timeout)
        ranks = None if ranks is None else sorted(ranks)
        report: dict[str, str] = {}
        group = dist.new_group(ranks, timeout=group_timeout, backend="gloo")
        device = None
        if backend == "nccl":
            device = torch.device("cuda", _env_int("LOCAL_RANK", 0) % max(1, torch.cuda.device_count()))
            torch.cuda.set_device(device)
            pg_options, algo = _nccl_options(comm_options, report)
            if data_timeout is None:
                data_timeout = timedelta(seconds=max(300.0, 2 * timeout)) if timeout else group_timeout
            with _scoped_env("NCCL_ALGO", algo):  # eager (device_id): NCCL reads it now, and only now
                data_group = dist.new_group(ranks, timeout=data_timeout, backend="nccl", pg_options=pg_options,
                                            device_id=device)
            if ranks is None or dist.get_rank() in ranks:  # warm: connected now, collectively
                dist.barrier(group=data_group, device_ids=[device.index])
        else:
            data_group = group
            if comm_options is not None and not getattr(comm_options, "is_default", True):
                for name in ("use_ring_sync", "nccl_max_ctas", "nccl_min_ctas"):
                    value = getattr(comm_options, name)
                    if value not in (None, False):
                        report[name] = f"accepted; no effect on gloo ({name}={value})"
                log.info("aiosync: weight-sync group on gloo: %s", "; ".join(report.values()))
        keep = comm_options if backend == "nccl" and comm_options is not None else None
        return cls(group, data_group, backend, device, timeout, report, keep)

    def transport(self, peer: int, *, timeout: float | None | str = "group", tag: int = DEFAULT_TAG
                  ) -> DistributedTransport:
        """A :class:`DistributedTransport` to ``peer`` over these groups. The peer must make the
        matching one (with this rank as its ``peer`` and the same ``tag``)."""
        t = self.timeout if timeout == "group" else timeout
        return DistributedTransport(peer, self.group, self.data_group, self.device, t, tag, self.comm_options,
                                    router=self.multicast)

    async def broadcast(self, payload: Any = None, *, src: int, timeout: float | None | str = "group") -> Any:
        """Fan one payload out from ``src`` to every rank of the group (a collective: every rank
        calls it with the same ``src``; ``payload`` matters only on ``src``). Returns the payload
        on every rank. Awaited without blocking the loop; :class:`PeerTimeoutError` after ``timeout``.

        A prefix that fails validation (:meth:`.wire.Prefix.parse`) raises
        :class:`aiosync.errors.PayloadError` on the receiving ranks before the header is
        received; the group's broadcasts are out of step after that.

        A collective needs every rank at once; the :class:`aiosync.Synchronizer` sends one encoded
        payload to each explorer point to point instead, so that a slow or dead explorer never
        holds the others back.
        """
        limit = self.timeout if timeout == "group" else timeout
        deadline = None if limit is None else time.monotonic() + limit
        me = dist.get_rank()
        frame = None
        if me == src:
            frame = await encode_cached(payload, self.device)
            meta = frame.prefix.tensor()
        else:
            meta = Prefix.buffer()

        async def bcast(tensor: torch.Tensor, group: Any, what: str) -> None:
            try:
                work = dist.broadcast(tensor, src=src, group=group, async_op=True)
            except RuntimeError as exc:
                raise TransportError(f"broadcast ({what}) failed: {exc}") from exc
            op = _Op(work, tensor, f"broadcast ({what})", threaded=is_gloo(group))
            try:
                await op.wait(deadline)
            except PeerTimeoutError:
                raise PeerTimeoutError(f"broadcast ({what}) from rank {src} timed out after {limit}s") from None
            except Exception as exc:
                raise TransportError(f"broadcast ({what}) from rank {src} failed: {exc}") from exc

        await bcast(meta, self.group, "prefix")
        if frame is not None:
            header, host, dev = frame.header_tensor(), frame.host, frame.device
        else:  # validated like a point-to-point prefix, before anything is allocated
            announced = Prefix.parse(meta, sender=f"rank {src} (broadcast)", device_body=self.device is not None)
            header, host, dev = allocate_frame(announced, None, self.device, sender=f"rank {src} (broadcast)")
        await bcast(header, self.group, "header")
        if host is not None:
            await bcast(host, self.group, "host body")
        if dev is not None:
            await bcast(dev, self.data_group, "device body")
        if me == src:
            return payload
        return decode_message(header.numpy().tobytes(), host, dev)

    def destroy(self) -> None:
        """Destroy the groups this object made (not the default group)."""
        for g in {id(self.group): self.group, id(self.data_group): self.data_group}.values():
            try:
                dist.destroy_process_group(g)
            except Exception:  # pragma: no cover - best effort at shutdown
                pass


def _nccl_options(comm_options: Any, report: dict[str, str]) -> tuple[Any, str | None]:
    """ProcessGroupNCCL options carrying W4's ``nccl_max_ctas`` / ``nccl_min_ctas``, and the
    ``NCCL_ALGO`` value ``use_ring_sync`` asks for while the communicator is made (``None``:
    leave the environment alone). Nothing here changes the environment."""
    if comm_options is None or getattr(comm_options, "is_default", True):
        return None, None
    opts = dist.ProcessGroupNCCL.Options()
    if comm_options.nccl_max_ctas is not None:
        opts.config.max_ctas = comm_options.nccl_max_ctas
        report["nccl_max_ctas"] = f"ncclConfig.maxCTAs={comm_options.nccl_max_ctas}"
    if comm_options.nccl_min_ctas is not None:
        opts.config.min_ctas = comm_options.nccl_min_ctas
        report["nccl_min_ctas"] = f"ncclConfig.minCTAs={comm_options.nccl_min_ctas}"
    algo = None
    if comm_options.use_ring_sync:
        current = os.environ.get("NCCL_ALGO")
        if current and current.lower() != "ring":
            log.warning("aiosync: use_ring_sync is set but NCCL_ALGO=%s is already set for the process; keeping it",
                        current)
            report["use_ring_sync"] = f"NCCL_ALGO already set to {current} for the process; not changed"
        else:
            algo = "Ring"
            report["use_ring_sync"] = "NCCL_ALGO=Ring while the weight-sync communicator was made (not kept)"
    return opts, algo


@contextlib.contextmanager
def _scoped_env(name: str, value: str | None) -> Iterator[None]:
    """Set environment variable ``name`` to ``value`` for the block only (``None``: untouched)."""
    if value is None:
        yield
        return
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before
