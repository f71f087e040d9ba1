"""The allreduce matrix: world size x algorithm x dtype x op x count, against NumPy."""

import numpy as np
import pytest

import pycollect as pc
from conftest import counts_for
from group import ThreadGroup
from reference import (BFLOAT16, DTYPES, assert_matches, make_input, np_dtype, ops_for,
                       reduce_reference)

ALGORITHMS = ["recursive_doubling", "halving_doubling", "bcube", "bcube:3", "ring",
              "ring_chunked", "direct", "flags", "auto"]


def expected_algorithm(ctx, group, algorithm, buf):
    """The algorithm that must run: auto's plan; direct only where the ranks may read each
    other's memory (threads over shared memory), else halving-doubling (except where
    there is nothing to exchange: one rank, or no elements)."""
    if algorithm == "auto":
        return ctx.plan("allreduce", buf).name
    name = algorithm.partition(":")[0]
    if name == "flags" and (ctx._transport.flag_area is None or buf.nbytes > 16384):
        return "recursive_doubling"     # no flag area (TCP, one rank), or too large for it
    if name == "direct" and group.transport == "tcp" and group.size > 1 and buf.size > 0:
        return "halving_doubling"
    return name


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_allreduce_matrix(group, algorithm, dtype):
    if dtype == "bfloat16" and BFLOAT16 is None:
        pytest.skip("ml_dtypes is not installed")
    size = group.size
    cases = [(op, n) for op in ops_for(dtype) for n in counts_for(size)]

    def body(ctx):
        out = []
        for op, n in cases:
            buf = make_input(dtype, n, ctx.rank, op)
            work = ctx.allreduce(buf, op=op, algorithm=algorithm, async_op=True)
            assert work.wait(timeout=60) is buf
            ran = expected_algorithm(ctx, group, algorithm, buf)
            assert work.algorithm == ran, (algorithm, n, work.algorithm, ran)
            out.append(buf)
        return out

    results = group.run(body)
    for i, (op, n) in enumerate(cases):
        expected = reduce_reference(dtype, [make_input(dtype, n, r, op) for r in range(size)], op)
        for rank in range(size):
            assert_matches(dtype, op, results[rank][i], expected,
                           "size %d rank %d count %d %s" % (size, rank, n, algorithm))


@pytest.mark.parametrize("shape", [(3, 5), (2, 3, 4), ()])
def test_allreduce_any_shape(group, shape):
    def body(ctx):
        buf = np.full(shape, ctx.rank + 1, dtype=np.float32)
        return ctx.allreduce(buf)
    for res in group.run(body):
        assert res.shape == shape
        assert np.all(res == group.size * (group.size + 1) / 2)


@pytest.mark.parametrize("algorithm", ["recursive_doubling", "halving_doubling", "bcube",
                                       "bcube:2", "bcube:3", "ring", "ring_chunked", "direct"])
def test_allreduce_floats_bitwise_identical_on_every_rank(group, algorithm):
    """Every rank computes each element with the same operands in the same order."""
    def body(ctx):
        rng = np.random.default_rng(ctx.rank)
        buf = rng.standard_normal(5003).astype(np.float32)
        ctx.allreduce(buf, algorithm=algorithm)
        return buf
    results = group.run(body)
    for res in results[1:]:
        assert np.array_equal(res.view(np.uint32), results[0].view(np.uint32))
    expected = sum(np.random.default_rng(r).standard_normal(5003) for r in range(group.size))
    np.testing.assert_allclose(results[0], expected, rtol=1e-5, atol=1e-5)


