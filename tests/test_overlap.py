"""Send and receive buffers that share memory (pycollect/_ext/_buffer.pyx, check_apart).

The algorithms write a receive buffer while they, and over shared memory the peers, still
read the send buffer, so overlapping bytes came out silently wrong (alltoall(a, a) of 20000
float64, a scatter root's recvbuf inside its sendbuf, sendrecv(a, p, a, p)).  Every
collective with both buffers now refuses an overlap before anything goes out, except its
in-place form (docs/api.md): the send buffer is exactly this rank's block of the receive
buffer (allgather(v); gather(v) on the root), the receive buffer exactly this rank's block
of the send buffer (reduce_scatter(v); scatter(v) on the root), or both the very same
memory (alltoall(v), whose send side is then staged in a copy).  The matrix runs both
at every world size, over shared memory and TCP, at counts that take the flags, direct and
ring paths."""

import re

import numpy as np
import pytest

import pycollect as pc

BOUND = 60          # each case's bound (the contexts' own deadline is the group's 60 s)
COUNTS = [5, 20000]  # per block: the flag area's size and one past it (direct, ring)
OVERLAP = re.compile(r"'sendbuf' and 'recvbuf' overlap in memory")


def _block(ctx, n):
    """Rank r's n elements: r + 1, r + 1.1, ... (distinct per rank and element)."""
    return ctx.rank + 1.0 + np.arange(n) / 10.0


def _blocks(size, n):
    return np.concatenate([r + 1.0 + np.arange(n) / 10.0 for r in range(size)])


# -- the in-place forms --------------------------------------------------------------------


def _allgather_in_place(ctx, n, **kw):
    out = np.zeros(n * ctx.size)
    mine = out[ctx.rank * n:(ctx.rank + 1) * n]
    mine[:] = _block(ctx, n)
    work = ctx.allgather(mine, out, **kw)
    if kw.get("async_op"):
        work.wait()
    return np.array_equal(out, _blocks(ctx.size, n))


def _allgatherv_in_place(ctx, n):
    counts = [n + p for p in range(ctx.size)]
    offs = np.cumsum([0] + counts)
    out = np.zeros(offs[-1])
    mine = out[offs[ctx.rank]:offs[ctx.rank + 1]]
    mine[:] = ctx.rank + 1.0
    ctx.allgatherv(mine, out, counts)
    return np.array_equal(out, np.repeat(np.arange(1.0, ctx.size + 1), counts))


def _gather_in_place(ctx, n, root):
    out = np.zeros(n * ctx.size)
    if ctx.rank == root:
        mine = out[root * n:(root + 1) * n]
        mine[:] = _block(ctx, n)
        ctx.gather(mine, out, root=root)
        return np.array_equal(out, _blocks(ctx.size, n))
    return ctx.gather(_block(ctx, n), None, root=root) is None


def _gatherv_in_place(ctx, n, root):
    counts = [n + 2 * p for p in range(ctx.size)]
    offs = np.cumsum([0] + counts)
    out = np.zeros(offs[-1])
    if ctx.rank == root:
        mine = out[offs[root]:offs[root + 1]]
        mine[:] = root + 1.0
        ctx.gatherv(mine, out, counts, root=root)
        return np.array_equal(out, np.repeat(np.arange(1.0, ctx.size + 1), counts))
    return ctx.gatherv(np.full(counts[ctx.rank], ctx.rank + 1.0), None, counts,
                       root=root) is None


def _scatter_in_place(ctx, n, root):
    if ctx.rank == root:
        blocks = _blocks(ctx.size, n)
        mine = blocks[root * n:(root + 1) * n]
        ctx.scatter(blocks, mine, root=root)
        # The root's recvbuf is its own block: every block is as it was.
        return np.array_equal(blocks, _blocks(ctx.size, n))
    out = ctx.scatter(None, np.zeros(n), root=root)
    return np.array_equal(out, _block(ctx, n))


def _scatterv_in_place(ctx, n, root):
    counts = [n + p for p in range(ctx.size)]
    offs = np.cumsum([0] + counts)
    if ctx.rank == root:
        blocks = np.repeat(np.arange(1.0, ctx.size + 1), counts)
        ctx.scatterv(blocks, counts, blocks[offs[root]:offs[root + 1]], root=root)
        return np.array_equal(blocks, np.repeat(np.arange(1.0, ctx.size + 1), counts))
    out = ctx.scatterv(None, counts, np.zeros(counts[ctx.rank]), root=root)
    return np.array_equal(out, np.full(counts[ctx.rank], ctx.rank + 1.0))


