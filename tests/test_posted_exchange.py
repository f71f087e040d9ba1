"""Async calls on the message path (TCP, or shared memory without a flag area) begun in the
call: at 2 ranks the one exchange of recursive doubling (allreduce) or dissemination
(barrier) starts with this rank's send (pycollect/_ext/_algo.pxd, ``exchange_post``) and
the end receives and reduces (``allreduce_end``, ``barrier_end``); at any size a binomial
broadcast's root sends to its children (``broadcast_begin``)."""

import threading
import time

import numpy as np
import pytest

import pycollect as pc
from group import ThreadGroup, without_runner
from pycollect._ext._doorbell import Doorbell
from jobs import last_json, run_script


@pytest.fixture(scope="module", params=["tcp", "shm-subgroup"])
def pair(request):
    """Two ranks whose allreduce of a small buffer runs recursive doubling and whose barrier
    runs dissemination: over TCP, or a sub-group of a shared-memory job (no flag area)."""
    if request.param == "tcp":
        g = ThreadGroup(2, transport="tcp", timeout=30)
        yield g, g.contexts
    else:
        g = ThreadGroup(3, timeout=30)
        subs = g.run(lambda ctx: ctx.split(0 if ctx.rank < 2 else 1))
        yield g, subs[:2]
    g.close()


def _on(pair_, body):
    """Run ``body(ctx)`` on the pair's two contexts (the third rank of a sub-group job
    idles)."""
    g, contexts = pair_
    return g.run(lambda ctx: body(contexts[ctx.rank]) if ctx.rank < 2 else None)[:2]


def test_the_calls_begin_the_exchange_and_end_in_order(pair):
    """Async allreduces (several dtypes, ops, in place), barriers and a blocking call in
    between, each rank late in turn: every value right, each allreduce named
    recursive_doubling and each barrier dissemination, as the blocking calls run them."""
    def body(ctx):
        assert ctx._transport.flag_area is None
        out = []
        for late in (0, 1, None):
            if ctx.rank == late:
                time.sleep(0.1)
            a = np.arange(5, dtype=np.float32) + ctx.rank
            b = np.full(3, 2 + ctx.rank, np.int64)
            c = np.full(4, ctx.rank + 1.0)
            works = [ctx.allreduce(a, async_op=True),
                     ctx.barrier(async_op=True),
                     ctx.allreduce(b, op=pc.PRODUCT, async_op=True),
                     ctx.allreduce(c, op=pc.AVG, async_op=True)]
            blocking = ctx.allreduce(np.full(2, 10.0 * (ctx.rank + 1)))
            values = [w.wait(timeout=20) for w in works]
            out.append(([None if v is None else v.tolist() for v in values],
                        [w.algorithm for w in works], blocking.tolist()))
        return out

    expected = ([[1.0, 3.0, 5.0, 7.0, 9.0], None, [6] * 3, [1.5] * 4],
                ["recursive_doubling", "dissemination", "recursive_doubling",
                 "recursive_doubling"], [30.0, 30.0])
    assert _on(pair, body) == [[expected] * 3] * 2


def test_a_begun_exchange_meets_a_blocking_call_and_a_queued_one(pair):
    """One rank's async allreduce meets the peer's blocking one (the same messages); polls
    end a begun one; nine in a row (more than may be begun at once) all end right."""
    def body(ctx):
        buf = np.full(3, ctx.rank + 1.0)
        if ctx.rank == 0:
            first = ctx.allreduce(buf, async_op=True).wait(timeout=20).tolist()
        else:
            first = ctx.allreduce(buf).tolist()
        polled = ctx.allreduce(np.full(2, 5.0), async_op=True)
        deadline = time.monotonic() + 20
        while not polled.is_completed() and time.monotonic() < deadline:
            pass
        many = [ctx.allreduce(np.full(2, float(i)), async_op=True) for i in range(9)]
        return first, polled.wait().tolist(), [w.wait(timeout=20)[0] for w in many]

    assert _on(pair, body) == [([3.0] * 3, [10.0] * 2, [2.0 * i for i in range(9)])] * 2


@pytest.mark.parametrize("kind", ["allreduce", "barrier", "large allreduce"])
def test_a_poll_ends_a_begun_exchange_whose_message_has_come(pair, kind):
    """As MPI's Test: where the peer's message is already here, a poll of a small begun
    allreduce or barrier receives it and ends the call on the polling thread, without the
    runner; a large one (more than a poll lets in at once) is left to the runner, which the
    first poll wakes."""
    count = 3 if kind == "allreduce" else 8192     # 32 KiB: more than EXCHANGE_LOOK_BYTES

    def body(ctx):
        out = []
        for _ in range(3):
            ctx.barrier()
            if ctx.rank == 0:
                time.sleep(0.2)     # rank 1's message is here before rank 0 begins
            buf = np.full(count, ctx.rank + 1.0, np.float32)
            work = (ctx.barrier(async_op=True) if kind == "barrier" else
                    ctx.allreduce(buf, algorithm="recursive_doubling", async_op=True))
            ended = []
            work.add_done_callback(lambda w: ended.append(threading.current_thread()))
            deadline = time.monotonic() + 20
            while not work.is_completed() and time.monotonic() < deadline:
                pass
            value = work.wait(timeout=1)
            out.append((ended == [threading.current_thread()],
                        None if value is None else bool(np.all(value == 3.0))))
        return out

    polled, _ = _on(pair, body)
    value = None if kind == "barrier" else True
    if kind == "large allreduce":
        assert polled == [(False, True)] * 3          # the runner ended it
    else:
        assert polled == [(True, value)] * 3          # the poll ended it


