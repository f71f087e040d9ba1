"""Async direct allreduces and allgathers begun in steps (pycollect/_ext/_allreduce.pyx:
``allreduce_begin``, ``allreduce_step``, ``allreduce_end``; _allgather.pyx likewise): the
call stages the buffer (an allreduce's) and sends its hello; a poll that finds every peer's
hello reduces this rank's slice, or writes this rank's block into every peer's recvbuf, and
releases it (``Queued.advance``); a poll that finds every peer's release ends it.  The
messages are the blocking call's, so a rank that runs it whole meets one that runs it in
steps; nothing else is begun behind it until it ends."""

import threading
import time

import numpy as np
import pytest

import pycollect as pc
from group import ThreadGroup, poll_to_end as _poll, without_runner
from jobs import last_json, run_script


@pytest.fixture(scope="module", params=[2, 3, 4])
def group(request):
    g = ThreadGroup(request.param, timeout=30)
    yield g
    g.close()


@pytest.mark.parametrize("pooled", [False, True], ids=["plain", "pc.empty"])
@pytest.mark.parametrize("size", [2, 3, 4])
def test_polls_alone_end_it_with_every_value_right(size, pooled, monkeypatch):
    """Dtypes and ops, plain (staged) and pc.empty buffers, sizes that split unevenly,
    each rank late in turn, no runner: polls alone end every call (its callback runs on
    the polling thread), named direct, with the blocking allreduce's values."""
    without_runner(monkeypatch)
    cases = [(np.float32, pc.SUM, 4096), (np.int64, pc.PRODUCT, 1001), (np.float64, pc.AVG, 3),
             (np.int32, pc.MAX, 70001), (np.float32, pc.SUM, 1 << 18)]
    g = ThreadGroup(size, timeout=30)
    try:
        def body(ctx):
            out = []
            for i, (dtype, op, n) in enumerate(cases):
                ctx.barrier()
                if ctx.rank == i % size:
                    time.sleep(0.05)    # the peers' hellos are here before this rank begins
                buf = pc.empty(n, dtype) if pooled else np.empty(n, dtype)
                buf[:] = (np.arange(n) % 5 + ctx.rank + 1).astype(dtype)
                work = ctx.allreduce(buf, op=op, algorithm="direct", async_op=True)
                ended = _poll(work, 10)
                got = work.wait(timeout=1)
                out.append((ended == [threading.current_thread()], work.algorithm,
                            got.tolist() == _expected(dtype, op, n, size).tolist()))
            return out

        assert g.run(body) == [[(True, "direct", True)] * len(cases)] * size
    finally:
        g.close()


def _expected(dtype, op, n, size):
    parts = [(np.arange(n) % 5 + r + 1).astype(dtype) for r in range(size)]
    if op == pc.SUM:
        return np.sum(parts, axis=0, dtype=dtype)
    if op == pc.PRODUCT:
        return np.prod(parts, axis=0, dtype=dtype)
    if op == pc.MAX:
        return np.max(parts, axis=0)
    return (np.sum(parts, axis=0, dtype=dtype) / size).astype(dtype)


def test_auto_begins_it_and_it_meets_blocking_and_queued_calls(group):
    """auto's pick for 4096 floats on shared memory is direct, begun in the call; one rank
    runs the same allreduce blocking (the same messages), the others begin it; calls made
    behind a begun one (an async barrier, a small allreduce through the flags, a second
    direct one) are queued, not begun, and every value is right; a wait ends the call."""
    size = group.size

    def body(ctx):
        out = []
        for blocking in range(size):
            buf = np.full(4096, ctx.rank + 1.0, np.float32)
            if ctx.rank == blocking:
                ctx.allreduce(buf)
                first = None
            else:
                first = ctx.allreduce(buf, async_op=True)
            behind = [ctx.barrier(async_op=True),
                      ctx.allreduce(np.full(2, float(ctx.rank)), async_op=True),
                      ctx.allreduce(np.full(4096, 2.0 * ctx.rank, np.float32), async_op=True)]
            small, second = behind[1].wait(timeout=20), behind[2].wait(timeout=20)
            if first is not None:
                first.wait(timeout=20)
            out.append((bool(np.all(buf == size * (size + 1) / 2)),
                        None if first is None else first.algorithm, behind[0].wait(timeout=20),
                        small.tolist(), bool(np.all(second == size * (size - 1)))))
        return out

    res = group.run(body)
    total = float(size * (size - 1) / 2)
    for rank, rows in enumerate(res):
        for blocking, row in enumerate(rows):
            assert row == (True, None if rank == blocking else "direct", None,
                           [total, total], True), res


