"""Bad input is refused with a clear error; ranks that disagree fail fast, all of them."""

import logging
import os
import re
import socket
import threading
import time

import numpy as np
import pytest

import pycollect as pc
from pycollect import trace
from group import ThreadGroup, outcomes


@pytest.fixture(scope="module")
def pair():
    g = ThreadGroup(2, timeout=30)
    yield g
    g.close()


def _still_usable(g):
    res = g.run(lambda ctx: ctx.allreduce(np.ones(3)))
    assert all(np.all(r == g.size) for r in res)


@pytest.mark.parametrize("make, words", [
    (lambda: np.zeros(4, dtype=object), "unsupported dtype"),
    (lambda: np.zeros(8)[::2], "not C-contiguous"),
    (lambda: np.zeros(4, dtype=">f8"), "byte order"),
    (lambda: np.zeros(4, dtype="U3"), "unsupported dtype"),
    (lambda: [1.0, 2.0], "buffer protocol"),
    (lambda: None, "is None"),
])
def test_bad_buffers_are_refused_and_context_stays_usable(pair, make, words):
    def body(ctx):
        with pytest.raises(pc.InvalidArgument, match=words) as info:
            ctx.allreduce(make())
        assert "allreduce" in str(info.value) and "'buf'" in str(info.value)
    pair.run(body)
    _still_usable(pair)


def test_read_only_output_is_refused(pair):
    def body(ctx):
        buf = np.ones(4)
        buf.setflags(write=False)
        with pytest.raises(pc.InvalidArgument, match="read-only"):
            ctx.allreduce(buf)
        with pytest.raises(pc.InvalidArgument, match="read-only"):
            ctx.allreduce(b"abcd")
    pair.run(body)
    _still_usable(pair)
    # A broadcast receiver writes its buffer (the root only reads its): rank 1 alone
    # refuses, and the root returns or fails naming it (tests/test_refusal.py).
    g = ThreadGroup(2, timeout=30)
    try:
        out = g.outcomes(lambda ctx: ctx.broadcast(_read_only(4), root=0))
    finally:
        g.close()
    assert isinstance(out[1], pc.InvalidArgument) and "read-only" in str(out[1]), out
    assert not isinstance(out[0], pc.Error) or "rank 1" in str(out[0]) and \
        "refused its arguments to broadcast" in str(out[0]), out


def test_an_async_receive_into_a_read_only_array_is_refused_at_the_call(pair):
    """Refused before the wire, the compiled begin of an async receive leaves the call to
    the Python path, which raises at once; the context's runner is free for what follows."""
    def body(ctx):
        peer = 1 - ctx.rank
        with pytest.raises(pc.InvalidArgument, match="read-only"):
            ctx.recv(_read_only(4), peer, tag=3, async_op=True)
        got = np.zeros(4)
        works = [ctx.send(np.full(4, float(ctx.rank)), peer, tag=3, async_op=True),
                 ctx.recv(got, peer, tag=3, async_op=True)]
        pc.wait_all(works)
        return got.tolist()
    assert pair.run(body) == [[1.0] * 4, [0.0] * 4]


def _read_only(n):
    buf = np.ones(n)
    buf.setflags(write=False)
    return buf


@pytest.mark.parametrize("root", [-1, 2, 7, 1.0, "0", True, None])
def test_bad_root(pair, root):
    def body(ctx):
        with pytest.raises(pc.InvalidArgument, match="root"):
            ctx.broadcast(np.zeros(3), root=root)
    pair.run(body)


