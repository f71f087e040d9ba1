"""The compiled call path (pycollect/_ext/_call.pyx) and the recorder's ring (_record.pyx).

The commonest calls (blocking allreduce, broadcast and barrier on a NumPy
array) never enter the Context's Python methods; every other form does.  Both
paths must number, record and fail a collective alike.
"""

import datetime
import inspect
import threading
import time

import numpy as np
import pytest

import pycollect as pc
from pycollect._ext._lock import CallLock
from pycollect.context import Context
from pycollect.recorder import Recorder
from reference import reduce_reference

from group import ThreadGroup


@pytest.fixture
def python_calls(monkeypatch):
    """Count the calls that reach the Context's Python path, by collective."""
    seen = {"allreduce": 0, "broadcast": 0, "barrier": 0, "reduce": 0, "allgather": 0,
            "gather": 0, "scatter": 0, "reduce_scatter": 0, "alltoall": 0, "alltoallv": 0,
            "allgatherv": 0, "reduce_scatterv": 0, "gatherv": 0, "scatterv": 0, "send": 0,
            "recv": 0, "sendrecv": 0}
    for name in seen:
        slow = getattr(Context, "_%s_any" % name)

        def counting(self, *args, _slow=slow, _name=name, **kwargs):
            seen[_name] += 1
            return _slow(self, *args, **kwargs)
        monkeypatch.setattr(Context, "_%s_any" % name, counting)
    return seen


@pytest.fixture(scope="module")
def trio():
    group = ThreadGroup(3, timeout=30)
    yield group
    group.close()


def test_blocking_calls_on_arrays_stay_compiled(trio, python_calls):
    def body(ctx):
        a = np.full(5, ctx.rank + 1, np.int64)
        ctx.allreduce(a)
        b = np.full(3, ctx.rank, np.float32)
        ctx.broadcast(b, root=2)
        ctx.barrier()
        ctx.allreduce(a, pc.ReduceOp.MAX)
        return a.tolist(), b.tolist()
    for a, b in trio.run(body):
        assert a == [6] * 5 and b == [2.0] * 3
    assert not any(python_calls.values()), python_calls