@pytest.mark.parametrize("size", [2, 3, 4])
def test_a_broadcast_root_begins_its_sends(size):
    """An async binomial broadcast's root sends to its children in the call (any group
    size over TCP); the others queue theirs as before.  Roots in turn, small and larger
    buffers, allreduces between, a blocking broadcast on some ranks: every value right."""
    g = ThreadGroup(size, transport="tcp", timeout=30)
    try:
        def body(ctx):
            out = []
            for i in range(2 * size):
                root = i % size
                n = 3 if i % 2 else 5000
                buf = np.full(n, 100.0 * i + root) if ctx.rank == root else np.zeros(n)
                if ctx.rank == (i + 1) % size:
                    ctx.broadcast(buf, root=root, algorithm="binomial")
                    got, algo = buf, "binomial"
                else:
                    w = ctx.broadcast(buf, root=root, algorithm="binomial", async_op=True)
                    got, algo = w.wait(timeout=20), w.algorithm
                total = ctx.allreduce(np.ones(2), async_op=True).wait(timeout=20)
                out.append((bool(np.all(got == 100.0 * i + root)), algo, total.tolist()))
            return out

        assert g.run(body) == [[(True, "binomial", [float(size)] * 2)] * (2 * size)] * size
    finally:
        g.close()


@pytest.mark.parametrize("end", ["mismatch", "abort"])
def test_a_begun_exchange_fails_as_a_blocking_one_would(end):
    """The peer's disagreement (its count differs) is a MismatchError on the waiting rank;
    abort() from another thread fails the begun call at once; nothing hangs."""
    g = ThreadGroup(2, transport="tcp", timeout=30)
    try:
        def body(ctx):
            if ctx.rank == 1:
                if end == "abort":
                    time.sleep(1.5)
                    return None
                with pytest.raises(pc.MismatchError):
                    ctx.allreduce(np.ones(9))
                return "mismatch seen"
            work = ctx.allreduce(np.ones(8), async_op=True)
            if end == "abort":
                threading.Timer(0.3, ctx.abort).start()
            started = time.monotonic()
            with pytest.raises(pc.Error) as caught:
                work.wait(timeout=10)
            return type(caught.value), time.monotonic() - started

        res = g.outcomes(body, timeout=60)
        kind, took = res[0]
        assert kind is (pc.MismatchError if end == "mismatch" else pc.Aborted), res
        assert took < 5, res
    finally:
        g.close()


_COMPUTE = r"""
import json, sys, time
import numpy as np
import pycollect as pc
rank, store = int(sys.argv[1]), sys.argv[2]
ctx = pc.init(rank=rank, size=2, store=store, timeout=60, transport="tcp")
ctx.barrier()
# This rank's runner thread cannot take the GIL while the main thread computes in Python:
# what the peer waits for must have left in the calls themselves.
sys.setswitchinterval(30)
bufs = [np.full(4, rank + 1.0 + i) for i in range(4)]
data = np.full(6, 42.0) if rank == 0 else np.zeros(6)
works = [ctx.allreduce(b, async_op=True) for b in bufs] + [ctx.barrier(async_op=True),
                                                           ctx.broadcast(data, 0, async_op=True)]
if rank == 0:
    end = time.monotonic() + 3.0
    while time.monotonic() < end:
        pass
    waited = None
else:
    t0 = time.monotonic()
    pc.wait_all(works)
    waited = time.monotonic() - t0
values = [w.wait()[0] for w in works[:4]] + [works[5].wait()[0]]
algorithms = [w.algorithm for w in works]
sys.setswitchinterval(0.005)
ctx.close()
print(json.dumps({"waited": waited, "values": values, "algorithms": algorithms}))
"""


def test_the_peer_ends_begun_exchanges_while_this_rank_computes(tmp_path):
    """Rank 0 makes four async allreduces, an async barrier and an async broadcast from
    itself over TCP, then computes for 3 s in Python with its runner kept off the GIL;
    rank 1's wait for its own ends long before (each of rank 0's calls sent its message),
    with the right values."""
    procs = run_script(tmp_path, _COMPUTE, size=2)
    results = last_json(procs, (0, 1), timeout=60)
    assert results[1]["waited"] < 1.5, results
    assert results[0]["values"] == results[1]["values"] == [3.0, 5.0, 7.0, 9.0, 42.0], results
    assert results[0]["algorithms"] == ["recursive_doubling"] * 4 + ["dissemination",
                                                                     "binomial"], results