def test_bad_op_and_algorithm(pair):
    def body(ctx):
        with pytest.raises(pc.InvalidArgument, match="AVG"):
            ctx.allreduce(np.ones(3, dtype=np.int32), op=pc.AVG)
        with pytest.raises(pc.InvalidArgument, match="bitwise"):
            ctx.allreduce(np.ones(3), op=pc.BXOR)
        with pytest.raises(pc.InvalidArgument, match="unknown reduction op"):
            ctx.allreduce(np.ones(3), op=42)
        # A bool or a float equal to a member's value is not an op, nor is its name.
        for op in (True, 1.0, "sum"):
            with pytest.raises(pc.InvalidArgument, match="unknown reduction op"):
                ctx.allreduce(np.ones(3), op=op)
        with pytest.raises(pc.InvalidArgument, match="no meaning on Python values"):
            ctx.allreduce_object(3, op=True)
        assert ctx.allreduce(np.ones(3), op=3)[0] == 1      # MAX by its integer
        with pytest.raises(pc.InvalidArgument, match="unknown algorithm 'fastest'"):
            ctx.allreduce(np.ones(3), algorithm="fastest")
        with pytest.raises(pc.InvalidArgument, match="unknown algorithm"):
            ctx.broadcast(np.ones(3), algorithm="ring")
    pair.run(body)
    _still_usable(pair)


@pytest.mark.parametrize("size", [2, 3, 5])
@pytest.mark.parametrize("disagreement", ["count", "dtype", "op", "collective", "root",
                                          "algorithm"])
def test_ranks_that_disagree_all_get_mismatch(size, disagreement):
    """One rank calls something else: every rank raises MismatchError, fast, no hang."""
    g = ThreadGroup(size, timeout=20)
    odd = size - 1

    def body(ctx):
        me = ctx.rank == odd
        if disagreement == "count":
            ctx.allreduce(np.ones(20 if me else 10, dtype=np.float32))
        elif disagreement == "dtype":
            ctx.allreduce(np.ones(10, dtype=np.float64 if me else np.float32))
        elif disagreement == "op":
            ctx.allreduce(np.ones(10), op=pc.MAX if me else pc.SUM)
        elif disagreement == "collective":
            # Over the ring every rank hears from its left neighbour; see
            # test_disagreeing_collectives_that_exchange_nothing for the rest.
            if me:
                ctx.broadcast(np.ones(100000), root=0)
            else:
                ctx.allreduce(np.ones(100000), algorithm="ring")
        elif disagreement == "root":
            ctx.broadcast(np.ones(10), root=1 if me else 0)
            if size == 2:
                # Both ranks think they are the root: both only send, so the
                # disagreement surfaces at the next collective.
                ctx.barrier()
        else:
            ctx.allreduce(np.ones(10), algorithm="ring" if me else "ring_chunked")

    try:
        t0 = time.monotonic()
        results = g.outcomes(body, timeout=60)
        elapsed = time.monotonic() - t0
        assert elapsed < 10, "mismatch took %.1f s to surface" % elapsed
        # A rank whose part of a broadcast completed before anyone noticed
        # learns of it at its next call; every other rank raises in the
        # disagreeing call itself.
        followup = g.outcomes(lambda ctx: ctx.barrier(), 10)
        for rank, (res, nxt) in enumerate(zip(results, followup)):
            if res is None and disagreement == "root":
                res = nxt
            else:
                assert "failed earlier" in str(nxt), (rank, nxt)
            assert isinstance(res, pc.MismatchError), (rank, res)
            assert "rank %d" % rank in str(res)
            assert isinstance(nxt, pc.MismatchError), (rank, nxt)
    finally:
        g.close()


def test_monitored_barrier_takes_its_timeout_as_every_call_does():
    import datetime
    with pc.init(rank=0, size=1) as ctx:
        ctx.monitored_barrier(timeout=datetime.timedelta(seconds=2))
        for bad in ("5", [5], 0, -1, float("nan"), True):
            with pytest.raises(pc.InvalidArgument, match="monitored_barrier: timeout"):
                ctx.monitored_barrier(timeout=bad)


