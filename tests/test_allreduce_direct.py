"""The direct allreduce: ranks of one host reduce straight from each other's memory.

The dtype x op x count x world-size matrix runs in test_allreduce.py (threads,
over shared memory and TCP) and tests/proc_worker.py (processes); this file
checks which path ran, the fallback, sub-groups, auto's choice and failures.
"""

import os
import secrets
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

import pycollect as pc
from group import ThreadGroup
from jobs import run_victims
from pycollect._ext import _allreduce
from pycollect._ext._engine import Engine
from pycollect._ext._shm import RING_HEADER_BYTES, RingChannel, Segment
from pycollect._ext._socket import SocketChannel
from pycollect._ext._transport import ALGORITHM_NAMES
from pycollect import selection
from group import run_ranks

DIRECT = _allreduce.ALGORITHMS["direct"]


RING_BYTES = 64 << 10


def run_direct(ctx, buf, segment_bytes=1 << 20):
    """Allreduce ``buf`` with the direct algorithm, chunks of at most ``segment_bytes``;
    return the name of what ran."""
    t = ctx._transport
    return ctx._execute((lambda seq: _allreduce.allreduce(
        t, buf, pc.SUM, DIRECT, seq, ctx.timeout, segment_bytes), 1, None, None))


def ring_engines(size, pid_of=lambda me, peer: os.getpid(), reads=lambda me, peer: True,
                 by_address_min=1):
    """``size`` engines of this process, every pair on a ring of one fresh segment, the
    channel of ``me`` to ``peer`` reading process ``pid_of(me, peer)`` where
    ``reads(me, peer)``, messages from ``by_address_min`` bytes by address (0: none); the
    segment's name is gone before this returns."""
    path = "/dev/shm/pycollect-test-%s" % secrets.token_hex(8)
    segment = Segment(path, size * size * (RING_HEADER_BYTES + RING_BYTES), True)
    segment.unlink()
    socks = {}
    for a in range(size):
        for b in range(a + 1, size):
            socks[a, b], socks[b, a] = socket.socketpair()
    engines = []
    for me in range(size):
        channels = [None if p == me else RingChannel(
            SocketChannel(socks[me, p].detach()), segment, me, p, size, RING_BYTES,
            pid_of(me, p), reads(p, me), reads(me, p), by_address_min) for p in range(size)]
        engines.append(Engine(me, size, channels, ["self" if p == me else "test ring %d" % p
                                                   for p in range(size)], spin_us=0))
    return engines


def direct_on(engines, bufs, timeout=10.0):
    """The direct allreduce of ``bufs[r]`` on engine r, every rank at once: what ran, or the
    error, per rank."""
    def body(rank):
        try:
            return ALGORITHM_NAMES[_allreduce.allreduce(
                engines[rank], bufs[rank], pc.SUM, DIRECT, 1, timeout, 1 << 20)]
        except pc.Error as exc:
            return exc
    return run_ranks(len(engines), body, timeout=timeout + 30)


def inputs(rank, n):
    return np.arange(n, dtype=np.float64) * (rank + 1) + rank


def expected(size, n):
    return sum(inputs(r, n) for r in range(size))


@pytest.mark.parametrize("size", [2, 3, 5])
def test_threads_of_one_process_read_each_other(size):
    """Thread ranks (one pid) take the direct path, with chunks of every size."""
    g = ThreadGroup(size)
    try:
        n = 3 * 65536 + size + 1
        for seg in (64, 24 << 10, 1 << 20):
            bufs = [inputs(r, n) for r in range(size)]
            names = g.run(lambda ctx: run_direct(ctx, bufs[ctx.rank], segment_bytes=seg))
            assert names == ["direct"] * size
            for buf in bufs:
                np.testing.assert_array_equal(buf, expected(size, n))
    finally:
        g.close()


@pytest.mark.parametrize("transport,env", [("shm", {"PYCOLLECT_CMA": "0"}), ("tcp", {})])
def test_without_memory_reads_every_rank_runs_halving_doubling(monkeypatch, transport, env):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    g = ThreadGroup(3, transport=transport)
    try:
        n = 100003
        bufs = [inputs(r, n) for r in range(3)]
        assert g.run(lambda ctx: run_direct(ctx, bufs[ctx.rank])) == ["halving_doubling"] * 3
        for buf in bufs:
            np.testing.assert_array_equal(buf, expected(3, n))
    finally:
        g.close()


