"""The explorer protocol: every message between a synchronizer's per-explorer session and an
explorer, whether the explorer lives in the trainer's process or in another one.

One wire (a :class:`~aiosync.transports.Transport`) carries two kinds of messages, split by
:class:`aiosync.coordination.mux.Mux`:

* the **delivery line** (:class:`Packet`, :class:`Part`, :class:`Credit`, :class:`Reinit`,
  :class:`Abort`, :class:`Ack`, and the syncers' own init conversation in between): one
  version's payloads, applied as a unit; :class:`Verify` / :class:`Verified`: whole-state
  verification after a delivery;
* **control** messages (subclasses of :class:`Control`): joining, requests, notices, liveness,
  leaving.

A session, from the explorer's side::

    explorer                                   synchronizer (session)
    Hello(name, version)            ──▶
                                    ◀──        Welcome(config, weight_syncer, versions)
                                    ◀──        Reinit / init conversation / Packet   (first sync)
    Ack                             ──▶
                                    ◀──        Verify(version, digests)   (after a bootstrap; on schedule)
    Verified(mismatched)            ──▶
                                    ◀──        Attached(version)
    SyncRequest(id)                 ──▶        (a request for the newest weights)
                                    ◀──        Served(id, outcome, version)
                                    ◀──        Notice(published | window_open | window_closed | trainer_stopped)
    Heartbeat                       ──▶        (while the explorer's loop shows signs of life)
    Stopped | Leave                 ──▶
                                    ◀──        Close(version)      after the final drain, on Leave, or when lost
    Close                           ──▶        (the answer: both readers end, the wire is free again)

Every class is a registered message type (:func:`aiosync.messages.message`): only these and the
syncers' payloads are rebuilt by a receiving process.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..errors import PayloadError
from ..messages import message

#: Version of this protocol; a Hello of another version is refused. 3: streamed packets
#: (:class:`Part`, :class:`Credit`), shared payloads with the session beside them. 4:
#: whole-state verification (:class:`Verify`, :class:`Verified`, ``Hello.dtypes``), the
#: handshake's ``shares`` and the bucket manifest's ``__aiosync__.shares``. 5: the closing
#: synchronizer's last :class:`Close` (reason :data:`UNSERVED`, not answered: an explorer of 4
#: would answer it on a wire nobody reads), :class:`ShardServe` between a sharded trainer's ranks. 6:
#: ``SyncRequest.lost`` (the explorer's model lost its weights outside aiosync: bootstrap it).
PROTOCOL = 6

_INT64 = 1 << 63
#: What each field kind accepts (a received message is rebuilt through ``__init__``, so a peer's
#: field of the wrong type or out of range is refused as it is parsed, before anyone uses it).
_KINDS: dict[str, tuple[str, Any]] = {
    "v": ("a version (an int in [0, 2**63))", lambda x: type(x) is int and 0 <= x < _INT64),
    "i": ("an int64", lambda x: type(x) is int and -_INT64 <= x < _INT64),
    "b": ("true or false", lambda x: type(x) is bool),
    "s": ("a string", lambda x: type(x) is str),
    "n": ("a non-empty name of at most 256 characters", lambda x: type(x) is str and 0 < len(x) <= 256),
    "f": ("a finite number >= 0", lambda x: type(x) in (int, float) and math.isfinite(x) and x >= 0),
    "l": ("a list", lambda x: type(x) is list),
    "d": ("a mapping", lambda x: type(x) is dict),
}


def _fields(**kinds: str):
    """Give a message class a ``__post_init__`` that checks each named field's kind (``?``: or None)."""

    def check(self) -> None:
        for name, kind in kinds.items():
            value = getattr(self, name)
            if value is None and kind.endswith("?"):
                continue
            what, ok = _KINDS[kind.rstrip("?")]
            if not ok(value):
                raise PayloadError(f"{type(self).__name__}.{name} must be {what}"
                                   f"{' or null' if kind.endswith('?') else ''}, got {type(value).__name__} "
                                   f"{str(value)[:40]!r}")

    def wrap(cls):
        cls.__post_init__ = check
        return cls

    return wrap