def test_allreduce_bytearray_and_memoryview(group):
    def body(ctx):
        a = bytearray([ctx.rank + 1] * 10)
        ctx.allreduce(a, op=pc.MAX)
        m = memoryview(np.full(6, ctx.rank, dtype=np.int64))
        ctx.allreduce(m, op=pc.SUM)
        return bytes(a), np.asarray(m).copy()
    for a, m in group.run(body):
        assert a == bytes([group.size] * 10)
        assert np.all(m == group.size * (group.size - 1) // 2)


def test_allreduce_large_default_segments():
    """A few MiB with default segments: the multi-segment ring at realistic sizes."""
    from group import ThreadGroup
    g = ThreadGroup(3)
    try:
        n = (3 << 20) // 4 + 5
        def body(ctx):
            buf = np.full(n, ctx.rank + 1, dtype=np.float32)
            ctx.allreduce(buf, algorithm="ring_chunked")
            summed = buf.copy()
            buf += ctx.rank * (np.arange(n, dtype=np.float32) % 7)   # ranks differ again
            ctx.allreduce(buf, op=pc.AVG)
            return summed, buf
        # AVG of 6 + r * (i mod 7) over r = 0, 1, 2: 6 + (i mod 7)
        want = 6.0 + np.arange(n, dtype=np.float32) % 7
        for summed, res in g.run(body):
            assert np.all(summed == 6.0)
            np.testing.assert_allclose(res, want, rtol=1e-6)
    finally:
        g.close()


def test_two_ranks_cut_ring_chunked_into_small_segments_below_16_mib():
    """ring_chunked at 2 ranks: segments of at most 128 KiB below 16 MiB (each chunk in many
    of them), the context's segment from 16 MiB on and at other sizes; the result is right
    over TCP with the context's default segment of 1 MiB."""
    from group import ThreadGroup
    from pycollect._ext._allreduce import ring_segment_bytes
    mib = 1 << 20
    assert ring_segment_bytes(mib, 4 * mib, 2) == 128 << 10
    assert ring_segment_bytes(mib, 16 * mib - 1, 2) == 128 << 10
    assert ring_segment_bytes(mib, 16 * mib, 2) == mib
    assert ring_segment_bytes(mib, 4 * mib, 3) == mib
    assert ring_segment_bytes(mib, 4 * mib, 4) == mib
    assert ring_segment_bytes(64, 4 * mib, 2) == 64          # a smaller one is kept
    g = ThreadGroup(2, transport="tcp")
    try:
        n = (3 << 20) // 4 + 5
        def body(ctx):
            buf = np.arange(n, dtype=np.float32) * (ctx.rank + 1)
            work = ctx.allreduce(buf, algorithm="ring_chunked", async_op=True)
            work.wait(timeout=60)
            assert work.algorithm == "ring_chunked"
            return buf
        for res in g.run(body):
            assert np.array_equal(res, np.arange(n, dtype=np.float32) * 3)
    finally:
        g.close()

@pytest.mark.parametrize("size, transport, cases", [
    (2, "auto", [(4 << 10, "flags"), ((4 << 10) + 4, "direct"), (32 << 10, "direct")]),
    (2, "tcp", [(256 << 10, "recursive_doubling"), ((256 << 10) + 4, "ring_chunked"),
                (1 << 20, "ring_chunked")]),
    (4, "auto", [(4 << 10, "flags"), (8 << 10, "flags"), ((8 << 10) + 4, "direct"),
                 (128 << 10, "direct")]),
    (4, "tcp", [(4 << 10, "recursive_doubling"), ((256 << 10) - 4, "halving_doubling"),
                ((16 << 20) - 4, "bcube"), (16 << 20, "ring_chunked")]),
    (3, "auto", [(8 << 10, "flags"), ((8 << 10) + 4, "direct")]),
])
def test_auto_follows_the_measured_crossovers(size, transport, cases):
    """auto's rule (docs/algorithms.md): by size, rank count and whether all pairs share memory;
    every pick also runs and is reported on the handle."""
    g = ThreadGroup(size, transport=transport)
    try:
        ctx = g.contexts[0]
        for nbytes, name in cases:
            picked = ctx.plan("allreduce", np.zeros(nbytes // 4, np.float32)).name
            assert picked == name, (nbytes, picked, name)
        nbytes, name = cases[-1]
        works = g.run(lambda c: c.allreduce(np.ones(nbytes // 4, np.float32), async_op=True))
        for w in works:
            assert w.wait(timeout=60)[0] == size and w.algorithm == name
    finally:
        g.close()


@pytest.mark.parametrize("size, algorithm", [(4, "bcube:2"), (7, "bcube:2"), (8, "bcube:2"),
                                             (9, "bcube:3")])
def test_bcube_in_several_steps(size, algorithm):
    """bcube with more than one digit (world size >= base**2, with ranks folded in at 7):
    each step reduces and shares a part that does not start at 0 (the matrix's bases ran
    one step only, so an offset lost inside the steps went unseen)."""
    g = ThreadGroup(size, timeout=30)
    try:
        def body(ctx):
            out = []
            for n in (1, 5, 4 * size + 3, 1000):
                buf = np.arange(n, dtype=np.int64) * (ctx.rank + 1)
                work = ctx.allreduce(buf, algorithm=algorithm, async_op=True)
                work.wait(timeout=30)
                out.append((work.algorithm, buf))
            return out
        total = size * (size + 1) // 2
        for per_rank in g.run(body, timeout=120):
            for ran, buf in per_rank:
                assert ran == "bcube"
                assert np.array_equal(buf, np.arange(buf.size, dtype=np.int64) * total)
    finally:
        g.close()
