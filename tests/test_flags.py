"""The small-message path of one host: barrier, broadcast, allreduce, reduce_scatter(v),
allgather(v) and alltoall through the shared-memory flag area (pycollect/_ext/_flags.pyx), its
results and its failures."""

import threading
import time

import numpy as np
import pytest

import pycollect as pc
from group import ThreadGroup
from jobs import run_victims
from reference import (BFLOAT16, DTYPES, assert_matches, make_input, ops_for,
                       reduce_reference)

MAX_BYTES = 16384


def _operations(g):
    return [ctx._transport.flag_area.operations for ctx in g.contexts]


def _ended(work, way, result):
    """End the async call ``work`` by polling it (``way`` "poll", at most 30 s) or at once
    by its wait, which must return ``result``; the algorithm it ran."""
    deadline = time.monotonic() + 30
    while way == "poll" and not work.is_completed() and time.monotonic() < deadline:
        pass
    assert work.wait(timeout=60) is result
    return work.algorithm


@pytest.fixture(scope="module", params=[2, 3, 4, 5, 7, 8], ids=lambda n: "size%d" % n)
def local_group(request):
    g = ThreadGroup(request.param, timeout=60)
    yield g
    g.close()


def test_only_a_transport_all_on_shared_memory_has_a_flag_area():
    g, tcp = ThreadGroup(3), ThreadGroup(2, transport="tcp")
    try:
        assert all(ctx._transport.flag_area.max_bytes == MAX_BYTES for ctx in g.contexts)
        assert all(ctx._transport.flag_area is None for ctx in tcp.contexts)

        def run(ctx):
            work = ctx.allreduce(np.ones(4), algorithm="flags", async_op=True)
            return work.wait(timeout=30)[0], work.algorithm, ctx._transport.flag_area

        # A sub-group, or pairs over TCP, keep the message path: "flags" runs recursive
        # doubling there.
        sub = g.run(lambda ctx: ctx.split(0))
        assert g.run(lambda ctx: run(sub[ctx.rank])) == [(3.0, "recursive_doubling", None)] * 3
        assert tcp.run(run) == [(2.0, "recursive_doubling", None)] * 2
        assert g.run(run)[0][:2] == (3.0, "flags")
    finally:
        g.close()
        tcp.close()


