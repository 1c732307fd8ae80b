"""The copy schedule of paged state (lowmemopt.paging.schedule), carried out on simulated lanes, and the movers
(lowmemopt.paging.engine) on simulated streams: no buffer is read before it is filled, none is overwritten before it
is read, at most n_slots buckets hold device buffers; the optimizer's results stay bit-identical whatever order the
simulated copy engines run in."""

from __future__ import annotations

import random
import threading
from collections import deque

import pytest
import torch
from helpers import make_params, run
from optim_info import BY_NAME, SHAPES, STATEFUL

import lowmemopt
from lowmemopt import paging
from lowmemopt.paging import engine, schedule
from lowmemopt.paging.engine import HostLanes, coalesce
from lowmemopt.paging.schedule import LANE, Schedule

# ---------------------------------------------------------------------------------------------------------------------
# the schedule alone: a driver that issues its operations as the residency manager does, and lanes that run them in
# any order their waits allow, checking what each one reads


class Violation(AssertionError):
    pass


class Lanes:
    """FIFO lanes of issued operations; a buffer model (slots, staging, homes: each holds a token) checks the data
    flow: a reader finds the token it expects, a writer overwrites only content whose readers are done."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.queues: dict[str, deque] = {lane: deque() for lane in set(LANE.values())}
        self.issued: set[tuple[str, int]] = set()
        self.done: set[tuple[str, int]] = set()
        self.cancelled: set[tuple[str, int]] = set()
        self.buffers: dict[tuple[str, int], tuple[object, tuple]] = {}  # buffer -> (token, its readers)
        self.homes: dict[object, int] = {}  # key -> version written
        self.running = None

    def issue(self, op, effect) -> None:
        waits = tuple(w for w in op.waits if w in self.issued)  # the movers skip waits for what was never issued
        self.issued.add((op.kind, op.seq))
        self.queues[op.lane].append((op, waits, effect))

    def step(self) -> bool:
        ready = [q for q in self.queues.values() if q and all(w in self.done for w in q[0][1])]
        if not ready:
            return False
        op, _, effect = self.rng.choice(ready).popleft()
        self.running = (op.kind, op.seq)
        effect(self)
        self.done.add((op.kind, op.seq))
        return True

    def drain(self) -> None:
        while self.step():
            pass
        if any(self.queues.values()):
            raise Violation(f"deadlock: {[q[0][0] for q in self.queues.values() if q]}")

    def write(self, buffer, token, readers) -> None:
        _, pending = self.buffers.get(buffer, (None, ()))
        alive = [r for r in pending if r not in self.done and r not in self.cancelled and r != self.running]
        if alive:
            raise Violation(f"{buffer} overwritten before {alive} read it")
        self.buffers[buffer] = (token, tuple(readers))

    def read(self, buffer, token) -> None:
        found = self.buffers.get(buffer, (None, ()))[0]
        if found != token:
            raise Violation(f"{buffer} holds {found}, expected {token}")


def drive(
    sched: Schedule,
    passes,
    route: str,
    lanes: Lanes,
    rng: random.Random,
    early: bool = True,
    fail: float = 0.0,
    positions: bool = True,
) -> dict:
    """Run ``passes`` (each a list of buckets, each a list of keys) as the residency manager does: up to two buckets
    ahead as slots allow, the next one's load completed before the current one's kernels, the write-back after them,
    the next pass's first bucket prefetched at the end (dropped if the pass starts otherwise); ``fail``: the chance
    that an update fails (its bucket is discarded, its homes keep their version); ``positions``: buffers by a
    bucket's place in its pass (else by its seq). Returns each key's version."""
    expected: dict = {}  # key -> the version its home will hold once every issued write-back is done
    held = None  # (keys, plan) prefetched for the next pass

    def issue_loads(plan, loads):
        versions = {k: expected.get(k, 0) for k in loads}
        for op in plan.load:
            if op.kind in plan.issued:
                continue
            plan.issued.add(op.kind)
            lanes.issue(op, load_effect(plan, op, versions))

    def load_effect(plan, op, versions):
        slot, staging = ("slot", plan.slot), ("staging", plan.staging)

        def effect(lanes):
            token = ("loaded", plan.seq, tuple(sorted(versions.items())))
            if op.kind == "read" and plan.route == "staged":
                for k, v in versions.items():
                    if lanes.homes.get(k, 0) != v:
                        raise Violation(f"read({plan.seq}) of {k}: version {lanes.homes.get(k, 0)}, expected {v}")
                lanes.write(staging, token, [("h2d", plan.seq)])
            elif op.kind == "h2d" and plan.route == "staged":
                lanes.read(staging, token)
                lanes.write(slot, token, [("kernels", plan.seq)])
            else:  # copy: h2d from the homes; file: read into the slot
                for k, v in versions.items():
                    if lanes.homes.get(k, 0) != v:
                        raise Violation(f"{op.kind}({plan.seq}) of {k}: version {lanes.homes.get(k, 0)}, expected {v}")
                lanes.write(slot, token, [("kernels", plan.seq)])

        return effect

    def start(keys, fresh, position):
        loads = [k for k in keys if k not in fresh]
        plan = sched.plan(keys, route, loads, position if positions else None)
        if plan.load:
            issue_loads(plan, loads)
        return plan, loads

    for n, buckets in enumerate(passes):
        handles = {}
        if held is not None:
            keys, (plan, loads) = held
            held = None
            if buckets and list(buckets[0]) == list(keys):
                handles[0] = (plan, loads)
            else:
                sched.discard(plan)
                for op in plan.load + (plan.kernels,):
                    lanes.cancelled.add((op.kind, op.seq))
        for k, keys in enumerate(buckets):
            for j in range(k, min(len(buckets), k + 3)):
                if j not in handles:
                    if not sched.can_plan():
                        break
                    handles[j] = start(buckets[j], {key for key in buckets[j] if key not in expected}, j)
            if k + 1 in handles:
                issue_loads(handles[k + 1][0], handles[k + 1][1])
            plan, loads = handles.pop(k)
            issue_loads(plan, loads)
            versions = {key: expected.get(key, 0) for key in keys}
            slot, staging = ("slot", plan.slot), ("staging", plan.staging)
            fresh = ("fresh", plan.seq)
            out = ("updated", plan.seq, tuple(sorted((key, v + 1) for key, v in versions.items())))
            if rng.random() < fail:  # the update raised: nothing is written back
                sched.discard(plan)
                lanes.cancelled.update({("kernels", plan.seq)} | {(o.kind, plan.seq) for o in plan.load})
                continue

            def kernels(lanes, plan=plan, loads=loads, versions=versions, out=out, fresh=fresh, slot=slot):
                if plan.load:
                    lanes.read(slot, ("loaded", plan.seq, tuple(sorted((k, versions[k]) for k in loads))))
                kinds = [o.kind for o in sched_store_kinds(plan.route)]
                target = slot if plan.load else fresh  # state made by the update lives outside the slots
                lanes.write(target, out, [(kinds[0], plan.seq)])

            lanes.issue(plan.kernels, kernels)
            for key in keys:
                expected[key] = versions[key] + 1
            ops = sched.stored(plan)
            source = slot if plan.load else fresh
            for i, op in enumerate(ops):

                def store(lanes, op=op, i=i, plan=plan, out=out, source=source, staging=staging, last=len(ops) - 1):
                    src = staging if (plan.route == "staged" and op.kind == "write") else source
                    lanes.read(src, out)
                    if plan.route == "staged" and op.kind == "d2h":
                        lanes.write(staging, out, [("write", plan.seq)])
                    if i == last:
                        for key, v in out[2]:
                            lanes.homes[key] = v

                lanes.issue(op, store)
            if rng.random() < 0.3:  # lanes run some of what is issued while the host goes on
                for _ in range(rng.randint(0, 4)):
                    lanes.step()
        if early and n + 1 < len(passes) and passes[n + 1]:
            guess = passes[n + 1][0] if rng.random() < 0.7 else passes[n][0]
            if sched.can_plan():
                held = (guess, start(guess, {key for key in guess if key not in expected}, 0))
    if held is not None:
        sched.discard(held[1][0])
        for op in held[1][0].load:
            lanes.cancelled.add((op.kind, op.seq))
    return expected


def sched_store_kinds(route):
    return [schedule.Op(kind, 0, 0, None) for kind in schedule.ROUTES[route][1]]


def _passes(rng, keys=12, n=5):
    """Passes over ``keys`` keys in buckets of 1-4, the same buckets each pass (as steps are), some passes partial."""
    order = list(range(keys))
    buckets, i = [], 0
    while i < keys:
        size = rng.randint(1, 4)
        buckets.append(order[i : i + size])
        i += size
    out = []
    for _ in range(n):
        out.append(buckets if rng.random() < 0.8 else buckets[rng.randint(0, len(buckets) - 1) :])
    return out


@pytest.mark.parametrize("positions", [True, False], ids=["by-position", "by-seq"])
@pytest.mark.parametrize("route", ["copy", "staged", "file"])
@pytest.mark.parametrize("n_slots", [2, 3])
def test_schedule_orders_every_copy_whatever_order_the_lanes_run(route, n_slots, positions):
    for seed in range(40):
        rng = random.Random(seed)
        sched = Schedule(n_slots=n_slots, n_staging=rng.randint(n_slots, 4))
        lanes = Lanes(rng)
        passes = _passes(rng)
        expected = drive(sched, passes, route, lanes, rng, fail=0.1 if seed % 4 == 0 else 0.0, positions=positions)
        lanes.drain()
        assert lanes.homes == expected, seed
        assert not sched.plans


def test_schedule_refuses_a_bucket_beyond_its_slots():
    sched = Schedule(n_slots=2)
    sched.plan(["a"], "copy")
    sched.plan(["b"], "copy")
    assert not sched.can_plan()
    with pytest.raises(RuntimeError, match="held by a bucket"):
        sched.plan(["c"], "copy")
    with pytest.raises(RuntimeError, match="slot 1 or staging buffer None is held"):
        _two_at(1)


def _two_at(position):
    sched = Schedule(n_slots=3)
    sched.plan(["a"], "copy", position=position)
    sched.plan(["b"], "copy", position=position)  # the same slot while the first is not written back


def test_schedule_waits_for_the_slots_last_write_back_and_the_homes_last_write():
    sched = Schedule(n_slots=2, n_staging=2)
    a = sched.plan(["a"], "copy")
    assert a.load[0].waits == () and a.kernels.waits == (("h2d", 0),)
    sched.stored(a)
    b = sched.plan(["b"], "copy")
    sched.stored(b)
    c = sched.plan(["a"], "copy")  # slot 0 again, home "a" again: both after d2h(0)
    assert c.slot == 0 and c.load[0].waits == (("d2h", 0),)
    assert sched.stored(c)[0].waits == (("kernels", 2),)
    d = sched.plan(["x"], "staged")
    assert [o.kind for o in d.load] == ["read", "h2d"] and d.load[1].waits == (("d2h", 1), ("read", 3))
    assert [o.kind for o in sched.stored(d)] == ["d2h", "write"]
    e = sched.plan(["x"], "staged")  # its file is read after its last write
    assert ("write", 3) in e.load[0].waits


@pytest.mark.parametrize("bug", ["slot", "home", "staging"])
def test_the_simulation_catches_a_missing_wait(monkeypatch, bug):
    """A schedule that forgets one kind of wait is caught by the simulated lanes (the checks can fail)."""
    real = Schedule.plan

    def forgetful(self, keys, route, loads=None, position=None):
        if bug == "slot":
            self._slot_free.clear()
        elif bug == "home":
            self._home_written.clear()
        else:
            self._staging_free.clear()
        return real(self, keys, route, loads, position)

    monkeypatch.setattr(Schedule, "plan", forgetful)
    route = "staged" if bug == "staging" else "copy"
    caught = 0
    for seed in range(40):
        rng = random.Random(seed)
        lanes = Lanes(rng)
        try:
            expected = drive(Schedule(n_slots=3, n_staging=3), _passes(rng), route, lanes, rng)
            lanes.drain()
            assert lanes.homes == expected
        except (Violation, AssertionError):
            caught += 1
    assert caught > 0


def test_coalesce_merges_neighbours_laid_out_alike():
    homes = paging.homes.Homes()
    layout = [(torch.Size([100]), torch.float32), (torch.Size([3]), torch.int8), (torch.Size([7, 5]), torch.float16)]
    src = homes.arena(layout, pin=False)
    offsets, total = paging.homes.layout_offsets([s.numel() * s.element_size() for s in src])
    slot = torch.empty(total, dtype=torch.uint8)
    dst = [slot[o : o + s.nbytes].view(s.dtype).view(s.shape) for s, o in zip(src, offsets)]
    for s in src:
        s.copy_(torch.randn(s.shape).to(s.dtype))
    pairs = list(zip(dst, src))
    assert len({s.untyped_storage().data_ptr() for s in src}) == 3  # homes of their own storage each (torch.save)
    assert len(coalesce(pairs)) == 3  # (not known to be neighbours without the arena)
    runs = coalesce(pairs, homes.buffer_of)
    assert len(runs) == 1
    for d, s in runs:
        d.copy_(s)
    assert all(torch.equal(d, s) for d, s in pairs)
    assert len(coalesce([pairs[0], pairs[2]], homes.buffer_of)) == 2  # a gap on one side only: two copies
    for s in src:
        homes.free(s)
    assert not homes._owned and not homes._refs and not homes._arenas


# ---------------------------------------------------------------------------------------------------------------------
# the movers on simulated streams: copies queued on two lanes that run in random order, only as events allow


class _Event:
    def __init__(self):
        self.done = False


class SimLanes(HostLanes):
    """Stand-in for a CUDA device's lanes on the CPU: ``copy`` queues the copy on its lane, ``record`` queues an event,
    ``wait`` queues a wait for one (the compute lane is the host: it waits until the event is done); the lanes run
    their heads in random order, whenever any call comes in, and as far as a host wait needs."""

    def __init__(self, device, rng):
        super().__init__(device)
        self.staged_files = True
        self.rng = rng
        self.lock = threading.RLock()
        self.queues = {"h2d": deque(), "d2h": deque()}

    def compute(self):
        return "compute"

    def stream(self, name):
        return name

    def _wander(self):
        for _ in range(self.rng.randint(0, 2)):
            self._step()

    def copy(self, stream, dst, src):
        with self.lock:
            self.queues[stream].append(("copy", dst, src))
            self._wander()

    def record(self, stream):
        event = _Event()
        with self.lock:
            if stream == "compute":
                event.done = True
            else:
                self.queues[stream].append(("record", event, None))
            self._wander()
        return event

    def wait(self, stream, event):
        if stream == "compute":
            self.sync(event)
            return
        with self.lock:
            self.queues[stream].append(("wait", event, None))

    def sync(self, event):
        while True:
            with self.lock:
                if event.done:
                    return
                if not self._step():
                    raise AssertionError("simulated lanes stuck: an event waited for is never recorded")

    def done(self, event):
        return event.done

    def _step(self):
        ready = [q for q in self.queues.values() if q and (q[0][0] != "wait" or q[0][1].done)]
        if not ready:
            return False
        kind, a, b = self.rng.choice(ready).popleft()
        if kind == "copy":
            a.copy_(b)
        elif kind == "record":
            a.done = True
        return True


@pytest.mark.parametrize("tier", ["cpu", "disk"])
@pytest.mark.parametrize("name", ["AdamW", "Adafactor"])
def test_movers_on_simulated_streams_are_bit_identical(name, tier, tmp_path, monkeypatch):
    """The real residency manager and movers, with copies that run late and in any order their events allow (the
    staged route for files, as on a GPU): the same values and state as unpaged, every step."""
    rng = random.Random(0)
    monkeypatch.setattr(engine, "_lanes_for", lambda device: SimLanes(device, rng))
    monkeypatch.setattr(paging.pager, "HOST_BUCKET_BYTES", 1)  # a bucket per parameter: slots reused within a step
    info, kwargs = BY_NAME[name], STATEFUL[name]
    paged, plain = make_params(SHAPES), make_params(SHAPES)
    opt = info.cls(paged, state_bits=8, paged=tier, offload_dir=tmp_path, **kwargs)
    ref = info.cls(plain, state_bits=8, **kwargs)
    for t in range(4):
        run(opt, paged, 1, start=t)
        run(ref, plain, 1, start=t)
        paging.settle(opt)
        for a, b in zip(paged, plain):
            assert torch.equal(a, b)
            sa, sb = opt.state[a], ref.state[b]
            assert sa.keys() == sb.keys()
            assert all(torch.equal(sa[k], v) if isinstance(v, torch.Tensor) else sa[k] == v for k, v in sb.items())
    mover = paging.pager_of(opt).movers[torch.device("cpu")]
    assert isinstance(mover.lanes, SimLanes) and mover.schedule.next_seq > 4 * len(SHAPES) // 2
    opt.close()


@pytest.mark.parametrize("tier", ["cpu", "disk"])
def test_slots_are_reused_across_steps_and_the_next_step_starts_early(tier, tmp_path, monkeypatch):
    """The slots (and staging) are made in the first steps at the size of the largest bucket and never again; when a
    step ends, the next one's first bucket is already on its way (a bucket planned, its load issued; or, for files
    read when the bucket is loaded, read ahead into the page cache and nothing issued yet)."""
    monkeypatch.setattr(paging.pager, "HOST_BUCKET_BYTES", 1)  # a bucket per parameter
    monkeypatch.setattr(paging.contention.CpuShare, "others_busy", lambda self: False)  # (a decision that holds)
    params = make_params(SHAPES)
    opt = lowmemopt.AdamW(params, lr=1e-2, state_bits=8, paged=tier, offload_dir=tmp_path)
    run(opt, params, 2)
    pager = paging.pager_of(opt)
    mover = pager.movers[torch.device("cpu")]
    buffers = [b.data_ptr() for b in mover.slots + mover.stagings if b is not None]
    assert buffers and mover.pool_bytes() == len(buffers) * mover.slot_bytes
    for t in range(2, 5):
        run(opt, params, 1, start=t)
        assert [b.data_ptr() for b in mover.slots + mover.stagings if b is not None] == buffers
        early = pager.next_pass.early
        assert early is not None and early[0] == [params[0]]
        assert bool(early[1].plan.issued) != early[1].here and early[1].here == (
            tier == "disk" and mover.lanes.files_here()
        )
    opt.load_state_dict(opt.state_dict())  # a load drops the bucket on its way (its homes are replaced)
    assert pager.next_pass.early is None
