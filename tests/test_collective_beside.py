"""A collective made while async receives wait for their messages (MPI's Irecv, then
Allreduce, then Send and Wait, where each rank's message to its neighbour comes only after
that neighbour's allreduce) runs beside the waiting receives, which keep their own deadline
and get their messages afterwards: a blocking allreduce, broadcast or barrier on the
calling thread (over shared memory's flag area, or reading the pairs' streams over TCP and
for large messages), any other collective, and async ones, from the runner's queue.  A
point-to-point message that the collective meets on a stream before the peer's part (the
peer sent it first) is read aside into the mailbox, where the receives look first; a
receive that finds the peer's part of a collective first waits behind it."""

import threading
import time

import numpy as np
import pytest

import pycollect as pc
from group import ThreadGroup, without_runner


@pytest.fixture(params=[("shm", 2), ("shm", 3), ("tcp", 2), ("tcp", 3)],
                ids=["shm-2ranks", "shm-3ranks", "tcp-2ranks", "tcp-3ranks"])
def group(request):
    transport, size = request.param
    g = ThreadGroup(size, timeout=8, transport=transport)
    assert all((ctx._transport.flag_area is not None) == (transport == "shm")
               for ctx in g.contexts)
    yield g
    g.close()


# Elements of a small message (the flag area's, over shared memory) and of a large one,
# which reads the pairs' streams on every transport (over 16 KiB).
COUNTS = {"small": 3, "large": 6000}


def _collective(ctx, kind, i, count=3, async_op=False):
    """Run one ``kind`` of round ``i`` on ``count`` elements; what every rank must get
    back (with ``async_op``: a function that waits for it and returns that)."""
    if kind == "allreduce":
        buf = np.full(count, float(ctx.rank + i), np.float32)
        got = ctx.allreduce(buf, async_op=async_op)
    elif kind == "broadcast":
        root = i % ctx.size
        buf = np.full(count, 10.0 * i + root) if ctx.rank == root else np.zeros(count)
        got = ctx.broadcast(buf, root=root, async_op=async_op)
    elif kind == "allgather":
        buf = np.full(count, float(ctx.rank + i))
        out = np.zeros(count * ctx.size)
        got = ctx.allgather(buf, out, async_op=async_op)
        buf = out
    else:
        got = ctx.barrier(async_op=async_op)
        buf = None
    done = (lambda: None) if buf is None else buf.tolist
    if not async_op:
        return done()
    return lambda: (got.wait(timeout=10), done())[1]


def _expected(kind, i, size, count=3):
    if kind == "allreduce":
        return [float(sum(r + i for r in range(size)))] * count
    if kind == "broadcast":
        return [10.0 * i + i % size] * count
    if kind == "allgather":
        return [float(r + i) for r in range(size) for _ in range(count)]
    return None


@pytest.mark.parametrize("late", [False, True], ids=["parked", "runner-took-it"])
@pytest.mark.parametrize("kind,count", [("allreduce", "small"), ("allreduce", "large"),
                                        ("broadcast", "small"), ("broadcast", "large"),
                                        ("barrier", "small")])
def test_a_collective_runs_beside_receives_whose_messages_come_after_it(group, kind, count,
                                                                          late):
    """Every rank receives from its left neighbour (async), runs the collective, then sends
    to its right neighbour and waits: the collective cannot wait for the receive.  With
    ``late``, the rank computes first, long enough for its runner to take the waiting
    receive up and drive it; the collective then gets the lock from the runner."""
    size, n = group.size, COUNTS[count]

    def body(ctx):
        left, right = (ctx.rank - 1) % size, (ctx.rank + 1) % size
        out = []
        for i in range(3):
            got = np.zeros(2)
            w = ctx.recv(got, left, tag=40 + i, async_op=True)
            if late:
                time.sleep(0.03)
            result = _collective(ctx, kind, i, n)
            ctx.send(np.full(2, 100.0 * ctx.rank + i), right, tag=40 + i)
            st = w.wait(timeout=5)
            out.append((result, got.tolist(), (st.source, st.tag)))
        ctx.barrier()
        return out

    results = group.run(body, timeout=60)
    for rank, out in enumerate(results):
        left = (rank - 1) % size
        assert out == [(_expected(kind, i, size, n), [100.0 * left + i] * 2, (left, 40 + i))
                       for i in range(3)], (rank, out)


