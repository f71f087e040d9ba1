"""reduce, allgather(v), gather(v), scatter(v), reduce_scatter(v), alltoall(v),
allreduce_coalesced and the object collectives, against NumPy, at every world size."""

import numpy as np
import pytest

import pycollect as pc
from conftest import counts_for
from reference import (BFLOAT16, DTYPES, assert_matches, make_input, np_dtype, ops_for,
                       reduce_reference)

SOME_DTYPES = ["int8", "uint64", "bool", "float16", "bfloat16", "float32", "float64",
               "complex64"]


def _skip_missing(dtype):
    if dtype == "bfloat16" and BFLOAT16 is None:
        pytest.skip("ml_dtypes is not installed")


def _vcounts(size, salt):
    """Uneven per-rank counts with zeros among them."""
    return [((r * 7 + salt) % 5) * (r % 3 != 1) + (r == size - 1) * 3 for r in range(size)]


def _payload(dtype, n, rank, salt=0):
    return make_input(dtype, n, rank, pc.SUM, seed=salt)


@pytest.mark.parametrize("algorithm", ["binomial", "ring", "auto"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_reduce(group, algorithm, dtype):
    _skip_missing(dtype)
    size = group.size
    cases = [(op, n, root) for op in ops_for(dtype) for n in counts_for(size)
             for root in {0, size - 1, n % size}]

    def body(ctx):
        out = []
        for op, n, root in cases:
            buf = make_input(dtype, n, ctx.rank, op)
            before = buf.copy()
            assert ctx.reduce(buf, root=root, op=op, algorithm=algorithm) is buf
            if ctx.rank != root:      # a non-root input is never written
                assert np.array_equal(buf.view(np.uint8), before.view(np.uint8))
            out.append(buf)
        return out

    results = group.run(body)
    for i, (op, n, root) in enumerate(cases):
        expected = reduce_reference(dtype, [make_input(dtype, n, r, op) for r in range(size)], op)
        assert_matches(dtype, op, results[root][i], expected,
                       "reduce size %d root %d count %d" % (size, root, n))


@pytest.mark.parametrize("dtype", DTYPES)
def test_reduce_scatter(group, dtype):
    _skip_missing(dtype)
    size = group.size
    cases = [(op, n) for op in ops_for(dtype) for n in [0, 1, 3, 250]]

    def body(ctx):
        out = []
        for op, n in cases:
            send = make_input(dtype, n * size, ctx.rank, op)
            before = send.copy()
            out.append(ctx.reduce_scatter(send, op=op))
            assert np.array_equal(send.view(np.uint8), before.view(np.uint8))
        return out

    results = group.run(body)
    for i, (op, n) in enumerate(cases):
        full = reduce_reference(dtype, [make_input(dtype, n * size, r, op)
                                        for r in range(size)], op)
        for r in range(size):
            assert_matches(dtype, op, results[r][i], full[r * n:(r + 1) * n],
                           "reduce_scatter size %d rank %d n %d" % (size, r, n))


@pytest.mark.parametrize("dtype", ["int32", "float64", "bfloat16"])
def test_reduce_scatterv(group, dtype):
    _skip_missing(dtype)
    size = group.size
    counts = _vcounts(size, 1)
    total = sum(counts)
    offs = np.concatenate([[0], np.cumsum(counts)])

    def body(ctx):
        send = make_input(dtype, total, ctx.rank, pc.SUM)
        recv = np.empty(counts[ctx.rank], dtype=np_dtype(dtype))
        ctx.reduce_scatterv(send, recv, counts)
        return recv

    full = reduce_reference(dtype, [make_input(dtype, total, r, pc.SUM) for r in range(size)],
                            pc.SUM)
    for r, got in enumerate(group.run(body)):
        assert_matches(dtype, pc.SUM, got, full[offs[r]:offs[r + 1]], "rank %d" % r)


@pytest.mark.parametrize("dtype", SOME_DTYPES)
def test_allgather_gather_scatter_alltoall(group, dtype):
    _skip_missing(dtype)
    size = group.size
    dt = np_dtype(dtype)
    ns = [0, 1, 5, 1000]

    def body(ctx):
        r = ctx.rank
        out = {}
        for n in ns:
            mine = _payload(dtype, n, r)
            out["allgather", n] = ctx.allgather(mine)
            inplace = np.zeros((size, n), dt)
            inplace[r] = mine
            out["inplace", n] = ctx.allgather(inplace[r], inplace)
            for root in {0, size - 1}:
                out["gather", n, root] = ctx.gather(mine, root=root)
                blocks = np.stack([_payload(dtype, n, p, 1) for p in range(size)]) \
                    if r == root else None
                recv = np.empty(n, dt)
                out["scatter", n, root] = ctx.scatter(blocks, recv, root=root)
            send = np.stack([_payload(dtype, n, r * size + p, 2) for p in range(size)])
            out["alltoall", n] = ctx.alltoall(send)
        return out

    results = group.run(body)
    for n in ns:
        every = np.stack([_payload(dtype, n, p) for p in range(size)])
        for r in range(size):
            assert np.array_equal(results[r]["allgather", n], every)
            assert np.array_equal(results[r]["inplace", n], every)
            a2a = np.stack([_payload(dtype, n, p * size + r, 2) for p in range(size)])
            assert np.array_equal(results[r]["alltoall", n], a2a)
            for root in {0, size - 1}:
                got = results[r]["gather", n, root]
                if r == root:
                    assert np.array_equal(got, every)
                else:
                    assert got is None
                assert np.array_equal(results[r]["scatter", n, root], _payload(dtype, n, r, 1))


def test_buffers_that_are_not_arrays(group):
    """Every collective takes memoryviews (and bytearrays) where it takes arrays: their
    exported buffers are described and held for the call as arrays are."""
    size = group.size

    def body(ctx):
        r, out = ctx.rank, {}
        a = np.arange(6, dtype=np.int32) + 10 * r
        out["allreduce"] = np.asarray(ctx.allreduce(memoryview(a.copy()))).copy()
        b = bytearray([r + 1] * 5)
        ctx.broadcast(b, root=size - 1)
        out["broadcast"] = bytes(b)
        red = a.copy()
        ctx.reduce(memoryview(red), root=0, op=pc.MAX)
        out["reduce"] = red
        got = np.zeros((size, 6), np.int32)
        ctx.allgather(memoryview(a), memoryview(got))
        out["allgather"] = got
        send = np.arange(size * 3, dtype=np.float64) + 100 * r
        rs = np.zeros(3, np.float64)
        ctx.reduce_scatter(memoryview(send), memoryview(rs))
        out["reduce_scatter"] = rs
        a2a = np.zeros(size * 3, np.float64)
        ctx.alltoall(memoryview(send), memoryview(a2a))
        out["alltoall"] = a2a
        gat = np.zeros((size, 6), np.int32) if r == 0 else None
        ctx.gather(memoryview(a), None if gat is None else memoryview(gat), root=0)
        out["gather"] = gat
        sc = np.zeros(2, np.int64)
        blocks = np.arange(size * 2, dtype=np.int64) if r == 0 else None
        ctx.scatter(None if blocks is None else memoryview(blocks), memoryview(sc), root=0)
        out["scatter"] = sc
        return out

    results = group.run(body)
    rows = np.stack([np.arange(6, dtype=np.int32) + 10 * p for p in range(size)])
    sends = np.stack([np.arange(size * 3, dtype=np.float64) + 100 * p for p in range(size)])
    for r, out in enumerate(results):
        assert np.array_equal(out["allreduce"], rows.sum(axis=0))
        assert out["broadcast"] == bytes([size] * 5)
        assert np.array_equal(out["allgather"], rows)
        assert np.array_equal(out["reduce_scatter"], sends.sum(axis=0)[3 * r:3 * r + 3])
        assert np.array_equal(out["alltoall"], sends[:, 3 * r:3 * r + 3].ravel())
        assert np.array_equal(out["scatter"], np.arange(2 * r, 2 * r + 2))
    assert np.array_equal(results[0]["reduce"], rows.max(axis=0))
    assert np.array_equal(results[0]["gather"], rows)


@pytest.mark.parametrize("dtype", ["uint8", "float32", "complex128"])
def test_v_collectives_with_uneven_counts(group, dtype):
    size = group.size
    dt = np_dtype(dtype)
    counts = _vcounts(size, 2)
    offs = np.concatenate([[0], np.cumsum(counts)]).astype(int)
    total = int(offs[-1])
    # alltoallv: rank s sends (2s + d) % 5 elements to rank d (not what d sends s: a rank's
    # send and receive counts differ, so their displacements do)
    a2a = [[(2 * s + d) % 5 for d in range(size)] for s in range(size)]

    def body(ctx):
        r = ctx.rank
        out = {}
        mine = _payload(dtype, counts[r], r)
        everything = np.empty(total, dt)
        out["allgatherv"] = ctx.allgatherv(mine, everything, counts).copy()
        root = size // 2
        gathered = np.empty(total, dt) if r == root else None
        ctx.gatherv(mine, gathered, counts, root=root)
        out["gatherv"] = gathered
        source = np.concatenate([_payload(dtype, counts[p], p, 3) for p in range(size)]) \
            if r == root else None
        recv = np.empty(counts[r], dt)
        out["scatterv"] = ctx.scatterv(source, counts, recv, root=root)
        sendcounts = a2a[r]
        recvcounts = [a2a[s][r] for s in range(size)]
        send = np.concatenate([_payload(dtype, sendcounts[d], r * 100 + d, 4)
                               for d in range(size)])
        got = np.empty(sum(recvcounts), dt)
        out["alltoallv"] = ctx.alltoallv(send, sendcounts, got, recvcounts)
        return out

    results = group.run(body)
    every = np.concatenate([_payload(dtype, counts[p], p) for p in range(size)])
    for r in range(size):
        assert np.array_equal(results[r]["allgatherv"], every)
        if r == size // 2:
            assert np.array_equal(results[r]["gatherv"], every)
        assert np.array_equal(results[r]["scatterv"], _payload(dtype, counts[r], r, 3))
        expect = np.concatenate([_payload(dtype, a2a[s][r], s * 100 + r, 4)
                                 for s in range(size)])
        assert np.array_equal(results[r]["alltoallv"], expect)


@pytest.mark.parametrize("transport", ["auto", "tcp"])
@pytest.mark.parametrize("collective", ["allgatherv", "reduce_scatterv"])
def test_v_counts_that_differ_between_ranks_are_a_mismatch(transport, collective):
    """Ranks that pass different counts with the same total (their blocks would land at
    other offsets than the peers think) fail with a MismatchError naming the counts, over
    the flag area and over the ring, instead of returning misplaced blocks."""
    from group import ThreadGroup
    g = ThreadGroup(2, timeout=10, transport=transport)
    try:
        def body(ctx):
            counts = [2, 1] if ctx.rank == 0 else [1, 2]
            try:
                if collective == "allgatherv":
                    ctx.allgatherv(np.ones(counts[ctx.rank]), np.zeros(3), counts)
                else:
                    ctx.reduce_scatterv(np.ones(3), np.zeros(counts[ctx.rank]), counts)
            except pc.MismatchError as exc:
                return str(exc)
            return None

        for said in g.run(body, timeout=30):
            assert said is not None and said.count("counts #") == 2, said
    finally:
        g.close()


def test_allreduce_coalesced(group):
    size = group.size

    def body(ctx):
        bufs = [np.full(3, ctx.rank, np.float32), np.full((2, 2), ctx.rank + 1, np.int64),
                np.arange(5, dtype=np.float32), np.zeros(0, np.float64)]
        out = ctx.allreduce_coalesced(bufs)
        assert out == bufs
        ctx.barrier()     # sequence numbers stay in step after the fused calls
        return bufs

    tri = size * (size - 1) // 2
    for bufs in group.run(body):
        assert np.all(bufs[0] == tri)
        assert np.all(bufs[1] == tri + size) and bufs[1].dtype == np.int64
        assert np.array_equal(bufs[2], np.arange(5) * size)


def test_object_collectives(group):
    size = group.size

    def body(ctx):
        r = ctx.rank
        big = np.arange(100000, dtype=np.float64) * (r + 1)
        got = ctx.broadcast_object({"from": r, "array": big} if r == 0 else None, root=0)
        every = ctx.allgather_object(("rank", r, [r] * r))
        root = size - 1
        gathered = ctx.gather_object({"r": r}, root=root)
        mine = ctx.scatter_object([f"item {p}" for p in range(size)] if r == root else None,
                                  root=root)
        return got, every, gathered, mine

    for r, (got, every, gathered, mine) in enumerate(group.run(body)):
        assert got["from"] == 0 and np.array_equal(got["array"], np.arange(100000.0))
        assert every == [("rank", p, [p] * p) for p in range(size)]
        assert gathered == ([{"r": p} for p in range(size)] if r == size - 1 else None)
        assert mine == f"item {r}"


def test_async_handles_complete_in_issue_order(group):
    def body(ctx):
        a = np.full(100000, ctx.rank + 1.0)
        b = np.full(7, ctx.rank + 1.0)
        works = [ctx.allreduce(a, async_op=True), ctx.broadcast(b, root=0, async_op=True),
                 ctx.barrier(async_op=True), ctx.allgather(np.array([ctx.rank]), async_op=True)]
        c = ctx.allreduce(np.ones(3))     # a blocking call waits its turn
        assert all(w.is_completed() for w in works)
        assert works[0].wait() is a and works[0].exception() is None
        # 800 KB: the handle names what auto chose (direct on shared memory; over TCP
        # ring_chunked at 2 ranks, bcube at 4, halving_doubling at the other sizes)
        assert works[0].algorithm == ctx.plan("allreduce", a).name
        assert works[0].algorithm in ("direct", "ring_chunked", "halving_doubling", "bcube")
        return a, b, works[3].wait(timeout=10), c

    s = group.size
    for a, b, ranks, c in group.run(body):
        assert np.all(a == s * (s + 1) / 2) and np.all(b == 1.0)
        assert np.array_equal(ranks.reshape(-1), np.arange(s)) and np.all(c == s)


@pytest.mark.parametrize("call, words", [
    (lambda ctx: ctx.allgather(np.zeros(3), np.zeros(3 * ctx.size + 1)), "must hold"),
    (lambda ctx: ctx.allgather(np.zeros(3, np.float32), np.zeros(3 * ctx.size)), "float32"),
    (lambda ctx: ctx.reduce_scatter(np.zeros(ctx.size * 2 + 1)), "multiple"),
    (lambda ctx: ctx.allgatherv(np.zeros(2), np.zeros(9), [2] * (ctx.size + 1)), "entries"),
    (lambda ctx: ctx.allgatherv(np.zeros(2), np.zeros(9), [-1] * ctx.size), "negative"),
    (lambda ctx: ctx.alltoall(np.zeros(ctx.size * 2 + 1)), "multiple"),
    (lambda ctx: ctx.alltoallv(np.zeros(2), [2] * ctx.size, np.zeros(2), None), "recvcounts"),
    (lambda ctx: ctx.scatter(None, np.zeros(2), root=ctx.size), "root"),
    (lambda ctx: ctx.reduce(np.zeros(2), op=pc.AVG, algorithm="bcube"), "unknown algorithm"),
    (lambda ctx: ctx.allreduce_coalesced([np.zeros(2), np.zeros(4)[::2]]), "bufs\\[1\\]"),
])
def test_bad_arguments(group, call, words):
    if words == "multiple" and group.size == 1:
        pytest.skip("every count is a multiple of 1")

    def body(ctx):
        with pytest.raises(pc.InvalidArgument, match=words):
            call(ctx)
        ctx.barrier()      # still usable, still in step
    group.run(body)


def test_the_gil_is_free_during_a_collective():
    """Python runs on another thread while a rank waits inside a collective: rank 1 holds
    back until the main thread has done its Python work, so a rank that kept the GIL in its
    wait would hold up that work until its call ended (at the deadline)."""
    import threading
    import time
    from group import ThreadGroup

    g = ThreadGroup(2, timeout=10)
    try:
        data = [np.full(1 << 20, r + 1, np.float32) for r in range(2)]
        entered, returned, go = threading.Event(), threading.Event(), threading.Event()
        errors = []

        def rank(r):
            try:
                if r == 0:
                    entered.set()
                else:
                    go.wait(30)
                g.contexts[r].allreduce(data[r])
            except Exception as exc:        # reported below
                errors.append(exc)
            finally:
                if r == 0:
                    returned.set()

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        entered.wait(30)
        time.sleep(0.05)                    # rank 0 is now waiting inside its allreduce
        total = sum(i * i for i in range(200000))       # Python work, under the GIL
        inside = not returned.is_set()
        go.set()
        for t in threads:
            t.join(30)
        assert total == sum(i * i for i in range(200000))
        assert inside, "the main thread's Python ran only after rank 0's call had ended"
        assert not errors, errors
        assert all(np.all(d == 3.0) for d in data)
    finally:
        g.close()