def test_arguments_of_the_wrong_kind_are_named():
    """Each raised a bare Python error before (OverflowError, ValueError, TypeError)."""
    with pc.init(rank=0, size=1) as ctx:
        refusals = [
            (lambda: ctx.split(2**63), "split: color 9223372036854775808 does not fit"),
            (lambda: ctx.split(0, key=-2**64), "split: key -18446744073709551616 does not"),
            (lambda: ctx.agree(np.array([1, 2])), "agree: flag must be true or false"),
            (lambda: ctx.new_group(5), "new_group: ranks must be a list of ranks, got 5"),
            (lambda: ctx.allreduce_coalesced(5), "allreduce_coalesced: bufs must be a list"),
        ]
        # Counts whose outputs no array can hold, with the output left to be allocated.
        huge = [2**62]
        refusals += [(call, "%s: the counts call for %d elements of float64, more than an "
                            "array can hold" % (name, 2**62)) for name, call in (
            ("allgatherv", lambda: ctx.allgatherv(np.ones(2), None, huge)),
            ("gatherv", lambda: ctx.gatherv(np.ones(2), None, huge)),
            ("scatterv", lambda: ctx.scatterv(np.ones(2), huge)),
            ("reduce_scatterv", lambda: ctx.reduce_scatterv(np.ones(2), None, huge)),
            ("alltoallv", lambda: ctx.alltoallv(np.ones(2), [2], None, huge)))]
        for call, words in refusals:
            with pytest.raises(pc.InvalidArgument, match=re.escape(words)):
                call()
        assert ctx.split(2**63 - 1, key=-2**63) is not None       # the ends of the range
        assert ctx.agree(np.array([1])) is True
        assert ctx.new_group(iter([0])).size == 1
        assert ctx.allreduce(np.ones(2))[0] == 1.0


def test_plan_and_new_group_refuse_what_they_cannot_serve():
    ctx = pc.init(rank=0, size=1)
    for bad in ("x", "gather", None, 1.5):
        with pytest.raises(pc.InvalidArgument, match="is not a collective that picks"):
            ctx.plan(bad, np.ones(2))
    # "bcube:B", which allreduce runs, is a plan too; its base is checked as the call's is.
    assert ctx.plan("allreduce", np.ones(2), algorithm="bcube:3") == ctx.plan(
        "allreduce", np.ones(2), algorithm="bcube")
    with pytest.raises(pc.InvalidArgument, match="bcube base 40 is outside"):
        ctx.plan("allreduce", np.ones(2), algorithm="bcube:40")
    with pytest.raises(pc.InvalidArgument, match="broadcast: unknown algorithm 'bcube:3'"):
        ctx.plan("broadcast", np.ones(2), algorithm="bcube:3")
    ctx.close()
    with pytest.raises(pc.Error, match="new_group: the context is closed"):
        ctx.new_group([0])


def test_a_rank_told_of_a_third_ranks_disagreement_names_that_rank(monkeypatch, tmp_path):
    """Rank 0 finds rank 2's call out of step; rank 1, whose call matches rank 0's, is told
    so: its error names rank 2 as the one out of step and rank 0 as the one who found it,
    and pycollect-trace reads it as blaming rank 2."""
    monkeypatch.setenv("PYCOLLECT_TRACE_DIR", str(tmp_path))
    # Ranks that spin rather than sleep read the stream they wait on (rank 1: rank 0's)
    # before looking at the others, where rank 2's relay of the same report may come first.
    monkeypatch.setenv("PYCOLLECT_SPIN_US", "1000000")
    g = ThreadGroup(3, timeout=20, transport="tcp")
    try:
        # halving_doubling at 3 ranks: rank 2 folds into rank 0, rank 1 meets only rank 0.
        results = g.outcomes(lambda ctx: ctx.allreduce(
            np.ones(11 if ctx.rank == 2 else 10, np.float32), algorithm="halving_doubling"),
            timeout=30)
        assert all(isinstance(r, pc.MismatchError) for r in results), results
        told = str(results[1])
        assert "disagrees with rank 0" not in told, told
        if "relayed" in told:       # rank 2's relay came first after all: it names rank 2 too
            assert "disagrees with rank 2" in told and "rank 0's report" in told, told
        else:
            assert told.startswith("rank 1: allreduce(float32 x 10, SUM, halving_doubling) "
                                   "#1 failed: rank 0 ("), told
            assert told.endswith("which called allreduce(float32 x 10, SUM, "
                                 "halving_doubling) #1, reported that rank 2 disagrees with "
                                 "it"), told
        os.remove(tmp_path / "pycollect_trace_rank2.json")     # as if rank 2 had died
        assert "rank(s) 0, 1 blame rank 2" in trace.analyse(trace.load(str(tmp_path))[0])
        assert "disagrees with rank 0" in str(results[2]) and \
            "which called allreduce(float32 x 10" in str(results[2])
        assert "disagrees with rank 2" in str(results[0]) and \
            "which called allreduce(float32 x 11" in str(results[0])
    finally:
        g.close()