# ----------------------------------------------------------------------------- delivery line

@message
@dataclass(eq=False)
@_fields(version="v", payloads="l")
class Packet:
    """All payloads of one sync of ``version``, applied as one unit. A *streamed* packet
    (``parts``: how many) carries none itself: they follow one by one as :class:`Part` s, the
    next only once the explorer's :class:`Credit` says it is done with the one before (so it
    holds about one payload at a time); the version is still applied as one unit."""

    version: int
    payloads: list
    parts: int | None = None


@message
@dataclass(eq=False)
class Part:
    """Payload ``index`` of streamed packet ``version``."""

    version: int
    index: int
    payload: object


@message
@dataclass(eq=False)
class Credit:
    """Explorer → session: done with part ``index`` of packet ``version``: send the next."""

    version: int
    index: int


@message
@dataclass(eq=False)
@_fields(version="v", bootstrap="b", conv="i")
class Reinit:
    """Start of a (re)bootstrap to ``version``: the syncers' init conversation follows, then a
    :class:`Packet`. ``bootstrap``: the init sends the whole state (a repair). ``conv`` numbers
    init conversations per session; answers echo it, so a late answer to an abandoned
    conversation is never taken for the answer to this one."""

    version: int
    bootstrap: bool
    conv: int = 0


@message
@dataclass(eq=False)
@_fields(version="v", reason="s", conv="i")
class Abort:
    """The session gave up the (re)bootstrap of ``version`` it started (conversation ``conv``)."""

    version: int
    reason: str
    conv: int = 0


@message
@dataclass(eq=False)
@_fields(version="v", applied="v?", error="s?", apply_s="f", conv="i?", stage_s="f", write_s="f", lease_wait_s="f")
class Ack:
    """The explorer's answer to a Packet (``conv`` None) or a Reinit (``conv`` its id).

    ``applied`` is the version the explorer's model holds afterwards; ``error`` says why the
    delivery was refused or failed (the explorer kept ``applied``). ``stage_s``: receiving and
    validating, outside the exclusive section; ``write_s``: the exclusive write;
    ``lease_wait_s``: how long the write waited for rollouts to release the model.
    """

    version: int
    applied: int | None
    error: str | None = None
    apply_s: float = 0.0
    conv: int | None = None
    stage_s: float = 0.0
    write_s: float = 0.0
    lease_wait_s: float = 0.0


@message
@dataclass(eq=False)
@_fields(version="v", digests="d", id="i")
class Verify:
    """Session → explorer, after a delivery of ``version`` (or at the drain): whole-state
    verification. ``digests``: the explorer's key → the digest its tensor must have if it holds
    exactly the trainer's ``version`` (:func:`aiosync.syncers.common.integrity.state_digest`,
    in the explorer's dtype). Answered by :class:`Verified` with the same ``id``."""

    version: int
    digests: dict
    id: int = 0


@message
@dataclass(eq=False)
@_fields(id="i", version="v", applied="v?", mismatched="l", error="s?", digest_s="f")
class Verified:
    """Explorer → session: the answer to :class:`Verify` ``id``. ``mismatched``: the keys whose
    tensors do not hold the trainer's values (empty: the whole state matched); ``error``: why
    nothing was checked (the explorer holds another version, ``applied``). ``digest_s``: the
    seconds the explorer spent digesting its state."""

    id: int
    version: int
    applied: int | None
    mismatched: list
    error: str | None = None
    digest_s: float = 0.0


# ----------------------------------------------------------------------------- control

@dataclass(eq=False)
class Control:
    """Base of the control messages (everything else on the wire belongs to the delivery line)."""


@message
@dataclass(eq=False)
@_fields(name="n", version="v?", protocol="i", dtypes="d?")
class Hello(Control):
    """Explorer → session: join as ``name``; ``version`` is what its model holds (or None);
    ``dtypes``: its model's key → dtype name (what whole-state verification digests)."""

    name: str
    version: int | None = None
    protocol: int = PROTOCOL
    dtypes: dict | None = None