def _reduce_scatter_in_place(ctx, n, **kw):
    send = np.tile(_block(ctx, n), ctx.size) + np.repeat(np.arange(ctx.size) * 100.0, n)
    mine = send[ctx.rank * n:(ctx.rank + 1) * n]
    work = ctx.reduce_scatter(send, mine, **kw)
    if kw.get("async_op"):
        work.wait()
    ranks = np.arange(ctx.size)
    want = (ranks + 1.0).sum() + ctx.size * (np.arange(n) / 10.0 + ctx.rank * 100.0)
    return np.allclose(mine, want, rtol=0, atol=1e-9)


def _reduce_scatterv_in_place(ctx, n):
    counts = [n + p for p in range(ctx.size)]
    offs = np.cumsum([0] + counts)
    send = np.full(offs[-1], ctx.rank + 1.0)
    mine = send[offs[ctx.rank]:offs[ctx.rank + 1]]
    ctx.reduce_scatterv(send, mine, counts)
    return np.array_equal(mine, np.full(counts[ctx.rank], ctx.size * (ctx.size + 1) / 2.0))


def _alltoall_in_place(ctx, n, **kw):
    a = np.concatenate([_block(ctx, n) + 100 * p for p in range(ctx.size)])
    work = ctx.alltoall(a, a, **kw)
    if kw.get("async_op"):
        work.wait()
    # Block p now comes from rank p: rank p's block for this rank.
    want = np.concatenate([p + 1.0 + np.arange(n) / 10.0 + 100 * ctx.rank
                           for p in range(ctx.size)])
    return np.array_equal(a, want)


def _alltoallv_in_place(ctx, n):
    counts = [n] * ctx.size
    a = np.concatenate([_block(ctx, n) + 100 * p for p in range(ctx.size)])
    view = a[:]                                  # another object over the same memory
    ctx.alltoallv(a, counts, view, counts)
    want = np.concatenate([p + 1.0 + np.arange(n) / 10.0 + 100 * ctx.rank
                           for p in range(ctx.size)])
    return np.array_equal(a, want)


IN_PLACE = {
    "alltoall": _alltoall_in_place,
    "alltoall async": lambda ctx, n: _alltoall_in_place(ctx, n, async_op=True),
    "alltoall memoryview": lambda ctx, n: _alltoall_memoryview(ctx, n),
    "alltoallv": _alltoallv_in_place,
    "allgather": _allgather_in_place,
    "allgather async": lambda ctx, n: _allgather_in_place(ctx, n, async_op=True),
    "allgather ring": lambda ctx, n: _allgather_in_place(ctx, n, algorithm="ring"),
    "allgatherv": _allgatherv_in_place,
    "gather root 0": lambda ctx, n: _gather_in_place(ctx, n, 0),
    "gather root last": lambda ctx, n: _gather_in_place(ctx, n, ctx.size - 1),
    "gatherv root last": lambda ctx, n: _gatherv_in_place(ctx, n, ctx.size - 1),
    "scatter root 0": lambda ctx, n: _scatter_in_place(ctx, n, 0),
    "scatter root last": lambda ctx, n: _scatter_in_place(ctx, n, ctx.size - 1),
    "scatterv root last": lambda ctx, n: _scatterv_in_place(ctx, n, ctx.size - 1),
    "reduce_scatter": _reduce_scatter_in_place,
    "reduce_scatter async": lambda ctx, n: _reduce_scatter_in_place(ctx, n, async_op=True),
    "reduce_scatterv": _reduce_scatterv_in_place,
}


@pytest.mark.parametrize("n", COUNTS)
@pytest.mark.parametrize("case", sorted(IN_PLACE))
def test_the_in_place_form_gives_what_separate_arrays_give(group, case, n):
    assert group.run(lambda ctx: IN_PLACE[case](ctx, n), timeout=BOUND) == [True] * group.size


# -- overlaps that are refused -------------------------------------------------------------