def test_one_rank_that_may_not_be_read_sends_every_rank_to_the_fallback():
    """Readability can be one-sided (ptrace rules): the ranks agree in the first step."""
    engines = ring_engines(4, reads=lambda me, peer: me != 2)
    try:
        n = 5000
        bufs = [inputs(r, n) for r in range(4)]
        assert direct_on(engines, bufs) == ["halving_doubling"] * 4
        for buf in bufs:
            np.testing.assert_array_equal(buf, expected(4, n))
        bufs = [inputs(r, n) for r in range(4)]
        readable = ring_engines(4)
        try:
            assert direct_on(readable, bufs) == ["direct"] * 4
        finally:
            for t in readable:
                t.close()
    finally:
        for t in engines:
            t.close()


DIRECT_MIN_BYTES = selection.min_bytes("allreduce", "direct", ranks=3)


def test_auto_picks_direct_when_every_pair_shares_memory():
    big = np.zeros(-(-DIRECT_MIN_BYTES // 4), np.float32)     # the first float32 count
    small = np.zeros(big.size - 1, np.float32)
    g = ThreadGroup(3)
    try:
        ctx = g.contexts[0]
        assert ctx.plan("allreduce", big).code == DIRECT
        assert ctx.plan("allreduce", small).code != DIRECT
    finally:
        g.close()
    g = ThreadGroup(3, transport="tcp")
    try:
        assert g.contexts[0].plan("allreduce", big).code != DIRECT
    finally:
        g.close()


def test_subgroups_read_their_members_memory():
    g = ThreadGroup(4)
    try:
        n = 70001

        def body(ctx):
            sub = ctx.new_group([3, 1])
            odd = ctx.split(ctx.rank % 2, key=-ctx.rank)
            out = []
            if sub is not None:
                buf = inputs(sub.rank, n)
                out.append((run_direct(sub, buf), buf))
            buf = inputs(odd.rank, n)
            out.append((run_direct(odd, buf), buf))
            buf = np.full(n, ctx.rank + 1.0)
            odd.allreduce(buf, algorithm="direct", op=pc.AVG)
            out.append(("avg", buf))
            return out

        for rank, out in enumerate(g.run(body)):
            for name, buf in out[:-1]:
                assert name == "direct"
                np.testing.assert_array_equal(buf, expected(2, n))
            peers = [r for r in range(4) if r % 2 == rank % 2]
            np.testing.assert_array_equal(out[-1][1], np.mean([r + 1.0 for r in peers]))
    finally:
        g.close()


def test_a_peer_whose_memory_cannot_be_read_is_named():
    """The read failing (here process_vm_readv's ESRCH: a process that is gone) is a
    PeerError naming the peer, on both ranks at once."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    engines = ring_engines(2, pid_of=lambda me, peer: gone.pid if me == 0 else os.getpid())
    try:
        start = time.monotonic()
        err0, err1 = direct_on(engines, [np.ones(100000), np.ones(100000)])
        took = time.monotonic() - start
        assert isinstance(err0, pc.PeerError) and isinstance(err1, pc.PeerError), (err0, err1)
        msg0, msg1 = str(err0), str(err1)
        assert "rank 1" in msg0 and "cannot read" in msg0 and "No such process" in msg0, msg0
        assert "rank 0" in msg1, msg1
        assert took < 5
    finally:
        for t in engines:
            t.close()


_VICTIM = r"""
import os, signal, sys, threading, time
import numpy as np
import pycollect as pc
rank, store = int(sys.argv[1]), sys.argv[2]
ctx = pc.init(rank=rank, size=3, store=store, timeout=TIMEOUT, transport="shm")
assert all(k in ("self", "shm+cma") for k in ctx._transport.pair_kinds()), \
    "cross-memory attach is needed for this test"
buf = np.ones(4 << 20, np.float32)
ctx.allreduce(buf, algorithm="direct")
ctx.barrier()
if rank == 2:
    # Die (or stop, its memory staying readable) at a random moment inside a loop
    # of 16 MiB direct allreduces.
    threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGNAL)).start()
t0 = time.monotonic()
try:
    for i in range(100000):
        ctx.allreduce(buf, algorithm="direct")
except (pc.Timeout, pc.PeerError) as exc:
    print("rank %d %s after %.2f s: %s" % (rank, type(exc).__name__, time.monotonic() - t0, exc))
    sys.exit(0)
sys.exit("rank %d finished without an error" % rank)
"""


def test_a_rank_killed_during_direct_allreduces(tmp_path):
    run_victims(tmp_path, _VICTIM.replace("SIGNAL", "SIGKILL").replace("TIMEOUT", "30"))


def test_a_stopped_rank_fails_its_peers_at_the_deadline(tmp_path):
    """A rank that stops mid-operation: the others fail by the deadline (3 s), naming it."""
    run_victims(tmp_path, _VICTIM.replace("SIGNAL", "SIGSTOP").replace("TIMEOUT", "3"),
                stopped=True, bound_s=3 + 5, min_s=2.5)     # at the deadline, not before