def test_nothing_is_begun_behind_it_on_the_streams():
    """In a sub-group of a shared-memory job (no flag area) small allreduces are exchanges
    begun in the call, on the same streams as the direct allreduce's hello and release: one
    begun behind a begun direct allreduce would put its message between them.  Many in a
    row, polled in turns with the peer: every value right."""
    g = ThreadGroup(3, timeout=30)
    try:
        def body(ctx):
            sub = ctx.split(0 if ctx.rank < 2 else 1)
            if ctx.rank == 2:
                return None
            assert sub._transport.flag_area is None
            out = []
            for i in range(6):
                big = np.full(4096, sub.rank + 1.0 + i, np.float32)
                works = [sub.allreduce(big, algorithm="direct", async_op=True),
                         sub.allreduce(np.full(3, 10.0 * (sub.rank + 1)), async_op=True),
                         sub.allreduce(np.full(4096, 1.0, np.float32), algorithm="direct",
                                       async_op=True)]
                if (i + sub.rank) % 2:
                    for w in works:
                        _poll(w)
                values = [w.wait(timeout=20) for w in works]
                out.append((bool(np.all(values[0] == 3.0 + 2 * i)), values[1].tolist(),
                            bool(np.all(values[2] == 2.0)), works[0].algorithm))
            return out

        res = g.run(body)
        assert res[:2] == [[(True, [30.0] * 3, True, "direct")] * 6] * 2, res
    finally:
        g.close()


_UNPOLLED = r"""
import json, sys, time
import numpy as np
import pycollect as pc
rank, store = int(sys.argv[1]), sys.argv[2]
ctx = pc.init(rank=rank, size=2, store=store, timeout=60, transport="shm")
ctx.barrier()
buf = np.full(4096, rank + 1.0, np.float32)
work = ctx.allreduce(buf, async_op=True)
if rank == 0:
    time.sleep(3.0)         # neither polls nor waits: the runner takes the begun call
    waited = None
else:
    t0 = time.monotonic()
    work.wait(timeout=30)
    waited = time.monotonic() - t0
value, algorithm = float(work.wait(timeout=30)[0]), work.algorithm
ctx.close()
print(json.dumps({"waited": waited, "value": value, "algorithm": algorithm}))
"""


def test_the_runner_ends_it_for_a_rank_that_neither_polls_nor_waits(tmp_path):
    """Rank 0 begins a direct allreduce and sleeps for 3 s without looking at it: its
    runner takes the begun call at its next look, so rank 1's wait (whose end needs rank
    0's slice) ends long before rank 0 looks."""
    procs = run_script(tmp_path, _UNPOLLED, size=2)
    results = last_json(procs, (0, 1), timeout=60)
    assert results[1]["waited"] < 1.0, results
    assert [(r["value"], r["algorithm"]) for r in results] == [(3.0, "direct")] * 2, results


