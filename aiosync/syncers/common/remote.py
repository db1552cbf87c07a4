"""Whole tensors for a :class:`~aiosync.syncers.base.RemoteTarget`: :class:`RemoteTensors`.

A receiver whose model is a remote target (an engine that decodes and writes in place) cannot
plan a write against the model — it holds no values, only the layout. Where a
:class:`~aiosync.syncers.common.staging.FullStateWrite` compares each received tensor with
the model and keeps the changes, :class:`RemoteTensors` keeps the received tensors as they
are (validated by the bucket reader before), bucket by bucket, for the
:class:`~aiosync.syncers.base.RemoteWrite` that hands them over. :func:`tensor_plan` picks
the one a target needs.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..base import RemoteTarget
from .staging import FullStateWrite, held_bytes


class RemoteTensors:
    """Validated whole tensors kept for a remote target, in the order they arrived (the
    interface of :class:`FullStateWrite` that staging uses: ``add``, ``changed``, ``nbytes``,
    ``written_keys``)."""

    def __init__(self) -> None:
        self.buckets: list[dict[str, torch.Tensor]] = []

    def __len__(self) -> int:
        return sum(len(b) for b in self.buckets)

    def add(self, target: Mapping[str, torch.Tensor], tensors: Mapping[str, torch.Tensor]) -> None:
        """Keep ``tensors`` (already validated against ``target``'s layout; nothing is read)."""
        if tensors:
            self.buckets.append(dict(tensors))

    @property
    def changed(self) -> int:
        """Elements the write brings (every element of every tensor: nothing is compared)."""
        return sum(t.numel() for b in self.buckets for t in b.values())

    @property
    def nbytes(self) -> int:
        return held_bytes(self.buckets)

    def take(self) -> list:
        """Hand over the kept tensors (to be released off the event loop; see ``written``)."""
        buckets, self.buckets = self.buckets, []
        return buckets

    @property
    def written_keys(self) -> list[str]:
        return list(dict.fromkeys(k for b in self.buckets for k in b))


def tensor_plan(target: Mapping[str, torch.Tensor]) -> FullStateWrite | RemoteTensors:
    """What staging keeps of received whole tensors for ``target``: a plan of its changes, or,
    for a remote target, the tensors themselves."""
    return RemoteTensors() if isinstance(target, RemoteTarget) else FullStateWrite()
