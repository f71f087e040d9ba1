"""A blocking collective made while async receives wait for their messages (MPI's Irecv,
then Allreduce, then Send and Wait, where each rank's message to its neighbour comes only
after that neighbour's allreduce): over shared memory, an allreduce, broadcast or barrier
of a small message runs at once on the flag area beside the waiting receives, which keep
their own deadline and get their messages afterwards.  Where it would read the pairs'
streams (TCP, large messages) it queues behind them, as docs/api.md says."""

import threading
import time

import numpy as np
import pytest

import pycollect as pc
from group import ThreadGroup


@pytest.fixture(params=[2, 3], ids=["2ranks", "3ranks"])
def group(request):
    g = ThreadGroup(request.param, timeout=8)
    assert all(ctx._transport.flag_area is not None for ctx in g.contexts)
    yield g
    g.close()


def _collective(ctx, kind, i):
    """Run one blocking ``kind`` of round ``i``; what every rank must get back."""
    if kind == "allreduce":
        return ctx.allreduce(np.full(3, float(ctx.rank + i), np.float32)).tolist()
    if kind == "broadcast":
        root = i % ctx.size
        buf = np.full(5, 10.0 * i + root) if ctx.rank == root else np.zeros(5)
        return ctx.broadcast(buf, root=root).tolist()
    ctx.barrier()
    return None


def _expected(kind, i, size):
    if kind == "allreduce":
        return [float(sum(r + i for r in range(size)))] * 3
    if kind == "broadcast":
        return [10.0 * i + i % size] * 5
    return None


@pytest.mark.parametrize("late", [False, True], ids=["parked", "runner-took-it"])
@pytest.mark.parametrize("kind", ["allreduce", "broadcast", "barrier"])
def test_a_collective_runs_beside_receives_whose_messages_come_after_it(group, kind, late):
    """Every rank receives from its left neighbour (async), runs the collective, then sends
    to its right neighbour and waits: the collective cannot wait for the receive.  With
    ``late``, the rank computes first, long enough for its runner to take the waiting
    receive up and drive it; the collective then gets the lock from the runner."""
    size = group.size

    def body(ctx):
        left, right = (ctx.rank - 1) % size, (ctx.rank + 1) % size
        out = []
        for i in range(3):
            got = np.zeros(2)
            w = ctx.recv(got, left, tag=40 + i, async_op=True)
            if late:
                time.sleep(0.03)
            result = _collective(ctx, kind, i)
            ctx.send(np.full(2, 100.0 * ctx.rank + i), right, tag=40 + i)
            st = w.wait(timeout=5)
            out.append((result, got.tolist(), (st.source, st.tag)))
        ctx.barrier()
        return out

    results = group.run(body, timeout=60)
    for rank, out in enumerate(results):
        left = (rank - 1) % size
        assert out == [(_expected(kind, i, size), [100.0 * left + i] * 2, (left, 40 + i))
                       for i in range(3)], (rank, out)


def test_messages_sent_before_and_after_the_collective_reach_their_receives(group):
    """Rank 0 posts receives for one message its peers send before their allreduce and one
    they send after; its allreduce runs beside both, and each receive gets its own."""
    size = group.size

    def body(ctx):
        if ctx.rank:
            ctx.send(np.full(2, 1.0 * ctx.rank), 0, tag=1)
            total = ctx.allreduce(np.ones(1)).tolist()
            ctx.send(np.full(2, 2.0 * ctx.rank), 0, tag=2)
            return total
        bufs = {(p, t): np.zeros(2) for p in range(1, size) for t in (1, 2)}
        works = [ctx.recv(b, p, tag=t, async_op=True) for (p, t), b in sorted(bufs.items())]
        total = ctx.allreduce(np.ones(1)).tolist()
        pc.wait_all(works, timeout=5)
        return total, {k: v.tolist() for k, v in bufs.items()}

    results = group.run(body, timeout=60)
    assert results[0] == ([float(size)], {(p, t): [float(t * p)] * 2
                                          for p in range(1, size) for t in (1, 2)})
    assert results[1:] == [[float(size)]] * (size - 1)


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


def test_over_tcp_a_collective_queues_behind_the_waiting_receives():
    """Without a flag area the collective would read the pairs' streams, where the peer's
    point-to-point messages may come first: it runs after the receives have ended, as
    before.  Here the messages were sent before the peers' collective, so all goes."""
    g = ThreadGroup(2, timeout=8, transport="tcp")
    try:
        def body(ctx):
            peer = 1 - ctx.rank
            got = np.zeros(2)
            w = ctx.recv(got, peer, tag=5, async_op=True)
            ctx.send(np.full(2, float(ctx.rank)), peer, tag=5)
            total = ctx.allreduce(np.ones(1)).tolist()
            return w.is_completed(), got.tolist(), total

        assert g.run(body, timeout=30) == [(True, [1.0] * 2, [2.0]), (True, [0.0] * 2, [2.0])]
    finally:
        g.close()