def test_disagreeing_collectives_that_exchange_nothing():
    """Rank 2 waits on rank 0 and rank 0 on rank 2: no message can reveal the
    disagreement, so they fail at the deadline, naming each other."""
    g = ThreadGroup(3, timeout=2)

    def body(ctx):
        if ctx.rank == 2:
            ctx.broadcast(np.ones(10), root=0)
        else:
            ctx.allreduce(np.ones(10), algorithm="recursive_doubling")

    try:
        t0 = time.monotonic()
        results = g.outcomes(body, timeout=30)
        assert time.monotonic() - t0 < 8
        # Whichever times out first tells the others (directly or relayed by
        # rank 1), which then raise PeerError naming it.
        for me, other in ((0, 2), (2, 0)):
            assert isinstance(results[me], (pc.Timeout, pc.PeerError)), results[me]
            assert "rank %d" % other in str(results[me])
    finally:
        g.close()


def test_mismatch_message_names_both_sides():
    g = ThreadGroup(2, timeout=20)
    try:
        res = g.outcomes(lambda ctx: ctx.allreduce(np.ones(10 + 10 * ctx.rank, np.float32)))
        text = str(res[0])
        assert "float32 x 10" in text and "float32 x 20" in text and "rank 1" in text, text
    finally:
        g.close()


def test_timeout_names_the_missing_rank():
    g = ThreadGroup(2, timeout=1.5)
    try:
        t0 = time.monotonic()
        with pytest.raises(pc.Timeout) as info:
            g.contexts[0].allreduce(np.ones(4))
        elapsed = time.monotonic() - t0
        assert 1.4 <= elapsed < 5, elapsed
        assert isinstance(info.value, TimeoutError)
        text = str(info.value)
        assert "rank 0" in text and "rank 1" in text and "allreduce" in text, text
    finally:
        g.close()


@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_close_from_another_thread_names_close_not_abort(transport):
    """A blocked collective and async handles that close() from another thread ends say the
    context was closed (they said abort() was called, which the program never did); an
    abort() still says abort()."""
    g = ThreadGroup(2, timeout=30, transport=transport)
    try:
        ctx = g.contexts[0]
        works = [ctx.allreduce(np.ones(4), async_op=True) for _ in range(2)]
        threading.Timer(0.3, ctx.close).start()
        with pytest.raises(pc.Aborted, match=r"the context was closed \(close\(\) from "
                                             r"another thread\)"):
            works[0].wait(timeout=10)
        with pytest.raises(pc.Error):
            works[1].wait(timeout=10)
    finally:
        g.close()
    g = ThreadGroup(2, timeout=30, transport=transport)
    try:
        threading.Timer(0.3, g.contexts[1].abort).start()
        with pytest.raises(pc.Aborted, match=r"abort\(\) was called"):
            g.contexts[1].barrier(timeout=10)
    finally:
        g.close()


@pytest.mark.parametrize("transport", ["auto", "tcp"])
@pytest.mark.parametrize("algorithm", ["ring", "halving_doubling"])
def test_a_peer_that_closes_mid_collective_fails_the_others_at_once(transport, algorithm):
    """Rank 2 closes its context where ranks 0 and 1 wait on its part of an allreduce: they
    raise PeerError naming rank 2 at once (its end of stream, read by the posted receive),
    not Timeout at their deadline."""
    g = ThreadGroup(3, timeout=20, transport=transport)
    try:
        def body(ctx):
            if ctx.rank == 2:
                time.sleep(0.3)
                ctx.close()
                return None
            start = time.monotonic()
            with pytest.raises(pc.PeerError, match="rank 2"):     # its end, or relayed
                ctx.allreduce(np.ones(1 << 16, np.float32), algorithm=algorithm)
            return time.monotonic() - start
        took = g.run(body, timeout=60)
        assert max(took[:2]) < 5, took
    finally:
        g.close()


