"""The shared-memory path: rings, single-copy reads, cleanup, and failure."""

import os
import threading
import time

import numpy as np
import pytest

import pycollect as pc

from group import ThreadGroup
from jobs import run_victims


def _segments(g):
    """The names in /dev/shm of the segments that ``g``'s rings live in."""
    return {ctx._transport.channel(p).segment_path for ctx in g.contexts
            for p in range(g.size) if p != ctx.rank}


def _leftovers(paths):
    return [path for path in paths if os.path.exists(path)]


def _check_sums(g, n):
    res = g.run(lambda ctx: ctx.allreduce(np.full(n, ctx.rank + 1.0),
                                          algorithm="ring_chunked"))
    for r in res:
        assert np.all(r == g.size * (g.size + 1) / 2)


def test_same_host_pairs_use_shared_memory_by_default():
    g = ThreadGroup(3)
    try:
        assert g.contexts[0]._transport.pair_kinds() == ["self", "shm+cma", "shm+cma"]
        paths = _segments(g)
        assert len(paths) == 1 and all(p.startswith("/dev/shm/pycollect-") for p in paths)
        assert not _leftovers(paths), "the segment is unlinked once every rank mapped it"
        _check_sums(g, 3 << 20)
    finally:
        g.close()
    assert not _leftovers(paths)


def test_tcp_can_be_forced():
    g = ThreadGroup(2, transport="tcp")
    try:
        assert g.contexts[1]._transport.pair_kinds() == ["tcp", "self"]
        _check_sums(g, 1000)
    finally:
        g.close()


def test_rings_alone_carry_large_messages(monkeypatch):
    """Without cross-memory reads, messages larger than a ring wrap around it."""
    monkeypatch.setenv("PYCOLLECT_CMA", "0")
    g = ThreadGroup(2, transport="shm")
    try:
        assert g.contexts[0]._transport.pair_kinds() == ["self", "shm"]
        _check_sums(g, 5 << 20)
        res = g.run(lambda ctx: ctx.broadcast(np.arange(3 << 20, dtype=np.float32)
                                              if ctx.rank == 0 else
                                              np.zeros(3 << 20, np.float32)))
        assert np.array_equal(res[1], np.arange(3 << 20, dtype=np.float32))
    finally:
        g.close()


@pytest.mark.parametrize("cma_min,by_address", [("1", True), ("100000000", False)])
def test_every_message_size_by_either_path(monkeypatch, cma_min, by_address):
    """From PYCOLLECT_CMA_MIN_BYTES on, messages go by address; below it, through the ring."""
    monkeypatch.setenv("PYCOLLECT_CMA_MIN_BYTES", cma_min)
    g = ThreadGroup(4)
    try:
        for n in (0, 1, 7, 4096, 100003):
            before = [sum(ctx._transport.messages_by_address()) for ctx in g.contexts]
            _check_sums(g, n)
            sent = [sum(ctx._transport.messages_by_address()) - b
                    for ctx, b in zip(g.contexts, before)]
            if by_address and n > 0:
                assert all(k > 0 for k in sent), (n, sent)
            else:
                assert sent == [0] * 4, (n, sent)
    finally:
        g.close()


@pytest.mark.parametrize("cma_min", ["1", "100000000"])
def test_sendrecv_exchanges_every_size_by_either_path(monkeypatch, cma_min):
    """Two ranks exchange at once with sendrecv, by address and through the rings, from
    one element to several times a ring: each gets the other's data, its send done."""
    monkeypatch.setenv("PYCOLLECT_CMA_MIN_BYTES", cma_min)
    g = ThreadGroup(2, transport="shm")

    def body(ctx):
        other = 1 - ctx.rank
        out = []
        for n in (1, 4096, 100003, 3 << 20):
            mine = np.arange(n, dtype=np.float32) + ctx.rank * 7
            theirs = np.zeros(n, np.float32)
            assert ctx.sendrecv(mine, other, theirs, other, sendtag=3, recvtag=3) == other
            out.append(bool(np.array_equal(theirs, np.arange(n, dtype=np.float32)
                                           + other * 7)))
        return out, sum(ctx._transport.messages_by_address())
    try:
        results = g.run(body)
        for ok, by_address in results:
            assert ok == [True] * 4
            assert (by_address > 0) == (cma_min == "1"), by_address
    finally:
        g.close()


