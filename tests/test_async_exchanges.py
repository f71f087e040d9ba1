"""Async reduce_scatter and alltoall on the compiled call path (pycollect/_ext/_call.pyx):
checked and planned in the call and queued as a compiled call, or begun in the call as the
blocking call runs: through the flag area where the whole sendbuf fits (every rank on one
host's shared memory: ``_reduce_scatter.reduce_scatter_begin``, ``_alltoall.alltoall_begin``
post it), else, at 2 ranks, as the one exchange the blocking call makes
(``reduce_scatter_begin`` sends the peer's block; ``alltoall_begin`` copies this rank's own
block and sends the peer's); the end waits for the peers' posts or receives the peer's part
(``reduce_scatter_end``, ``alltoall_end``).  A poll ends a begun one whose peers' posts or
message have come, and runs a queued one that every peer has entered
(``Runner._run_entered``: every peer of an alltoall sends first), without the runner (the
late rank's poll of a queued alltoall: tests/test_poll_entered.py)."""

import threading
import time

import numpy as np
import pytest

import pycollect as pc
from group import ThreadGroup, poll_to_end as _poll, without_runner

FLAGS_MAX = 16384      # the flag area's slot (_flags.FLAGS_MAX_BYTES)
CASES = [(np.float32, pc.SUM, 1), (np.int64, pc.PRODUCT, 3), (np.float64, pc.AVG, 5),
         (np.int32, pc.MAX, 1000), (np.uint8, pc.BOR, 7), (np.float32, pc.MIN, 20000)]


def _send(rank, size, n, dtype):
    """Rank ``rank``'s sendbuf: ``size`` blocks of ``n``, different on every rank and block."""
    return ((np.arange(size * n) % 7) + 3 * rank + 1).astype(dtype)


def _reduced(size, n, dtype, op, block):
    """Block ``block`` of a reduce_scatter of the ``_send`` buffers."""
    parts = [_send(r, size, n, dtype)[block * n:(block + 1) * n] for r in range(size)]
    if op == pc.SUM:
        return np.sum(parts, axis=0, dtype=dtype)
    if op == pc.PRODUCT:
        return np.prod(parts, axis=0, dtype=dtype)
    if op == pc.MAX:
        return np.max(parts, axis=0)
    if op == pc.MIN:
        return np.min(parts, axis=0)
    if op == pc.BOR:
        return np.bitwise_or.reduce(parts, axis=0)
    return (np.sum(parts, axis=0, dtype=dtype) / size).astype(dtype)


def _exchanged(rank, size, n, dtype):
    """What an alltoall of the ``_send`` buffers leaves on ``rank``."""
    return np.concatenate([_send(p, size, n, dtype)[rank * n:(rank + 1) * n]
                           for p in range(size)])


def _algorithm(ctx, send, messages):
    """What a reduce_scatter or an alltoall of ``send`` runs: through the flag area where
    the context has one (every rank on one host's shared memory) and the whole sendbuf fits
    a slot, else ``messages`` (ring, pairwise)."""
    return ("flags" if ctx._transport.flag_area is not None and 0 < send.nbytes <= FLAGS_MAX
            else messages)


def _right(ctx, size, dtype, op, n, block, blocks):
    return (block.tolist() == _reduced(size, n, dtype, op, ctx.rank).tolist(),
            blocks.tolist() == _exchanged(ctx.rank, size, n, dtype).tolist())


class _Pair:
    """Two ranks: a shared-memory job, a TCP job, or a sub-group of a shared-memory job."""

    def __init__(self, kind):
        if kind == "shm-subgroup":
            self.group = ThreadGroup(3, timeout=30)
            self.contexts = self.group.run(
                lambda ctx: ctx.split(0 if ctx.rank < 2 else 1))[:2]
        else:
            self.group = ThreadGroup(2, transport=kind, timeout=30)
            self.contexts = self.group.contexts

    def run(self, body):
        return self.group.run(
            lambda ctx: body(self.contexts[ctx.rank]) if ctx.rank < 2 else None)[:2]

    def close(self):
        self.group.close()


