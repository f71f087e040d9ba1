"""Mixed programs of blocking and async collectives, and sends and receives around a ring of
ranks: each rank runs the same calls, but makes each one blocking or async on its own (the
begun forms send the blocking call's messages, so a rank that begins a call meets one that
runs it whole), polls some handles, waits for others in batches, with sizes from one
element to past a segment and the algorithms named or auto's. Every value right, nothing
hangs: a test of the ways the calls begun in the call, queued, posted through the flags or
run beside each other meet on the same streams. Bounded: a fixed set of seeded programs of
40 calls."""

import random
import time

import numpy as np
import pytest

import pycollect as pc
from group import ThreadGroup

SIZES = [1, 3, 1000, 5000, 20000, 131073, 300000]
KINDS = ["allreduce", "allgather", "reduce_scatter", "alltoall", "broadcast", "barrier",
         "shift"]
ALGORITHMS = {"allreduce": ["auto", "recursive_doubling", "ring", "direct"],
              "allgather": ["auto", "ring", "direct"],
              "broadcast": ["auto", "binomial", "direct"]}
CALLS = 40
# A shift's messages go through the streams; from 8192 float64 (64 KiB) by address on shared
# memory, where the sender's blocking send ends only once the receiver has read it, which a
# collective run beside the receive does for it on every stream.
SHIFT_MAX = 300000


def _program(seed):
    """The calls of one program: (kind, n, algorithm, root), the same on both ranks."""
    rng = random.Random(seed)
    out = []
    for _ in range(CALLS):
        kind = rng.choice(KINDS)
        n = rng.choice(SIZES)
        out.append((kind, min(n, SHIFT_MAX) if kind == "shift" else n,
                    rng.choice(ALGORITHMS.get(kind, ["auto"])), rng.randrange(4)))
    return out


def _value(rank, i, n):
    """Rank ``rank``'s input to call ``i``: small integers (exact in float64 sums)."""
    return ((np.arange(n) + 5 * i + 11 * rank) % 13).astype(np.float64)


def _expected(kind, i, n, root, rank, size):
    inputs = [_value(r, i, n) for r in range(size)]
    if kind in ("allreduce", "reduce_scatter"):     # every block of a send is its input
        return np.sum(inputs, axis=0)
    if kind in ("allgather", "alltoall"):
        return np.concatenate(inputs)
    if kind == "broadcast":
        return inputs[root % size]
    if kind == "shift":
        return inputs[(rank - 1) % size]
    return None


def _start(ctx, kind, i, n, algorithm, root, async_op):
    """Make call ``i``; (its handle or None, the array that holds its result).  "shift":
    every rank sends its input to the next rank (tag ``i``), its receive posted first."""
    mine, size = _value(ctx.rank, i, n), ctx.size
    if kind == "allreduce":
        return ctx.allreduce(mine, algorithm=algorithm, async_op=async_op), mine
    if kind == "allgather":
        out = np.empty(size * n)
        return ctx.allgather(mine, out, algorithm=algorithm, async_op=async_op), out
    if kind == "reduce_scatter":
        out = np.empty(n)
        return ctx.reduce_scatter(np.tile(mine, size), out, async_op=async_op), out
    if kind == "alltoall":
        out = np.empty(size * n)
        return ctx.alltoall(np.tile(mine, size), out, async_op=async_op), out
    if kind == "broadcast":
        return ctx.broadcast(mine, root % size, algorithm=algorithm, async_op=async_op), mine
    if kind == "shift":
        out = np.empty(n)
        received = ctx.recv(out, (ctx.rank - 1) % size, tag=i, async_op=True)
        sent = ctx.send(mine, (ctx.rank + 1) % size, tag=i, async_op=async_op)
        if not async_op:
            received.wait(timeout=30)
            return None, out
        return _Both(received, sent), out
    return ctx.barrier(async_op=async_op), None


class _Both:
    """The handles of a shift's receive and send as one."""

    def __init__(self, received, sent):
        self.works = [received] + ([sent] if sent is not None else [])

    def is_completed(self):
        return all(w.is_completed() for w in self.works)


def _run(ctx, seed):
    rng = random.Random(seed * 7 + 1 + ctx.rank)    # each rank's own choices
    pending, results = [], []
    for i, (kind, n, algorithm, root) in enumerate(_program(seed)):
        async_op = rng.random() < 0.6
        work, out = _start(ctx, kind, i, n, algorithm, root, async_op)
        results.append((i, kind, n, root, out))
        if async_op:
            if rng.random() < 0.3:
                for _ in range(rng.randrange(200)):
                    if work.is_completed():
                        break
            pending.extend(work.works if type(work) is _Both else [work])
        if pending and rng.random() < 0.25:
            pc.wait_all(pending, timeout=30)
            pending = []
    pc.wait_all(pending, timeout=30)
    wrong = []
    for i, kind, n, root, out in results:
        want = _expected(kind, i, n, root, ctx.rank, ctx.size)
        if want is not None and not np.array_equal(out, want):
            wrong.append((i, kind, n))
    return wrong


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("size, kind", [(2, "shm"), (2, "tcp"), (2, "shm-subgroup"),
                                        (3, "shm"), (3, "tcp"), (4, "shm")])