def _alltoall_memoryview(ctx, n):
    a = np.concatenate([_block(ctx, n) + 100 * p for p in range(ctx.size)])
    ctx.alltoall(memoryview(a), a)
    want = np.concatenate([p + 1.0 + np.arange(n) / 10.0 + 100 * ctx.rank
                           for p in range(ctx.size)])
    return np.array_equal(a, want)


def _alltoall_shifted(ctx, n, **kw):
    buf = np.append(np.tile(_block(ctx, n), ctx.size), 0.0)
    kept = buf.copy()
    try:
        work = ctx.alltoall(buf[1:], buf[:-1], **kw)    # one element apart: no form of it
        if kw.get("async_op"):
            work.wait()
    finally:
        assert np.array_equal(buf, kept)        # refused before a byte was written
    return "ran"


def _alltoallv_shifted(ctx, n):
    counts = [n] * ctx.size
    buf = np.zeros(n * ctx.size + 1)
    ctx.alltoallv(buf[1:], counts, buf[:-1], counts)
    return "ran"


def _allgather_shifted(ctx, n, **kw):
    # One element off this rank's block: neither separate nor the in-place form.
    out = np.zeros(n * ctx.size + 1)
    work = ctx.allgather(out[ctx.rank * n + 1:(ctx.rank + 1) * n + 1], out[:-1], **kw)
    if kw.get("async_op"):
        work.wait()
    return "ran"


def _allgatherv_shifted(ctx, n):
    out = np.zeros(n * ctx.size + 1)
    ctx.allgatherv(out[1:n + 1], out[:-1], [n] * ctx.size)
    return "ran"


def _reduce_scatter_shifted(ctx, n, **kw):
    send = np.ones(n * ctx.size + 1)
    work = ctx.reduce_scatter(send[:-1], send[ctx.rank * n + 1:(ctx.rank + 1) * n + 1], **kw)
    if kw.get("async_op"):
        work.wait()
    return "ran"


def _reduce_scatterv_shifted(ctx, n):
    send = np.ones(n * ctx.size + 1)
    ctx.reduce_scatterv(send[1:], send[:n], [n] * ctx.size)
    return "ran"


def _sendrecv_same(ctx, n):
    a = _block(ctx, n)
    ctx.sendrecv(a, (ctx.rank + 1) % ctx.size, a, (ctx.rank - 1) % ctx.size)
    return "ran"


EVERY_RANK = {
    "alltoall": _alltoall_shifted,
    "alltoall async": lambda ctx, n: _alltoall_shifted(ctx, n, async_op=True),
    "alltoallv": _alltoallv_shifted,
    "allgather": _allgather_shifted,
    "allgather async": lambda ctx, n: _allgather_shifted(ctx, n, async_op=True),
    "allgather direct": lambda ctx, n: _allgather_shifted(ctx, n, algorithm="direct"),
    "allgatherv": _allgatherv_shifted,
    "reduce_scatter": _reduce_scatter_shifted,
    "reduce_scatter async": lambda ctx, n: _reduce_scatter_shifted(ctx, n, async_op=True),
    "reduce_scatterv": _reduce_scatterv_shifted,
    "sendrecv": _sendrecv_same,
}


@pytest.mark.parametrize("n", COUNTS)
@pytest.mark.parametrize("case", sorted(EVERY_RANK))
def test_an_overlap_on_every_rank_is_refused_and_the_group_goes_on(group, case, n):
    if case == "sendrecv" and group.size == 1:
        pytest.skip("a rank of one has no peer to send to")
    out = group.outcomes(lambda ctx: EVERY_RANK[case](ctx, n), timeout=BOUND)
    for rank, outcome in enumerate(out):
        assert isinstance(outcome, pc.InvalidArgument), (rank, outcome)
        assert OVERLAP.search(str(outcome)), outcome
        assert str(outcome).startswith(case.split()[0] + ":"), outcome
    # Refused by every rank before the wire: the group is in step.
    after = group.run(lambda ctx: ctx.allreduce(np.ones(3))[0], timeout=BOUND)
    assert after == [float(group.size)] * group.size


def _gather_shifted_at_root(ctx, n):
    if ctx.rank == 0:
        out = np.zeros(n * ctx.size + 1)
        return ctx.gather(out[1:n + 1], out[:-1], root=0)
    return ctx.gather(_block(ctx, n), None, root=0)