PAIRS = ["shm", "tcp", "shm-subgroup"]


@pytest.mark.parametrize("kind", PAIRS)
def test_begun_at_two_ranks_every_value_right(kind):
    """Dtypes and ops, each rank late in turn, a blocking call behind them: every value
    right, named as the blocking calls name theirs (flags where the sendbuf fits the flag
    area, else ring and pairwise), the handles' results the outputs; also empty blocks and
    blocks larger than a segment (queued, not begun)."""
    pair = _Pair(kind)
    cases = CASES + [(np.float32, pc.SUM, 0), (np.float64, pc.SUM, (1 << 17) + 1)]
    try:
        def body(ctx):
            out = []
            for late in (0, 1, None):
                for dtype, op, n in cases:
                    if ctx.rank == late:
                        time.sleep(0.02)
                    send = _send(ctx.rank, 2, n, dtype)
                    block, blocks = np.empty(n, dtype), np.empty(2 * n, dtype)
                    rs = ctx.reduce_scatter(send, block, op=op, async_op=True)
                    a2a = ctx.alltoall(send, blocks, async_op=True)
                    total = ctx.allreduce(np.ones(2)).tolist()
                    results = rs.wait(timeout=20), a2a.wait(timeout=20)
                    out.append((results[0] is block and results[1] is blocks,
                                rs.algorithm == _algorithm(ctx, send, "ring"),
                                a2a.algorithm == _algorithm(ctx, send, "pairwise"),
                                total) + _right(ctx, 2, dtype, op, n, block, blocks))
            return out

        want = (True, True, True, [2.0, 2.0], True, True)
        assert pair.run(body) == [[want] * (3 * len(cases))] * 2
    finally:
        pair.close()


@pytest.mark.parametrize("kind", PAIRS)
def test_they_are_sent_in_the_call(kind, monkeypatch):
    """No runner thread: rank 0 makes its async calls and waits for nothing until rank 1's
    blocking calls have ended, which they can only if rank 0's parts left in the calls
    (messages the channel takes whole: a larger one's rest goes at the runner's next look,
    test_the_runner_sends_the_rest)."""
    without_runner(monkeypatch)
    pair = _Pair(kind)
    try:
        peer_done = threading.Event()

        def body(ctx):
            out = []
            for dtype, op, n in CASES[:-1]:
                send = _send(ctx.rank, 2, n, dtype)
                block, blocks = np.empty(n, dtype), np.empty(2 * n, dtype)
                if ctx.rank == 0:
                    works = [ctx.reduce_scatter(send, block, op=op, async_op=True),
                             ctx.alltoall(send, blocks, async_op=True)]
                    assert peer_done.wait(10)
                    peer_done.clear()
                    for w in works:
                        w.wait()        # runs its end here (one with a timeout would not)
                else:
                    ctx.reduce_scatter(send, block, op=op)
                    ctx.alltoall(send, blocks)
                    peer_done.set()
                out.append(_right(ctx, 2, dtype, op, n, block, blocks))
                ctx.barrier()
            return out

        assert pair.run(body) == [[(True, True)] * (len(CASES) - 1)] * 2
    finally:
        pair.close()


@pytest.mark.parametrize("kind", ["shm", "tcp"])
def test_the_runner_sends_the_rest(kind):
    """A begun alltoall whose message is larger than its channel takes at once: rank 0 makes
    it and then neither polls nor waits for five seconds; its runner's next look sends the
    rest, so rank 1's blocking alltoall ends long before rank 0's wait."""
    n = 20000 if kind == "shm" else 400000
    g = ThreadGroup(2, transport=kind, timeout=30)
    try:
        def body(ctx):
            send = _send(ctx.rank, 2, n, np.float32)
            blocks = np.empty(2 * n, np.float32)
            ctx.barrier()
            if ctx.rank == 0:
                work = ctx.alltoall(send, blocks, async_op=True)
                time.sleep(5.0)
                work.wait(timeout=20)
                took = None
            else:
                started = time.monotonic()
                ctx.alltoall(send, blocks)
                took = time.monotonic() - started
            return took, bool(np.array_equal(blocks, _exchanged(ctx.rank, 2, n, np.float32)))

        (_, right0), (took, right1) = g.run(body)
        assert right0 and right1
        assert took < 2.5, took     # not at rank 0's wait, 5 s on
    finally:
        g.close()