def test_mixed_programs_end_with_every_value_right(size, kind, seed):
    if kind == "shm-subgroup":
        g = ThreadGroup(size + 1, timeout=30)
        subs = g.run(lambda ctx: ctx.split(0 if ctx.rank < size else 1))
        body = (lambda ctx: _run(subs[ctx.rank], seed) if ctx.rank < size else [])
    else:
        g = ThreadGroup(size, transport=kind, timeout=30)
        body = (lambda ctx: _run(ctx, seed))
    try:
        assert g.run(body, timeout=240) == [[]] * g.size
    finally:
        g.close()


@pytest.mark.parametrize("collective", ["barrier", "allreduce"])
@pytest.mark.parametrize("way", ["by-address", "through-the-ring"])
def test_a_flags_collective_beside_a_receive_takes_its_message(collective, way, monkeypatch):
    """Rank 0 posts a receive and runs a small collective through the flag area beside it;
    rank 1 makes a blocking send that ends only once rank 0 has taken the message (1 MiB by
    address; or, with single-copy reads off, 4 MiB through the shared-memory ring, more
    than it holds, read aside piece by piece as the ring refills, with no spin: every
    wait sleeps), then the collective.  The flags wait reads the message aside for the
    receive (``Transport.watch`` while stashing), so rank 1's send ends and both reach the
    collective; the receive gets the message whole."""
    n = 131072
    if way == "through-the-ring":
        monkeypatch.setenv("PYCOLLECT_CMA", "0")
        monkeypatch.setenv("PYCOLLECT_SPIN_US", "0")
        n = 524288
    g = ThreadGroup(2, timeout=10)
    try:
        def body(ctx):
            big = np.arange(n, dtype=np.float64)
            one = np.ones(1)
            if ctx.rank == 0:
                got = np.zeros_like(big)
                received = ctx.recv(got, 1, tag=5, async_op=True)
                ctx.barrier() if collective == "barrier" else ctx.allreduce(one)
                received.wait(timeout=10)
                return bool(np.array_equal(got, big)), one.tolist()
            time.sleep(0.2)         # rank 0 waits in the collective by now
            ctx.send(big, 0, tag=5)
            ctx.barrier() if collective == "barrier" else ctx.allreduce(one)
            return True, one.tolist()

        want = [1.0] if collective == "barrier" else [2.0]
        assert g.run(body, timeout=60) == [(True, want)] * 2
    finally:
        g.close()


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_stream_collective_beside_a_receive_takes_its_message(transport, monkeypatch):
    """Three ranks.  Rank 0 posts a receive from rank 1 and runs a ring allreduce beside it,
    which reads rank 2's stream alone; rank 1 makes a blocking send that ends only once rank
    0 has taken the message (shm: 1 MiB, by address; TCP: 32 MiB, past what the sockets
    hold), then the allreduce; rank 2 comes to the allreduce late.  Rank 0's waits in the
    allreduce read the message aside from the stream the allreduce does not read, so rank
    1's send ends and all three reach the allreduce.  With no spin every wait sleeps in
    poll(), so a stream that wakes it in the middle of a message read aside must go on
    with that message, not take its bytes for a frame's header."""
    monkeypatch.setenv("PYCOLLECT_SPIN_US", "0")
    n = 1 << 17 if transport == "shm" else 1 << 22
    g = ThreadGroup(3, transport=transport, timeout=10)
    try:
        def body(ctx):
            big = np.arange(n, dtype=np.float64)
            mine = np.full(3000, ctx.rank + 1.0)
            if ctx.rank == 0:
                got = np.zeros_like(big)
                received = ctx.recv(got, 1, tag=5, async_op=True)
                ctx.allreduce(mine, algorithm="ring")
                received.wait(timeout=10)
                return bool(np.array_equal(got, big)), mine.tolist() == [6.0] * 3000
            time.sleep(0.2)         # rank 0 waits in the allreduce by now
            if ctx.rank == 1:
                ctx.send(big, 0, tag=5)
            else:
                time.sleep(0.3)     # rank 0 waits for rank 2 while it reads the message
            ctx.allreduce(mine, algorithm="ring")
            return True, mine.tolist() == [6.0] * 3000

        assert g.run(body, timeout=60) == [(True, True)] * 3
    finally:
        g.close()
