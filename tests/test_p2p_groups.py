"""Tagged send/recv (Gloo's patterns) and sub-groups over the parent's connections."""

import threading
import time

import numpy as np
import pytest

import pycollect as pc
from group import ThreadGroup


@pytest.fixture(scope="module")
def quad():
    g = ThreadGroup(4, timeout=20)
    yield g
    g.close()


def test_all_to_all_by_send_and_recv(quad):
    """Every rank sends to every other (lower ranks first), then receives from each."""
    def body(ctx):
        r, n = ctx.rank, ctx.size
        for d in range(n):
            if d != r:
                ctx.send(np.full(100, r * 10 + d, np.int32), d, tag=7)
        got = {}
        for s in range(n):
            if s != r:
                buf = np.zeros(100, np.int32)
                assert ctx.recv(buf, src=s, tag=7) == s
                got[s] = int(buf[0])
        return got
    for r, got in enumerate(quad.run(body)):
        assert got == {s: s * 10 + r for s in range(4) if s != r}


def test_receive_from_any_source(quad):
    def body(ctx):
        if ctx.rank == 0:
            seen = []
            for _ in range(3):
                buf = np.zeros(4)
                src = ctx.recv(buf, tag=3)
                assert np.all(buf == src)
                seen.append(src)
            return sorted(seen)
        ctx.send(np.full(4, float(ctx.rank)), 0, tag=3)
    assert quad.run(body)[0] == [1, 2, 3]


def test_zero_byte_and_smaller_messages(quad):
    def body(ctx):
        if ctx.rank == 1:
            ctx.send(np.zeros(0, np.float32), 2, tag=0)
            ctx.send(np.arange(3, dtype=np.float32), 2, tag=1)
        elif ctx.rank == 2:
            empty = np.zeros(0, np.float32)
            assert ctx.recv(empty, src=1, tag=0) == 1
            big = np.full(10, -1, np.float32)
            work = ctx.recv(big, src=1, tag=1, async_op=True)
            assert work.wait(timeout=10) == (1, 3)
            assert np.array_equal(big[:3], [0, 1, 2]) and np.all(big[3:] == -1)
        ctx.barrier()
    quad.run(body)


def test_many_in_flight(quad):
    """Several async sends and receives outstanding at once, each receive with its message."""
    def body(ctx):
        peer = ctx.rank ^ 1
        outs = [np.full(1000, ctx.rank * 100 + i, np.int64) for i in range(16)]
        ins = [np.zeros(1000, np.int64) for _ in range(16)]
        works = []
        for i in range(16):
            works.append(ctx.send(outs[i], peer, tag=i, async_op=True))
            works.append(ctx.recv(ins[i], src=peer, tag=i, async_op=True))
        for w in works:
            w.wait(timeout=20)
        return [int(x[0]) for x in ins]
    for r, firsts in enumerate(quad.run(body)):
        assert firsts == [(r ^ 1) * 100 + i for i in range(16)]


@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_large_async_sends_before_receives_do_not_wait_on_each_other(transport):
    """Both ranks post a send far larger than socket buffers before their receive
    (and a receive from any source): the batch keeps them all in flight."""
    g = ThreadGroup(2, timeout=20, transport=transport)
    try:
        def body(ctx):
            peer, n = ctx.rank ^ 1, 3 << 20       # 24 MiB of float64 each way
            out = np.full(n, ctx.rank + 1.0)
            into = np.zeros(n)
            small_out = np.arange(5, dtype=np.int32) + 10 * ctx.rank
            small_in = np.zeros(8, np.int32)
            works = [ctx.send(out, peer, tag=1, async_op=True),
                     ctx.send(small_out, peer, tag=2, async_op=True),
                     ctx.recv(into, src=peer, tag=1, async_op=True),
                     ctx.recv(small_in, tag=2, async_op=True)]
            results = [w.wait(timeout=20) for w in works]
            assert results[2] == (peer, n) and results[3] == (peer, 5)
            assert np.all(into == peer + 1.0)
            assert small_in[:5].tolist() == list(range(10 * peer, 10 * peer + 5))
            return [w.is_completed() for w in works]
        assert g.run(body, timeout=60) == [[True] * 4] * 2
    finally:
        g.close()