@pytest.mark.parametrize("order", ["collective-first", "receive-first"])
@pytest.mark.parametrize("kind", ["allreduce", "broadcast", "allgather", "barrier"])
def test_a_queued_collective_runs_beside_the_waiting_receives(group, kind, order):
    """The same exchange with the collective async, or one the compiled call path does not
    run (allgather), so that it goes to the runner's queue behind the receive: the runner
    (or the wait that drives the queue) runs it beside the receive.  With
    "collective-first", the collective's wait comes before the send: it must end while the
    receive still waits."""
    size = group.size

    def body(ctx):
        left, right = (ctx.rank - 1) % size, (ctx.rank + 1) % size
        out = []
        for i in range(3):
            got = np.zeros(2)
            w = ctx.recv(got, left, tag=60 + i, async_op=True)
            finish = _collective(ctx, kind, i, 4, async_op=kind != "allgather")
            if kind == "allgather":
                result, finish = finish, None
            elif order == "collective-first":
                result, finish = finish(), None
            ctx.send(np.full(2, 100.0 * ctx.rank + i), right, tag=60 + i)
            st = w.wait(timeout=5)
            if finish is not None:
                result = finish()
            out.append((result, got.tolist(), (st.source, st.tag)))
        ctx.barrier()
        return out

    results = group.run(body, timeout=60)
    for rank, out in enumerate(results):
        left = (rank - 1) % size
        assert out == [(_expected(kind, i, size, 4), [100.0 * left + i] * 2, (left, 60 + i))
                       for i in range(3)], (rank, out)


def _fails_beside_a_receive(transport, peer_part, match):
    """Rank 0 posts a receive from rank 1 (tag 7) and runs an allreduce of 6000 floats beside
    it, which fails with MismatchError (``match``), and so does the receive's wait; rank 1
    runs ``peer_part(ctx)``, where a pycollect error is allowed (rank 0's failure may reach
    it first).  Nothing hangs."""
    g = ThreadGroup(2, timeout=4, transport=transport)
    try:
        def body(ctx):
            if ctx.rank == 1:
                try:
                    peer_part(ctx)
                except pc.Error:
                    pass
                return None
            w = ctx.recv(np.zeros(4), 1, tag=7, async_op=True)
            with pytest.raises(pc.MismatchError, match=match):
                ctx.allreduce(np.ones(6000, np.float32))
            with pytest.raises(pc.Error):
                w.wait(timeout=8)
            return True

        assert g.run(body, timeout=30) == [True, None]
    finally:
        g.close()


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_message_no_waiting_receive_takes_fails_the_collective(transport):
    """Rank 1 sends a message before its allreduce (tag 8) that no receive of rank 0 waits
    for, then the one rank 0's receive does wait for (tag 7): a message sent before a
    collective must be received before it.  Rank 0's allreduce fails with MismatchError
    naming tag 8, whether rank 0's receive found tag 8 first (parked in the mailbox, which
    the collective finds on entry) or the allreduce met it on the stream."""
    def peer_part(ctx):
        ctx.send(np.arange(4.0) + 8, 0, tag=8)
        ctx.allreduce(np.ones(6000, np.float32))
        ctx.send(np.arange(4.0) + 7, 0, tag=7)

    _fails_beside_a_receive(transport, peer_part, "tag 8")


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_large_message_read_aside_arrives_whole(transport):
    """A message of 12 MB sent before the peer's collective, for a receive that waits: over
    TCP it outgrows the socket's buffers, so the collective reads it aside in pieces
    between its own frames; over shared memory it is sent by address, and the collective
    copies it from the sender's memory and acknowledges it, which ends the sender's send."""
    g = ThreadGroup(2, timeout=15, transport=transport)
    big = np.arange(3 << 20, dtype=np.float32)
    try:
        def body(ctx):
            if ctx.rank == 1:
                s = ctx.send(big, 0, tag=2, async_op=True)
                ctx.allreduce(np.ones(6000, np.float32))
                ctx.send(np.ones(1), 0, tag=3)
                s.wait(timeout=10)
                return None
            got, small = np.zeros_like(big), np.zeros(1)
            works = [ctx.recv(small, 1, tag=3, async_op=True),
                     ctx.recv(got, 1, tag=2, async_op=True)]
            total = ctx.allreduce(np.ones(6000, np.float32))
            pc.wait_all(works, timeout=10)
            return total[0], bool(np.array_equal(got, big)), small[0]

        assert g.run(body, timeout=60)[0] == (2.0, True, 1.0)
    finally:
        g.close()