@message
@dataclass(eq=False)
@_fields(config="d", weight_syncer="d?", trainer_version="v?", published="v?", trainer_stopped="b")
class Welcome(Control):
    """Session → explorer: accepted; the synchronizer's config, the weight syncer config (None:
    a syncer factory, which the explorer must be given itself) and where the trainer is."""

    config: dict
    weight_syncer: dict | None
    trainer_version: int
    published: int | None
    trainer_stopped: bool = False


@message
@dataclass(eq=False)
@_fields(reason="s")
class Refused(Control):
    """Session → explorer: not accepted (name taken, protocol mismatch, first sync failed)."""

    reason: str


@message
@dataclass(eq=False)
@_fields(version="v?")
class Attached(Control):
    """Session → explorer: the first (blocking) sync was applied; ``version`` is held."""

    version: int | None


@message
@dataclass(eq=False)
@_fields(id="i", lost="s?")
class SyncRequest(Control):
    """Explorer → session: ask for the newest weights (``Explorer.sync_weight``). ``lost``:
    why the explorer's model no longer holds any version it was given (a server that
    restarted): the session then counts it as holding none, and the delivery bootstraps it."""

    id: int
    lost: str | None = None


@message
@dataclass(eq=False)
@_fields(id="i", outcome="s", version="v?")
class Served(Control):
    """Session → explorer: request ``id`` was served with ``outcome`` (``delivered``,
    ``up_to_date``, ``timeout``, ``failed``, ``trainer_stopped``, ``closed``); ``version`` is
    the version the explorer reported as applied."""

    id: int
    outcome: str
    version: int | None


@message
@dataclass(eq=False)
@_fields(event="s", version="v?")
class Notice(Control):
    """Session → explorer: ``published`` (a new version), ``window_open`` / ``window_closed``
    (an NCCL handshake), ``trainer_stopped``; ``delivering`` / ``settled`` (a delivery to this
    explorer is due or under way / none is: its ``wait_applied`` waits for ``settled``)."""

    event: str
    version: int | None


@message
@dataclass(eq=False)
@_fields(step="i")
class Heartbeat(Control):
    """Explorer → session: the explorer's loop showed signs of life (a call into the explorer
    API, or a lease held) since the last heartbeat."""

    step: int = 0


@message
@dataclass(eq=False)
@_fields(step="i")
class Stopped(Control):
    """Explorer → session: the explorer stopped (STOPPED); deliveries may still come (drain)."""

    step: int


@message
@dataclass(eq=False)
@_fields(reason="s")
class Leave(Control):
    """Explorer → session: detach me now (no final drain)."""

    reason: str = ""


@message
@dataclass(eq=False)
@_fields(version="v?", reason="s")
class Close(Control):
    """Either way: the session ends; the receiver answers with its own Close and stops reading.
    A reason that starts with :data:`UNSERVED` is the synchronizer's last word on a wire it
    served (``serve_remote``) when it closed: nobody reads that wire any more, so it is not
    answered — an explorer that joins on it after that fails at once, saying so."""

    version: int | None = None
    reason: str = ""


#: The reason prefix of the Close a closing synchronizer leaves on each wire it served.
UNSERVED = "unserved:"


# ----------------------------------------------------------------------------- shard ranks
# Between the rank that runs the synchronizer and the other ranks of a sharded trainer
# (:mod:`aiosync.coordination.shards`); the commands themselves are the syncers'
# (:mod:`aiosync.syncers.patch.shards`).

@message
@dataclass(eq=False)
class ShardGo:
    """The synchronizer's rank finished its check point of trainer step ``step``: a shard rank
    waiting in ``step_done()`` trains on."""

    step: int


@message
@dataclass(eq=False)
class ShardServe:
    """The synchronizer's rank is at its check point of trainer step ``step`` again, outside
    ``step_done()`` (``wait_for_explorers``, an attach from the trainer's task): a rank that
    finished that step serves commands now — a synchronous trainer's weights cannot change while
    that rank is not training. :class:`ShardGo` of the same step ends it."""

    step: int


@message
@dataclass(eq=False)
class ShardClose:
    """The synchronizer closed: a shard rank stops serving."""

    reason: str = ""