def test_receives_from_any_source_posted_before_the_sends():
    """Each rank posts a receive from any source, then its send: neither waits forever."""
    g = ThreadGroup(3, timeout=20)
    try:
        def body(ctx):
            into = np.zeros(1 << 20, np.float32)
            got = ctx.recv(into, tag=4, async_op=True)
            ctx.send(np.full(1 << 20, float(ctx.rank), np.float32), (ctx.rank + 1) % 3,
                     tag=4, async_op=True)
            src, count = got.wait(timeout=20)
            assert src == (ctx.rank - 1) % 3 and count == 1 << 20
            assert np.all(into == src)
            ctx.barrier()      # a collective after the batch: issue order holds
            return src
        assert g.run(body, timeout=60) == [2, 0, 1]
    finally:
        g.close()


@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_a_batch_fails_as_a_whole_when_its_peer_leaves(transport):
    """Rank 1 closes instead of answering: every operation handed to rank 0's batch fails
    with the PeerError naming rank 1, and the context fails after it."""
    g = ThreadGroup(2, timeout=10, transport=transport)
    queued = threading.Event()
    try:
        def body(ctx):
            if ctx.rank == 1:
                assert queued.wait(10)
                time.sleep(0.5)         # the batch takes both (it looks every 2 ms)
                ctx.close()
                return None
            works = [ctx.recv(np.zeros(4), src=1, tag=1, async_op=True),
                     ctx.send(np.ones(1 << 22), 1, tag=2, async_op=True)]
            queued.set()
            errors = []
            for w in works:
                with pytest.raises(pc.PeerError, match="rank 1") as info:
                    w.wait(timeout=20)
                errors.append(w.exception())
                assert info.value is w.exception()
            assert errors[0] is errors[1]          # one failure, handed to the whole batch
            with pytest.raises(pc.PeerError, match="failed earlier"):
                ctx.barrier()
            return str(errors[0])
        message = g.run(body, timeout=60)[0]
        assert message.startswith("rank 0: send/recv(") and "rank 1 (" in message, message
    finally:
        g.close()


@pytest.mark.parametrize("transport", ["auto", "tcp"])
@pytest.mark.parametrize("how", ["recv", "probe"])
def test_a_receive_from_any_rank_fails_when_a_peer_leaves(transport, how):
    """Rank 2 closes while rank 0 waits for a message from any rank: PeerError naming rank
    2 at once, over shared memory as over TCP (a ring's reader skipped the ended stream and
    waited to its deadline)."""
    g = ThreadGroup(3, timeout=8, transport=transport)
    try:
        def body(ctx):
            if ctx.rank == 2:
                time.sleep(0.3)
                ctx.close()
                return None
            if ctx.rank == 1:
                return None
            start = time.monotonic()
            with pytest.raises(pc.PeerError, match="rank 2 .* closed its connection"):
                if how == "recv":
                    ctx.recv(np.zeros(4), pc.ANY_SOURCE, tag=3)
                else:
                    ctx.probe()
            return time.monotonic() - start
        assert g.run(body, timeout=60)[0] < 4
    finally:
        g.close()


@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_a_receive_from_any_rank_takes_a_message_beside_an_ended_stream(transport):
    """Rank 1 closes; rank 2's message is already here: a receive from any rank takes it
    (the ended stream, looked at first, failed the receive over TCP)."""
    g = ThreadGroup(3, timeout=5, transport=transport)
    try:
        def body(ctx):
            if ctx.rank == 1:
                ctx.close()
                return None
            if ctx.rank == 2:
                ctx.send(np.full(4, 2.0), 0, tag=3)
                return None
            time.sleep(0.5)
            got = np.zeros(4)
            return ctx.recv(got, pc.ANY_SOURCE, tag=3), got[0]
        assert g.run(body, timeout=60)[0] == (2, 2.0)
    finally:
        g.close()