@pytest.mark.parametrize("kind", PAIRS)
def test_polls_alone_end_them(kind, monkeypatch):
    """No runner thread, each rank late in turn: polls alone end every call (messages the
    channel takes whole, begun in the call), on the polling thread, values right."""
    without_runner(monkeypatch)
    pair = _Pair(kind)
    cases = CASES[:-1]
    try:
        def body(ctx):
            out = []
            for i, (dtype, op, n) in enumerate(cases):
                ctx.barrier()
                if ctx.rank == i % 2:
                    time.sleep(0.02)    # the peer's message is here before this rank begins
                send = _send(ctx.rank, 2, n, dtype)
                block, blocks = np.empty(n, dtype), np.empty(2 * n, dtype)
                rs = ctx.reduce_scatter(send, block, op=op, async_op=True)
                ended_rs = _poll(rs, 10)
                a2a = ctx.alltoall(send, blocks, async_op=True)
                ended_a2a = _poll(a2a, 10)
                here = [threading.current_thread()]
                out.append((ended_rs == here, ended_a2a == here)
                           + _right(ctx, 2, dtype, op, n, block, blocks))
            return out

        assert pair.run(body) == [[(True, True, True, True)] * len(cases)] * 2
    finally:
        pair.close()


@pytest.mark.parametrize("transport", ["shm", "tcp"])
@pytest.mark.parametrize("size", [1, 3, 4])
def test_queued_at_other_sizes(size, transport):
    """Other group sizes queue the compiled call for the runner (one through the flag area
    is begun in the call at any size): every value right, async calls several at once and
    blocking ones between."""
    g = ThreadGroup(size, transport=transport, timeout=30)
    try:
        def body(ctx):
            out = []
            for dtype, op, n in CASES:
                send = _send(ctx.rank, size, n, dtype)
                block, blocks = np.empty(n, dtype), np.empty(size * n, dtype)
                works = [ctx.reduce_scatter(send, block, op=op, async_op=True),
                         ctx.alltoall(send, blocks, async_op=True)]
                total = ctx.allreduce(np.ones(1)).tolist()
                pc.wait_all(works, timeout=20)
                out.append((works[0].algorithm == _algorithm(ctx, send, "ring"),
                            works[1].algorithm == _algorithm(ctx, send, "pairwise"), total)
                           + _right(ctx, size, dtype, op, n, block, blocks))
            return out

        want = (True, True, [float(size)], True, True)
        assert g.run(body) == [[want] * len(CASES)] * size
    finally:
        g.close()


