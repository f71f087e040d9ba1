"""PYCOLLECT_DEBUG=detail: a cross-rank check of every collective's signature."""

import numpy as np
import pytest

import pycollect as pc
from group import ThreadGroup


@pytest.fixture(scope="module")
def trio():
    mp = pytest.MonkeyPatch()
    mp.setenv("PYCOLLECT_DEBUG", "detail")
    try:
        g = ThreadGroup(3, timeout=10)
    finally:
        mp.undo()
    yield g
    g.close()


def test_every_collective_passes_the_check_when_ranks_agree(trio):
    """Legitimate per-rank differences (v-counts' own blocks, root-only buffers) are not
    disagreements."""
    def body(ctx):
        r, n = ctx.rank, ctx.size
        out = {}
        out["allreduce"] = ctx.allreduce(np.full(5, r + 1.0))[0]
        out["broadcast"] = ctx.broadcast(np.full(3, float(r)), root=2)[0]
        out["reduce"] = ctx.reduce(np.full(2, 1, np.int32), root=1, op=pc.MAX)[0]
        counts = [1, 0, 2]
        mine = np.full(counts[r], r, np.int16)
        got = np.empty(sum(counts), np.int16)
        out["allgatherv"] = ctx.allgatherv(mine, got, counts).tolist()
        gathered = ctx.gatherv(mine, got if r == 0 else None, counts, root=0)
        out["gatherv"] = None if gathered is None else gathered.tolist()
        piece = np.empty(counts[r], np.int16)
        ctx.scatterv(np.arange(3, dtype=np.int16) if r == 2 else None, counts, piece, root=2)
        out["scatterv"] = piece.tolist()
        out["reduce_scatter"] = ctx.reduce_scatter(np.ones(6)).tolist()
        out["alltoall"] = ctx.alltoall(np.arange(3, dtype=np.int64) + 10 * r).tolist()
        a, b = np.ones(2, np.float32), np.ones(3, np.int64)
        ctx.allreduce_coalesced([a, b])
        out["coalesced"] = (a.tolist(), b.tolist())
        out["objects"] = ctx.allgather_object({"rank": r})
        sub = ctx.new_group([2, 0])
        out["group"] = None if sub is None else float(sub.allreduce(np.ones(1))[0])
        work = ctx.allreduce(np.ones(4), async_op=True)
        out["async"] = work.wait(timeout=10).tolist()
        ctx.barrier()
        return out
    res = trio.run(body)
    for r, out in enumerate(res):
        assert out["allreduce"] == 6.0 and out["broadcast"] == 2.0
        assert out["allgatherv"] == [0, 2, 2] and out["scatterv"] == [[0], [], [1, 2]][r]
        assert out["gatherv"] == ([0, 2, 2] if r == 0 else None)
        assert out["reduce_scatter"] == [3.0, 3.0]
        assert out["alltoall"] == [r, 10 + r, 20 + r]
        assert out["coalesced"] == ([3.0, 3.0], [3, 3, 3])
        assert out["objects"] == [{"rank": i} for i in range(3)]
        assert out["group"] == (None if r == 1 else 2.0)
        assert out["async"] == [3.0] * 4
    assert res[1]["reduce"] == 1


@pytest.mark.parametrize("case", ["collective", "count", "root", "op", "dtype"])
def test_disagreement_is_named_on_every_rank_and_the_context_survives(trio, case):
    """Rank 2 differs in one way.  Without the check, ranks that never exchange a message
    with rank 2 could only time out; with it every rank raises the same MismatchError."""
    def body(ctx):
        odd = ctx.rank == 2
        buf = np.ones(4, np.float32)
        try:
            if case == "collective":
                ctx.broadcast(buf, root=0) if odd else ctx.allreduce(buf)
            elif case == "count":
                ctx.broadcast(np.ones(5 if odd else 4, np.float32), root=0)
            elif case == "root":
                ctx.broadcast(buf, root=1 if odd else 0)
            elif case == "op":
                ctx.allreduce(buf, op=pc.MAX if odd else pc.SUM)
            else:
                ctx.allreduce(buf.astype(np.float64) if odd else buf)
        except pc.MismatchError as exc:
            message = str(exc)
        else:
            message = None
        after = ctx.allreduce(np.ones(2))      # the check moved no data: still usable
        return message, after.tolist()
    res = trio.run(body)
    for r, (message, after) in enumerate(res):
        assert after == [3.0, 3.0]
        assert message is not None and message.startswith("rank %d:" % r), message
        assert "ranks 0, 1 called" in message and "rank 2 called" in message, message
    words = {"collective": "broadcast(", "count": "buf count 5", "root": "root 1",
             "op": "MAX", "dtype": "float64"}[case]
    assert words in res[0][0]