@pytest.mark.parametrize("transport", ["auto", "tcp"])
@pytest.mark.parametrize("how", ["recv", "probe", "irecv", "nested"])
def test_a_groups_receive_from_any_rank_waits_on_beside_a_non_members_end(transport, how):
    """Rank 3, outside the group {0, 1, 2}, closes before rank 0 of the group receives from
    any member: the group's receive waits for its members' messages and takes rank 1's
    (a non-member's ended stream failed it with PeerError naming nobody).  ``nested``: the
    receive runs on a group {0, 1} made of that group, and rank 2 leaves too."""
    g = ThreadGroup(4, timeout=8, transport=transport)
    try:
        def body(ctx):
            grp = ctx.new_group([0, 1, 2])
            if ctx.rank == 3:
                ctx.close()
                return None
            sub = grp.new_group([0, 1]) if how == "nested" else grp
            if ctx.rank == 2:
                if how == "nested":
                    ctx.close()         # a member of grp, not of sub
                return None
            if ctx.rank == 1:
                time.sleep(0.6)         # rank 3 has closed by now
                sub.send(np.full(4, 1.0), 0, tag=3)
                return None
            time.sleep(0.3)
            got = np.zeros(4)
            if how == "probe":
                status = sub.probe(pc.ANY_SOURCE, 3)
                assert (status.source, status.tag) == (1, 3)
                return sub.recv(got, status.source, tag=3), got[0]
            if how == "irecv":
                return sub.recv(got, pc.ANY_SOURCE, tag=3, async_op=True).wait()[0], got[0]
            return sub.recv(got, pc.ANY_SOURCE, tag=3), got[0]
        assert g.run(body, timeout=60)[0] == (1, 1.0)
    finally:
        g.close()


@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_a_groups_receive_from_any_rank_fails_when_a_member_leaves(transport):
    """A member's ended stream still fails the group's receive from any rank, naming the
    member by its group rank and its global rank."""
    g = ThreadGroup(4, timeout=8, transport=transport)
    try:
        def body(ctx):
            grp = ctx.new_group([0, 2, 3])
            if ctx.rank == 3:
                time.sleep(0.3)
                ctx.close()
            if ctx.rank != 0:
                return None
            with pytest.raises(pc.PeerError, match=r"rank 2 \(global rank 3.* closed its"):
                grp.recv(np.zeros(4), pc.ANY_SOURCE, tag=3)
            return True
        assert g.run(body, timeout=60)[0]
    finally:
        g.close()


def test_a_receive_for_a_tag_nobody_sends_names_the_tag_that_came():
    """Receives match by tag (tests/test_p2p_matching.py): a message with another tag waits
    for its own receive, and the one that never comes times out naming it."""
    g = ThreadGroup(2, timeout=10)
    try:
        def body(ctx):
            if ctx.rank == 0:
                ctx.send(np.zeros(3), 1, tag=1)
            else:
                ctx.recv(np.zeros(3), src=0, tag=2, timeout=1)
        res = g.outcomes(body)
        assert isinstance(res[1], pc.Timeout) and "not matched: from rank 0, tag 1" \
            in str(res[1]), res[1]
    finally:
        g.close()


def test_a_message_larger_than_the_buffer_is_refused():
    g = ThreadGroup(2, timeout=10)
    try:
        def body(ctx):
            if ctx.rank == 0:
                ctx.send(np.zeros(30), 1)
            else:
                ctx.recv(np.zeros(3), src=0)
        assert isinstance(g.outcomes(body)[1], pc.MismatchError)
    finally:
        g.close()


@pytest.mark.parametrize("call, words", [
    (lambda ctx: ctx.send(np.zeros(2), ctx.rank), "itself"),
    (lambda ctx: ctx.send(np.zeros(2), 9), "not a rank"),
    (lambda ctx: ctx.recv(np.zeros(2), src=-5), "not a rank"),
    (lambda ctx: ctx.send(np.zeros(2), (ctx.rank + 1) % 4, tag=-1), "tag"),
    (lambda ctx: ctx.recv(b"ro", src=(ctx.rank + 1) % 4), "read-only"),
    (lambda ctx: ctx.new_group([0, 0]), "distinct"),
])
def test_p2p_bad_arguments(quad, call, words):
    def body(ctx):
        with pytest.raises(pc.InvalidArgument, match=words):
            call(ctx)
        ctx.barrier()
    quad.run(body)