def test_abort_from_another_thread_ends_a_blocked_collective():
    g = ThreadGroup(2, timeout=60)
    try:
        ctx = g.contexts[0]
        threading.Timer(0.3, ctx.abort).start()
        t0 = time.monotonic()
        with pytest.raises(pc.Aborted, match="rank 0"):
            ctx.allreduce(np.ones(4))
        assert time.monotonic() - t0 < 5
        with pytest.raises(pc.Aborted, match="failed earlier"):
            ctx.barrier()
        # The peer hears of it at once instead of waiting for its timeout.  Its
        # first allreduce may still complete: rank 0 had sent its part before
        # it was aborted.
        t0 = time.monotonic()
        with pytest.raises(pc.PeerError, match="rank 0"):
            g.contexts[1].allreduce(np.ones(4))
            g.contexts[1].allreduce(np.ones(4))
        assert time.monotonic() - t0 < 5
    finally:
        g.close()


def test_peer_that_closes_mid_job_is_named():
    g = ThreadGroup(3, timeout=30)
    try:
        g.contexts[2].close()
        res = outcomes(2, lambda r: g.contexts[r].allreduce(np.ones(1000)), timeout=30)
        for r in range(2):
            assert isinstance(res[r], pc.PeerError), res[r]
            assert "rank 2" in str(res[r])
    finally:
        g.close()


def test_closed_context_refuses_work(pair):
    g = ThreadGroup(1)
    g.close()
    with pytest.raises(pc.Error, match="closed"):
        g.contexts[0].barrier()
    g.contexts[0].close()   # idempotent


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_store_fails_within_its_deadline():
    port = _free_port()
    t0 = time.monotonic()
    with pytest.raises(pc.StoreError, match="127.0.0.1:%d" % port):
        pc.init(rank=1, size=2, store="tcp://127.0.0.1:%d" % port, timeout=2)
    assert time.monotonic() - t0 < 6