def _gatherv_in_another_block(ctx, n):
    if ctx.rank == 0:
        if ctx.size == 1:
            out = np.zeros(n + 1)
            return ctx.gatherv(out[1:], out[:-1], [n])
        out = np.zeros(n * ctx.size)
        return ctx.gatherv(out[n:2 * n], out, [n] * ctx.size)     # block 1, not its own
    return ctx.gatherv(_block(ctx, n), None, [n] * ctx.size)


def _scatter_into_another_block(ctx, n):
    if ctx.rank == 0:
        blocks = np.append(_blocks(ctx.size, n), 0.0)
        kept = blocks.copy()
        try:
            # Block 1 of sendbuf (not the root's own), or one element off at 1 rank.
            return ctx.scatter(blocks[:-1], blocks[n:2 * n] if ctx.size > 1 else blocks[1:],
                               root=0)
        finally:
            assert np.array_equal(blocks, kept)
    return ctx.scatter(None, np.zeros(n), root=0)


def _scatterv_shifted(ctx, n):
    if ctx.rank == 0:
        blocks = np.ones(n * ctx.size + 1)
        return ctx.scatterv(blocks[:-1], [n] * ctx.size, blocks[1:n + 1], root=0)
    return ctx.scatterv(None, [n] * ctx.size, np.zeros(n), root=0)


AT_ROOT = {
    "gather": _gather_shifted_at_root,
    "gatherv": _gatherv_in_another_block,
    "scatter": _scatter_into_another_block,
    "scatterv": _scatterv_shifted,
}


@pytest.mark.parametrize("n", COUNTS)
@pytest.mark.parametrize("case", sorted(AT_ROOT))
def test_an_overlap_on_the_root_is_refused_and_its_peers_told(group, case, n):
    out = group.outcomes(lambda ctx: AT_ROOT[case](ctx, n), timeout=BOUND)
    assert isinstance(out[0], pc.InvalidArgument), out
    assert OVERLAP.search(str(out[0])) and str(out[0]).startswith(case + ":"), out[0]
    for rank in range(1, group.size):
        # A rank that waits on the root fails naming the refusal; one whose part the
        # channel took returns (docs/errors.md).
        if isinstance(out[rank], pc.Error):
            assert isinstance(out[rank], pc.MismatchError), out
            assert re.search(r"rank 0\b.*refused its arguments to %s #\d+" % case,
                             str(out[rank])), out[rank]
            if "relayed" not in str(out[rank]):         # from the root itself: its reason
                assert "overlap in memory" in str(out[rank]), out[rank]


def test_arrays_that_only_touch_are_not_an_overlap(group):
    def run(ctx):
        buf = np.zeros(2 * ctx.size * 3)
        send, recv = buf[:ctx.size * 3], buf[ctx.size * 3:]
        send[:] = _blocks(ctx.size, 3) + ctx.rank
        ctx.alltoall(send, recv)
        want = np.concatenate([_block(ctx, 3) + p for p in range(ctx.size)])
        return np.array_equal(recv, want)

    assert group.run(run, timeout=BOUND) == [True] * group.size


def test_sendrecv_replace_is_the_one_buffer_form():
    from group import ThreadGroup
    pair = ThreadGroup(2)
    try:
        out = pair.outcomes(lambda ctx: _sendrecv_same(ctx, 8))
        assert all(isinstance(o, pc.InvalidArgument) and "sendrecv_replace" in str(o)
                   for o in out), out

        def swap(ctx):
            a = _block(ctx, 8)
            ctx.sendrecv_replace(a, 1 - ctx.rank, 1 - ctx.rank)
            return a[0]

        assert pair.run(swap) == [2.0, 1.0]
        torch = pytest.importorskip("torch")
        shared = [torch.ones(8), torch.ones(8)]
        out = pair.outcomes(lambda ctx: ctx.sendrecv(shared[ctx.rank], 1 - ctx.rank,
                                                     shared[ctx.rank], 1 - ctx.rank))
        assert all(isinstance(o, pc.InvalidArgument) and OVERLAP.search(str(o))
                   for o in out), out                   # tensors are checked as their arrays
    finally:
        pair.close()