@pytest.mark.parametrize("end", ["mismatch", "refused", "abort"])
@pytest.mark.parametrize("call", ["reduce_scatter", "alltoall"])
def test_they_fail_as_blocking_ones_would(call, end):
    """The peer's disagreement (its count differs) is a MismatchError; arguments this rank
    refuses (a recvbuf of the wrong size) fail its handle with InvalidArgument and the
    peer's call with a MismatchError that names this rank and the reason; abort() from
    another thread fails a begun call at once.  Nothing hangs."""
    g = ThreadGroup(2, transport="tcp", timeout=30)
    try:
        def make(ctx, n, out_n, async_op):
            send = np.ones(2 * n, np.float32)
            out = np.empty(out_n, np.float32)
            if call == "reduce_scatter":
                return ctx.reduce_scatter(send, out, async_op=async_op)
            return ctx.alltoall(send, out, async_op=async_op)

        full = 1 if call == "reduce_scatter" else 2     # the output's elements per block

        def body(ctx):
            if ctx.rank == 1:
                if end == "abort":
                    time.sleep(1.5)
                    return None
                with pytest.raises(pc.Error) as caught:
                    make(ctx, 5, 5 * full, False)
                return type(caught.value), str(caught.value)
            n = 4 if end == "mismatch" else 5
            work = make(ctx, n, n * full + (1 if end == "refused" else 0), True)
            if end == "abort":
                threading.Timer(0.3, ctx.abort).start()
            started = time.monotonic()
            with pytest.raises(pc.Error) as caught:
                work.wait(timeout=10)
            return type(caught.value), str(caught.value), time.monotonic() - started

        res = g.outcomes(body, timeout=60)
        kind, text, took = res[0]
        assert kind is {"mismatch": pc.MismatchError, "refused": pc.InvalidArgument,
                        "abort": pc.Aborted}[end], res
        assert end != "refused" or "must hold" in text, res
        assert took < 5, res
        if end != "abort":         # the peer's call: a MismatchError, the refusal's reason
            assert res[1][0] is pc.MismatchError, res
            assert end != "refused" or "rank 0 (" in res[1][1] and "must hold" in res[1][1], res
    finally:
        g.close()


@pytest.mark.parametrize("kind", PAIRS)
@pytest.mark.parametrize("n", [10000, 131072], ids=["80KiB", "1MiB"])
def test_large_ones_begun_on_both_ranks_end(kind, n):
    """Both ranks make the same async call of a large block, several in a row, then wait:
    an exchange begun in the call is only one whose message the channel takes whole (a send
    left half-way, or one read by address, would leave both ends waiting for each other);
    the rest are queued.  Allreduce (recursive doubling), allgather (ring), reduce_scatter
    and alltoall of float64 blocks: every call ends, values right."""
    pair = _Pair(kind)
    try:
        def body(ctx):
            send = _send(ctx.rank, 2, n, np.float64)
            mine = send[:n].copy()
            block, blocks, gathered = (np.empty(n), np.empty(2 * n), np.empty(2 * n))
            summed = mine.copy()
            works = [ctx.allreduce(summed, algorithm="recursive_doubling", async_op=True),
                     ctx.allgather(mine, gathered, algorithm="ring", async_op=True),
                     ctx.reduce_scatter(send, block, async_op=True),
                     ctx.alltoall(send, blocks, async_op=True)]
            pc.wait_all(works, timeout=20)
            firsts = [_send(r, 2, n, np.float64)[:n] for r in range(2)]
            return (bool(np.array_equal(summed, firsts[0] + firsts[1])),
                    bool(np.array_equal(gathered, np.concatenate(firsts))))\
                + _right(ctx, 2, np.float64, pc.SUM, n, block, blocks)

        assert pair.run(body) == [(True,) * 4] * 2
    finally:
        pair.close()


def test_the_flight_recorder_notes_begun_ones_as_blocking_ones(monkeypatch):
    """A begun reduce_scatter or alltoall's recorder entry agrees with the blocking call's
    in everything but its number and times (name, algorithm, dtype, count, root, peers)."""
    monkeypatch.setenv("PYCOLLECT_TRACE_SIZE", "16")
    g = ThreadGroup(2, timeout=30)
    try:
        def body(ctx):
            calls = [lambda a: ctx.reduce_scatter(np.ones(6, np.int64), np.empty(3, np.int64),
                                                  async_op=a),
                     lambda a: ctx.alltoall(np.ones(4, np.uint8), np.empty(4, np.uint8),
                                            async_op=a)]
            pairs = []
            for call in calls:
                call(False)
                call(True).wait(timeout=20)
                pairs.append(ctx._recorder.entries()[-2:])
            return pairs

        for pairs in g.run(body):
            for blocking, begun in pairs:
                assert blocking[8] == begun[8] == "completed"
                assert blocking[1] + 1 == begun[1]
                assert blocking[2:8] == begun[2:8], (blocking, begun)
    finally:
        g.close()