def test_the_receives_keep_their_deadline_across_the_collective():
    """A receive begun with a 0.6 s timeout whose message never comes still times out at
    its own deadline, though a barrier (with its own, longer one) ran beside it."""
    g = ThreadGroup(2, timeout=8)
    try:
        def body(ctx):
            if ctx.rank == 1:
                ctx.barrier(timeout=5)
                return None
            got = np.zeros(1)
            start = time.monotonic()
            w = ctx.recv(got, 1, tag=9, async_op=True, timeout=0.6)
            ctx.barrier(timeout=5)
            with pytest.raises(pc.Timeout, match="tag 9"):
                w.wait(timeout=5)
            return time.monotonic() - start

        took, _ = g.run(body, timeout=30)
        assert 0.5 < took < 3.0, took
    finally:
        g.close()


def test_a_peer_that_leaves_fails_the_collective_and_the_waiting_receive():
    """The peer closes instead of joining the allreduce: the allreduce run beside the
    receive fails with PeerError, and so does the receive's wait; nothing hangs."""
    g = ThreadGroup(2, timeout=8)
    peer_left = threading.Event()
    try:
        def body(ctx):
            if ctx.rank == 1:
                time.sleep(0.2)
                ctx.close()
                peer_left.set()
                return None
            got = np.zeros(1)
            w = ctx.recv(got, 1, tag=3, async_op=True)
            start = time.monotonic()
            with pytest.raises(pc.PeerError):
                ctx.allreduce(np.ones(2))
            with pytest.raises(pc.PeerError):
                w.wait(timeout=5)
            return time.monotonic() - start

        took, _ = g.run(body, timeout=30)
        assert took < 5.0, took
        assert peer_left.is_set()
    finally:
        g.close()


def test_over_tcp_messages_sent_before_the_collective_reach_the_waiting_receives(monkeypatch):
    """Without a flag area the collective reads the pairs' streams, where the peer's
    point-to-point message comes first: it is read aside and handed to the receive, whose
    handle has ended when the collective returns (the call moves the batch once, on its own
    thread: the runners here never run, and nothing looks at the handle before)."""
    without_runner(monkeypatch)
    g = ThreadGroup(2, timeout=8, transport="tcp")
    try:
        def body(ctx):
            peer = 1 - ctx.rank
            got = np.zeros(2)
            w = ctx.recv(got, peer, tag=5, async_op=True)
            ended_in = []
            w.add_done_callback(lambda _: ended_in.append(threading.current_thread()))
            ctx.send(np.full(2, float(ctx.rank)), peer, tag=5)
            total = ctx.allreduce(np.ones(1)).tolist()
            ended = ended_in == [threading.current_thread()]
            st = w.wait(timeout=5)
            return ended, got.tolist(), (st.source, st.tag), total

        assert g.run(body, timeout=30) == [(True, [1.0] * 2, (1, 5), [2.0]),
                                           (True, [0.0] * 2, (0, 5), [2.0])]
    finally:
        g.close()


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_collective_beside_the_receives_still_meets_disagreement(transport):
    """Rank 0 runs an allreduce beside its waiting receive while rank 1 runs a broadcast of
    the same size: rank 0's fails with MismatchError, and so does the receive's wait; rank
    1, the broadcast's root, may finish its part first."""
    _fails_beside_a_receive(
        transport, lambda ctx: ctx.broadcast(np.ones(6000, np.float32), root=1),
        "disagree")


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_receive_behind_a_collective_this_rank_never_runs_times_out(transport):
    """The peer's allreduce frame stands before the message the receive waits for, and
    this rank never calls allreduce: the receive waits behind the frame (it is no
    disagreement yet) until its own deadline, then fails with Timeout; the peer's
    allreduce fails at its deadline or when this rank's failure reaches it."""
    g = ThreadGroup(2, timeout=8, transport=transport)
    try:
        def body(ctx):
            if ctx.rank == 1:
                with pytest.raises((pc.Timeout, pc.PeerError)):
                    ctx.allreduce(np.ones(6000, np.float32), timeout=4)
                return None
            start = time.monotonic()
            w = ctx.recv(np.zeros(1), 1, tag=4, async_op=True, timeout=1.0)
            with pytest.raises(pc.Timeout):
                w.wait(timeout=8)
            return time.monotonic() - start

        took, _ = g.run(body, timeout=30)
        assert 0.8 < took < 4.0, took
    finally:
        g.close()