class _HeldBell(Doorbell):
    """A runner's doorbell whose ``sleep`` does not return, on the runner thread named
    ``held_on``, until ``released`` is set: that runner takes nothing meanwhile."""

    def __init__(self, held_on, released):
        self._held_on, self._released = held_on, released

    def sleep(self):
        if threading.current_thread().name == self._held_on:
            self._released.wait(20)
        return Doorbell.sleep(self)


def test_a_call_that_ends_at_once_behind_a_begun_one_keeps_its_number(monkeypatch):
    """Numbering where begun calls end out of order: the root of a binomial broadcast
    sends in the call, and that broadcast's end waits in the queue for the peer's copy of
    the message (by address); an async barrier begun after it through the flags, where the
    peer has posted its barrier already, ends in the call.  Running the broadcast's end
    afterwards must not take the context's count back to the broadcast's number: the next
    collective is number 3 on both ranks (it was 2 on the root: a MismatchError)."""
    from pycollect._ext import _work
    released, posted = threading.Event(), threading.Event()
    # The root's runner takes nothing until released: the broadcast's end stays queued.
    monkeypatch.setattr(_work, "doorbell_type",
                        lambda: _HeldBell("pycollect-rank1", released))
    g = ThreadGroup(2, timeout=30)
    try:
        def body(ctx):
            buf = np.full(1 << 16, float(ctx.rank), np.float32)
            if ctx.rank == 0:
                ctx.broadcast(buf, root=1, algorithm="binomial")
                second = ctx.barrier(async_op=True)     # posted in the call
                posted.set()
                second.wait(10)
                ended_in_call = None
            else:
                first = ctx.broadcast(buf, root=1, algorithm="binomial", async_op=True)
                posted.wait(10)
                second = ctx.barrier(async_op=True)
                ended_in_call = (second.is_completed(), first.is_completed())
                released.set()
                first.wait(10)
                second.wait(10)
            total = np.ones(1, np.float32)
            ctx.allreduce(total)
            return ended_in_call, float(buf[0]), float(buf[-1]), float(total[0]), ctx._seq

        results = g.run(body)
    finally:
        released.set()
        g.close()
    # The case under test: the barrier ended in the call, the broadcast not yet.
    assert results[1][0] == (True, False), results
    assert [r[1:] for r in results] == [(1.0, 1.0, 2.0, 3)] * 2, results


def test_a_poll_ends_a_begun_exchange_whose_peer_left(monkeypatch):
    """The peer closes instead of sending its part: a poll finds the end of its stream
    (``head_here`` answers yes), runs the end, and the call fails with PeerError naming the
    peer.  The runner never runs here (its thread returns at once), so only the poll can
    end it."""
    without_runner(monkeypatch)
    g = ThreadGroup(2, transport="tcp", timeout=10)
    try:
        gone = threading.Event()

        def body(ctx):
            if ctx.rank == 1:
                ctx.close()
                gone.set()
                return None
            gone.wait(10)
            work = ctx.barrier(async_op=True)
            deadline = time.monotonic() + 5
            while not work.is_completed() and time.monotonic() < deadline:
                pass
            with pytest.raises(pc.PeerError, match="rank 1"):
                work.wait(timeout=1)
            return work.is_completed()

        assert g.run(body)[0] is True
    finally:
        g.close()


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_a_small_allgather_of_two_ranks_begins_its_exchange(transport, monkeypatch):
    """An async ring allgather of 2 ranks whose block goes in one message places its block
    and sends it in the call; a poll that finds the peer's block receives it into place.
    No runner runs here: polls alone end every call (on the polling thread), each rank
    late in turn, dtypes, the in-place form, and one rank's blocking allgather meets the
    other's begun one; every block in place, named ring."""
    without_runner(monkeypatch)
    g = ThreadGroup(2, transport=transport, timeout=30)
    try:
        def body(ctx):
            out = []
            cases = [(np.float32, 1, False), (np.int64, 100, True), (np.uint8, 3000, False)]
            for i, (dtype, n, in_place) in enumerate(cases * 3):
                blocking = i >= 2 * len(cases) and ctx.rank == i % 2
                if ctx.rank == i % 2:
                    time.sleep(0.05)        # the peer's block is here before this one begins
                recv = np.zeros(2 * n, dtype)
                mine = recv[ctx.rank * n:(ctx.rank + 1) * n] if in_place else np.empty(n, dtype)
                mine[:] = (np.arange(n) + 10 * ctx.rank) % 50
                if blocking:
                    ctx.allgather(mine, recv, algorithm="ring")
                    polled, algorithm = True, "ring"
                else:
                    work = ctx.allgather(mine, recv, algorithm="ring", async_op=True)
                    ended = []
                    work.add_done_callback(lambda w: ended.append(threading.current_thread()))
                    deadline = time.monotonic() + 10
                    while not work.is_completed() and time.monotonic() < deadline:
                        pass
                    work.wait(timeout=1)
                    polled, algorithm = ended == [threading.current_thread()], work.algorithm
                want = np.concatenate([(np.arange(n) + 10 * r) % 50 for r in (0, 1)])
                out.append((polled, algorithm, bool(np.array_equal(recv, want.astype(dtype)))))
            return out

        assert g.run(body) == [[(True, "ring", True)] * 9] * 2
    finally:
        g.close()
