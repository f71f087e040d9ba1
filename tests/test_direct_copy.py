"""The one-copy paths on one host: broadcast and allgather through one-sided reads.

Ranks copy straight out of the root's (or each owner's) memory after an address
exchange, and an owner returns only once every reader is done.  Thread ranks
of one process can read each other's memory (one pid), so the matrix runs on
threads; the owner's return, failures and the fallbacks run as processes or on
engines whose readability the test chooses.
"""

import os

import numpy as np
import pytest

import pycollect as pc
from group import ThreadGroup
from jobs import last_json, run_script, run_victims, shm_ranks
from pycollect import selection
from pycollect._ext import _allgather, _broadcast
from pycollect._ext._direct import DIRECT_READ_BYTES
from pycollect._ext._transport import ALGORITHM_NAMES
from reference import assert_matches, make_input, reduce_reference
from test_allreduce_direct import direct_on, expected, inputs, ring_engines

DTYPES = ["float32", "float64", "int8", "uint16", "int64", "bool", "float16", "complex128"]
# Counts: none, one, odd, and one whose blocks cross several read pieces and end mid-piece.
COUNTS = [0, 1, 7, 3 * DIRECT_READ_BYTES // 8 + 5]


def data(dtype, n, rank):
    return make_input(dtype, n, rank, pc.SUM, seed=3)


def ran(work):
    """The name of the algorithm an async handle ran, once done."""
    work.wait()
    return work.algorithm


@pytest.fixture(scope="module", params=[2, 3, 8])
def group(request):
    g = ThreadGroup(request.param)
    yield g
    g.close()


def test_direct_broadcast_every_root_dtype_and_count(group):
    P = group.size

    def body(ctx):
        out = []
        for dtype in DTYPES:
            for n in COUNTS:
                for root in range(P):
                    want = data(dtype, n, root)
                    buf = want.copy() if ctx.rank == root else np.zeros_like(want)
                    name = ran(ctx.broadcast(buf, root, algorithm="direct", async_op=True))
                    out.append((dtype, n, root, name, np.array_equal(buf, want)))
        return out

    for rank, out in enumerate(group.run(body)):
        for dtype, n, root, name, ok in out:
            assert ok, (rank, dtype, n, root)
            assert name == "direct", (rank, dtype, n, root, name)


def test_direct_allgather_every_dtype_and_count_in_and_out_of_place(group):
    P = group.size

    def body(ctx):
        out = []
        for dtype in DTYPES:
            for n in COUNTS:
                every = np.concatenate([data(dtype, n, r) for r in range(P)])
                mine = data(dtype, n, ctx.rank)
                recv = np.zeros_like(every)
                name = ran(ctx.allgather(mine, recv, algorithm="direct", async_op=True))
                inplace = np.zeros_like(every)
                inplace[ctx.rank * n:(ctx.rank + 1) * n] = mine
                ran(ctx.allgather(inplace[ctx.rank * n:(ctx.rank + 1) * n], inplace,
                                  algorithm="direct", async_op=True))
                out.append((dtype, n, name, np.array_equal(recv, every),
                            np.array_equal(inplace, every)))
        return out

    for rank, out in enumerate(group.run(body)):
        for dtype, n, name, ok, ok_inplace in out:
            assert ok and ok_inplace, (rank, dtype, n, ok, ok_inplace)
            assert name == "direct" or n == 0, (rank, dtype, n, name)


@pytest.mark.parametrize("size", [2, 5])
def test_direct_allreduce_slices_larger_than_a_read_piece(size):
    """Slices larger than a read piece (DIRECT_READ_BYTES), reduced and written back in
    chunks and ending mid-chunk, for every op of an integer and a floating type."""
    g = ThreadGroup(size)
    try:
        n = size * (2 * DIRECT_READ_BYTES // 8) + 3
        for dtype, ops in (("int32", [pc.SUM, pc.PRODUCT, pc.MIN, pc.MAX, pc.BAND, pc.BOR,
                                      pc.BXOR]),
                           ("float64", [pc.SUM, pc.PRODUCT, pc.MIN, pc.MAX, pc.AVG])):
            for op in ops:
                bufs = [make_input(dtype, n, r, op) for r in range(size)]
                want = reduce_reference(dtype, [b.copy() for b in bufs], op)
                names = g.run(lambda ctx: ran(ctx.allreduce(bufs[ctx.rank], op=op,
                                                            algorithm="direct", async_op=True)))
                assert names == ["direct"] * size
                for r, buf in enumerate(bufs):
                    assert_matches(dtype, op, buf, want, "rank %d %s %s" % (r, dtype, op))
    finally:
        g.close()


def test_over_tcp_direct_broadcast_sends_and_allgather_runs_the_ring():
    g = ThreadGroup(3, transport="tcp")
    try:
        n = 50001

        def body(ctx):
            buf = np.full(n, ctx.rank + 1.0)
            b = ran(ctx.broadcast(buf, 1, algorithm="direct", async_op=True))
            recv = np.zeros(3 * n)
            a = ran(ctx.allgather(np.full(n, ctx.rank + 1.0), recv, algorithm="direct",
                                  async_op=True))
            return b, a, bool(np.all(buf == 2.0)), bool(np.array_equal(
                recv, np.repeat([1.0, 2.0, 3.0], n)))

        for b, a, ok_b, ok_a in g.run(body):
            assert (b, a, ok_b, ok_a) == ("direct", "ring", True, True)
    finally:
        g.close()


def _on_engines(engines, fn, timeout=10.0):
    from group import run_ranks

    def body(rank):
        try:
            return fn(rank, engines[rank])
        except pc.Error as exc:
            return exc
    return run_ranks(len(engines), body, timeout=timeout + 30)


def test_a_rank_that_may_not_read_the_root_gets_the_buffer_as_a_message():
    """Readability can be one-sided: rank 2 may read nobody; it answers "send it"."""
    engines = ring_engines(4, reads=lambda me, peer: me != 2)
    try:
        n = 70001
        for root in (0, 2):
            bufs = [np.full(n, float(r + 1)) for r in range(4)]
            codes = _on_engines(engines, lambda r, t: _broadcast.broadcast(
                t, bufs[r], root, _broadcast.ALGORITHMS["direct"], 1 + root, 10.0, 1 << 20))
            assert [ALGORITHM_NAMES[c] for c in codes] == ["direct"] * 4, codes
            for buf in bufs:
                assert np.all(buf == root + 1.0)
        recvs = [np.zeros(4 * n) for _ in range(4)]
        codes = _on_engines(engines, lambda r, t: _allgather.allgather(
            t, np.full(n, float(r)), recvs[r], None, 9, 10.0, 1 << 20,
            _allgather.ALGORITHMS["direct"]))
        assert [ALGORITHM_NAMES[c] for c in codes] == ["ring"] * 4, codes
        for recv in recvs:
            np.testing.assert_array_equal(recv, np.repeat([0.0, 1.0, 2.0, 3.0], n))
        # ... and the direct allreduce on these engines still agrees on halving-doubling
        bufs = [inputs(r, 5000) for r in range(4)]
        assert direct_on(engines, bufs) == ["halving_doubling"] * 4
        np.testing.assert_array_equal(bufs[3], expected(4, 5000))
    finally:
        for t in engines:
            t.close()


def test_the_root_writes_the_head_of_each_buffer_itself():
    """The root copies the first 1/size of the buffer into each reader's memory while the
    readers copy the rest: where the root's writes go to a process that is gone, the
    broadcast fails on the root naming process_vm_writev, and no rank hangs."""
    import subprocess
    import sys
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    engines = ring_engines(2, pid_of=lambda me, peer: gone.pid if me == 0 else os.getpid(),
                           by_address_min=0)
    try:
        n = 4 * DIRECT_READ_BYTES // 8
        bufs = [np.full(n, float(r + 1)) for r in range(2)]
        out = _on_engines(engines, lambda r, t: _broadcast.broadcast(
            t, bufs[r], 0, _broadcast.ALGORITHMS["direct"], 1, 10.0, 1 << 20))
        assert isinstance(out[0], pc.PeerError), out
        assert "process_vm_writev" in str(out[0]) and "cannot write" in str(out[0]), out[0]
        assert isinstance(out[1], pc.Error), out
    finally:
        for t in engines:
            t.close()
    # With a pid that may be written, the head arrives from the root and the rest is read.
    engines = ring_engines(3)
    try:
        n = 3 * DIRECT_READ_BYTES // 8 + 3
        bufs = [np.arange(n, dtype=np.float64) if r == 1 else np.zeros(n) for r in range(3)]
        codes = _on_engines(engines, lambda r, t: _broadcast.broadcast(
            t, bufs[r], 1, _broadcast.ALGORITHMS["direct"], 1, 10.0, 1 << 20))
        assert [ALGORITHM_NAMES[c] for c in codes] == ["direct"] * 3, codes
        for buf in bufs:
            np.testing.assert_array_equal(buf, np.arange(n, dtype=np.float64))
    finally:
        for t in engines:
            t.close()


def test_an_allgather_writes_its_block_to_each_peer_in_one_kernel_copy():
    """The allgather's block goes to every peer whole: one process_vm_writev each, where
    pieces of DIRECT_READ_BYTES would take four here (each call costs microseconds beyond
    its copy, and nothing of the block is read again)."""
    engines = ring_engines(3, by_address_min=0)     # messages stream: only the writes count
    try:
        n = 3 * DIRECT_READ_BYTES // 8 + 5
        sends = [np.arange(n, dtype=np.float64) + r * n for r in range(3)]
        recvs = [np.zeros(3 * n) for _ in range(3)]
        before = [t.kernel_copies() for t in engines]
        codes = _on_engines(engines, lambda r, t: _allgather.allgather(
            t, sends[r], recvs[r], None, 1, 10.0, 1 << 20, _allgather.ALGORITHMS["direct"]))
        assert [ALGORITHM_NAMES[c] for c in codes] == ["direct"] * 3, codes
        for r, t in enumerate(engines):
            np.testing.assert_array_equal(recvs[r], np.arange(3 * n, dtype=np.float64))
            copies = [a - b for a, b in zip(t.kernel_copies(), before[r])]
            assert copies == [0 if p == r else 1 for p in range(3)], (r, copies)
    finally:
        for t in engines:
            t.close()


def test_auto_picks_the_direct_broadcast_and_allgather_where_the_table_says():
    edge = selection.min_bytes("broadcast", "direct")
    big = np.zeros(edge // 4, np.float32)
    small = np.zeros(edge // 4 - 1, np.float32)
    block = selection.min_bytes("allgather", "direct")
    for size in (2, 4):
        g = ThreadGroup(size)
        try:
            ctx = g.contexts[0]
            assert ctx.plan("broadcast", big).name == "direct", size
            assert ctx.plan("broadcast", small).name != "direct", size
            works = g.run(lambda c: c.broadcast(np.zeros(edge // 4, np.float32), async_op=True))
            assert [ran(w) for w in works] == ["direct"] * size
            assert ctx.plan("allgather", np.zeros(block, np.uint8)).name == "direct"
            # Below it, the flag area (the whole group is on one host's shared memory),
            # which at 2 ranks leaves blocks from 4 KiB to the ring.
            assert ctx.plan("allgather", np.zeros(block - 1, np.uint8)).name == (
                "ring" if size == 2 else "flags")
            works = g.run(lambda c: c.allgather(np.full(block, c.rank, np.uint8),
                                                async_op=True))
            assert [ran(w) for w in works] == ["direct"] * size
            for w in works:
                np.testing.assert_array_equal(
                    w.wait().ravel(), np.repeat(np.arange(size, dtype=np.uint8), block))
        finally:
            g.close()
    g = ThreadGroup(2, transport="tcp")
    try:
        assert g.contexts[0].plan("broadcast", big).name != "direct"
        assert g.contexts[0].plan("allgather", np.zeros(block, np.uint8)).name == "ring"
    finally:
        g.close()


# Processes: the owner mutates its buffer the moment the call returns; a reader that had
# not finished would see the mutation.
_MUTATE = shm_ranks(3, r"""
n = 4 << 20
buf = np.empty(n, np.float32)
send = np.empty(n, np.float32)
recv = np.empty(3 * n, np.float32)
bad = 0
for i in range(12):
    root = i % 3
    buf[:] = i if rank == root else -2
    ctx.broadcast(buf, root, algorithm="direct")
    if rank == root:
        buf[:] = -1                      # at once: a reader still copying would see this
    elif not np.all(buf == i):
        bad += 1
    send[:] = 10 * i + rank
    ctx.allgather(send, recv, algorithm="direct")
    send[:] = -1
    if not np.array_equal(recv.reshape(3, n)[:, ::4096],
                          np.repeat([[10.0 * i], [10.0 * i + 1], [10.0 * i + 2]], n // 4096, 1)):
        bad += 1
    ctx.barrier()
print(json.dumps({"bad": bad}))
""")


def test_an_owner_returns_only_after_every_reader_has_copied(tmp_path):
    assert last_json(run_script(tmp_path, _MUTATE), range(3), 120) == [{"bad": 0}] * 3


_VICTIM = r"""
import os, signal, sys, threading, time
import numpy as np
import pycollect as pc
rank, store = int(sys.argv[1]), sys.argv[2]
ctx = pc.init(rank=rank, size=3, store=store, timeout=30, transport="shm")
assert all(k in ("self", "shm+cma") for k in ctx._transport.pair_kinds()), \
    "cross-memory attach is needed for this test"
buf = np.ones(4 << 20, np.float32)
recv = np.ones(3 * (4 << 20), np.float32)
CALL
ctx.barrier()
if rank == 2:
    threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGKILL)).start()
t0 = time.monotonic()
try:
    for i in range(100000):
        CALL
except (pc.Timeout, pc.PeerError) as exc:
    print("rank %d %s after %.2f s: %s" % (rank, type(exc).__name__, time.monotonic() - t0, exc))
    sys.exit(0)
sys.exit("rank %d finished without an error" % rank)
"""


@pytest.mark.parametrize("call", [
    "ctx.broadcast(buf, 2, algorithm='direct')",     # the owner dies
    "ctx.broadcast(buf, 0, algorithm='direct')",     # a reader dies
    "ctx.allgather(buf, recv, algorithm='direct')",  # an owner and reader dies
], ids=["broadcast-owner", "broadcast-reader", "allgather"])
def test_a_rank_killed_mid_operation_is_a_prompt_peer_error(tmp_path, call):
    run_victims(tmp_path, _VICTIM.replace("CALL", call))



def test_a_call_right_after_a_barrier_is_no_disagreement():
    """A rank leaves a flag-area barrier as soon as every flag is up; its next call's first
    message can then reach a peer still watching the barrier, which must not take it for a
    rank running the barrier another way (MismatchError).  allreduce_paired.py puts a barrier
    before every call of four algorithms in turn: the pattern that met the race."""
    import os
    import subprocess
    import sys
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                          "benchmarks", "allreduce_paired.py")
    done = subprocess.run([sys.executable, script, "--ranks", "2", "--count", "500000",
                           "--algorithms", "direct,ring,bcube,halving_doubling",
                           "--iterations", "40", "--timeout", "30"],
                          capture_output=True, text=True, timeout=200)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "direct" in done.stdout


@pytest.mark.parametrize("args, message", [
    (["--ranks", "0"], "--ranks must be at least 1"),
    (["--iterations", "0"], "--iterations must be at least 1"),
    (["--algorithms", "direct,foo"], "unknown algorithm 'foo'"),
    (["--algorithms", "direct@x"], "direct@N takes a chunk of N >= 1 bytes"),
    (["--dtype", "foo"], "--dtype 'foo' is not a dtype pycollect has"),
])
def test_allreduce_paired_refuses_what_no_rank_could_run(args, message):
    """allreduce_paired.py's usage error, before any rank starts (it was a traceback)."""
    import subprocess
    import sys
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                          "benchmarks", "allreduce_paired.py")
    done = subprocess.run([sys.executable, script, *args], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert message in done.stderr and not done.stdout