def test_split_like_mpi(quad):
    def body(ctx):
        sub = ctx.split(ctx.rank % 2, key=-ctx.rank)     # reversed order inside a color
        total = sub.allreduce(np.array([ctx.rank + 1.0]))
        seen = sub.allgather(np.array([ctx.rank]))
        none = ctx.split(None if ctx.rank == 0 else 1)
        return sub.rank, sub.size, float(total[0]), seen.reshape(-1).tolist(), none
    res = quad.run(body)
    assert res[0][:4] == (1, 2, 4.0, [2, 0]) and res[2][:4] == (0, 2, 4.0, [2, 0])
    assert res[1][:4] == (1, 2, 6.0, [3, 1]) and res[3][:4] == (0, 2, 6.0, [3, 1])
    assert res[0][4] is None and all(r[4] is not None for r in res[1:])


def test_groups_and_parent_interleave_without_mixing(quad):
    """Collectives alternate between two overlapping groups and the parent."""
    def body(ctx):
        low = ctx.new_group([0, 1, 2])
        high = ctx.new_group([3, 2, 1])
        out = []
        for i in range(5):
            if low is not None:
                out.append(("low", float(low.allreduce(np.array([1.0 * i]))[0])))
            if high is not None:
                out.append(("high", float(high.allreduce(np.array([2.0 * i]))[0])))
            out.append(("all", float(ctx.allreduce(np.array([1.0]))[0])))
        return out, (high.rank if high else None)
    res = quad.run(body)
    assert res[1][1] == 2 and res[3][1] == 0       # group rank follows the list order
    for r, (out, _) in enumerate(res):
        for i in range(5):
            if r <= 2:
                assert ("low", 3.0 * i) in out
            if r >= 1:
                assert ("high", 6.0 * i) in out
        assert out.count(("all", 4.0)) == 5


def test_a_group_collective_that_meets_the_parent_is_a_mismatch():
    g = ThreadGroup(2, timeout=10)
    try:
        subs = g.run(lambda ctx: ctx.new_group([0, 1]))
        def body(ctx):
            if ctx.rank == 0:
                subs[0].allreduce(np.ones(5))
            else:
                ctx.allreduce(np.ones(5))
        res = g.outcomes(body)
        assert all(isinstance(x, pc.MismatchError) for x in res), res
        assert "group" in str(res[0]) or "group" in str(res[1])
    finally:
        g.close()


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_async_calls_on_groups_and_their_parent_run_in_the_order_made(transport):
    """A context and its sub-groups share one runner, so async calls made on a group and on
    its parent (and on a group of that group) in the same order on every rank run in that
    order, whoever takes them up: collectives of both, and sends and receives of the group
    posted between them, waited for in reverse.  With a runner per context they ran in an
    order of each runner's own, which could differ between ranks: MismatchError.  Closing
    a group leaves the shared runner to the parent."""
    g = ThreadGroup(4, timeout=20, transport=transport)
    try:
        subs = g.run(lambda ctx: ctx.split(ctx.rank % 2))
        inner = g.run(lambda ctx: subs[ctx.rank].split(0))

        def body(ctx):
            sub, sub2 = subs[ctx.rank], inner[ctx.rank]
            peer = 1 - sub.rank
            calls = []
            for i in range(12):
                a, b, c = np.full(3, float(i)), np.full(5, float(i)), np.full(2, float(i))
                got = np.zeros(4)
                calls.append((sub.allreduce(a, async_op=True), a, 2.0 * i))
                # A collective queued behind a receive starts once the receive has ended
                # (docs/api.md), so the exchange is whole before the parent's allreduce.
                calls.append((sub.recv(got, peer, tag=i, async_op=True), got, 10.0 * i + peer))
                calls.append((sub.send(np.full(4, 10.0 * i + sub.rank), peer, tag=i,
                                       async_op=True), None, None))
                calls.append((ctx.allreduce(b, async_op=True), b, 4.0 * i))
                calls.append((sub2.allreduce(c, async_op=True), c, 2.0 * i))
                if i % 4 == 3:
                    calls.append((ctx.barrier(async_op=True), None, None))
            for w, arr, want in reversed(calls):
                w.wait(15)
                if arr is not None:
                    assert np.all(arr == want), (arr, want)
            shared = sub._runner is ctx._runner and sub2._runner is ctx._runner
            sub2.close()
            sub.close()
            x = np.ones(3)
            ctx.allreduce(x, async_op=True).wait(15)
            return shared, x.tolist()

        assert g.run(body) == [(True, [4.0, 4.0, 4.0])] * 4
    finally:
        g.close()


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_groups_async_collective_waits_for_the_parents_exchange(transport):
    """An async exchange on the parent, then an async collective on a sub-group: the
    collective runs once the exchange has ended (docs/api.md), whose messages were sent
    first.  A compiled call's queued collective was taken for the parent's and run beside
    its receives: it read the peer's message (MismatchError on one rank or both)."""
    g = ThreadGroup(2, timeout=10, transport=transport)
    try:
        subs = g.run(lambda ctx: ctx.new_group([0, 1]))

        def body(ctx):
            sub, peer, out = subs[ctx.rank], 1 - ctx.rank, []
            for i, call in enumerate((
                    lambda: sub.allreduce(np.ones(10), async_op=True),
                    lambda: sub.barrier(async_op=True),
                    lambda: sub.broadcast(np.full(10, 3.0), root=0, async_op=True),
                    lambda: sub.allgather(np.ones(1), np.empty((2, 1)), async_op=True))):
                got = np.zeros(3000)
                works = [ctx.recv(got, peer, tag=i, async_op=True),
                         ctx.send(np.full(3000, float(ctx.rank)), peer, tag=i, async_op=True),
                         call()]
                results = pc.wait_all(works, timeout=10)
                out.append((got[0], None if results[2] is None else results[2].ravel()[0]))
            return out

        for rank, out in enumerate(g.run(body)):
            assert out == [(1.0 - rank, 2.0), (1.0 - rank, None), (1.0 - rank, 3.0),
                           (1.0 - rank, 1.0)], out
    finally:
        g.close()