@pytest.mark.parametrize("kwargs, words", [
    (dict(rank=0, size=0, store="hash://x"), "size must be >= 1"),
    (dict(rank=2, size=2, store="hash://x"), "outside"),
    (dict(rank=0, size=2), "no store"),
    (dict(rank=0, size=2, store="hash://x", timeout=0), "timeout"),
    (dict(rank=0, size=1, store="hash://x", timeout=float("inf")), "at most 2000000"),
    # Past int64 nanoseconds a deadline wrapped (a call failed at once), and past epoll's
    # int milliseconds the launcher's store server crashed on every rank's first wait.
    (dict(rank=0, size=1, store="hash://x", timeout=1e10), "at most 2000000 .about 23 days"),
    (dict(rank=0, size=1, store="hash://x", timeout=2_000_001), "at most 2000000"),
    (dict(rank=0, size=1, store="hash://x", segment_bytes=0), "segment_bytes"),
    (dict(rank=0, size=2, store="nosuch://x"), "nosuch"),
    (dict(rank=0, size=2, store="hash://x", transport="carrier-pigeon"), "carrier-pigeon"),
    # An interface that is not a string failed with AttributeError (at every size).
    (dict(rank=0, size=1, store="hash://x", interface=1.5), "interface must be a name"),
])
def test_init_rejects_bad_arguments(kwargs, words, monkeypatch):
    for var in ("PYCOLLECT_RANK", "PYCOLLECT_SIZE", "PYCOLLECT_STORE"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(pc.Error, match=words):
        pc.init(**kwargs)


def test_init_names_the_missing_variable(monkeypatch):
    monkeypatch.delenv("PYCOLLECT_RANK", raising=False)
    monkeypatch.setenv("PYCOLLECT_SIZE", "2")
    with pytest.raises(pc.InvalidArgument, match="PYCOLLECT_RANK"):
        pc.init(store="hash://x")
    monkeypatch.setenv("PYCOLLECT_RANK", "one")
    with pytest.raises(pc.InvalidArgument, match="PYCOLLECT_RANK"):
        pc.init(store="hash://x")


def test_stranger_on_the_listener_does_not_disturb_the_job(monkeypatch, caplog):
    """A connection without the run's token is dropped; the mesh still forms."""
    from pycollect.plugins import mesh
    real_mesh_run = mesh.Mesh.run
    knocked = []

    def run_with_a_stranger(self, listener, addrs):
        if self.rank == 0 and not knocked:
            host, port = listener.getsockname()[:2]
            s = socket.create_connection((host, port))
            s.sendall(b"GET / HTTP/1.0\r\n\r\n" + b"x" * 100)
            knocked.append(s)
        return real_mesh_run(self, listener, addrs)

    monkeypatch.setattr(mesh.Mesh, "run", run_with_a_stranger)
    with caplog.at_level(logging.WARNING, logger="pycollect.tcp"):
        g = ThreadGroup(2, timeout=20)
    try:
        _still_usable(g)
        assert len(knocked) == 1
        dropped = [r.getMessage() for r in caplog.records if "dropped a connection" in
                   r.getMessage()]
        assert len(dropped) == 1 and "not a pycollect hello" in dropped[0], dropped
        knocked[0].settimeout(5)
        try:        # closed with the stranger's bytes unread: a reset, or the end
            gone = knocked[0].recv(1) == b""
        except ConnectionResetError:
            gone = True
        assert gone, "the listener kept the stranger's connection"
    finally:
        g.close()
        for s in knocked:
            s.close()


_INTERRUPTED_RANK = r"""
import os, signal, sys, threading, time
import numpy as np
import pycollect as pc
ctx = pc.init(rank=int(sys.argv[1]), size=2, store=sys.argv[2], timeout=60)
if ctx.rank == 0:
    threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
    t0 = time.monotonic()
    try:
        ctx.allreduce(np.ones(4))
    except KeyboardInterrupt:
        print("interrupted after %.2f s" % (time.monotonic() - t0))
        assert isinstance(ctx.failed, pc.Aborted), ctx.failed
        sys.exit(0)
    sys.exit("rank 0 was not interrupted")
time.sleep(3)
ctx.close()
"""


def test_ctrl_c_ends_a_blocked_collective(tmp_path):
    """SIGINT reaches Python while the main thread waits in a collective."""
    import subprocess
    import sys
    script = tmp_path / "rank.py"
    script.write_text(_INTERRUPTED_RANK)
    store = "file://%s" % (tmp_path / "store")
    peer = subprocess.Popen([sys.executable, str(script), "1", store])
    try:
        out = subprocess.run([sys.executable, str(script), "0", store], capture_output=True,
                             text=True, timeout=30)
    finally:
        peer.wait(timeout=30)
    assert out.returncode == 0, out.stderr
    seconds = float(out.stdout.split()[2])
    assert seconds < 3, out.stdout


def test_the_recovery_recipe_of_docs_errors_md():
    """Close the failed context, join again through the same store under a new prefix."""
    from group import run_ranks
    with pc.TCPStoreServer("127.0.0.1", 0) as server:
        def rank(r):
            first = pc.init(rank=r, size=2, store=server.url, timeout=10)
            with pytest.raises(pc.MismatchError):
                first.allreduce(np.ones(10 + r))          # the ranks disagree on the count
            assert isinstance(first.failed, pc.MismatchError)
            first.close()
            with pc.init(rank=r, size=2, store=server.url + "?prefix=attempt-1",
                         timeout=10) as ctx:
                assert ctx is not first and ctx.failed is None
                return ctx.allreduce(np.ones(10))
        for res in run_ranks(2, rank, timeout=60):
            assert np.all(res == 2.0)