@pytest.mark.parametrize("end", ["mismatch", "abort", "peer closes"])
def test_it_fails_as_a_blocking_one_would(end, monkeypatch):
    """The peer's disagreement (its count differs) is a MismatchError; abort() from another
    thread fails it at once; a peer that closes instead fails it with PeerError naming the
    peer, found by a poll (the runner never runs here).  Nothing hangs."""
    if end == "peer closes":
        without_runner(monkeypatch)
    g = ThreadGroup(2, timeout=30)
    try:
        gone = threading.Event()

        def body(ctx):
            if ctx.rank == 1:
                if end == "mismatch":
                    with pytest.raises(pc.MismatchError):
                        ctx.allreduce(np.ones(5000, np.float32), algorithm="direct")
                elif end == "peer closes":
                    ctx.close()
                    gone.set()
                else:
                    time.sleep(1.5)
                return None
            gone.wait(10 if end == "peer closes" else 0)
            work = ctx.allreduce(np.ones(4096, np.float32), algorithm="direct",
                                 async_op=True)
            if end == "abort":
                threading.Timer(0.3, ctx.abort).start()
            started = time.monotonic()
            _poll(work, 10)
            with pytest.raises(pc.Error) as caught:
                work.wait(timeout=10)
            return type(caught.value), str(caught.value), time.monotonic() - started

        res = g.outcomes(body, timeout=60)
        kind, text, took = res[0]
        assert kind is {"mismatch": pc.MismatchError, "abort": pc.Aborted,
                        "peer closes": pc.PeerError}[end], res
        assert end != "peer closes" or "rank 1" in text, res
        assert took < 5, res
    finally:
        g.close()


@pytest.mark.parametrize("pooled", [False, True], ids=["plain", "pc.empty"])
@pytest.mark.parametrize("size", [2, 3, 4])
def test_polls_alone_end_a_direct_allgather(size, pooled, monkeypatch):
    """Allgathers run direct (asked for, and auto's pick), dtypes, the in-place form (the
    send block is this rank's block of recvbuf), each rank late in turn, no runner: polls
    alone end every call, on the polling thread, with every block in place."""
    without_runner(monkeypatch)
    cases = [(np.float32, 4096, "direct", False), (np.int64, 4097, "auto", False),
             (np.float64, 3, "direct", True), (np.uint8, 70001, "direct", False)]
    g = ThreadGroup(size, timeout=30)
    try:
        def body(ctx):
            out = []
            for i, (dtype, n, algorithm, in_place) in enumerate(cases):
                ctx.barrier()
                if ctx.rank == i % size:
                    time.sleep(0.05)
                recv = pc.empty(n * size, dtype) if pooled else np.empty(n * size, dtype)
                recv[:] = 0
                mine = recv[ctx.rank * n:(ctx.rank + 1) * n] if in_place else np.empty(n, dtype)
                mine[:] = (np.arange(n) + 7 * ctx.rank) % 100
                work = ctx.allgather(mine, recv, algorithm=algorithm, async_op=True)
                ended = _poll(work, 10)
                work.wait(timeout=1)
                want = np.concatenate([(np.arange(n) + 7 * r) % 100 for r in range(size)])
                out.append((ended == [threading.current_thread()], work.algorithm,
                            bool(np.array_equal(recv, want.astype(dtype)))))
            return out

        assert g.run(body) == [[(True, "direct", True)] * len(cases)] * size
    finally:
        g.close()


def test_a_begun_allgather_meets_blocking_calls_and_queued_ones(group):
    """One rank runs the allgather blocking, the others begin it; an allreduce and a second
    allgather made behind a begun one are queued; every value right."""
    size = group.size

    def body(ctx):
        out = []
        for blocking in range(size):
            send = np.full(512, ctx.rank + 1.0, np.float32)
            recv = np.zeros(512 * size, np.float32)
            if ctx.rank == blocking:
                ctx.allgather(send, recv, algorithm="direct")
                first = None
            else:
                first = ctx.allgather(send, recv, algorithm="direct", async_op=True)
            behind = [ctx.allreduce(np.full(4096, 1.0, np.float32), async_op=True),
                      ctx.allgather(np.full(3, float(ctx.rank)), np.zeros(3 * size),
                                    algorithm="direct", async_op=True)]
            total, gathered = behind[0].wait(timeout=20), behind[1].wait(timeout=20)
            if first is not None:
                first.wait(timeout=20)
            out.append((bool(np.array_equal(recv, np.repeat(np.arange(1.0, size + 1), 512))),
                        bool(np.all(total == size)),
                        gathered.tolist() == [float(r) for r in range(size) for _ in range(3)]))
        return out

    assert group.run(body) == [[(True, True, True)] * size] * size
