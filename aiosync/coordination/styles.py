"""How weights travel (:class:`SyncMethod`, S2) and when syncs happen (:class:`SyncStyle`, S3).

Scheduling rules (``interval`` = ``sync_interval``, ``offset`` = ``sync_offset``, ``last`` = the
explore step of the explorer's last *successful* sync, 0 at first)::

    style            trainer syncs after train step t        explorer syncs after explore step s
    FIXED            t % interval == 0                        s > offset and (s - offset) % interval == 0
    TRAINER_DRIVEN   t % interval == 0                        a newer version was published
    EXPLORER_DRIVEN  an explorer asked (serves at next check) s - last >= interval

What each sync waits for, and the bound it gives:

* ``FIXED``: at each of its sync points the explorer waits, at most ``sync_timeout``, for a
  version newer than the one it holds (a blocking sync: until it is applied; with
  ``sync_weight_no_wait``: until it is published, the apply runs in the background). So while
  the trainer is alive an explorer never runs more than ``offset + interval`` explore steps on
  one version (plus, with no-wait, the steps its background apply takes).
* ``EXPLORER_DRIVEN``: the explorer asks; the trainer serves the request at its next check; an
  ask that times out (``sync_timeout``) is repeated at the explorer's very next step, since the
  steps since its last successful sync still reach the interval.
* ``TRAINER_DRIVEN``: the explorer picks up the newest version at its next check; it never waits
  for the trainer.

With ``FIXED``, ``interval=10, offset=0`` syncs every 10 steps with both sides starting
together; ``interval=10, offset=5`` lets the explorer run 5 steps ahead first, then sync every
10 steps.
"""

from __future__ import annotations

import enum


class _ChoiceEnum(str, enum.Enum):
    @classmethod
    def parse(cls, value: "str | _ChoiceEnum") -> "_ChoiceEnum":
        """Accept a member, its name or its value, case-insensitively (``"memory"``, ``"MEMORY"``)."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            key = value.strip().lower()
            for member in cls:
                if key in (member.value, member.name.lower()):
                    return member
        valid = ", ".join(m.value for m in cls)
        raise ValueError(f"unknown {cls.__name__} {value!r}; valid values are: {valid}")

    def __str__(self) -> str:
        return self.value


class SyncMethod(_ChoiceEnum):
    """Where the published weights live on their way from trainer to explorers.

    * ``NCCL``: direct trainer → explorer transfer after a two-way handshake (both sides
      REQUIRE_SYNC, then both RUNNING). No intermediate copy. In one process it runs over the
      configured transport; across processes over NCCL (GPU) or gloo (CPU).
    * ``MEMORY``: the trainer copies its weights into the synchronizer's memory and stays
      RUNNING; explorers pull the newest copy.
    * ``CHECKPOINT``: the trainer writes a safetensors file (atomic publish); the synchronizer
      finds the newest file; explorers pull it.
    """

    NCCL = "nccl"
    MEMORY = "memory"
    CHECKPOINT = "checkpoint"


class SyncStyle(_ChoiceEnum):
    """Who decides when a sync happens: a fixed schedule, the explorer, or the trainer."""

    FIXED = "fixed"
    EXPLORER_DRIVEN = "explorer_driven"
    TRAINER_DRIVEN = "trainer_driven"


def trainer_step_syncs(style: SyncStyle, step: int, interval: int) -> bool:
    """Whether the trainer's schedule asks for a sync after train step ``step`` (1-based).

    ``EXPLORER_DRIVEN`` has no trainer schedule: the trainer syncs when an explorer asks.
    """
    if style is SyncStyle.EXPLORER_DRIVEN or step <= 0:
        return False
    return step % interval == 0


def explorer_step_syncs(style: SyncStyle, step: int, interval: int, offset: int, last_synced: int = 0) -> bool:
    """Whether the explorer's schedule asks for a sync after explore step ``step`` (1-based).

    ``last_synced``: the explore step of the explorer's last successful sync (``EXPLORER_DRIVEN``
    asks once ``interval`` steps have passed since, so a timed-out ask is repeated at the next
    step). ``TRAINER_DRIVEN`` has no explorer schedule: the explorer syncs when a newer version
    exists.
    """
    if step <= 0:
        return False
    if style is SyncStyle.FIXED:
        return step > offset and (step - offset) % interval == 0
    if style is SyncStyle.EXPLORER_DRIVEN:
        return step - last_synced >= interval
    return False
