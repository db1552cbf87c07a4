"""The library's own exceptions.

Every error aiosync raises on bad input derives from :class:`AiosyncError`, and most also
derive from the builtin a caller would expect (``ValueError`` for bad values, ``TimeoutError``
for a peer that does not answer), so ``except ValueError`` keeps working.
"""

from __future__ import annotations


class AiosyncError(Exception):
    """Base class of every error raised by aiosync."""


class ConfigError(AiosyncError, ValueError):
    """A configuration value, key or combination is invalid."""


class HandshakeError(AiosyncError, ValueError):
    """Sender and receiver disagree on keys, shapes or dtypes."""


class PayloadError(AiosyncError, ValueError):
    """A received payload is malformed, truncated or of the wrong kind."""


class MessageError(PayloadError):
    """A received message could not be rebuilt, but its framing was intact: the channel goes on
    and only this message is refused. ``message_type`` is the class its header names (``None``:
    unknown); ``version`` and ``conv`` are its integer fields of those names, when it had them,
    so the receiver can answer for it."""

    def __init__(self, message: str, *, message_type: str | None = None, version: int | None = None,
                 conv: int | None = None):
        super().__init__(message)
        self.message_type = message_type
        self.version = version
        self.conv = conv


class PatchChainError(PayloadError):
    """A patch was built on a base version the receiver does not hold."""

    def __init__(self, message: str, *, expected_base: int | None, receiver_version: int | None):
        super().__init__(message)
        self.expected_base = expected_base
        self.receiver_version = receiver_version


class ChecksumError(PayloadError):
    """Weights written from a payload do not match the checksums the sender computed: the
    payload was corrupted on the way or the receiver's weights had drifted. What was written
    has been rolled back."""


class VersionError(AiosyncError, ValueError):
    """A version did not strictly increase."""


class CodecUnavailableError(AiosyncError, RuntimeError):
    """A compression codec cannot run here (missing package or device)."""


class PeerTimeoutError(AiosyncError, TimeoutError):
    """A peer did not answer within the configured timeout."""


class ClosedResourceError(AiosyncError):
    """The channel or slot was closed by this side."""


class EndOfStream(AiosyncError):
    """The other side closed the channel; nothing more will arrive."""


class WouldBlock(AiosyncError):
    """A ``*_nowait`` call could not complete without waiting."""


class ApplyError(AiosyncError, RuntimeError):
    """Applying received weights failed; the previous weights and version were kept."""


class StateTransitionError(AiosyncError, RuntimeError):
    """A trainer or explorer was asked to move between states the protocol does not allow."""


class TransportError(AiosyncError, ConnectionError):
    """A transport failed to deliver a payload (a broken link, or a failure injected on purpose)."""


class ExplorerLostError(TransportError):
    """The synchronizer declared this explorer lost (it went silent past ``liveness_timeout``,
    or its wire broke) and ended its session: the explorer's calls fail from now on. ``reason``
    says why it was lost. Attach it again under the same name (``Synchronizer.attach_explorer``,
    or a new ``Explorer`` in its process) to start from the newest version."""

    def __init__(self, message: str, *, reason: str = ""):
        super().__init__(message)
        self.reason = reason


class TrainerRankLostError(TransportError):
    """A rank of a sharded trainer is gone (its process died, its node was lost, or its channel
    to the synchronizer's rank broke): a sharded trainer cannot go on without any of its ranks,
    so the run ends with this error, naming ``rank``, instead of waiting on it. Restart the
    trainer's ranks together (from their last checkpoint); the explorers keep their weights."""

    def __init__(self, message: str, *, rank: int | None = None):
        super().__init__(message)
        self.rank = rank  # kept when pickled (e.g. a Ray actor's error): Exception pickles __dict__


class AuthenticationError(AiosyncError, PermissionError):
    """A request or answer was refused because it does not carry a valid signature of the key
    both sides share (none, a wrong key, an altered message, or a replay: ``reason`` says which,
    one of ``"unsigned"``, ``"no_key"``, ``"bad_signature"``, ``"other_server"``,
    ``"replayed"``). Nothing it asked for was done."""

    def __init__(self, message: str, *, reason: str):
        super().__init__(message)
        self.reason = reason


class DriftError(PayloadError):
    """The receiver's old values at a patch's changed positions are not the ones the sender
    built the patch on (they were written behind aiosync's back, or a delivery was lost):
    refused before anything was written; the link re-bootstraps the receiver."""


class StateMismatchError(AiosyncError, RuntimeError):
    """Whole-state verification: an explorer that reports a version does not hold exactly the
    trainer's weights of it. ``tensors`` names the keys that differ; the link re-bootstraps the
    explorer (a repair), and the drain raises :class:`DrainError` for one it cannot repair."""

    def __init__(self, message: str, *, tensors: list[str], version: int | None):
        super().__init__(message)
        self.tensors = tensors
        self.version = version


class DrainError(AiosyncError, RuntimeError):
    """Leaving a :class:`aiosync.Synchronizer` could not bring every explorer to the trainer's
    last published version. ``explorers`` maps each explorer that was not served to the
    version it holds (``None``: none)."""

    def __init__(self, message: str, *, explorers: dict[str, int | None], target: int | None):
        super().__init__(message)
        self.explorers = explorers
        self.target = target


class CheckpointHeldError(AiosyncError, RuntimeError):
    """A checkpoint directory is held by another run (a second trainer on it, or the directory
    was taken over or replaced under this one): nothing was written. ``holder`` describes the
    run that holds it (run id, host, process, last publish), when one does."""

    def __init__(self, message: str, *, directory: str, holder: dict | None = None):
        super().__init__(message)
        self.directory = directory
        self.holder = holder


class CheckpointWriteError(AiosyncError, OSError):
    """Writing a checkpoint file failed (a full disk: ``ENOSPC``; a file size limit: ``EFBIG``;
    ...). Nothing was published and nothing is left behind. ``errno`` is the OS error's;
    ``directory`` and ``version`` say what was being written."""

    def __init__(self, message: str, *, errno: int | None, directory: str, version: int):
        super().__init__(errno, message)
        self.directory = directory
        self.version = version