def test_the_other_blocking_collectives_stay_compiled(trio, python_calls):
    def body(ctx):
        r, n = ctx.rank, ctx.size
        out = {}
        a = np.full(4, r + 1, np.int64)
        assert ctx.reduce(a, root=1) is a
        out["reduce"] = a.tolist()
        b = np.full(4, r + 1, np.float32)
        ctx.reduce(b, 0, pc.ReduceOp.MAX, algorithm="ring", timeout=20)
        out["reduce ring"] = b.tolist()
        recv = np.empty(2 * n, np.int32)
        assert ctx.allgather(np.full(2, r, np.int32), recv) is recv
        out["allgather"] = recv.tolist()
        ctx.allgather(np.full(2, r, np.int32), recv, algorithm="ring")
        out["allgather ring"] = recv.tolist()
        got = np.empty(n, np.float64) if r == 2 else None
        res = ctx.gather(np.array([r * 10.0]), got, root=2)
        out["gather"] = None if res is None else res.tolist()
        mine = np.empty(2, np.int16)
        send = np.arange(2 * n, dtype=np.int16) if r == 0 else None
        assert ctx.scatter(send, mine, root=0) is mine
        out["scatter"] = mine.tolist()
        block = np.empty(2, np.float64)
        ctx.reduce_scatter(np.arange(2 * n, dtype=np.float64) * (r + 1), block,
                           pc.ReduceOp.MAX)
        out["reduce_scatter"] = block.tolist()
        back = np.empty(n, np.int64)
        assert ctx.alltoall(np.arange(n, dtype=np.int64) + 10 * r, back) is back
        out["alltoall"] = back.tolist()
        # the same two async: queued as compiled calls
        block = np.empty(2, np.float64)
        assert ctx.reduce_scatter(np.arange(2 * n, dtype=np.float64) * (r + 1), block,
                                  pc.ReduceOp.MAX, async_op=True).wait(timeout=20) is block
        out["reduce_scatter async"] = block.tolist()
        back = np.empty(n, np.int64)
        assert ctx.alltoall(np.arange(n, dtype=np.int64) + 10 * r, back,
                            async_op=True).wait(timeout=20) is back
        out["alltoall async"] = back.tolist()
        # alltoallv: rank r sends p + 1 elements (each 10 * r + p) to rank p
        send = np.concatenate([np.full(p + 1, 10 * r + p, np.int32) for p in range(n)])
        got = np.empty(n * (r + 1), np.int32)
        assert ctx.alltoallv(send, [p + 1 for p in range(n)], got, [r + 1] * n) is got
        out["alltoallv"] = got.tolist()
        # allgatherv: rank q contributes q + 1 copies of q; reduce_scatterv: rank p gets
        # p + 1 elements
        every = np.empty(6, np.int64)
        assert ctx.allgatherv(np.full(r + 1, r, np.int64), every, [1, 2, 3]) is every
        out["allgatherv"] = every.tolist()
        mine = np.empty(r + 1, np.float32)
        assert ctx.reduce_scatterv(np.arange(6, dtype=np.float32) * (r + 1), mine, [1, 2, 3],
                                   pc.ReduceOp.MAX) is mine
        out["reduce_scatterv"] = mine.tolist()
        # gatherv onto rank 1, scatterv from rank 2: rank q's block holds q + 1 elements
        onto = np.empty(6, np.int8) if r == 1 else None
        res = ctx.gatherv(np.full(r + 1, r, np.int8), onto, [1, 2, 3], root=1)
        out["gatherv"] = None if res is None else res.tolist()
        part = np.empty(r + 1, np.float64)
        from_two = np.arange(6, dtype=np.float64) if r == 2 else None
        assert ctx.scatterv(from_two, [1, 2, 3], part, root=2) is part
        out["scatterv"] = part.tolist()
        return out
    results = trio.run(body)
    for r, out in enumerate(results):
        assert out["reduce"] == ([6] * 4 if r == 1 else [r + 1] * 4)
        assert out["reduce ring"] == ([3.0] * 4 if r == 0 else [r + 1.0] * 4)
        assert out["allgather"] == out["allgather ring"] == [0, 0, 1, 1, 2, 2]
        assert out["gather"] == ([0.0, 10.0, 20.0] if r == 2 else None)
        assert out["scatter"] == [2 * r, 2 * r + 1]
        assert out["reduce_scatter"] == out["reduce_scatter async"] == [2 * r * 3.0,
                                                                        (2 * r + 1) * 3.0]
        assert out["alltoall"] == out["alltoall async"] == [r, 10 + r, 20 + r]
        assert out["alltoallv"] == [10 * q + r for q in range(3) for _ in range(r + 1)]
        assert out["allgatherv"] == [0, 1, 1, 2, 2, 2]
        assert out["gatherv"] == ([0, 1, 1, 2, 2, 2] if r == 1 else None)
        assert out["scatterv"] == [float(k) for k in range(6)][r * (r + 1) // 2:
                                                                (r + 1) * (r + 2) // 2]
        assert out["reduce_scatterv"] == [3.0 * k for k in range(6)][r * (r + 1) // 2:
                                                                     (r + 1) * (r + 2) // 2]
    assert not any(python_calls.values()), python_calls


@pytest.mark.parametrize("kind, call", [
    ("reduce", lambda ctx: ctx.reduce(np.ones(2), 0, recvbuf=np.empty(2))),
    ("reduce_scatter", lambda ctx: ctx.reduce_scatter(
        np.ones(6), np.empty(2), async_op=True, timeout=datetime.timedelta(seconds=9)).wait()),
    ("reduce", lambda ctx: ctx.reduce(np.ones(2), np.int64(0))),
    ("allgather", lambda ctx: ctx.allgather(np.ones(2))),
    ("gather", lambda ctx: ctx.gather(np.ones(2), None, root=ctx.rank)),
    ("scatter", lambda ctx: ctx.scatter(np.ones(6), None, root=0)),
    ("reduce_scatter", lambda ctx: ctx.reduce_scatter(np.ones(6))),
    ("alltoall", lambda ctx: ctx.alltoall(np.ones(3), timeout=datetime.timedelta(seconds=9))),
    ("alltoallv", lambda ctx: ctx.alltoallv(np.ones(3), [1, 1, 1], None, [1, 1, 1])),
    ("alltoallv", lambda ctx: ctx.alltoallv(np.ones(3), [1, 1, 1], np.empty(3), [1, 1, 1],
                                            async_op=True).wait()),
    ("allgatherv", lambda ctx: ctx.allgatherv(np.ones(1), None, [1, 1, 1])),
    ("gatherv", lambda ctx: ctx.gatherv(np.ones(1), None, [1, 1, 1], root=0)),
    ("scatterv", lambda ctx: ctx.scatterv(np.ones(3), [1, 1, 1], np.empty(1), root=0,
                                          async_op=True).wait()),
    ("reduce_scatterv", lambda ctx: ctx.reduce_scatterv(np.ones(3), np.empty(1), [1, 1, 1],
                                                        timeout=datetime.timedelta(seconds=9))),
], ids=["reduce-recvbuf", "reduce_scatter-async-timedelta", "numpy-root", "allgather-allocates",
        "gather-allocates", "scatter-allocates", "reduce_scatter-allocates", "alltoall-timedelta",
        "alltoallv-allocates", "alltoallv-async", "allgatherv-allocates",
        "gatherv-root-allocates", "scatterv-async", "reduce_scatterv-timedelta"])
def test_the_other_collectives_other_forms_take_the_python_path(trio, python_calls, kind, call):
    if kind == "gather":
        # every rank the root of its own gather, one after the other
        trio.run(lambda ctx: [ctx.gather(np.ones(2), None, root=k) for k in range(3)])
        assert python_calls["gather"] == 3      # the root's (allocating) call of each
        return
    if kind == "gatherv":
        trio.run(lambda ctx: [ctx.gatherv(np.ones(1), None, [1, 1, 1], root=k)
                              for k in range(3)])
        assert python_calls["gatherv"] == 3
        return
    trio.run(call)
    assert python_calls[kind] == 3


def _two_to_self(ctx):
    """alltoallv counts of 2 elements to this rank itself and 1 to each other one (the
    same on both sides: the matrix of counts is symmetric)."""
    return [1 + (p == ctx.rank) for p in range(ctx.size)]


def test_the_compiled_path_records_every_kind_as_the_python_path_does(monkeypatch):
    # The same call once compiled, once queued (async_op=True: the Python path, or for
    # reduce and allgather the compiled path's queue): the two entries agree in everything
    # but the sequence number and the times.
    monkeypatch.setenv("PYCOLLECT_TRACE_SIZE", "64")
    group = ThreadGroup(3, timeout=30)
    calls = [
        lambda ctx, a: ctx.reduce(np.ones(5, np.float32), 2, async_op=a),
        lambda ctx, a: ctx.allgather(np.ones(2, np.int32), np.empty(6, np.int32), async_op=a),
        lambda ctx, a: ctx.gather(np.ones(2, np.int8), np.empty(6, np.int8) if ctx.rank == 1
                                  else None, root=1, async_op=a),
        lambda ctx, a: ctx.scatter(np.ones(9, np.float64) if ctx.rank == 0 else None,
                                   np.empty(3, np.float64), root=0, async_op=a),
        lambda ctx, a: ctx.reduce_scatter(np.ones(6, np.int64), np.empty(2, np.int64),
                                          async_op=a),
        lambda ctx, a: ctx.alltoall(np.ones(3, np.uint8), np.empty(3, np.uint8), async_op=a),
        lambda ctx, a: ctx.alltoallv(np.ones(4, np.int16), _two_to_self(ctx),
                                     np.empty(4, np.int16), _two_to_self(ctx), async_op=a),
        lambda ctx, a: ctx.allgatherv(np.ones(ctx.rank, np.float32), np.empty(3, np.float32),
                                      [0, 1, 2], async_op=a),
        lambda ctx, a: ctx.reduce_scatterv(np.ones(5, np.int32),
                                           np.empty([2, 1, 2][ctx.rank], np.int32), [2, 1, 2],
                                           async_op=a),
        lambda ctx, a: ctx.gatherv(np.ones(ctx.rank, np.uint16), np.empty(3, np.uint16)
                                   if ctx.rank == 2 else None, [0, 1, 2], root=2, async_op=a),
        lambda ctx, a: ctx.scatterv(np.ones(3, np.float32) if ctx.rank == 1 else None,
                                    [1, 0, 2], np.empty([1, 0, 2][ctx.rank], np.float32),
                                    root=1, async_op=a),
    ]

    def body(ctx):
        pairs = []
        for call in calls:
            call(ctx, False)
            work = call(ctx, True)
            work.wait()
            fast, slow = ctx._recorder.entries()[-2:]
            pairs.append((fast, slow))
        return pairs
    try:
        results = group.run(body)
    finally:
        group.close()
    for pairs in results:
        for fast, slow in pairs:
            assert fast[8] == slow[8] == "completed"
            assert fast[1] + 1 == slow[1]
            for field in (2, 3, 4, 5, 6, 7):        # name, algorithm, dtype, count, root, peers
                assert fast[field] == slow[field], (fast[2], field, fast[field], slow[field])


def test_a_root_that_allocates_takes_the_python_path_alone(monkeypatch):
    # gather's root with recvbuf=None goes straight to the Python path, which allocates
    # it: one recorder entry for the call, none refused on the way.
    monkeypatch.setenv("PYCOLLECT_TRACE_SIZE", "16")
    group = ThreadGroup(2, timeout=30)

    def body(ctx):
        before = ctx._recorder.recorded
        got = ctx.gather(np.ones(2), None, root=1)
        entries = ctx._recorder.entries()
        return ctx._recorder.recorded - before, entries[-1][8], None if got is None else got.size
    try:
        assert group.run(body) == [(1, "completed", None), (1, "completed", 4)]
    finally:
        group.close()


def test_blocking_send_and_recv_on_arrays_stay_compiled(python_calls):
    group = ThreadGroup(2, timeout=30)

    def body(ctx):
        before = ctx._seq
        peer = 1 - ctx.rank
        got = np.zeros(3, np.int32)
        if ctx.rank == 0:
            ctx.send(np.arange(3, dtype=np.int32), 1, tag=7)
            src = ctx.recv(got, pc.ANY_SOURCE, tag=pc.ANY_TAG, timeout=20)
        else:
            src = ctx.recv(got, 0, tag=7)
            ctx.send(got * 2, peer, timeout=20.0)
        return src, got.tolist(), ctx._seq - before
    try:
        assert group.run(body) == [(1, [0, 2, 4], 0), (0, [0, 1, 2], 0)]   # no seq used
        assert python_calls["send"] == python_calls["recv"] == 0
    finally:
        group.close()


def test_async_sends_and_receives_of_arrays_take_no_python_path(python_calls):
    """Begun on the calling thread (Runner.claim), a status object included."""
    group = ThreadGroup(2, timeout=30)

    def body(ctx):
        peer = 1 - ctx.rank
        st = pc.Status()
        got = np.zeros(3)
        works = [ctx.send(np.full(3, ctx.rank + 1.0), peer, tag=4, async_op=True),
                 ctx.recv(got, pc.ANY_SOURCE, tag=4, async_op=True, status=st)]
        pc.wait_all(works)
        return got.tolist(), (st.source, st.count, st.tag), works[1].result()
    try:
        (got0, st0, r0), (got1, st1, r1) = group.run(body)
        assert got0 == [2.0] * 3 and got1 == [1.0] * 3
        assert st0 == (1, 3, 4) and st1 == (0, 3, 4) and tuple(r0) == (1, 3)
        assert python_calls["send"] == python_calls["recv"] == 0
    finally:
        group.close()


@pytest.mark.parametrize("kind, sender, receiver", [
    ("recv", lambda ctx, a: ctx.send(a, 1), lambda ctx, a: ctx.recv(a, 0, status=pc.Status())),
    ("recv", lambda ctx, a: ctx.send(a, 1), lambda ctx, a: ctx.recv(a, np.int64(0))),
    ("recv", lambda ctx, a: ctx.send(a, 1), lambda ctx, a: ctx.recv(memoryview(a), 0)),
    ("send", lambda ctx, a: ctx.send(a, 1, timeout=datetime.timedelta(seconds=5)),
     lambda ctx, a: ctx.recv(a, 0)),
    ("send", lambda ctx, a: ctx.send(a, np.int32(1)), lambda ctx, a: ctx.recv(a, 0)),
], ids=["status", "numpy-src", "memoryview", "timedelta", "numpy-dst"])
def test_other_point_to_point_forms_take_the_python_path(python_calls, kind, sender, receiver):
    group = ThreadGroup(2, timeout=30)

    def body(ctx):
        a = np.full(2, 5.0) if ctx.rank == 0 else np.zeros(2)
        (sender if ctx.rank == 0 else receiver)(ctx, a)
        return a.tolist()
    try:
        assert group.run(body) == [[5.0, 5.0]] * 2
        assert python_calls[kind] == 1
    finally:
        group.close()


def test_a_message_waiting_in_the_mailbox_is_received_either_way(python_calls):
    # A message that arrived before its receive (while the rank received another) waits
    # in the mailbox; the context is then not "ready" and the Python path takes it.
    group = ThreadGroup(2, timeout=30)

    def body(ctx):
        if ctx.rank == 0:
            ctx.send(np.array([1.0]), 1, tag=1)
            ctx.send(np.array([2.0]), 1, tag=2)
            return None
        second, first = np.zeros(1), np.zeros(1)
        ctx.recv(second, 0, tag=2)          # tag 1's message is put aside meanwhile
        ctx.recv(first, 0, tag=1)
        return first[0], second[0]
    try:
        assert group.run(body)[1] == (1.0, 2.0)
        assert python_calls["recv"] == 1
    finally:
        group.close()


def test_the_compiled_path_records_send_and_recv_as_the_python_path_does(monkeypatch):
    monkeypatch.setenv("PYCOLLECT_TRACE_SIZE", "16")
    group = ThreadGroup(2, timeout=30)

    def body(ctx):
        a = np.ones(4, np.float32)
        for async_op in (False, True):
            if ctx.rank == 0:
                w = ctx.send(a, 1, tag=3, async_op=async_op)
            else:
                w = ctx.recv(a, 0, tag=3, async_op=async_op)
            if async_op:
                w.wait()
        return ctx._recorder.entries()[-2:]
    try:
        for fast, slow in group.run(body):
            assert fast[8] == slow[8] == "completed"
            assert fast[1] is None and slow[1] is None          # no sequence number
            for field in (2, 3, 4, 5, 6, 7):
                assert fast[field] == slow[field], (fast[2], field, fast[field], slow[field])
    finally:
        group.close()


def test_the_other_collectives_refuse_on_the_compiled_path_in_step(trio):
    def body(ctx):
        before = ctx._seq
        errors = []
        bad = [
            lambda: ctx.allgather(np.ones(2), np.empty(5)),
            lambda: ctx.reduce_scatter(np.ones(7), np.empty(2)),
            lambda: ctx.alltoall(np.ones(3, np.float32), np.empty(3, np.float64)),
            lambda: ctx.reduce(np.ones((4, 4))[:, 0], 0),
            lambda: ctx.alltoallv(np.ones(3), [1, -1, 3], np.empty(3), [1, 1, 1]),
            lambda: ctx.allgatherv(np.ones(2), np.empty(4), [2, 2]),
            lambda: ctx.reduce_scatterv(np.ones(3), np.empty(2), [1, 1, 1]),
            lambda: ctx.gatherv(np.ones(1), np.empty(3), [1, 1], root=0),
            lambda: ctx.scatterv(np.ones(3), [1, -2, 4], np.empty(1), root=2),
            lambda: ctx.allgatherv(np.ones(2), np.empty(6), [2.0, 2, 2]),
            lambda: ctx.reduce_scatterv(np.ones(6), np.empty(2), [2, 2 ** 70, 2]),
            # each count fits int64, their sum wraps to 0 in 64 bits (it passed the size
            # checks and wrote before the buffer: a segfault, or heap corruption)
            *(lambda fn=fn: fn([2 ** 63 - 1, 2 ** 63 - 1, 2]) for fn in (
                lambda c: ctx.alltoallv(np.zeros(0), c, np.zeros(0), c),
                lambda c: ctx.allgatherv(np.zeros(2 if ctx.rank == 2 else 0), np.zeros(0), c),
                lambda c: ctx.reduce_scatterv(np.zeros(0), np.zeros(c[ctx.rank] % 8), c),
                lambda c: ctx.gatherv(np.zeros(2 if ctx.rank == 2 else 0),
                                      np.zeros(0) if ctx.rank == 2 else None, c, root=2),
                lambda c: ctx.scatterv(np.zeros(0) if ctx.rank == 2 else None, c,
                                       np.zeros(c[ctx.rank] % 8), root=2))),
        ]
        for call in bad:
            with pytest.raises(pc.InvalidArgument) as info:
                call()
            errors.append(str(info.value))
        a = np.ones(1)
        ctx.allreduce(a)        # still in step on every rank
        return ctx._seq - before, a[0], errors
    for used, value, errors in trio.run(body):
        assert used == 17 and value == 3.0
        assert errors[0].startswith("allgather") and errors[1].startswith("reduce_scatter")
        assert errors[2].startswith("alltoall") and "C-contiguous" in errors[3]
        assert errors[4].startswith("alltoallv") and "negative count -1" in errors[4]
        assert errors[5].startswith("allgatherv") and "3 ranks" in errors[5]
        assert errors[6].startswith("reduce_scatterv"), errors[6]
        assert errors[7].startswith("gatherv") and "3 ranks" in errors[7], errors[7]
        assert errors[8].startswith("scatterv") and "negative" in errors[8], errors[8]
        assert errors[9].startswith("allgatherv") and "integer counts" in errors[9], errors[9]
        assert errors[10].startswith("reduce_scatterv") and "too large for rank 1" in errors[10]
        for error, what in zip(errors[11:], ("alltoallv: argument 'sendcounts'", "allgatherv",
                                             "reduce_scatterv", "gatherv", "scatterv")):
            assert error.startswith(what), error
            assert "adds up to more than 9223372036854775807 elements" in error, error


def test_named_algorithms_and_call_timeouts_stay_compiled(trio, python_calls):
    # Every flat algorithm by name, and a timeout= in seconds (int or float), take the
    # compiled path and give what auto gives.
    names = ("recursive_doubling", "halving_doubling", "ring", "ring_chunked", "bcube")

    def body(ctx):
        out = []
        for name in names:
            a = np.arange(40, dtype=np.float64) + ctx.rank
            ctx.allreduce(a, algorithm=name)
            out.append(a.tolist())
        a = np.full(6, ctx.rank, np.int32)
        ctx.allreduce(a, pc.ReduceOp.MAX, timeout=20)
        out.append(a.tolist())
        for name in ("binomial", "pipelined"):
            b = np.full(5, ctx.rank, np.float32)
            ctx.broadcast(b, root=1, algorithm=name, timeout=7.5)
            out.append(b.tolist())
        ctx.barrier(timeout=20)
        return out
    want = [(np.arange(40) * 3 + 3).tolist()] * len(names) + [[2] * 6] + [[1.0] * 5] * 2
    assert trio.run(body) == [want] * 3
    assert not any(python_calls.values()), python_calls


def test_sendrecv_on_arrays_stays_compiled_around_a_ring(trio, python_calls):
    """MPI_Sendrecv's commonest form: one batch of its own under the lock, the status filled,
    a send and a receive recorded; the buffers larger than the channel take several
    passes."""
    def body(ctx):
        n, r = ctx.size, ctx.rank
        got = np.zeros(3, np.float32)
        st = pc.Status()
        src = ctx.sendrecv(np.full(3, r, np.float32), (r + 1) % n, got, (r - 1) % n,
                           sendtag=7, recvtag=7, status=st)
        big = np.empty(300_000)
        anyone = ctx.sendrecv(np.full(300_000, float(r)), (r - 1) % n, big, timeout=20)
        names = [e[2] for e in ctx._recorder.entries()[-4:]]
        return src, got.tolist(), (st.source, st.count, st.tag), anyone, big[0], big[-1], names

    for r, (src, got, st, anyone, first, last, names) in enumerate(trio.run(body)):
        assert src == (r - 1) % 3 and got == [(r - 1) % 3] * 3
        assert st == ((r - 1) % 3, 3, 7)
        assert anyone == (r + 1) % 3 and first == last == (r + 1) % 3
        assert names == ["send", "recv", "send", "recv"], names
    assert not any(python_calls.values()), python_calls


def test_sendrecv_takes_its_message_from_the_mailbox_or_past_others(fresh_pair, python_calls):
    """The compiled sendrecv's other paths, with its own send in flight meanwhile: its
    message already parked in the mailbox (rank 1: an earlier receive passed tag 5 over),
    and other messages ahead of it on the wire (rank 0: tag 8 comes before the tag 9 it
    wants, and waits in the mailbox for the receive after)."""
    def body(ctx):
        if ctx.rank == 0:
            ctx.send(np.full(2, 5.0), 1, tag=5)
            ctx.send(np.full(2, 6.0), 1, tag=6)
            got = np.zeros(2)
            src = ctx.sendrecv(np.full(2, 7.0), 1, got, 1, sendtag=7, recvtag=9)
            eight, one = np.zeros(2), np.zeros(2)
            ctx.recv(eight, 1, tag=8)
            ctx.recv(one, 1, tag=1)
            return src, got.tolist(), eight.tolist(), one.tolist()
        six = np.zeros(2)
        ctx.recv(six, 0, tag=6)                 # parks tag 5
        ctx.send(np.full(2, 8.0), 0, tag=8)
        ctx.send(np.full(2, 9.0), 0, tag=9)
        got, seven = np.zeros(2), np.zeros(2)
        st = pc.Status()
        src = ctx.sendrecv(np.full(2, 1.0), 0, got, 0, sendtag=1, recvtag=5, status=st)
        ctx.recv(seven, 0, tag=7)
        return src, got.tolist(), (st.source, st.count, st.tag), seven.tolist()
    first, second = fresh_pair.run(body)
    assert first == (1, [9.0, 9.0], [8.0, 8.0], [1.0, 1.0]), first
    assert second == (0, [5.0, 5.0], (0, 2, 5), [7.0, 7.0]), second
    # The sends and receives made while a message waited in the mailbox took the Python
    # path (rank 1's two sends, rank 0's receive of tag 8); neither sendrecv did.
    assert python_calls["sendrecv"] == 0 and python_calls["send"] == 2, python_calls


def test_a_sendrecv_whose_waiting_message_does_not_fit_sends_nothing(fresh_pair):
    """The message parked in the mailbox is checked before the send goes out: where it does
    not fit the receive (another dtype), MismatchError, and the peer gets nothing."""
    def body(ctx):
        if ctx.rank == 0:
            ctx.send(np.ones(2, np.float64), 1, tag=5)
            ctx.send(np.ones(2, np.float64), 1, tag=6)
            ctx.barrier()
            return ctx.iprobe()
        ctx.recv(np.zeros(2, np.float64), 0, tag=6)     # parks tag 5
        with pytest.raises(pc.MismatchError, match="sendrecv: the message from rank 0 "
                                                   "with tag 5"):
            ctx.sendrecv(np.ones(2, np.float32), 0, np.zeros(2, np.float32), 0, sendtag=1,
                         recvtag=5)
        ctx.barrier()
        return None
    assert fresh_pair.run(body) == [None, None]


def test_sendrecv_refused_or_out_of_step_keeps_the_python_paths_words(trio, python_calls):
    def body(ctx):
        n, r = ctx.size, ctx.rank
        ro = np.zeros(2)
        ro.flags.writeable = False
        with pytest.raises(pc.InvalidArgument, match="recvbuf|read-only|writeable"):
            ctx.sendrecv(np.ones(2), (r + 1) % n, ro, (r - 1) % n)
        with pytest.raises(pc.InvalidArgument, match="not a rank|rank"):
            ctx.sendrecv(np.ones(2), n, np.zeros(2), (r - 1) % n)
        ctx.barrier()
        return ctx.iprobe()         # neither refusal sent anything
    assert trio.run(body) == [None] * 3
    assert python_calls["sendrecv"] == 6        # the two refusals, on every rank


@pytest.fixture
def fresh_pair():
    group = ThreadGroup(2, timeout=30)
    yield group
    group.close()


@pytest.mark.parametrize("path", ["compiled", "python"])
def test_a_sendrecv_whose_message_never_comes_times_out_alike_on_both_paths(fresh_pair, path):
    def body(ctx):
        if ctx.rank == 1:
            ctx.recv(np.zeros(2), 0, tag=1)
            return None
        call = ctx.sendrecv if path == "compiled" else ctx._sendrecv_any
        with pytest.raises(pc.Timeout) as info:
            call(np.ones(2), 1, np.zeros(2), 1, sendtag=1, recvtag=2, timeout=0.3)
        return str(info.value)
    text = fresh_pair.run(body)[0]
    assert text == "rank 0: a receive from rank 1 with tag 2 timed out after 0.3 s", text


def test_async_calls_on_arrays_are_queued_from_the_compiled_path(trio, python_calls):
    """barrier, broadcast, allreduce, reduce and allgather with async_op=True on arrays are
    checked and planned in compiled code and queued as they are; the results are right."""
    def body(ctx):
        a = np.full(4, ctx.rank + 1.0, np.float32)
        b = np.full(3, ctx.rank, np.int64)
        r = np.full(2, ctx.rank + 1, np.int32)
        g = np.empty(6, np.int16)
        works = [ctx.allreduce(a, async_op=True), ctx.broadcast(b, root=2, async_op=True),
                 ctx.barrier(async_op=True), ctx.reduce(r, root=1, async_op=True),
                 ctx.allgather(np.full(2, ctx.rank, np.int16), g, async_op=True),
                 ctx.allreduce(a, pc.MAX, "ring", async_op=True, timeout=20)]
        return [w.wait() for w in works], [w.algorithm for w in works]

    for rank, (results, algorithms) in enumerate(trio.run(body)):
        assert results[0].tolist() == [6.0] * 4 and results[1].tolist() == [2] * 3
        assert results[2] is None
        assert results[3].tolist() == ([6, 6] if rank == 1 else [rank + 1] * 2)
        assert results[4].tolist() == [0, 0, 1, 1, 2, 2]
        assert algorithms[5] == "ring"
    assert not any(python_calls.values()), python_calls


@pytest.mark.parametrize("call", [
    lambda ctx, a: ctx.allreduce(a, recvbuf=np.empty_like(a), async_op=True).wait(),
    lambda ctx, a: ctx.allreduce(a, recvbuf=np.empty_like(a)),
    lambda ctx, a: ctx.allreduce(a, timeout=datetime.timedelta(seconds=20)),
    lambda ctx, a: ctx.allreduce(a, timeout=np.float64(20)),
    lambda ctx, a: ctx.allreduce(a, algorithm="bcube:2"),
    lambda ctx, a: ctx.allreduce(a, pc.ReduceOp.SUM.value),
    lambda ctx, a: ctx.allreduce(a.tolist()[0]),
    lambda ctx, a: ctx.allreduce(memoryview(a)),
], ids=["async-recvbuf", "recvbuf", "timedelta", "numpy-timeout", "bcube-base", "int-op", "number",
        "memoryview"])
def test_every_other_form_takes_the_python_path(trio, python_calls, call):
    trio.run(lambda ctx: call(ctx, np.ones(4, np.float64)))
    assert python_calls["allreduce"] == 3


@pytest.mark.parametrize("kwargs, match", [
    (dict(timeout=0), "timeout must be a positive"),
    (dict(timeout=-2.0), "timeout must be a positive"),
    (dict(timeout=float("nan")), "timeout must be"),
    (dict(timeout=float("inf")), "timeout must be"),
    (dict(timeout=True), "timeout"),
    # 1e10 s wrapped past int64 nanoseconds: some ranks timed out at once, others went on
    (dict(timeout=1e10), "timeout must be at most 2000000 seconds"),
    (dict(timeout=2 * 10**6 + 1), "at most 2000000"),
    (dict(timeout=datetime.timedelta(days=24)), "at most 2000000"),
    (dict(algorithm="nope"), "unknown algorithm 'nope'"),
    (dict(algorithm="binomial"), "unknown algorithm 'binomial'"),
], ids=["zero", "negative", "nan", "inf", "bool", "huge", "huge-int", "huge-timedelta", "unknown",
        "broadcast's"])
def test_what_the_compiled_path_does_not_take_is_refused_as_before(trio, kwargs, match):
    def body(ctx):
        with pytest.raises(pc.InvalidArgument, match=match):
            ctx.allreduce(np.ones(3), **kwargs)
        a = np.ones(1)
        ctx.allreduce(a)        # still in step
        return a[0]
    assert trio.run(body) == [3.0] * 3


def test_a_call_timeout_on_the_compiled_path_is_its_deadline(python_calls):
    # The context allows 60 s; the call's own 0.3 s is what rank 0 waits for rank 1.
    group = ThreadGroup(2, timeout=60)
    try:
        def body(ctx):
            if ctx.rank == 1:
                return None
            start = time.monotonic()
            with pytest.raises(pc.Timeout):
                ctx.allreduce(np.ones(4), algorithm="ring", timeout=0.3)
            return time.monotonic() - start
        waited = group.run(body)[0]
        assert 0.25 <= waited < 10
        assert python_calls["allreduce"] == 0
    finally:
        group.close()


def test_both_paths_agree_on_every_result(trio):
    rng = np.random.default_rng(7)
    inputs = rng.integers(-50, 50, size=(3, 9)).astype(np.float64)

    def body(ctx):
        out = []
        for op in (pc.ReduceOp.SUM, pc.ReduceOp.PRODUCT, pc.ReduceOp.MIN, pc.ReduceOp.MAX,
                   pc.ReduceOp.AVG):
            fast = inputs[ctx.rank].copy()
            ctx.allreduce(fast, op)
            slow = ctx.allreduce(inputs[ctx.rank].copy(), op,
                                 timeout=datetime.timedelta(seconds=20))
            queued = ctx.allreduce(inputs[ctx.rank].copy(), op, async_op=True).wait()
            out.append((op, fast, slow, queued))
        return out
    for per_rank in trio.run(body):
        for op, fast, slow, queued in per_rank:
            # the three paths agree, and agree with NumPy (a bug all three shared would not
            # show between them)
            np.testing.assert_array_equal(fast, slow)
            np.testing.assert_array_equal(fast, queued)
            np.testing.assert_allclose(fast, reduce_reference("float64", list(inputs), op),
                                       rtol=1e-12)


def test_both_paths_share_one_numbering(trio):
    def body(ctx):
        before = ctx._seq
        a = np.ones(2, np.int32)
        later = datetime.timedelta(seconds=20)
        ctx.allreduce(a)                        # compiled
        ctx.allreduce(a, timeout=later)         # Python
        ctx.allreduce(a, async_op=True).wait()  # compiled, queued
        ctx.barrier()                           # compiled
        ctx.barrier(timeout=later)              # Python
        ctx.barrier(async_op=True).wait()       # compiled, queued
        return ctx._seq - before, a.tolist()
    assert trio.run(body) == [(6, [27, 27])] * 3


def test_arguments_refused_on_the_compiled_path_are_refused_in_step(trio):
    # Each refusal uses its call's number on every rank, as the peers are told of it
    # (docs/errors.md, "One rank refuses"): five refusals and one allreduce.
    def body(ctx):
        before = ctx._seq
        ro = np.ones(3, np.float32)
        ro.flags.writeable = False
        errors = []
        for bad in (ro, np.ones((4, 4), np.float32)[:, 1], np.ones(2, np.dtype(">f4")),
                    np.array(["x"])):
            with pytest.raises(pc.InvalidArgument) as info:
                ctx.allreduce(bad)
            errors.append(str(info.value))
        with pytest.raises(pc.InvalidArgument, match="not a rank"):
            ctx.broadcast(np.ones(1), root=3)
        a = np.ones(1)
        ctx.allreduce(a)        # still in step on every rank
        return ctx._seq - before, a[0], errors
    for used, value, errors in trio.run(body):
        assert used == 6 and value == 3.0
        assert "read-only" in errors[0] and "C-contiguous" in errors[1]
        assert "byte order" in errors[2] and "unsupported dtype" in errors[3]


def test_the_compiled_path_records_what_the_python_path_does(monkeypatch):
    monkeypatch.setenv("PYCOLLECT_TRACE_SIZE", "50")
    group = ThreadGroup(2, timeout=30)
    line = inspect.currentframe().f_lineno + 4      # the allreduce below

    def body(ctx):
        a = np.zeros(7, np.float32)
        ctx.allreduce(a)
        ctx.broadcast(a, root=1)
        ctx.barrier()
        return ctx._recorder.entries()[-3:]
    try:
        start = time.time_ns()
        results = group.run(body)
        end = time.time_ns()
    finally:
        group.close()
    for entries in results:
        ar, bc, ba = entries
        assert [e[2] for e in entries] == ["allreduce", "broadcast", "barrier"]
        assert [e[8] for e in entries] == ["completed"] * 3
        assert ar[1] + 1 == bc[1] and bc[1] + 1 == ba[1]        # consecutive seqs
        assert str(ar[4]) == "float32" and ar[5] == 7 and ar[6] is None
        assert bc[6] == 1 and ba[4] is None and ba[5] is None
        assert ar[3] and bc[3] and ba[3]                        # the algorithms that ran
        for e in entries:
            assert start <= e[9] <= e[10] <= e[11] <= end
            code, at = e[12]
            assert code.co_filename == __file__ and code.co_name == "body"
        assert ar[12][1] == line


def test_the_recorder_finds_the_callers_line_from_frames_of_every_kind():
    # The caller's frame is found from the interpreter's frames in place (3.11, 3.12) or
    # through frame objects: a fresh function frame each call, a comprehension, a
    # generator, a thread's first frame, and calls through the package's own Python
    # code (a sub-group's Python path) all name the user's line.
    ctx = pc.init(rank=0, size=1, store="hash://recorder-frames", timeout=30)
    buf = np.zeros(2, np.float32)
    here = inspect.currentframe().f_lineno

    def step():
        ctx.allreduce(buf)                                  # here + 3

    def gen():
        yield ctx.broadcast(buf)                            # here + 6
    try:
        for _ in range(3):
            step()
        [ctx.barrier() for _ in range(2)]                   # here + 10
        list(gen())
        t = threading.Thread(target=step)
        t.start()
        t.join(30)
        ctx.allreduce(buf, async_op=True).wait()            # here + 15
        entries = ctx._recorder.entries()
        got = [(e[2], e[12][0].co_filename, e[12][1] - here) for e in entries]
        assert got == ([("allreduce", __file__, 3)] * 3 + [("barrier", __file__, 10)] * 2
                       + [("broadcast", __file__, 6), ("allreduce", __file__, 3),
                          ("allreduce", __file__, 15)])
    finally:
        ctx.close()


def test_a_failure_on_the_compiled_path_fails_the_context_and_its_entry(monkeypatch):
    monkeypatch.setenv("PYCOLLECT_TRACE_SIZE", "10")
    group = ThreadGroup(2, timeout=3)
    try:
        def body(ctx):
            if ctx.rank == 1:
                return None     # never arrives: rank 0's allreduce meets its deadline
            with pytest.raises(pc.Timeout):
                ctx.allreduce(np.ones(4))
            entry = ctx._recorder.entries()[-1]
            with pytest.raises(pc.Timeout, match="failed earlier"):
                ctx.allreduce(np.ones(4))
            return entry
        entry = group.run(body)[0]
        assert entry[2] == "allreduce" and entry[8] == "failed"
        assert entry[13].startswith("Timeout: ")
    finally:
        group.close()


def test_a_closed_context_refuses_the_compiled_calls():
    ctx = pc.init(rank=0, size=1, store="hash://call-path-closed", timeout=10)
    ctx.close()
    for call in (ctx.barrier, lambda: ctx.allreduce(np.ones(1)),
                 lambda: ctx.broadcast(np.ones(1))):
        with pytest.raises(pc.Error, match="closed"):
            call()


def test_one_rank_results():
    ctx = pc.init(rank=0, size=1, store="hash://call-path-one", timeout=10)
    try:
        a = np.arange(4, dtype=np.int16)
        assert ctx.allreduce(a) is a and a.tolist() == [0, 1, 2, 3]
        assert ctx.broadcast(a) is a and ctx.barrier() is None
        b = np.arange(3, dtype=np.float64)
        ctx.allreduce(b, pc.ReduceOp.AVG)
        assert b.tolist() == [0.0, 1.0, 2.0]
    finally:
        ctx.close()


def test_async_calls_in_a_world_of_one_end_in_the_call():
    """A world of one has nothing to wait for: an async collective runs in the call, as a
    blocking one does, and its handle has ended when it is returned (no runner thread is
    started for it); an error, here abort()'s, is its wait's to raise."""
    ctx = pc.init(rank=0, size=1, store="hash://call-path-solo-async", timeout=10)

    def runners():
        return [t for t in threading.enumerate() if t.name.startswith("pycollect-rank")]

    before = runners()
    try:
        a = np.arange(4, dtype=np.float32)
        works = [ctx.allreduce(a, pc.ReduceOp.MAX, async_op=True), ctx.barrier(async_op=True),
                 ctx.broadcast(a, async_op=True), ctx.reduce(a, async_op=True)]
        recv = np.zeros(4, np.float32)
        works.append(ctx.allgather(a, recv, async_op=True))
        rs = np.zeros(4, np.float32)
        works.append(ctx.reduce_scatter(a, rs, async_op=True))
        a2a = np.zeros(4, np.float32)
        works.append(ctx.alltoall(a, a2a, async_op=True))
        ended = [w.is_completed() for w in works]      # the first look at each
        results = [w.wait(timeout=5) for w in works]
        assert ended == [True] * len(works)
        assert results[0] is a and results[1] is None and results[2] is a
        assert works[0].algorithm is not None
        assert a.tolist() == recv.tolist() == rs.tolist() == a2a.tolist() == [0, 1, 2, 3]
        assert runners() == before
        ctx.abort()
        failed = ctx.allreduce(a, async_op=True)
        assert failed.is_completed()
        with pytest.raises(pc.Aborted, match="abort"):
            failed.wait(timeout=5)
    finally:
        ctx.close()


def test_a_world_of_one_keeps_the_gil_and_still_sees_abort_and_bad_arguments():
    """A world of one has nothing to wait for (``solo``): its calls keep the GIL, and still
    refuse what they refused and fail after abort(); a sub-group of one is not solo (its
    begin may wait for the parent's sends) and runs as before."""
    ctx = pc.init(rank=0, size=1, store="hash://call-path-solo", timeout=10)
    try:
        assert ctx._transport.solo
        with pytest.raises(pc.InvalidArgument, match="BAND"):
            ctx.allreduce(np.ones(2, np.float32), pc.ReduceOp.BAND)
        with pytest.raises(pc.InvalidArgument, match="C-contiguous"):
            ctx.broadcast(np.ones(4, np.float32)[::2])
        ctx.barrier()
        ctx.abort()
        with pytest.raises(pc.Aborted, match="abort"):
            ctx.barrier()
    finally:
        ctx.close()
    g = ThreadGroup(2, timeout=30)
    try:
        def body(c):
            sub = c.new_group([c.rank])
            a = np.full(3, c.rank + 1.0)
            sub.allreduce(a)
            sub.barrier()
            return c._transport.solo, sub._transport.solo, a.tolist()
        for rank, (world, sub, a) in enumerate(g.run(body)):
            assert (world, sub, a) == (False, False, [rank + 1.0] * 3)
    finally:
        g.close()


def test_the_ring_keeps_the_last_entries_and_ignores_stale_ids():
    rec = Recorder(0, 1, 3)
    ids = [rec.record("allreduce", np.ones(i + 1), None, None) for i in range(5)]
    assert ids == [0, 1, 2, 3, 4]
    rec.started(0, 9)           # overwritten: nothing happens
    rec.ended(1, "ring")
    rec.started(4, 11)
    rec.ended(4, "ring", pc.PeerError("gone"))
    entries = rec.entries()
    assert [e[0] for e in entries] == [2, 3, 4]
    assert [e[5] for e in entries] == [3, 4, 5]
    assert [e[8] for e in entries] == ["queued", "queued", "failed"]
    assert entries[2][1] == 11 and entries[2][3] == "ring"
    assert entries[2][13] == "PeerError: gone"
    assert all(e[1] is None for e in entries[:2])


def test_the_ring_counts_a_torch_tensor_by_its_elements():
    torch = pytest.importorskip("torch")
    rec = Recorder(0, 1, 4)
    rec.record("allreduce", torch.zeros(2, 3), None, None)
    assert rec.entries()[0][5] == 6


def test_a_recorder_needs_a_positive_capacity():
    for bad in (0, -1, 2.0, True):
        with pytest.raises(pc.InvalidArgument, match="capacity"):
            Recorder(0, 1, bad)


def test_the_call_lock_excludes_and_releases():
    lock = CallLock()
    order = []
    taken = threading.Event()

    def other():
        taken.wait(10)
        with lock:
            order.append("other")
    with lock:
        t = threading.Thread(target=other, daemon=True)
        t.start()
        taken.set()
        time.sleep(0.05)
        order.append("first")
    t.join(10)
    assert order == ["first", "other"]
    with pytest.raises(ZeroDivisionError):
        with lock:
            1 / 0
    with lock:      # released by the error above
        pass


def _all_finish(body, n, within=30.0):
    """Run ``body`` in ``n`` threads at once; whether all of them end within ``within`` s."""
    threads = [threading.Thread(target=body, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    end = time.monotonic() + within
    for t in threads:
        t.join(max(0.0, end - time.monotonic()))
    return not any(t.is_alive() for t in threads)


def test_the_call_lock_admits_one_thread_at_a_time_and_loses_no_waiter():
    # Four threads take the lock 300 times each and, holding it, read a counter, give the
    # GIL away (time.sleep(0)) and write it back: a second holder would lose increments,
    # and a waiter that missed its wake-up would hang the join.
    lock = CallLock()
    count = [0]
    inside = [0]
    overlaps = []

    def body():
        for _ in range(300):
            with lock:
                inside[0] += 1
                if inside[0] != 1:
                    overlaps.append(inside[0])
                seen = count[0]
                time.sleep(0)
                count[0] = seen + 1
                inside[0] -= 1
    assert _all_finish(body, 4)
    assert overlaps == [] and count[0] == 1200


def test_threads_sharing_a_context_run_its_compiled_calls_one_at_a_time():
    ctx = pc.init(rank=0, size=1, store="hash://call-lock-threads", timeout=30)
    try:
        first = ctx._seq
        buf = np.ones(4, np.float32)

        def body():
            for _ in range(500):
                ctx.barrier()
                ctx.allreduce(buf)
        assert _all_finish(body, 3)
        assert ctx._seq - first == 3000     # every call numbered once
        assert buf.tolist() == [1.0] * 4
    finally:
        ctx.close()
