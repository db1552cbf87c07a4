"""Whole tensors for a :class:`~aiosync.syncers.base.RemoteTarget`: :class:`RemoteTensors`.

A receiver whose model is a remote target (an engine that decodes and writes in place) cannot
plan a write against the model — it holds no values, only the layout. Where a
:class:`~aiosync.syncers.common.staging.FullStateWrite` compares each received tensor with
the model and keeps the changes, :class:`RemoteTensors` keeps the received tensors as they
are (validated by the bucket reader before), bucket by bucket, for the
:class:`~aiosync.syncers.base.RemoteWrite` that hands them over. :func:`tensor_plan` picks
the one a target needs; :class:`AssembledTensors` is a sharded trainer's bootstrap for a remote
target, each tensor assembled whole from the rows of every shard.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ...errors import PayloadError
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


class AssembledTensors(RemoteTensors):
    """A sharded trainer's bootstrap for a remote target (whose loader takes whole tensors): each
    shard's rows of a tensor copied into the whole tensor, which joins :attr:`buckets` once every
    row of it arrived (a tensor whole in one shard joins as it came). Held meanwhile: the whole
    tensors begun (what a bootstrap for a remote target holds anyway: every tensor, until the
    write), not the pieces. :meth:`rows` gives the plan of one shard's buckets (``add``)."""

    def __init__(self, target: Mapping[str, torch.Tensor]) -> None:
        super().__init__()
        self.target = target
        self._begun: dict[str, tuple[torch.Tensor, int]] = {}  # key -> (whole tensor, rows still missing)

    def rows(self, rows: Mapping[str, list | None]) -> "_ShardRows":
        return _ShardRows(self, rows)

    def add_rows(self, rows: Mapping[str, list | None], tensors: Mapping[str, torch.Tensor]) -> None:
        done = {}
        for key, t in tensors.items():
            span = rows.get(key)
            if span is None:
                done[key] = t
                continue
            whole, missing = self._begun.get(key) or (torch.empty(self.target[key].shape, dtype=t.dtype),
                                                      self.target[key].shape[0])
            whole.narrow(0, span[0], span[1]).copy_(t)
            if missing - span[1]:
                self._begun[key] = (whole, missing - span[1])
            else:
                self._begun.pop(key, None)
                done[key] = whole
        RemoteTensors.add(self, self.target, done)

    def finish(self) -> "AssembledTensors":
        """This plan, once every shard's bootstrap arrived; a :class:`~aiosync.errors.PayloadError`
        if a tensor's rows did not all come (a shard that did not bootstrap)."""
        if self._begun:
            key, (_, missing) = next(iter(self._begun.items()))
            raise PayloadError(f"the sharded bootstrap brought {self.target[key].shape[0] - missing} of the "
                               f"{self.target[key].shape[0]} rows of {key!r}; an engine written in place loads whole "
                               "tensors: every shard must bootstrap")
        return self


class _ShardRows:
    def __init__(self, plan: AssembledTensors, rows: Mapping[str, list | None]) -> None:
        self.plan, self.rows = plan, rows

    def add(self, target: Mapping[str, torch.Tensor], tensors: Mapping[str, torch.Tensor]) -> None:
        self.plan.add_rows(self.rows, tensors)


def tensor_plan(target: Mapping[str, torch.Tensor]) -> FullStateWrite | RemoteTensors:
    """What staging keeps of received whole tensors for ``target``: a plan of its changes, or,
    for a remote target, the tensors themselves."""
    return RemoteTensors() if isinstance(target, RemoteTarget) else FullStateWrite()