def test_a_sendrecv_whose_send_is_never_taken_times_out_naming_the_send():
    """The receive of a sendrecv ends, but the peer never reads its send (by address: it
    waits for the peer's copy); the Timeout names the send, not the receive."""
    g = ThreadGroup(2, timeout=20, transport="shm")
    try:
        def body(ctx):
            if ctx.rank == 0:
                ctx.send(np.ones(4, np.float32), 1, tag=2)
                time.sleep(1.0)
                return None
            with pytest.raises(pc.Timeout) as info:
                ctx.sendrecv(np.ones(1 << 18, np.float32), 0, np.zeros(4, np.float32), 0,
                             sendtag=1, recvtag=2, timeout=0.3)
            return str(info.value)
        text = g.run(body)[1]
        assert "float32 x 262144, tag 1" in text and "rank 0" in text, text
    finally:
        g.close()


def test_an_async_send_up_to_the_eager_size_goes_through_the_ring_and_ends_at_once():
    """From PYCOLLECT_CMA_MIN_BYTES a message goes by address, and its send ends only once
    the peer has copied it; an async send up to the channel's eager size (256 KiB, a
    quarter of the ring at most) goes through the ring instead and has ended when the call
    returns, before the peer receives. Larger async sends, and blocking ones, still go by
    address."""
    from pycollect._ext._shm import ASYNC_EAGER_BYTES
    g = ThreadGroup(2, timeout=20, transport="shm")
    go = threading.Event()
    sizes = (16 << 10, ASYNC_EAGER_BYTES, ASYNC_EAGER_BYTES + 4, 1 << 20)
    try:
        def body(ctx):
            if ctx.rank == 1:
                go.wait(10)
                for n in sizes:
                    got = np.zeros(n // 4, np.float32)
                    ctx.recv(got, 0, tag=3)
                    assert got[0] == n and got[-1] == n
                return None
            before = ctx._transport.messages_by_address()[1]
            works = [ctx.send(np.full(n // 4, n, np.float32), 1, tag=3, async_op=True)
                     for n in sizes]
            ended_at_once = [work.is_completed() for work in works]
            go.set()
            for work in works:
                work.wait()
            return ended_at_once, ctx._transport.messages_by_address()[1] - before
        ended_at_once, by_address = g.run(body)[0]
        assert ended_at_once == [True, True, False, False], ended_at_once
        assert by_address == 2, by_address      # the two above the eager size
    finally:
        go.set()
        g.close()


_VICTIM = r"""
import os, signal, sys, time
import numpy as np
import pycollect as pc
rank, store = int(sys.argv[1]), sys.argv[2]
ctx = pc.init(rank=rank, size=3, store=store, timeout=30, transport="shm")
with open(os.path.join(os.path.dirname(__file__), "segment%d" % rank), "w") as f:
    f.write(ctx._transport.channel((rank + 1) % 3).segment_path)
ctx.barrier()
buf = np.ones(4 << 20, np.float32)
t0 = time.monotonic()
try:
    for i in range(1000):
        if rank == 2 and i == 3:
            os.kill(os.getpid(), signal.SIGKILL)
        ctx.allreduce(buf)
except pc.PeerError as exc:
    print("rank %d PeerError after %.2f s: %s" % (rank, time.monotonic() - t0, exc))
    sys.exit(0)
sys.exit("rank %d finished without an error" % rank)
"""


def test_a_rank_killed_mid_collective_over_shared_memory(tmp_path):
    run_victims(tmp_path, _VICTIM)
    paths = {(tmp_path / ("segment%d" % r)).read_text() for r in range(3)}
    assert len(paths) == 1 and not _leftovers(paths), paths


@pytest.mark.parametrize("call,count", [("recv", 1), ("sendrecv", 1), ("sendrecv", 1 << 18)])
def test_a_spinning_receive_notices_the_peer_leave(monkeypatch, call, count):
    # The longest spin: the reader never sleeps in poll() before the peer is gone, so
    # only its looks at the doorbell socket between looks at the ring can see the end.
    # A sendrecv's send went into the ring (1 element) or waits to be read by address.
    monkeypatch.setenv("PYCOLLECT_SPIN_US", "1000000")
    g = ThreadGroup(2, timeout=20)
    try:
        assert g.contexts[1]._transport.pair_kinds()[0].startswith("shm")

        def body(ctx):
            if ctx.rank == 0:
                time.sleep(0.1)
                ctx.close()
                return None
            start = time.monotonic()
            with pytest.raises(pc.PeerError, match="rank 0 .* closed its connection"):
                if call == "recv":
                    ctx.recv(np.zeros(count, np.float32), 0, tag=1)
                else:
                    ctx.sendrecv(np.ones(count, np.float32), 0, np.zeros(count, np.float32),
                                 0, sendtag=1, recvtag=1)
            return time.monotonic() - start

        _, seconds = g.run(body)
        assert seconds < 0.95, seconds  # within the 1 s spin, not after it
    finally:
        g.close()