@pytest.mark.parametrize("dtype", DTYPES)
def test_allreduce_every_dtype_and_op(local_group, dtype):
    if dtype == "bfloat16" and BFLOAT16 is None:
        pytest.skip("ml_dtypes is not installed")
    g, size = local_group, local_group.size
    itemsize = np.dtype(make_input(dtype, 1, 0, pc.SUM).dtype).itemsize
    cases = [(op, n) for op in ops_for(dtype) for n in (1, 3, 100, MAX_BYTES // itemsize)]
    before = _operations(g)

    def body(ctx):
        out = []
        for op, n in cases:
            buf = make_input(dtype, n, ctx.rank, op)
            # auto takes flags up to where direct starts; by name, up to the area's size.
            if buf.nbytes <= (4096 if size == 2 else 8192):
                assert ctx.plan("allreduce", buf).name == "flags"
            work = ctx.allreduce(buf, op=op, algorithm="flags", async_op=True)
            assert work.wait(timeout=60) is buf and work.algorithm == "flags"
            out.append(buf)
        return out

    results = g.run(body)
    assert all(a - b == len(cases) for a, b in zip(_operations(g), before))
    for i, (op, n) in enumerate(cases):
        expected = reduce_reference(dtype, [make_input(dtype, n, r, op) for r in range(size)], op)
        for rank in range(size):
            assert_matches(dtype, op, results[rank][i], expected,
                           "size %d rank %d count %d" % (size, rank, n))
        # Every rank reduced the slots in the same order: the same bits everywhere.
        assert all(results[r][i].tobytes() == results[0][i].tobytes() for r in range(size))


def test_broadcast_and_barrier(local_group):
    g, size = local_group, local_group.size
    before = _operations(g)

    def body(ctx):
        got = []
        for i, n in enumerate((1, 5, 1000, MAX_BYTES // 8)):
            root = i % size
            buf = np.arange(n, dtype=np.float64) * (i + 1) if ctx.rank == root \
                else np.zeros(n)
            work = ctx.broadcast(buf, root=root, async_op=True)
            assert work.wait(timeout=60) is buf and work.algorithm == "flags"
            got.append(buf)
            work = ctx.barrier(async_op=True)
            work.wait(timeout=60)
            assert work.algorithm == "flags"
        return got

    for res in g.run(body):
        for i, n in enumerate((1, 5, 1000, MAX_BYTES // 8)):
            assert np.array_equal(res[i], np.arange(n, dtype=np.float64) * (i + 1))
    assert all(a - b == 8 for a, b in zip(_operations(g), before))


def test_allgather(local_group):
    """Blocks of 1 to MAX_BYTES bytes, several dtypes, the in-place form (the send block is
    this rank's block of recvbuf), blocking, async waited on and async polled: every block
    in place, named flags, one flags operation each; auto takes flags below 16 KiB (4 KiB
    at 2 ranks)."""
    g, size = local_group, local_group.size
    cases = [(np.uint8, 1, False), (np.float32, 3, True), (np.int64, 100, False),
             (np.float64, MAX_BYTES // 8, True), (np.uint8, MAX_BYTES, False)]
    ways = ("blocking", "wait", "poll")
    before = _operations(g)

    def body(ctx):
        out = []
        for (dtype, n, in_place) in cases:
            for way in ways:
                recv = np.zeros(n * size, dtype)
                mine = recv[ctx.rank * n:(ctx.rank + 1) * n] if in_place else np.empty(n, dtype)
                mine[:] = (np.arange(n) * 3 + ctx.rank) % 97
                assert ctx.plan("allgather", mine).name == (
                    "direct" if mine.nbytes >= 16384 else
                    "ring" if size == 2 and mine.nbytes >= 4096 else "flags")
                if way == "blocking":
                    ctx.allgather(mine, recv, algorithm="flags")
                    algorithm = "flags"
                else:
                    algorithm = _ended(ctx.allgather(mine, recv, algorithm="flags",
                                                     async_op=True), way, recv)
                want = np.concatenate([(np.arange(n) * 3 + r) % 97 for r in range(size)])
                out.append((algorithm, bool(np.array_equal(recv, want.astype(dtype)))))
        return out

    assert g.run(body) == [[("flags", True)] * (len(cases) * len(ways))] * size
    assert all(a - b == len(cases) * len(ways) for a, b in zip(_operations(g), before))


@pytest.mark.parametrize("collective", ["reduce_scatter", "alltoall"])
def test_reduce_scatter_and_alltoall(local_group, collective):
    """Blocks of 1 element up to a whole sendbuf of MAX_BYTES, several dtypes (and ops),
    blocking, async waited on and async polled: every rank's block reduced (reduce_scatter)
    or every rank's block for this rank in place (alltoall), named flags, one flags
    operation each; a sendbuf one element past the slot takes the messages (ring,
    pairwise)."""
    g, size = local_group, local_group.size
    cases = [(np.float64, pc.SUM, 1), (np.int32, pc.MAX, 3), (np.float32, pc.AVG, 100),
             (np.int64, pc.PRODUCT, MAX_BYTES // (8 * size)),
             (np.uint8, pc.BOR, MAX_BYTES // size)]
    ways = ("blocking", "wait", "poll")
    messages = "ring" if collective == "reduce_scatter" else "pairwise"
    before = _operations(g)

    def inputs(r, n, dtype):
        return ((np.arange(size * n) * 5 + 3 * r) % 7 + 1).astype(dtype)

    def call(ctx, send, recv, op, async_op):
        if collective == "reduce_scatter":
            return ctx.reduce_scatter(send, recv, op=op, async_op=async_op)
        return ctx.alltoall(send, recv, async_op=async_op)

    def body(ctx):
        out = []
        for (dtype, op, n) in cases + [(np.float64, pc.SUM, MAX_BYTES // (8 * size) + 1)]:
            for way in ways:
                send = inputs(ctx.rank, n, dtype)
                recv = np.zeros(n if collective == "reduce_scatter" else size * n, dtype)
                posts = ctx._transport.flag_area.operations
                if way == "blocking":
                    call(ctx, send, recv, op, False)
                    algorithm = ("flags" if ctx._transport.flag_area.operations == posts + 1
                                 else messages)
                else:
                    algorithm = _ended(call(ctx, send, recv, op, True), way, recv)
                blocks = np.stack([inputs(r, n, dtype)[ctx.rank * n:(ctx.rank + 1) * n]
                                   for r in range(size)])
                if collective == "alltoall":
                    want = blocks.reshape(-1)
                else:
                    want = {pc.SUM: lambda: blocks.sum(0, dtype=dtype),
                            pc.MAX: lambda: blocks.max(0),
                            pc.AVG: lambda: (blocks.sum(0, dtype=dtype) / size).astype(dtype),
                            pc.PRODUCT: lambda: blocks.prod(0, dtype=dtype),
                            pc.BOR: lambda: np.bitwise_or.reduce(blocks, axis=0)}[op]()
                out.append((algorithm, bool(np.allclose(recv, want, rtol=1e-6))))
        return out

    want = [("flags", True)] * (len(cases) * len(ways)) + [(messages, True)] * len(ways)
    assert g.run(body) == [want] * size
    assert all(a - b == len(cases) * len(ways) for a, b in zip(_operations(g), before))


@pytest.mark.parametrize("collective", ["allgatherv", "reduce_scatterv"])
def test_v_variants(local_group, collective):
    """allgatherv and reduce_scatterv with blocks that differ by rank (zeros among them),
    several dtypes and ops, blocking, async waited on and async polled: every block in
    place or reduced, one flags operation each while the largest block (allgatherv) or the
    whole sendbuf (reduce_scatterv) fits a slot; one element past it, the ring."""
    g, size = local_group, local_group.size
    fits = MAX_BYTES // 8 - (0 if collective == "allgatherv" else size - 1)
    patterns = [[(3 * p + 1) % 4 for p in range(size)],         # zeros among them
                [0] * (size - 1) + [5],
                [1 + p for p in range(size)],
                [fits] + [1] * (size - 1)]                       # exactly a slot
    cases = [(np.float64, pc.SUM, patterns[0]), (np.int32, pc.MAX, patterns[1]),
             (np.float32, pc.AVG, patterns[2]), (np.float64, pc.SUM, patterns[3])]
    past = [fits + 1] + [1] * (size - 1)
    ways = ("blocking", "wait", "poll")
    before = _operations(g)

    def block(r, n, dtype, salt):
        return ((np.arange(n) * 5 + 3 * r + salt) % 7 + 1).astype(dtype)

    def body(ctx):
        out, r = [], ctx.rank
        for i, (dtype, op, counts) in enumerate(cases + [(np.float64, pc.SUM, past)]):
            offs = np.concatenate([[0], np.cumsum(counts)])
            for way in ways:
                posts = ctx._transport.flag_area.operations
                if collective == "allgatherv":
                    send = block(r, counts[r], dtype, i)
                    recv = np.zeros(offs[-1], dtype)
                    work = ctx.allgatherv(send, recv, counts, async_op=way != "blocking")
                    want = np.concatenate([block(p, counts[p], dtype, i) for p in range(size)])
                else:
                    send = block(r, offs[-1], dtype, i)
                    recv = np.zeros(counts[r], dtype)
                    work = ctx.reduce_scatterv(send, recv, counts, op=op,
                                               async_op=way != "blocking")
                    parts = np.stack([block(p, offs[-1], dtype, i) for p in range(size)])
                    parts = parts[:, offs[r]:offs[r + 1]]
                    want = {pc.SUM: lambda: parts.sum(0, dtype=dtype),
                            pc.MAX: lambda: parts.max(0),
                            pc.AVG: lambda: (parts.sum(0, dtype=dtype) / size).astype(dtype)
                            }[op]()
                if way != "blocking":
                    _ended(work, way, recv)
                flags = ctx._transport.flag_area.operations == posts + 1
                out.append((flags, bool(np.allclose(recv, want, rtol=1e-6))))
        return out

    want = [(True, True)] * (len(cases) * len(ways)) + [(False, True)] * len(ways)
    assert g.run(body) == [want] * size
    assert all(a - b == len(cases) * len(ways) for a, b in zip(_operations(g), before))


def test_larger_messages_take_the_message_path(local_group):
    def body(ctx):
        big = np.ones(MAX_BYTES // 4 + 1, np.float32)
        work = ctx.allreduce(big, async_op=True)
        work.wait(timeout=60)
        bcast = ctx.broadcast(np.ones(MAX_BYTES + 1, np.uint8), async_op=True)
        bcast.wait(timeout=60)
        gathered = ctx.allgather(np.ones(MAX_BYTES + 1, np.uint8),
                                 np.zeros((MAX_BYTES + 1) * ctx.size, np.uint8),
                                 algorithm="flags", async_op=True)
        gathered.wait(timeout=60)
        return work.algorithm, bcast.algorithm, gathered.algorithm, big[0]
    for ran, bcast, gathered, first in local_group.run(body):
        assert ran != "flags" and bcast != "flags" and first == local_group.size
        assert gathered == "ring"


def test_back_to_back_calls_never_overtake_a_slow_reader():
    """Hundreds of consecutive flags calls of varying sizes, each with its own values, mixed
    with collectives of the message path: every result exact (no trailing barrier needed)."""
    size = 4
    g = ThreadGroup(size, timeout=60)
    try:
        def body(ctx):
            rng = np.random.default_rng(ctx.rank)
            bad = []
            for i in range(400):
                n = 1 + (i * 613) % (MAX_BYTES // 8)
                if ctx.rank == i % size:
                    time.sleep(rng.random() * 1e-4)     # one rank late each time
                buf = np.full(n, i * 10.0 + ctx.rank)
                ctx.allreduce(buf)
                if not np.all(buf == i * 10.0 * size + size * (size - 1) / 2):
                    bad.append(("allreduce", i))
                b = np.full(7, float(i)) if ctx.rank == i % size else np.zeros(7)
                ctx.broadcast(b, root=i % size)
                if not np.all(b == i):
                    bad.append(("broadcast", i))
                if i % 50 == 0:
                    ctx.barrier()
                    big = np.full(50000, float(i))
                    ctx.allreduce(big)                  # the message path in between
                    gathered = ctx.allgather(np.array([i, ctx.rank]))
                    if not (np.all(big == i * size)
                            and gathered.tolist() == [[i, r] for r in range(size)]):
                        bad.append(("message path", i))
            return bad
        assert g.run(body, timeout=300) == [[]] * size
    finally:
        g.close()


def test_a_root_that_runs_ahead_never_overwrites_what_a_slow_rank_still_reads():
    """A broadcast's root returns once it has posted; hundreds of broadcasts from one root
    in a row, one rank slow each time, each with its own values."""
    size = 3
    g = ThreadGroup(size, timeout=60)
    try:
        def body(ctx):
            bad = []
            for i in range(300):
                if ctx.rank == 1 + i % 2 and i % 7 == 0:
                    time.sleep(0.001)
                n = 1 + (i * 389) % (MAX_BYTES // 8)
                buf = np.arange(n) + i * 1000.0 if ctx.rank == 0 else np.zeros(n)
                work = ctx.broadcast(buf, root=0, async_op=True)
                work.wait(timeout=60)
                if work.algorithm != "flags" or not np.array_equal(buf, np.arange(n) + i * 1000.0):
                    bad.append(i)
            return bad
        assert g.run(body, timeout=300) == [[]] * size
    finally:
        g.close()


@pytest.mark.parametrize("odd", ["dtype", "count", "root", "collective", "message path"])
def test_disagreement_is_a_mismatch_on_every_rank(odd):
    g = ThreadGroup(3, timeout=20)
    try:
        def body(ctx):
            mine = ctx.rank == 1
            if odd == "dtype":
                return ctx.allreduce(np.ones(8, np.float32 if mine else np.float64))
            if odd == "count":
                return ctx.allreduce(np.ones(9 if mine else 8))
            if odd == "root":
                # The two that think they are the root return at once; they learn of the
                # disagreement in their next call.
                ctx.broadcast(np.ones(8), root=1 if mine else 0)
                return ctx.barrier()
            if odd == "collective":
                return ctx.barrier() if mine else ctx.allreduce(np.ones(8))
            return ctx.allreduce(np.ones(MAX_BYTES if mine else 8))

        t0 = time.monotonic()
        res = g.outcomes(body, timeout=60)
        assert time.monotonic() - t0 < 15
        for rank, exc in enumerate(res):
            assert isinstance(exc, pc.MismatchError), (rank, exc)
        text = " ".join(str(exc) for exc in res)
        assert "disagrees with rank" in text and "flags" in text, text
    finally:
        g.close()


@pytest.mark.parametrize("spin_us", ["50", "1000000"], ids=["sleeping", "spinning"])
def test_abort_from_another_thread_while_waiting_on_flags(monkeypatch, spin_us):
    monkeypatch.setenv("PYCOLLECT_SPIN_US", spin_us)
    g = ThreadGroup(2, timeout=60)
    try:
        ctx = g.contexts[0]
        assert ctx.plan("allreduce", np.ones(4)).name == "flags"
        threading.Timer(0.3, ctx.abort).start()
        started = time.monotonic()
        with pytest.raises(pc.Aborted, match="rank 0"):
            ctx.allreduce(np.ones(4))
        # Spinning for a whole second, the abort at 0.3 s is seen while spinning.
        bound = 0.9 if spin_us == "1000000" else 5
        assert time.monotonic() - started < bound and ctx._transport.flag_area.operations == 1
        # Rank 0 had posted its part: the peer's first call may complete, a later one
        # fails at once (the failure word, then rank 0's abort frame), naming rank 0.
        peer, started = g.contexts[1], time.monotonic()
        with pytest.raises(pc.PeerError, match="rank 0"):
            for _ in range(2):
                peer.allreduce(np.full(4, 2.0))
        assert time.monotonic() - started < 5
    finally:
        g.close()


_VICTIM = r"""
import os, signal, sys, time
import numpy as np
import pycollect as pc
rank, store = int(sys.argv[1]), sys.argv[2]
ctx = pc.init(rank=rank, size=3, store=store, timeout=%(timeout)s, transport="shm")
assert ctx.plan("allreduce", np.ones(16, np.float32)).name == "flags"
ctx.barrier()
try:
    for i in range(100000):
        if rank == 2 and i == 300:
            os.kill(os.getpid(), signal.%(signal)s)
        t0 = time.monotonic()   # the failing call's own duration is reported
        buf = ctx.allreduce(np.full(16, i + rank, np.float32))
        assert np.all(buf == 3 * i + 3), buf
except (pc.PeerError, pc.Timeout) as exc:
    assert ctx._transport.flag_area.operations >= 300
    print("rank %%d %%s after %%.2f s: %%s" %% (rank, type(exc).__name__, time.monotonic() - t0, exc))
    sys.exit(0)
sys.exit("rank %%d finished without an error" %% rank)
"""


@pytest.mark.parametrize("spin_us", ["50", "1000000"], ids=["sleeping", "spinning"])
def test_a_rank_killed_while_the_others_wait_on_flags(tmp_path, monkeypatch, spin_us):
    """PeerError naming the dead rank within a fraction of the 30 s deadline (and, where the
    survivors spin for a whole second, before they would ever sleep)."""
    monkeypatch.setenv("PYCOLLECT_SPIN_US", spin_us)
    run_victims(tmp_path, _VICTIM % {"timeout": 30, "signal": "SIGKILL"},
                bound_s=0.9 if spin_us == "1000000" else 5, min_s=-1)


_ASYNC_VICTIM = r"""
import os, signal, sys, time
import numpy as np
import pycollect as pc
rank, store = int(sys.argv[1]), sys.argv[2]
ctx = pc.init(rank=rank, size=3, store=store, timeout=30, transport="shm")
ctx.barrier()
try:
    for i in range(100000):
        if rank == 2 and i == 100:
            os.kill(os.getpid(), signal.SIGKILL)
        t0 = time.monotonic()
        bufs = [np.full(16, 3 * i + j + rank, np.float32) for j in range(3)]
        works = [ctx.allreduce(b, async_op=True) for b in bufs]
        for j, w in enumerate(works):
            assert np.all(w.wait() == 3 * (3 * i + j) + 3), (i, j)
except pc.PeerError as exc:
    assert ctx._transport.flag_area.operations >= 300
    print("rank %d %s after %.2f s: %s" % (rank, type(exc).__name__, time.monotonic() - t0, exc))
    sys.exit(0)
sys.exit("rank %d finished without an error" % rank)
"""


def test_a_rank_killed_while_the_others_have_several_calls_posted(tmp_path):
    """Three async allreduces posted at a time: when a peer dies, the first wait that needs
    it fails with PeerError naming it, well within the deadline."""
    run_victims(tmp_path, _ASYNC_VICTIM, bound_s=5, min_s=-1)


def test_a_stopped_rank_is_named_in_the_timeout(tmp_path):
    run_victims(tmp_path, _VICTIM % {"timeout": 3, "signal": "SIGSTOP"}, stopped=True,
                bound_s=20, min_s=2.5)


def _posted(ctx):
    return ctx._transport.flag_area.operations


def test_an_async_call_posts_when_made_and_ends_where_every_peer_is_there():
    """An async allreduce or barrier through the flags posts this rank's part in the call
    itself, as MPI's Iallreduce begins; the last rank to call finds every post there and
    its call has ended when it returns, without the runner; the others end in a poll."""
    g = ThreadGroup(3, timeout=30)
    try:
        def body(ctx):
            before = _posted(ctx)
            if ctx.rank == 2:
                time.sleep(0.3)
            buf = np.full(4, ctx.rank + 1.0, np.float32)
            work = ctx.allreduce(buf, async_op=True)
            posted_at_call = _posted(ctx) - before
            ended_at_call = work.is_completed()
            deadline = time.monotonic() + 10
            while not work.is_completed() and time.monotonic() < deadline:
                pass
            bar = ctx.barrier(async_op=True)
            bar.wait(timeout=10)
            return (posted_at_call, ended_at_call, work.wait(timeout=1).tolist(),
                    work.algorithm, bar.algorithm, _posted(ctx) - before)

        out = g.run(body)
        for rank, (posted, ended, result, algo, bar_algo, ops) in enumerate(out):
            assert posted == 1 and result == [6.0] * 4, (rank, out)
            assert (algo, bar_algo, ops) == ("flags", "flags", 2), (rank, out)
        assert out[2][1] is True            # the last to come found every post there
        assert out[0][1] is False and out[1][1] is False
    finally:
        g.close()


def test_a_begun_call_ends_by_itself_and_keeps_its_place():
    """Nobody waits: the runner ends a posted call at its next look (its callback runs); a
    blocking call made behind a posted one runs after it, in order, on every rank."""
    g = ThreadGroup(2, timeout=30)
    try:
        def body(ctx):
            # Rank 1 posts first and never waits: its runner ends the call.
            if ctx.rank == 0:
                time.sleep(0.2)
            done = threading.Event()
            a = ctx.allreduce(np.ones(2), async_op=True)
            a.add_done_callback(lambda w: done.set())
            assert done.wait(10)
            # Rank 0 posts first, then makes a blocking call behind its posted one.
            if ctx.rank == 1:
                time.sleep(0.2)
            b = ctx.allreduce(np.full(2, 2.0), async_op=True)
            c = ctx.allreduce(np.full(2, 5.0))
            assert b.is_completed()
            return a.wait().tolist(), b.wait().tolist(), c.tolist()

        assert g.run(body) == [([2.0, 2.0], [4.0, 4.0], [10.0, 10.0])] * 2
    finally:
        g.close()


@pytest.mark.parametrize("end", ["mismatch", "timeout", "abort"])
def test_a_begun_call_fails_as_a_blocking_one_would(end):
    """A posted async call still meets the peers' disagreement (MismatchError on every
    rank), its deadline (Timeout naming the absent rank) and abort() from another thread."""
    g = ThreadGroup(2, timeout=3 if end == "timeout" else 30)
    try:
        def body(ctx):
            started = time.monotonic()
            if ctx.rank == 1:
                if end == "mismatch":
                    return ctx.allreduce(np.ones(9))
                time.sleep(1.5 if end == "abort" else 6)
                return None
            work = ctx.allreduce(np.ones(8), async_op=True)
            if end == "abort":
                threading.Timer(0.3, ctx.abort).start()
            with pytest.raises(Exception) as caught:
                work.wait()
            return caught.value, time.monotonic() - started

        res = g.outcomes(body, timeout=60)
        exc, took = res[0]
        expected = {"mismatch": pc.MismatchError, "timeout": pc.Timeout,
                    "abort": pc.Aborted}[end]
        assert isinstance(exc, expected), res
        assert took < (8 if end == "timeout" else 5), res
        if end == "mismatch":
            assert isinstance(res[1], pc.MismatchError), res
        if end == "timeout":
            assert "rank 1" in str(exc), exc
    finally:
        g.close()


def test_an_async_broadcast_posts_when_made_and_a_root_running_ahead_never_blocks():
    """An async broadcast through the flags posts in the call: the root's has ended when it
    returns, the others' end where the root had posted.  A root that runs further ahead
    than the flag area lets it (8 operations) gets async calls that return at once all the
    same (those that would wait for a slot queue), and every rank gets every value."""
    g = ThreadGroup(3, timeout=30)
    try:
        def body(ctx):
            before = _posted(ctx)
            if ctx.rank != 0:
                time.sleep(0.5)
            bufs = [np.full(3, i + 1.0 if ctx.rank == 0 else 0.0) for i in range(12)]
            slowest, works = 0.0, []
            for buf in bufs:
                t0 = time.monotonic()
                works.append(ctx.broadcast(buf, root=0, async_op=True))
                slowest = max(slowest, time.monotonic() - t0)
            t0 = time.monotonic()
            total = ctx.allreduce(np.ones(2), async_op=True)
            slowest = max(slowest, time.monotonic() - t0)
            ended_at_call = works[0].is_completed()
            values = [w.wait(timeout=20)[0] for w in works]
            return (slowest, ended_at_call, values, total.wait(timeout=20).tolist(),
                    {w.algorithm for w in works}, _posted(ctx) - before)

        out = g.run(body)
        for rank, (slowest, ended, values, total, algos, ops) in enumerate(out):
            assert values == [i + 1.0 for i in range(12)] and total == [3.0, 3.0], out
            assert algos == {"flags"} and ops == 13, (rank, out)
            assert slowest < 0.25, (rank, slowest)      # the others came 0.5 s later
            assert ended, (rank, out)   # the root's at once; the others found its post
    finally:
        g.close()


OUTSTANDING = 8     # _flags.OUTSTANDING: async calls a rank may have posted and not ended


def test_the_flag_area_says_how_many_calls_may_be_posted_at_once():
    from pycollect._ext import _flags
    assert _flags.OUTSTANDING == OUTSTANDING


def test_several_async_calls_post_when_made_and_end_in_order():
    """Async allreduces, broadcasts and barriers made in a row each post in the call, up to
    OUTSTANDING of them, as MPI's nonblocking collectives begin: a peer can end them all
    while this rank does something else.  One more call queues until the first has ended;
    they end in their order, with the right values, on every rank.  (The runner may take
    the first end between two calls of a slow thread, and then the calls behind it queue:
    of three tries, one must post every call.)"""
    size = 3
    g = ThreadGroup(size, timeout=30)
    try:
        def body(ctx):
            tries = []
            for attempt in range(3):
                ctx.barrier()
                before = _posted(ctx)
                if ctx.rank == 2:
                    time.sleep(0.2)         # nobody's first call can end before it comes
                calls, expected = [], []
                for i in range(OUTSTANDING):        # the four kinds in turn
                    kind = i % 4
                    if kind == 0:
                        calls.append(lambda i=i: ctx.allreduce(
                            np.full(3, ctx.rank + i, np.float32), async_op=True))
                        expected.append([3.0 * i + 3] * 3)
                    elif kind == 1:
                        calls.append(lambda i=i: ctx.broadcast(
                            np.full(2, 7.0 + i + attempt if ctx.rank == 1 else 0.0), root=1,
                            async_op=True))
                        expected.append([7.0 + i + attempt] * 2)
                    elif kind == 2:
                        calls.append(lambda: ctx.barrier(async_op=True))
                        expected.append(None)
                    else:
                        calls.append(lambda i=i: ctx.allreduce(
                            np.full(5, 10.0 * ctx.rank + i), op=pc.MAX, async_op=True))
                        expected.append([20.0 + i] * 5)
                works = [call() for call in calls]
                posted = _posted(ctx) - before
                works.append(ctx.allreduce(np.ones(1), async_op=True))  # one more: queues
                expected.append([3.0])
                outstanding = ctx._transport.flag_area.outstanding
                values = [w.wait(timeout=20) for w in works]
                tries.append((posted, outstanding, expected,
                              [None if v is None else v.tolist() for v in values],
                              [w.algorithm for w in works], _posted(ctx) - before))
            return tries

        for rank, tries in enumerate(g.run(body, timeout=120)):
            for posted, outstanding, expected, values, algos, total in tries:
                assert outstanding <= OUTSTANDING, (rank, tries)
                assert values == expected, (rank, tries)
                assert algos == ["flags"] * (OUTSTANDING + 1), (rank, tries)
                assert total == OUTSTANDING + 1, (rank, tries)
            if rank != 2:           # rank 2 came last: its calls could end as they were made
                assert max(t[0] for t in tries) == OUTSTANDING, (rank, tries)
    finally:
        g.close()


def test_posted_calls_keep_their_place_before_a_blocking_call_and_a_queued_one():
    """A blocking collective and an async one on the message path, made behind several
    posted calls, run after them on every rank, whoever comes late."""
    size = 3
    g = ThreadGroup(size, timeout=30)
    try:
        def body(ctx):
            out = []
            for late in range(size):
                if ctx.rank == late:
                    time.sleep(0.1)
                posted = [ctx.allreduce(np.full(2, float(i + ctx.rank)), async_op=True)
                          for i in range(3)]
                ring = ctx.allreduce(np.full(300, 1.0), algorithm="ring", async_op=True)
                blocking = ctx.allreduce(np.full(2, 100.0))
                out.append(([w.wait(timeout=20).tolist() for w in posted],
                            ring.wait(timeout=20)[0], blocking.tolist()))
            return out

        expected = [([[3.0 + 3 * i] * 2 for i in range(3)], 3.0, [300.0] * 2)] * size
        assert g.run(body, timeout=60) == [expected] * size
    finally:
        g.close()


@pytest.mark.parametrize("end", ["mismatch", "abort"])
def test_several_posted_calls_fail_as_blocking_ones_would(end):
    """Three posted calls: where the second disagrees with the peer's, the first ends with
    its value and the second with MismatchError; after abort() from another thread every
    wait fails; none hangs."""
    g = ThreadGroup(2, timeout=30)
    try:
        def body(ctx):
            if ctx.rank == 1:
                if end == "abort":
                    time.sleep(1.5)
                    return None
                first = ctx.allreduce(np.ones(8))
                with pytest.raises(pc.MismatchError):
                    ctx.allreduce(np.ones(9))
                return first.tolist()
            works = [ctx.allreduce(np.ones(8), async_op=True) for _ in range(3)]
            if end == "abort":
                threading.Timer(0.3, ctx.abort).start()
            started, outcomes = time.monotonic(), []
            for w in works:
                try:
                    outcomes.append(w.wait(timeout=10).tolist())
                except pc.Error as exc:
                    outcomes.append(type(exc))
            return outcomes, time.monotonic() - started

        res = g.outcomes(body, timeout=60)
        outcomes, took = res[0]
        assert took < 5, res
        if end == "mismatch":
            assert outcomes[0] == [2.0] * 8 and outcomes[1] is pc.MismatchError, res
            assert issubclass(outcomes[2], pc.Error), res
            assert res[1] == [2.0] * 8, res
        else:
            assert all(o is pc.Aborted for o in outcomes), res
    finally:
        g.close()


def test_posted_calls_mixed_with_roots_running_ahead_never_read_a_reused_slot():
    """A seeded mix of async and blocking allreduces, broadcasts from every root and
    barriers, each rank waiting for its handles at its own moments (up to 6 pending, so
    some calls post and some queue) and now and then slow: every value arrives intact.
    Messages of up to the area's largest, so slots and post lines are both reused."""
    size = 3
    g = ThreadGroup(size, timeout=60)
    try:
        def body(ctx):
            plan = np.random.default_rng(18)            # the same calls on every rank
            mine = np.random.default_rng(100 + ctx.rank)  # this rank's own pace
            pending, bad = [], []

            def settle(keep):
                while len(pending) > keep:
                    i, work, check = pending.pop(0)
                    if not check(work.wait(timeout=30)):
                        bad.append(i)

            for i in range(400):
                kind = plan.integers(4)
                n = int(plan.choice([1, 3, 40, MAX_BYTES // 8]))
                root = int(plan.integers(size))
                if mine.random() < 0.02:
                    time.sleep(0.002)
                if kind == 0 or kind == 3:
                    buf = np.full(n, i + ctx.rank, np.float64)
                    want = size * i + size * (size - 1) / 2

                    def check(v, want=want):
                        return v is not None and bool(np.all(v == want))
                    if kind == 3:
                        settle(0)
                        if not check(ctx.allreduce(buf)):
                            bad.append(i)
                        continue
                    work = ctx.allreduce(buf, async_op=True)
                elif kind == 1:
                    buf = np.full(n, i * 10.0 + root) if ctx.rank == root else np.zeros(n)

                    def check(v, want=i * 10.0 + root):
                        return v is not None and bool(np.all(v == want))
                    work = ctx.broadcast(buf, root=root, async_op=True)
                else:
                    def check(v):
                        return v is None
                    work = ctx.barrier(async_op=True)
                pending.append((i, work, check))
                settle(int(mine.integers(7)))
            settle(0)
            return bad

        assert g.run(body, timeout=240) == [[]] * size
    finally:
        g.close()


def test_a_root_running_ahead_never_overwrites_a_broadcast_posted_and_not_yet_read():
    """The others post OUTSTANDING async broadcasts and read none of them for a while; the
    root runs ahead with 16 more: it must not reuse the slot of a broadcast a rank has
    posted and not ended (a slot is free only once every peer has entered the operation
    OUTSTANDING - 1 past the one that freed it)."""
    size = 3
    g = ThreadGroup(size, timeout=30)
    try:
        def body(ctx):
            count = OUTSTANDING + 16
            bufs = [np.full(3, 1.0 + i) if ctx.rank == 0 else np.zeros(3) for i in range(count)]
            if ctx.rank == 0:
                time.sleep(0.1)     # the others post first, so theirs cannot end at once
                works = [ctx.broadcast(b, root=0, async_op=True) for b in bufs]
            else:
                works = [ctx.broadcast(b, root=0, async_op=True) for b in bufs[:OUTSTANDING]]
                time.sleep(0.4)     # the root posts what it may meanwhile
                works += [ctx.broadcast(b, root=0, async_op=True) for b in bufs[OUTSTANDING:]]
            return [w.wait(timeout=20)[0] for w in works]

        assert g.run(body) == [[1.0 + i for i in range(OUTSTANDING + 16)]] * size
    finally:
        g.close()
