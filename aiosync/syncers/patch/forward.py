"""A patch for a :class:`~aiosync.syncers.base.RemoteTarget` (an engine that decodes and writes
in place): checked without the weights, handed over as it was received.

The receiver holds no values to decode a patch against (a patch codes the new values against
the receiver's old ones), so it checks what it can without them — the kind of payload, its
version, the base version it was built on, the handshake it belongs to — and the target's
side decodes and validates the rest before anything is written
(:mod:`aiosync.engines.inplace`). :func:`handshake_of` is the handshake state the target needs
to decode the patches of a chain.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ...messages import payload_nbytes
from ..common.payloads import Stamped
from .receiver import ReceiverState, check_header, unstamp


@dataclass(frozen=True)
class ForwardedPatch:
    """A patch checked for a remote target: ``payload`` is the patch itself (a shared patch's
    session set to this receiver's), ``changed`` the elements it changes (from its header)."""

    version: int
    payload: Any
    nbytes: int
    changed: int


def forward_patch(payload: Any, state: ReceiverState, version_now: int | None) -> ForwardedPatch:
    """Check a received patch's header against the receiver (kind, version, base version,
    session); :class:`~aiosync.errors.PayloadError` (or the subclass naming it) otherwise."""
    patch, session = unstamp(payload, state.session)
    version = check_header(patch, version_now, session)
    if isinstance(payload, Stamped) and state.session is not None and getattr(patch, "session", None) != state.session:
        patch = dataclasses.replace(patch, session=state.session)  # shares the tensors
    return ForwardedPatch(version, patch, payload_nbytes(patch), int(getattr(patch, "nnz", 0)))


def handshake_of(state: ReceiverState) -> dict:
    """The handshake as a remote target takes it (:attr:`~aiosync.syncers.base.RemoteWrite.handshake`)."""
    return {"keys": list(state.keys), "synced": sorted(state.layouts), "session": state.session}
