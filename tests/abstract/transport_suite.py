"""The transport conformance suite: subclass ``TransportSuite`` and name the transport.

Every channel kind, built-in or third-party, passes the same checks through
the public API: ordering and matching of messages, large and zero-byte
messages, a mismatch between ranks, a peer that leaves, the deadline, abort()
from another thread, and one-sided reads of a peer's memory where the kind
offers them.  A subclass sets ``transport`` (the name ``pc.init`` takes),
``reads_remote`` (whether the direct allreduce reads peers' memory over it) and
may override ``options(rank)`` for the transport's own init options.
"""

import itertools
import threading
import time

import numpy as np
import pytest

import pycollect as pc
from group import run_ranks

SIZE = 3
TIMEOUT_S = 20.0
SHORT_TIMEOUT_S = 1.0
SLACK_S = 8.0           # how much later than its deadline a loaded machine may report
LARGE_ELEMENTS = (1 << 20) + 3      # 4 MiB of float32 and a few: every kind's large path
_stores = itertools.count()


class TransportSuite:
    """Behaviour every transport must show; subclasses set ``transport``."""

    transport = None
    reads_remote = False

    def options(self, rank):
        """Keyword arguments of ``pc.init`` for ``rank`` besides the transport's name."""
        return {}

    def contexts(self, size=SIZE, timeout=TIMEOUT_S):
        store = "hash://transport-suite-%s-%d" % (self.transport, next(_stores))
        return run_ranks(size, lambda r: pc.init(
            rank=r, size=size, store=store, timeout=timeout, transport=self.transport,
            **self.options(r)), timeout=60)

    @pytest.fixture
    def ctxs(self):
        contexts = self.contexts()
        yield contexts
        for ctx in contexts:
            ctx.close()

    def run(self, ctxs, fn):
        return run_ranks(len(ctxs), lambda r: fn(ctxs[r]), timeout=60)

    def outcomes(self, ctxs, fn):
        def guarded(ctx):
            try:
                return fn(ctx)
            except pc.Error as exc:
                return exc
        return self.run(ctxs, guarded)

    # -- ordering and matching -----------------------------------------------

    def test_messages_between_two_ranks_arrive_in_send_order(self, ctxs):
        sizes = [0, 1, 7, 4096, 65537, 3]

        def body(ctx):
            if ctx.rank == 0:
                for i, n in enumerate(sizes):
                    ctx.send(np.full(n, i, np.int32), dst=1)
                    ctx.send(np.full(n, -i, np.int32), dst=2)
                return None
            got = []
            for n in sizes:
                buf = np.empty(n, np.int32)
                assert ctx.recv(buf, src=0) == 0
                got.append(buf.copy())
            return got

        _, one, two = self.run(ctxs, body)
        for i, n in enumerate(sizes):
            np.testing.assert_array_equal(one[i], np.full(n, i, np.int32))
            np.testing.assert_array_equal(two[i], np.full(n, -i, np.int32))

    def test_receives_match_their_source_and_tag(self, ctxs):
        def body(ctx):
            if ctx.rank == 0:
                seen = {}
                for _ in range(2):
                    buf = np.empty(4, np.int64)
                    src = ctx.recv(buf, tag=7)
                    seen[src] = buf.tolist()
                tagged = np.empty(2, np.int64)
                assert ctx.recv(tagged, src=2, tag=9) == 2
                return seen, tagged.tolist()
            ctx.send(np.full(4, 10 * ctx.rank, np.int64), dst=0, tag=7)
            if ctx.rank == 2:
                ctx.send(np.array([5, 6], np.int64), dst=0, tag=9)
            return None

        (seen, tagged), _, _ = self.run(ctxs, body)
        assert seen == {1: [10] * 4, 2: [20] * 4}
        assert tagged == [5, 6]

    # -- messages of every size ---------------------------------------------

    def test_zero_one_and_large_messages_in_collectives(self, ctxs):
        def body(ctx):
            out = []
            for n in (0, 1, LARGE_ELEMENTS):
                buf = np.full(n, ctx.rank + 1.0, np.float32)
                ctx.allreduce(buf)
                out.append(buf)
                big = (np.arange(n, dtype=np.float32) if ctx.rank == 1
                       else np.zeros(n, np.float32))
                ctx.broadcast(big, root=1)
                out.append(big)
            ctx.barrier()
            return out

        for out in self.run(ctxs, body):
            for i, n in enumerate((0, 1, LARGE_ELEMENTS)):
                np.testing.assert_array_equal(out[2 * i], np.full(n, 6.0, np.float32))
                np.testing.assert_array_equal(out[2 * i + 1], np.arange(n, dtype=np.float32))

    def test_a_large_point_to_point_message(self, ctxs):
        def body(ctx):
            if ctx.rank == 0:
                ctx.send(np.arange(LARGE_ELEMENTS, dtype=np.float32), dst=2)
                return None
            if ctx.rank == 2:
                buf = np.zeros(LARGE_ELEMENTS, np.float32)
                assert ctx.recv(buf, src=0) == 0
                return buf
            return None

        got = self.run(ctxs, body)[2]
        np.testing.assert_array_equal(got, np.arange(LARGE_ELEMENTS, dtype=np.float32))

    # -- failures ------------------------------------------------------------

    def test_ranks_that_disagree_get_a_mismatch(self, ctxs):
        def body(ctx):
            ctx.allreduce(np.ones(100 if ctx.rank == 0 else 101))

        results = self.outcomes(ctxs, body)
        assert all(isinstance(r, pc.MismatchError) for r in results), results

    def test_a_peer_that_leaves_fails_the_others(self, ctxs):
        def body(ctx):
            if ctx.rank == 2:
                ctx.close()
                return None
            start = time.monotonic()
            with pytest.raises(pc.PeerError) as caught:
                ctx.allreduce(np.ones(1000))
            return str(caught.value), time.monotonic() - start

        for result in self.run(ctxs, body)[:2]:
            text, took = result
            assert "rank 2" in text, text
            assert took < TIMEOUT_S / 2, took

    def test_a_rank_that_never_comes_is_named_at_the_deadline(self):
        ctxs = self.contexts(timeout=SHORT_TIMEOUT_S)
        try:
            def body(ctx):
                if ctx.rank == 2:
                    time.sleep(SHORT_TIMEOUT_S * 2)
                    return None
                start = time.monotonic()
                with pytest.raises(pc.Error) as caught:
                    ctx.allreduce(np.ones(10))
                return caught.value, time.monotonic() - start

            results = self.run(ctxs, body)[:2]
            assert any(isinstance(exc, pc.Timeout) and "rank 2" in str(exc)
                       for exc, _ in results), results
            for _, took in results:
                assert SHORT_TIMEOUT_S * 0.9 <= took < SHORT_TIMEOUT_S + SLACK_S, took
        finally:
            for ctx in ctxs:
                ctx.close()

    def test_abort_from_another_thread_ends_a_wait(self, ctxs):
        def body(ctx):
            if ctx.rank != 0:
                return None
            timer = threading.Timer(0.2, ctx.abort)
            timer.start()
            start = time.monotonic()
            try:
                with pytest.raises(pc.Aborted):
                    ctx.recv(np.empty(1), src=1)
            finally:
                timer.cancel()
            return time.monotonic() - start

        took = self.run(ctxs, body)[0]
        assert took < TIMEOUT_S / 2, took

    # -- one-sided reads -----------------------------------------------------

    def test_one_sided_reads_run_where_the_pairs_offer_them(self, ctxs):
        n = 300001

        def body(ctx):
            buf = np.arange(n, dtype=np.float64) + ctx.rank
            work = ctx.allreduce(buf, algorithm="direct", async_op=True)
            work.wait(timeout=TIMEOUT_S)
            return work.algorithm, buf

        for algorithm, buf in self.run(ctxs, body):
            assert algorithm == ("direct" if self.reads_remote else "halving_doubling")
            np.testing.assert_array_equal(buf, 3 * np.arange(n, dtype=np.float64) + 3)
