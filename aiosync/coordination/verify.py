"""Whole-state verification (SPEC T6): an explorer's whole state checked, end to end, against the
trainer's published version — so that a wrong state never stays silent, whatever caused it.

* **The reference.** Per published version and receiver layout, the digest of every synced
  tensor as the explorer must hold it (:func:`aiosync.syncers.common.integrity.state_digest`:
  the trainer's values, cast as the syncer casts them — to the explorer's dtype, through a
  bucket's ``bucket_dtype`` — digested where the line already reads them: inside the build, so
  with NCCL inside the trainer's window). Computed once per version and layout
  (:func:`reference_digests`; explorers of one layout share it), in a worker thread.
* **The check.** The delivery line sends :class:`~aiosync.coordination.protocol.Verify`; the
  explorer digests what it holds (a worker thread, GIL released; an engine explorer — a
  :class:`~aiosync.syncers.base.DigestTarget` — digests the engine's own parameters, in the
  engine, by ``state_digests``) and answers with the keys that
  differ (:class:`~aiosync.coordination.protocol.Verified`).
* **When.** After every bootstrap and repair, on a schedule (``synchronizer.verify_state``:
  every N versions, aligned on multiples of N so explorers at the same versions share the
  reference), and at the drain, always (:func:`verify_drained`).
* **A mismatch** is a failed delivery (:class:`~aiosync.errors.StateMismatchError` naming the
  tensors, in ``metrics()["explorers"][name]["verify"]``): the line re-bootstraps the
  explorer at once and verifies it again; the drain raises
  :class:`~aiosync.errors.DrainError` for an explorer it cannot repair.

Not verified: a sharded trainer's state (DTensors; every rank would have to digest its shard),
and explorers whose Hello did not say their dtypes.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import anyio
import torch

from ..aio import run_sync
from ..dtypes import dtype_from_name, dtype_name
from ..errors import PayloadError
from ..syncers.base import DigestTarget
from ..syncers.common.integrity import state_digests, state_digest
from ..syncers.common.state_dicts import is_dtensor, module_state_dict
from ..transports.base import Transport
from .metrics import RunningStat, Series
from .protocol import Verified, Verify
from .sources import DirectSource, Published
from .styles import SyncMethod

log = logging.getLogger("aiosync.sync")

def expected_layout(syncer_config: Any, names: list[str], dtypes: Mapping[str, str]) -> dict[str, tuple]:
    """What the explorer must hold, per its key: ``(trainer key, dtype it travels in or None,
    the explorer's dtype)``, for every synced trainer key the explorer has. Bucket mode's
    ``bucket_dtype`` and ``is_agent`` renaming are followed; other syncers write the trainer's
    values cast to the explorer's dtype."""
    bucket = getattr(syncer_config, "bucket", None) if getattr(syncer_config, "type", None) == "bucket" else None
    via = dtype_from_name(bucket.bucket_dtype) if bucket is not None and bucket.bucket_dtype else None
    keys = dict(zip(names, names))
    if bucket is not None and bucket.is_agent:
        from ..syncers.bucket.format import agent_key

        visual = any("visual" in k for k in names)
        keys = {k: agent_key(k, visual) for k in names if not k.endswith("_extra_state")}
    out = {}
    for trainer_key, key in keys.items():
        dtype = dtype_from_name(dtypes.get(key)) if isinstance(dtypes.get(key), str) else None
        if dtype is not None:
            out[key] = (trainer_key, via, dtype)
    return out


@dataclass(eq=False)
class _Reference:
    done: anyio.Event = field(default_factory=anyio.Event)
    digests: dict | None = None


#: Published version → layout fingerprint → its reference (computed once, shared by the lines).
_REFERENCES: "weakref.WeakKeyDictionary[Published, dict]" = weakref.WeakKeyDictionary()


async def reference_digests(pub: Published, expected: dict[str, tuple]) -> tuple[dict | None, float]:
    """The digests the explorer's tensors must have if it holds exactly ``pub``'s version
    (``None``: this state cannot be digested here, e.g. a sharded trainer's DTensors), and the
    seconds this call spent computing them (0 when another line had)."""
    fingerprint = tuple(sorted((k, t, str(v), str(d)) for k, (t, v, d) in expected.items()))
    table = _REFERENCES.setdefault(pub, {})
    entry = table.get(fingerprint)
    if entry is not None:
        await entry.done.wait()
        return entry.digests, 0.0
    entry = table[fingerprint] = _Reference()
    spent = 0.0
    try:
        state = pub.state
        if all(t in state and isinstance(state[t], torch.Tensor) and not is_dtensor(state[t])
               for t, _, _ in expected.values()):
            entry.digests, spent = await run_sync(_timed, _digest_expected, state, expected)
    finally:
        entry.done.set()
    return entry.digests, spent


def _timed(fn: Any, *args: Any) -> tuple[Any, float]:
    """``fn(*args)`` and the seconds it took (in the worker thread: the work, not the waits)."""
    t0 = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - t0


def _digest_expected(state: Mapping[str, torch.Tensor], expected: dict[str, tuple]) -> dict[str, int]:
    return {key: state_digest(state[t], dtype, via=via) for key, (t, via, dtype) in expected.items()}


def held_dtypes(model: Any) -> dict[str, str] | None:
    """An explorer model's key → dtype name (what its Hello tells; ``None``: not a state dict)."""
    try:
        state = module_state_dict(model)
    except TypeError:
        return None
    return {k: dtype_name(t.dtype) for k, t in state.items() if isinstance(t, torch.Tensor)}


def mismatched_keys(state: Mapping[str, torch.Tensor], digests: Mapping[str, Any]) -> list[str]:
    """The explorer's side: the keys of ``digests`` whose tensors in ``state`` do not have that
    digest (a missing key, or a digest that is not an int, counts as a mismatch). Reads only; a
    worker thread."""
    held = state_digests(state, [k for k in digests if isinstance(state.get(k), torch.Tensor)])
    return [k for k, want in digests.items() if held.get(k) != want or type(want) is not int]


async def answer_verify(msg: Verify, model: Any, held: int | None, name: str) -> Verified:
    """The explorer's answer to ``msg``: digest what ``model`` holds (version ``held``) off the
    event loop and name the tensors that differ."""
    if held != msg.version:
        return Verified(msg.id, msg.version, held, [], f"holds version {held}, not {msg.version}")
    try:
        if isinstance(model, DigestTarget):  # its weights live elsewhere: digested there
            t0 = time.perf_counter()
            held_digests = await model.state_digests([k for k in msg.digests if k in model])
            mismatched = [k for k, want in msg.digests.items() if held_digests.get(k) != want or type(want) is not int]
            spent = time.perf_counter() - t0
        else:
            mismatched, spent = await run_sync(_timed, mismatched_keys, module_state_dict(model), msg.digests)
    except Exception as exc:  # a model that cannot be read: reported, the line repairs
        return Verified(msg.id, msg.version, held, [], f"{type(exc).__name__}: {exc}")
    if mismatched:
        log.warning("aiosync: %s does not hold exactly version %d: %s differ from the trainer's", name, msg.version,
                    ", ".join(mismatched[:8]) + (" ..." if len(mismatched) > 8 else ""))
    return Verified(msg.id, msg.version, held, mismatched, None, spent)


@dataclass(frozen=True)
class VerifyStatistics:
    """Whole-state verification of one explorer (B6): ``checks`` made, ``mismatches`` found,
    ``repaired`` (mismatches a later check found gone), ``unavailable`` (versions due whose
    reference could not be computed), the last version that matched, the keys of the last
    mismatch, and the seconds spent on both sides (``reference_s``: computed by this line)."""

    every: int
    checks: int
    mismatches: int
    repaired: int
    unavailable: int
    verified_version: int | None
    last_mismatch: tuple
    reference_s: Series
    digest_s: Series


@dataclass(eq=False)
class StateCheck:
    """One delivery line's verification: its schedule, the layout it checks, its counters."""

    every: int
    expected: dict
    checks: int = 0
    mismatches: int = 0
    repaired: int = 0
    unavailable: int = 0
    #: mismatches since the last check that matched (a repair is tried at once only after the first)
    in_a_row: int = 0
    verified_version: int | None = None
    last_checked: int | None = None
    last_mismatch: tuple = ()
    reference_s: RunningStat = field(default_factory=RunningStat)
    digest_s: RunningStat = field(default_factory=RunningStat)
    _id: int = 0

    @classmethod
    def for_explorer(cls, every: int | None, syncer_config: Any, names: list[str],
                     dtypes: Any) -> "StateCheck | None":
        """The check of an explorer whose Hello said ``dtypes`` (``None``: not verified)."""
        if every is None or not isinstance(dtypes, dict):
            return None
        return cls(every, expected_layout(syncer_config, names, dtypes))

    def due(self, version: int, reinit: bool) -> bool:
        """Whether a delivery of ``version`` is verified: after every (re)bootstrap, and when it
        reaches a multiple of ``every`` the last check had not reached."""
        if reinit or self.last_checked is None:
            return True
        return self.every > 0 and version // self.every > self.last_checked // self.every

    async def reference(self, pub: Published) -> dict | None:
        digests, spent = await reference_digests(pub, self.expected)
        if spent:
            self.reference_s.add(spent)
        if digests is None:
            self.unavailable += 1
        return digests

    async def check(self, transport: Transport, version: int, reference: dict) -> list[str]:
        """Ask the explorer to verify ``version`` against ``reference``; returns the keys that
        differ (empty: it holds exactly the trainer's state). A refusal to check (the explorer
        holds another version) raises :class:`PayloadError`."""
        self._id += 1
        await transport.send(Verify(version, reference, self._id))
        while True:
            msg = await transport.recv()
            if isinstance(msg, Verified) and msg.id == self._id and msg.version == version:
                break  # anything else: a late answer of an earlier delivery; skipped
        if msg.error is not None:
            raise PayloadError(f"the explorer could not verify version {version}: {msg.error}")
        self.checks += 1
        self.last_checked = version
        self.digest_s.add(msg.digest_s)
        mismatched = [str(k) for k in msg.mismatched]
        if mismatched:
            self.mismatches += 1
            self.in_a_row += 1
            self.last_mismatch = tuple(mismatched)
            return mismatched
        if self.in_a_row:
            self.repaired += 1
        self.in_a_row, self.last_mismatch, self.verified_version = 0, (), version
        return []

    @property
    def mismatched(self) -> bool:
        """The last check found a mismatch not yet repaired."""
        return self.in_a_row > 0

    def statistics(self) -> VerifyStatistics:
        return VerifyStatistics(self.every, self.checks, self.mismatches, self.repaired, self.unavailable,
                                self.verified_version, self.last_mismatch, self.reference_s.snapshot(),
                                self.digest_s.snapshot())


def mismatch_message(name: str, version: int, keys: list[str]) -> str:
    shown = ", ".join(repr(k) for k in keys[:8]) + (f" and {len(keys) - 8} more" if len(keys) > 8 else "")
    return (f"explorer {name} reports version {version} but does not hold exactly the trainer's weights of it: "
            f"{shown} differ (written behind aiosync's back, or a fault no other check caught); it is re-bootstrapped")


class _Held:
    """The publish a drained explorer is checked against: the source's newest (with NCCL, once
    the trainer stopped, its live tensors no longer change: they hold the last version)."""

    def __init__(self, source: Any, line: Any) -> None:
        self.source, self.line, self._cm = source, line, None

    async def __aenter__(self) -> Published | None:
        if isinstance(self.source, DirectSource):
            latest = self.source.latest
            return latest if self.source.trainer_stopped and self.source.window is None else None
        self._cm = self.source.borrow(self.line, None, None)
        return await self._cm.__aenter__()

    async def __aexit__(self, *exc: Any) -> None:
        if self._cm is not None:
            await self._cm.__aexit__(*exc)


def held_publish(source: Any, line: Any) -> _Held:
    """``async with held_publish(source, line) as pub``: the newest publish, kept alive."""
    return _Held(source, line)


async def verify_drained(hub: Any, trainer: Any, timeout: float) -> None:
    """The drain's check: every open explorer that reports the last version is verified against
    it (again, if it was before); one that does not hold it exactly is repaired
    (re-bootstrapped, then verified again), at most twice. An explorer still wrong afterwards
    stays marked (:attr:`StateCheck.mismatched`): the drain's :class:`DrainError` names it."""
    lines = [s.line for s in hub.open_sessions() if s.line.state_check is not None]
    for attempt in range(3):
        wrong: list = []

        async def verify(line: Any) -> None:
            if await line.verify_held(timeout):
                wrong.append(line)

        async with anyio.create_task_group() as tg:
            for line in lines:
                tg.start_soon(verify, line)
        wrong = [line for line in wrong if not line.closed]  # one that left or was lost is not waited for
        if not wrong or attempt == 2:
            return
        if hub.config.method is SyncMethod.NCCL:
            handed = await trainer.serve_joining(wrong)  # a window on the live tensors, the last version
        else:
            handed = [(line, line.request()) for line in wrong]
        await hub.wait_served(handed, timeout)
        # a repair verifies itself (after its bootstrap): check again only those it did not clear
        latest = hub.source.latest
        lines = [line for line in wrong if line.state_check.mismatched or latest is None
                 or line.state_check.verified_version != latest.version]
