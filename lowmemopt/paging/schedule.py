"""The copy schedule of paged state (:class:`Schedule`): which device slot and pinned staging buffer each bucket uses
and what each of its operations waits for, decided on the host as plain data before anything is issued::

    read(seq)     reader thread  files -> staging (CUDA) or -> slot (CPU)    [the "staged" and "file" routes]
    h2d(seq)      h2d stream     homes or staging -> slot                    [the "copy" and "staged" routes]
    kernels(seq)  compute        the update of the bucket, in the slot
    d2h(seq)      d2h stream     slot -> homes or staging                    [the "copy" and "staged" routes]
    write(seq)    writer thread  staging or slot -> files                    [the "staged" and "file" routes]

:mod:`.engine` carries it out; ``tests/test_paging_schedule.py`` runs it on simulated lanes. The waits:
docs/paging.md#how-a-step-runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Sequence

__all__ = ["Op", "BucketPlan", "Schedule", "ROUTES", "LANE", "N_SLOTS", "N_SLOTS_HOST", "N_STAGING"]

#: device slots: the bucket updating, the next one arriving, the last one being written back
N_SLOTS = 3
#: slots of a device without copy engines (the CPU): the bucket updating and the next one read ahead; the write-back
#: of the one before goes on in the updating bucket's time, before the read-ahead (host memory is the cost here)
N_SLOTS_HOST = 2
#: pinned staging buffers of the disk tier (CUDA): one more than the slots, for the write that lags behind its copy
N_STAGING = 4

ROUTES = {
    "copy": (("h2d",), ("d2h",)),
    "staged": (("read", "h2d"), ("d2h", "write")),
    "file": (("read",), ("write",)),
}
#: the lane each kind of operation runs on
LANE = {"read": "reader", "h2d": "h2d", "kernels": "compute", "d2h": "d2h", "write": "writer"}


@dataclass(frozen=True)
class Op:
    """One operation of a bucket: ``kind`` on its lane, after each ``(kind, seq)`` of ``waits``."""

    kind: str
    seq: int
    slot: int
    staging: int | None
    waits: tuple[tuple[str, int], ...] = ()

    @property
    def lane(self) -> str:
        return LANE[self.kind]


@dataclass
class BucketPlan:
    """The operations of one bucket: ``load`` (before its kernels), ``kernels``, ``store`` (after them)."""

    seq: int
    route: str
    slot: int
    staging: int | None
    keys: tuple[Hashable, ...]
    load: tuple[Op, ...]
    kernels: Op
    store: tuple[Op, ...] = ()
    issued: set[str] = field(default_factory=set)  # kinds the mover has issued

    def op(self, kind: str) -> Op | None:
        for o in self.load + (self.kernels,) + self.store:
            if o.kind == kind:
                return o
        return None


def _latest(waits: list[tuple[str, int]]) -> tuple[tuple[str, int], ...]:
    """Per lane, the latest of ``waits`` (a lane runs in issue order, which is seq order)."""
    best: dict[str, tuple[str, int]] = {}
    for kind, seq in waits:
        lane = LANE[kind]
        if lane not in best or best[lane][1] < seq:
            best[lane] = (kind, seq)
    return tuple(sorted(best.values(), key=lambda w: (w[1], w[0])))


#: per route: the operation after which a bucket's slot, and its staging buffer, may be refilled
_SLOT_FREE_AFTER = {"copy": "d2h", "staged": "d2h", "file": "write"}
_STAGING_FREE_AFTER = "write"


class Schedule:
    """The slot and staging rings of one device and the operations of each bucket.

    :meth:`plan` is called per bucket in load order; :meth:`stored` when its write-back is issued, :meth:`discard`
    when it is dropped unused."""

    def __init__(self, n_slots: int = N_SLOTS, n_staging: int = N_STAGING) -> None:
        if n_slots < 2 or n_staging < n_slots:
            # (the buckets planned and not yet written back, at most n_slots in a row, each hold their staging buffer)
            raise ValueError("a schedule needs at least 2 slots and as many staging buffers")
        self.n_slots, self.n_staging = n_slots, n_staging
        self.next_seq = 0
        self._slot_free: dict[int, tuple[str, int]] = {}  # slot -> the operation after which it may be refilled
        self._staging_free: dict[int, tuple[str, int]] = {}
        self._home_written: dict[Hashable, tuple[str, int]] = {}  # key -> its last write-back's last operation
        self.plans: dict[int, BucketPlan] = {}  # planned and not yet stored or discarded

    def plan(
        self, keys: Sequence[Hashable], route: str, loads: Sequence[Hashable] | None = None, position: int | None = None
    ) -> BucketPlan:
        """The next bucket: ``keys`` it writes back, ``loads`` it reads; ``position`` picks its buffers."""
        if route not in ROUTES:
            raise ValueError(f"unknown route {route!r}")
        seq = self.next_seq
        where = seq if position is None else position
        slot = where % self.n_slots
        staging = where % self.n_staging if route == "staged" else None
        if not self.can_plan() or any(
            p.slot == slot or (staging is not None and p.staging == staging) for p in self.plans.values()
        ):
            raise RuntimeError(f"slot {slot} or staging buffer {staging} is held by a bucket not written back yet")
        self.next_seq += 1
        loads = tuple(keys) if loads is None else tuple(loads)
        ops: list[Op] = []
        for i, kind in enumerate(ROUTES[route][0] if loads else ()):
            waits = [(ops[-1].kind, seq)] if ops else []
            if kind == "read" and staging is not None and staging in self._staging_free:
                waits.append(self._staging_free[staging])  # staging: its last bucket is written to the files
            if (kind == "h2d" or route == "file") and slot in self._slot_free:
                waits.append(self._slot_free[slot])  # the slot: its last bucket is copied out
            if i == 0:  # a home is read only once its last write-back is in it
                waits += [self._home_written[k] for k in loads if k in self._home_written]
            ops.append(Op(kind, seq, slot, staging, _latest(waits)))
        if ops:
            kernels = Op("kernels", seq, slot, staging, ((ops[-1].kind, seq),))
        else:  # state made by the update itself: at most n_slots buckets of it on their way home (the host waits)
            free = [self._slot_free[slot]] if slot in self._slot_free else []
            kernels = Op("kernels", seq, slot, staging, _latest(free))
        plan = BucketPlan(seq, route, slot, staging, tuple(keys), tuple(ops), kernels)
        self.plans[seq] = plan
        return plan

    def can_plan(self) -> bool:
        """Whether a slot is free for the next bucket."""
        return len(self.plans) < self.n_slots

    def stored(self, plan: BucketPlan) -> tuple[Op, ...]:
        """The operations of ``plan``'s write-back."""
        ops: list[Op] = []
        for kind in ROUTES[plan.route][1]:
            waits = [(ops[-1].kind, plan.seq) if ops else ("kernels", plan.seq)]
            if not ops and plan.staging is not None and not plan.load and plan.staging in self._staging_free:
                waits.append(self._staging_free[plan.staging])  # nothing was read into its staging: wait here
            ops.append(Op(kind, plan.seq, plan.slot, plan.staging, _latest(waits)))
        plan.store = tuple(ops)
        self.plans.pop(plan.seq, None)
        self._slot_free[plan.slot] = (_SLOT_FREE_AFTER[plan.route], plan.seq)
        if plan.staging is not None:
            self._staging_free[plan.staging] = (_STAGING_FREE_AFTER, plan.seq)
        for key in plan.keys:
            self._home_written[key] = (ops[-1].kind, plan.seq)
        return plan.store

    def discard(self, plan: BucketPlan) -> None:
        """``plan``'s bucket will not run: its buffers are free once its issued loads are done."""
        self.plans.pop(plan.seq, None)
        issued = [o for o in plan.load if o.kind in plan.issued]
        if not issued:
            return
        last = (issued[-1].kind, plan.seq)
        if any(o.kind == "h2d" for o in issued) or plan.route == "file":
            self._slot_free[plan.slot] = last
        if plan.staging is not None:
            self._staging_free[plan.staging] = last

    def forget(self, key: Hashable) -> None:
        """``key``'s home was freed or remade: no later load waits for its old write-backs."""
        self._home_written.pop(key, None)