def test_sub_groups_open_no_sockets(quad):
    import os
    before = len(os.listdir("/proc/self/fd"))
    groups = quad.run(lambda ctx: ctx.split(0))
    assert len(os.listdir("/proc/self/fd")) == before
    assert [s.size for s in groups] == [4] * 4


def test_closing_a_group_leaves_the_parent_usable(quad):
    subs = quad.run(lambda ctx: ctx.split(ctx.rank % 2))
    for sub in subs:
        sub.close()
    with pytest.raises(pc.Error, match="closed"):
        subs[0].barrier()
    res = quad.run(lambda ctx: ctx.allreduce(np.ones(3)))
    assert all(np.all(r == 4) for r in res)


def test_monitored_barrier_passes_when_all_arrive(quad):
    quad.run(lambda ctx: [ctx.monitored_barrier(timeout=10) for _ in range(3)])
    res = quad.run(lambda ctx: ctx.allreduce(np.ones(2)))      # still in step
    assert all(np.all(r == 4) for r in res)


def test_monitored_barrier_names_the_missing_ranks():
    import time
    g = ThreadGroup(4, timeout=30)
    try:
        def body(ctx):
            if ctx.rank in (2, 3):
                time.sleep(1.5)         # late: arrive after rank 0 gave up
            t0 = time.monotonic()
            try:
                ctx.monitored_barrier(timeout=0.5)
            except pc.Error as exc:
                return exc, time.monotonic() - t0
            return None, time.monotonic() - t0
        res = g.run(body)
        exc, elapsed = res[0]
        assert isinstance(exc, pc.Timeout) and elapsed < 3, (exc, elapsed)
        assert "rank(s) 2, 3 did not arrive" in str(exc), exc
        for r in (1, 2, 3):
            assert isinstance(res[r][0], pc.Error) and res[r][1] < 5, res[r]
    finally:
        g.close()


def test_sends_that_arrive_during_a_collective_are_not_mismatches(quad):
    """Point-to-point messages carry no collective sequence number."""
    def body(ctx):
        rounds = []
        for _ in range(20):
            ctx.barrier()
            if ctx.rank:
                ctx.send(np.full(3, ctx.rank), 0, tag=9)
            else:
                got = []
                for _ in range(3):
                    buf = np.zeros(3, np.int64)
                    src = ctx.recv(buf, tag=9)
                    got.append((src, buf.tolist()))
                rounds.append(sorted(got))
        return rounds
    assert quad.run(body)[0] == [[(r, [r] * 3) for r in (1, 2, 3)]] * 20
