"""Broadcast and barrier across world sizes, roots, algorithms, counts and dtypes."""

import threading
import time

import numpy as np
import pytest

import pycollect as pc
from conftest import counts_for
from reference import BFLOAT16, np_dtype

BCAST_DTYPES = ["uint8", "int32", "float16", "bfloat16", "float64", "complex128", "bool"]


def _expected(ctx, algorithm, buf):
    """What a broadcast of ``buf`` must run: auto's plan; flags only where the transport has
    a flag area and the buffer fits (else the binomial tree)."""
    if algorithm == "auto":
        return ctx.plan("broadcast", buf).name
    if algorithm == "flags" and (ctx._transport.flag_area is None or buf.nbytes > 16384):
        return "binomial"
    return algorithm


@pytest.mark.parametrize("algorithm", ["binomial", "pipelined", "flags", "auto"])
@pytest.mark.parametrize("dtype", BCAST_DTYPES)
def test_broadcast_matrix(group, algorithm, dtype):
    if dtype == "bfloat16" and BFLOAT16 is None:
        pytest.skip("ml_dtypes is not installed")
    size = group.size
    dt = np_dtype(dtype)
    counts = counts_for(size)

    def payload(n, root):
        return ((np.arange(n) * 7 + root) % 100).astype(dt)

    def body(ctx):
        out = []
        for root in range(size):          # roots rotate
            for n in counts:
                buf = payload(n, root) if ctx.rank == root else np.zeros(n, dtype=dt)
                work = ctx.broadcast(buf, root=root, algorithm=algorithm, async_op=True)
                assert work.wait(timeout=60) is buf
                assert size == 1 or work.algorithm == _expected(ctx, algorithm, buf)
                out.append(buf)
        return out

    results = group.run(body)
    i = 0
    for root in range(size):
        for n in counts:
            for rank in range(size):
                assert np.array_equal(results[rank][i], payload(n, root)), (root, n, rank)
            i += 1


def test_broadcast_root_buffer_may_be_read_only(group):
    def body(ctx):
        if ctx.rank == 0:
            buf = np.arange(10.0)
            buf.setflags(write=False)
        else:
            buf = np.zeros(10)
        return ctx.broadcast(buf, root=0).copy()
    for res in group.run(body):
        assert np.array_equal(res, np.arange(10.0))



@pytest.mark.parametrize("root", [0, "last"])
def test_a_pipelined_root_returns_once_the_chains_end_has_the_message(group, root):
    """The root of a pipelined broadcast leaves the call only after the last rank of the
    chain has the whole message, though every byte fits in the sockets' or rings' buffers
    (here 64 KiB in 64-byte segments) and the last rank comes late; its bytes are right."""
    if group.size == 1:
        pytest.skip("a world of one has no chain")
    size = group.size
    root = size - 1 if root == "last" else root
    tail = (root - 1) % size
    entered = {}
    left = {}
    lock = threading.Lock()

    def body(ctx):
        buf = np.arange(16384, dtype=np.float32) if ctx.rank == root else \
            np.zeros(16384, np.float32)
        if ctx.rank == tail:
            time.sleep(0.3)
        with lock:
            entered[ctx.rank] = time.monotonic()
        work = ctx.broadcast(buf, root=root, algorithm="pipelined", async_op=True)
        work.wait(timeout=60)
        assert work.algorithm == "pipelined"
        with lock:
            left[ctx.rank] = time.monotonic()
        return buf

    for res in group.run(body):
        assert np.array_equal(res, np.arange(16384, dtype=np.float32))
    assert left[root] >= entered[tail]

def test_barrier_repeated(group):
    """Twenty barriers in a row, a different rank late to each: none lets a rank through
    before the late one has entered it."""
    rounds = 20
    entered = [dict() for _ in range(rounds)]
    left = [dict() for _ in range(rounds)]
    lock = threading.Lock()

    def body(ctx):
        for i in range(rounds):
            if ctx.rank == i % group.size:
                time.sleep(0.005)
            with lock:
                entered[i][ctx.rank] = time.monotonic()
            work = ctx.barrier(async_op=True)
            work.wait(timeout=60)
            # One host's shared memory: the flags; otherwise dissemination.
            assert group.size == 1 or work.algorithm == (
                "flags" if ctx._transport.flag_area is not None else "dissemination")
            with lock:
                left[i][ctx.rank] = time.monotonic()

    group.run(body)
    for i in range(rounds):
        assert min(left[i].values()) >= max(entered[i].values()), i


def test_barrier_waits_for_the_last_rank(group):
    """No rank leaves the barrier before the slowest one has entered it."""
    entered = {}
    left = {}
    lock = threading.Lock()

    def body(ctx):
        if ctx.rank == group.size - 1:
            time.sleep(0.2)
        with lock:
            entered[ctx.rank] = time.monotonic()
        ctx.barrier()
        with lock:
            left[ctx.rank] = time.monotonic()

    group.run(body)
    assert min(left.values()) >= max(entered.values())
