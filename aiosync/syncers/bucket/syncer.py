"""Bucket mode (W16): whole tensors, grouped into buckets of at most ``bucket_size`` bytes.

The bucket format (metadata entries, manifest, validation) lives in :mod:`aiosync.syncers.bucket.format`.
The receiver stages (F3): each bucket is validated and planned against the model (cast to
its dtypes, compared bit for bit, read only) as it arrives; the
:class:`~aiosync.syncers.base.StagedWrite` then writes only the elements that changed, with a
journal, so a sync is applied all-or-nothing. ``apply`` is staging plus writing at once.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import anyio
import torch

from ...aio import resolve_device, run_sync
from ...dtypes import dtype_from_name, dtype_name
from ...errors import AiosyncError, ApplyError, ConfigError, HandshakeError, PatchChainError, VersionError
from ...messages import RecvFn, SendFn, payload_nbytes, unshare
from ...reclaim import hand_over
from ..base import RemoteTarget, RemoteWrite, StagedWrite, SyncStatistics, WeightSyncer, recv_with_timeout
from .format import (BucketReader, agent_key, bucket_manifest, cast_for_bucket, check_no_reserved_keys, check_version,
    encode_shares, iter_named_tensor_buckets, seal_bucket)
from ..config import BucketConfig
from ..common.remote import tensor_plan
from ..common.staging import FullStateWrite, Journal, commit_write, held_bytes, written
from ..kernels.warmup import request_for
from ..common.state_dicts import module_state_dict, select_sync_names, shared_memory

_D = BucketConfig()  # the one home of the defaults (== weight_syncer/bucket_syncer.yaml)


class BucketWeightSyncer(WeightSyncer, type_name="bucket"):
    """Whole-tensor sync in buckets (W16). Simple and robust. A sync spans several payloads,
    so it cannot be applied in the background (``sync_weight_no_wait`` rejects it); staged, it
    is written all-or-nothing. Defaults are those of :class:`~aiosync.syncers.config.BucketConfig`
    (the shipped ``bucket_syncer.yaml``). With ``load_instant`` each bucket is planned as it
    arrives (the receiver holds one bucket plus the changes found so far); without it every
    bucket is held until the last one arrived."""

    supports_no_wait = False
    supports_staging = True
    fan_out_mode = "latest"
    shares_payloads = True
    #: Fault injection: called as ``hook(i, n)`` after the ``i``-th of ``n`` tensors of a staged
    #: write was written (see :mod:`aiosync.syncers.faults`).
    after_each_write: Callable[[int, int], None] | None = None

    def __init__(self, bucket_size: int = _D.bucket_size, bucket_dtype: str | torch.dtype | None = _D.bucket_dtype,
                 bucket_device: str | None = _D.bucket_device, is_agent: bool = _D.is_agent,
                 load_instant: bool = _D.load_instant, recv_timeout: float | None = _D.recv_timeout,
                 verify_checksums: bool = _D.verify_checksums, **comm: Any) -> None:
        super().__init__(**comm)
        if isinstance(bucket_dtype, torch.dtype):
            bucket_dtype = dtype_name(bucket_dtype)
        self.config = BucketConfig(bucket_size=bucket_size, bucket_dtype=bucket_dtype, bucket_device=bucket_device,
                                   is_agent=is_agent, load_instant=load_instant, recv_timeout=recv_timeout,
                                   verify_checksums=verify_checksums)
        self._dtype = dtype_from_name(bucket_dtype) if bucket_dtype is not None else None
        self._device = resolve_device(bucket_device) if bucket_device else None  # "cuda": the caller's device
        if self._device is not None and self._device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError("bucket.bucket_device is cuda but CUDA is not available; use null or cpu")
        self._names: list[str] | None = None
        self._is_sender = True
        self._last_version: int | None = None
        self.version: int | None = None
        self._generation = 0  # bumped by every commit: older staged writes are void

    @classmethod
    def from_config(cls, cfg: BucketConfig, **comm: Any) -> "BucketWeightSyncer":
        return cls(bucket_size=cfg.bucket_size, bucket_dtype=cfg.bucket_dtype, bucket_device=cfg.bucket_device,
                   is_agent=cfg.is_agent, load_instant=cfg.load_instant, recv_timeout=cfg.recv_timeout,
                   verify_checksums=cfg.verify_checksums, **comm)

    # ---------------------------------------------------------------- sender
    async def init_sender(self, state_dict, param_names_need_sync, send, recv=None, is_sender=True) -> None:
        names = select_sync_names(state_dict, param_names_need_sync)
        if self.config.is_agent:
            names = [k for k in names if not k.endswith("_extra_state")]
        check_no_reserved_keys(names)
        self._names = names
        self._is_sender = is_sender

    def _wire_names(self, names: list[str]) -> list[str]:
        if not self.config.is_agent:
            return names
        has_visual = any("visual" in k for k in names)
        return [agent_key(k, has_visual) for k in names]

    async def sync(self, state_dict: Mapping[str, torch.Tensor], send: SendFn, version: int) -> None:
        """Send every synced tensor of ``state_dict`` as buckets stamped ``version``. Every
        bucket owns its bytes (never the live state: an in-process transport hands it over by
        reference)."""
        if self._names is None:
            raise RuntimeError("call init_sender before sync")
        version = check_version(version)
        if self._last_version is not None and version <= self._last_version:
            raise VersionError(f"version {version} is not greater than the last synced version {self._last_version}")
        names = self._names
        missing = [k for k in names if k not in state_dict]
        if missing:
            raise HandshakeError(f"state dict passed to sync lacks synced key {missing[0]!r}")
        wire = dict(zip(names, self._wire_names(names)))
        buckets = list(iter_named_tensor_buckets(((k, state_dict[k]) for k in names), self.config.bucket_size, self._dtype))
        manifest = bucket_manifest(buckets or [[]], wire, self._dtype)
        shares = encode_shares([[wire[a], wire[b], *rest] for a, b, *rest in shared_memory(state_dict, names)])
        checksum = self.config.verify_checksums
        timing = {"build_s": 0.0, "send_s": 0.0, "sent": 0}

        def build(i: int, bucket: list):
            tensors = {wire[k]: cast_for_bucket(t, self._dtype, self._device) for k, t in bucket}
            if not self._is_sender:  # other FSDP ranks only take part in the gathers
                return None
            return seal_bucket(tensors, index=i, count=len(buckets), version=version,
                               manifest=manifest if i == 0 else None, checksum=checksum,
                               shares=shares if i == 0 else None)

        async def produce(tx) -> None:
            async with tx:
                for i, bucket in enumerate(buckets):
                    t0 = time.perf_counter()
                    payload = await run_sync(build, i, bucket)
                    timing["build_s"] += time.perf_counter() - t0
                    if payload is not None:
                        await tx.send(payload)

        # Pipelined: bucket i+1 is built while bucket i is on its way (and staged by the receiver).
        tx, rx = anyio.create_memory_object_stream(0)
        async with anyio.create_task_group() as tg:
            tg.start_soon(produce, tx)
            async with rx:
                async for payload in rx:
                    t1 = time.perf_counter()
                    timing["sent"] += payload_nbytes(payload)
                    box, payload = [payload], None
                    await hand_over(send, box)  # let go of off the loop once sent
                    timing["send_s"] += time.perf_counter() - t1
        if not buckets and self._is_sender:
            await send(seal_bucket({}, index=0, count=1, version=version, manifest=manifest, checksum=checksum,
                                   shares=shares))
        self._last_version = version
        self._statistics = SyncStatistics(version=version, bytes=timing["sent"],
                                          elements=sum(state_dict[k].numel() for k in names),
                                          build_s=timing["build_s"], send_s=timing["send_s"], buckets=len(buckets))

    # -------------------------------------------------------------- receiver
    async def init_receiver(self, state_dict, recv, send=None) -> None:
        check_no_reserved_keys(state_dict.keys())

    async def stage_init(self, state_dict, recv, send=None) -> None:
        """Bucket mode has no init conversation: only checks the keys (nothing is staged)."""
        check_no_reserved_keys(state_dict.keys())

    async def apply(self, model, recv: RecvFn) -> int:
        """Receive every bucket of one version and write it; return that version.

        The first bucket's manifest is validated against the whole model before anything is
        planned, each bucket is validated (and its checksum verified) on arrival, and nothing
        is written before every bucket arrived and passed: a stream that breaks off, or a
        bucket refused late, leaves the model as it was. :meth:`stage` and writing at once.
        """
        staged = await self.stage(model, recv)
        return await staged.write(model)

    async def stage(self, model, recv: RecvFn) -> StagedWrite:
        """Receive and validate every bucket of one version without writing (see
        :meth:`WeightSyncer.stage`); ``model`` is only read."""
        t0 = time.perf_counter()
        target = module_state_dict(model)
        generation = self._generation
        request_for(target.values())  # loaded in the background; the torch paths serve until then (L2)
        reader = BucketReader(target, min_version=self.version, require_checksum=self.config.verify_checksums)
        plan, held, nbytes, peak = tensor_plan(target), {}, 0, 0
        while not reader.done:
            payload = unshare(await recv_with_timeout(recv, self.config.recv_timeout, "a weight bucket"))
            tensors = await run_sync(reader.read, payload)  # validates; writes nothing
            nbytes += payload_nbytes(tensors)
            if self.config.load_instant:
                await run_sync(plan.add, target, tensors)
                peak = max(peak, held_bytes(payload) + plan.nbytes)
            else:
                held.update(tensors)
                peak = max(peak, held_bytes(held))
            del payload, tensors  # let go of the bucket before the next one comes (a stream holds one)
        if held:
            await run_sync(plan.add, target, held)
            peak = max(peak, held_bytes(held) + plan.nbytes)
            held = {}
        version, count, stage_s = reader.version, reader.count, time.perf_counter() - t0

        async def write(model, rollback: bool = True) -> int:
            return await self._write_staged(model, plan, version, rollback=rollback, generation=generation,
                                            stats=(nbytes, count, stage_s, peak))

        return StagedWrite(version, write, nbytes=nbytes, changed=plan.changed, stage_s=stage_s)

    async def _write_staged(self, model, plan: FullStateWrite, version: int, *, rollback: bool, generation: int,
                            stats: tuple) -> int:
        if generation != self._generation:
            raise PatchChainError("this staged write was staged against an earlier state of the receiver (another "
                                  "write came first); stage again. Nothing was written",
                                  expected_base=None, receiver_version=self.version)
        if self.version is not None and version <= self.version:
            raise VersionError(f"received version {version}, not newer than the applied version {self.version}")
        target = module_state_dict(model)
        t0 = time.perf_counter()
        with anyio.CancelScope(shield=True):  # a cancellation cannot split the write from its commit
            if isinstance(target, RemoteTarget):  # written where the weights live, all or nothing
                await target.write_remote(RemoteWrite(version, tensors=list(plan.buckets)))
                changed, journal = plan.changed, None
            else:
                changed, journal = await run_sync(self._write_sync, target, plan, rollback)
            await commit_write(model, plan.written_keys, version, journal)  # an engine behind the model
            undo = 0 if journal is None else journal.nbytes
            held = plan.nbytes
            self.version = version
            self._generation += 1
            await written(journal, plan)
        write_s = time.perf_counter() - t0
        nbytes, count, stage_s, peak = stats
        self._statistics = SyncStatistics(version=version, bytes=nbytes, changed=changed, buckets=count,
                                          stage_s=stage_s, write_s=write_s, apply_s=stage_s + write_s,
                                          peak_bytes=max(peak, held + undo))
        return version

    def _write_sync(self, target: Mapping[str, torch.Tensor], plan: FullStateWrite,
                    rollback: bool) -> tuple[int, Journal | None]:
        """The exclusive part (a worker thread): writes the plan, undone whole on failure.
        Returns the elements written and the journal that undoes them."""
        journal = Journal() if rollback else None
        try:
            plan.check(target)
            return plan.write(target, journal, self.after_each_write), journal
        except BaseException as exc:
            if journal is not None:
                journal.rollback()
            if isinstance(exc, AiosyncError) or not isinstance(exc, Exception):
                raise
            undone = "was rolled back" if journal is not None else "may have left part of it written (rollback=False)"
            raise ApplyError(f"writing the buckets failed and {undone}: {exc}") from exc
