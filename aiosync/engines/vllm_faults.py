"""Engine updates that fail on purpose: the ``aiosync-faults`` weight-transfer backend
(``examples/engine_faults.py``, the engine tests; also for trying a deployment's handling of
failed updates).

It is the ``aiosync`` backend (:mod:`aiosync.engines.vllm_backend`) with one fault injected
where a plan says so. The plan is a JSON file named by the environment variable
:data:`PLAN_ENV`, read at every ``start_weight_update`` — so a test changes it between
updates, also for an engine in another process (set the variable before the engine starts):
``{"fault": name, "version": v, "bucket": i, "delay_s": s}``. Each fault that fires appends a
line to ``<plan>.fired`` (:meth:`FaultPlan.fired`), so a test can tell it really happened.

* ``load_raises`` — the model's weight loader raises when it reaches the first tensor of bucket
  ``i`` of version ``v``: the layers of the buckets before it are already processed and must be
  put back.
* ``refused_bucket`` — bucket ``i`` arrives damaged (its first tensor by name one row short): the
  backend's validation refuses it.
* ``missing_bucket`` — bucket ``i`` never arrives (dropped on arrival).
* ``late_bucket`` — bucket ``i`` arrives ``delay_s`` seconds late (set it past the client's
  timeout): the client gives up on the update before the bucket is there.
* ``write_raises`` — the in-place path (:mod:`aiosync.engines.vllm_inplace`): the commit of
  version ``v`` raises after writing tensor ``i`` of its patch (``bucket`` is ``i``): the
  values written before it must be put back.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..syncers.bucket.format import BUCKET_KEY, META_PREFIX, VERSION_KEY
from .vllm_backend import AiosyncUpdateInfo, AiosyncWeightTransferEngine, _Update

#: The environment variable naming the plan file.
PLAN_ENV = "AIOSYNC_ENGINE_FAULTS"
#: The backend name engines select to have faults injected.
BACKEND = "aiosync-faults"
FAULTS = ("load_raises", "refused_bucket", "missing_bucket", "late_bucket", "write_raises")


@dataclass(frozen=True)
class FaultPlan:
    """The plan file the ``aiosync-faults`` backend reads (the test's side)."""

    path: Path

    @classmethod
    def from_env(cls) -> "FaultPlan | None":
        path = os.environ.get(PLAN_ENV)
        return cls(Path(path)) if path else None

    def set(self, fault: str, version: int, bucket: int = 1, delay_s: float = 0.0) -> None:
        """Inject ``fault`` into bucket ``bucket`` of the update to ``version``."""
        if fault not in FAULTS:
            raise ValueError(f"unknown engine fault {fault!r}; one of {FAULTS}")
        self.path.write_text(json.dumps({"fault": fault, "version": version, "bucket": bucket, "delay_s": delay_s}))

    def clear(self) -> None:
        self.path.write_text("{}")

    def fired(self) -> list[str]:
        """One line per fault that fired: ``"<fault> version <v> bucket <i>"``."""
        fired = self.path.with_name(self.path.name + ".fired")
        return fired.read_text().splitlines() if fired.exists() else []

    def read(self) -> dict[str, Any]:
        try:
            plan = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return plan if isinstance(plan, dict) and plan.get("fault") in FAULTS else {}

    def note_fired(self, plan: dict[str, Any]) -> None:
        with open(self.path.with_name(self.path.name + ".fired"), "a") as fh:
            fh.write(f"{plan['fault']} version {plan['version']} bucket {plan['bucket']}\n")


class FaultyWeightTransferEngine(AiosyncWeightTransferEngine):
    """The ``aiosync`` backend with the fault of :class:`FaultPlan` injected."""

    _plan: dict[str, Any] = {}

    def start_weight_update(self) -> None:
        super().start_weight_update()
        source = FaultPlan.from_env()
        self._source, self._plan = source, (source.read() if source is not None else {})

    def arm_commit(self, receiver: Any, version: int | None) -> None:
        """Before an in-place commit (:func:`aiosync.engines.vllm_worker.commit_write`): read the
        plan and arm ``write_raises`` on the receiver."""
        source = FaultPlan.from_env()
        self._source, self._plan = source, (source.read() if source is not None else {})

        def fault(i: int, n: int) -> None:
            if self._fires("write_raises", version, i):
                raise RuntimeError(f"injected fault: the in-place write of version {version} failed after tensor "
                                   f"{i} of {n}")

        receiver.fault = fault

    def _fires(self, fault: str, version: Any, bucket: int) -> bool:
        plan = self._plan
        if plan.get("fault") != fault or plan.get("version") != version or plan.get("bucket") != bucket:
            return False
        self._source.note_fired(plan)
        return True

    def _payload(self, update_info: AiosyncUpdateInfo) -> dict | None:
        payload = super()._payload(update_info)
        try:
            version, (index, _) = int(payload[VERSION_KEY]), payload[BUCKET_KEY].tolist()
        except (KeyError, TypeError, ValueError, AttributeError):
            return payload
        if self._fires("missing_bucket", version, index):
            return None
        if self._fires("late_bucket", version, index):
            time.sleep(float(self._plan.get("delay_s", 0.0)))
        if self._fires("refused_bucket", version, index):
            payload = dict(payload)  # in-process buckets are the client's: damage a copy
            name = min(k for k in payload if not k.startswith(META_PREFIX))
            payload[name] = payload[name][:-1]
        return payload

    def _weights(self, update: _Update) -> Iterator[tuple[str, torch.Tensor]]:
        for i, tensors in enumerate(update.staged):
            if self._fires("load_raises", update.reader.version, i):
                raise RuntimeError(f"injected fault: the weight loader failed at bucket {i} of version "
                                   f"{update.reader.version}")
            yield from tensors.items()
