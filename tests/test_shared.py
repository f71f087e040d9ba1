"""Arrays in shared memory (``pycollect.empty``): the pool, and direct collectives on them.

The pool's blocks, their reuse and the pages they give back run in this
process; the direct collectives run on thread ranks (one process maps its own
pool through /proc like any peer) and as processes, where a peer's pool is
mapped for real, and the witness that plain loads were used is
``view_stats()``'s count of views handed out.
"""

import gc
import os

import numpy as np
import pytest

import pycollect as pc
from group import ThreadGroup
from jobs import last_json, run_script, run_victims, shm_ranks
from pycollect import shared
from test_allreduce_direct import _VICTIM, direct_on, ring_engines


def _hits():
    return shared.view_stats()[1]


def test_empty_gives_arrays_of_the_shape_and_dtype_asked_for():
    a = pc.empty((3, 5), np.float64)
    assert a.shape == (3, 5) and a.dtype == np.float64 and a.flags.writeable
    assert a.flags.c_contiguous and a.ctypes.data % 4096 == 0
    a[:] = 7
    assert a.sum() == 105
    z = pc.zeros(10, "int16")
    assert z.dtype == np.int16 and not z.any()
    v = pc.zeros(3, "V8")                       # a void dtype has its zero bytes too
    assert v.dtype == np.dtype("V8") and v.tobytes() == bytes(24)
    assert pc.empty(0).size == 0 and pc.empty((2, 0, 3), np.uint8).shape == (2, 0, 3)


@pytest.mark.parametrize("shape,dtype,what", [
    ((-1,), np.float32, "shape"),
    ((2.5,), np.float32, "shape"),
    ((4,), object, "Python objects"),
    ((4,), "no-such-type", "not a NumPy dtype"),
    (None, np.float32, "shape None"),
    (1.5, np.float32, "shape 1.5"),
    (True, np.float32, "shape True"),
    ((2, True), np.float32, "shape"),
    (2 ** 63, np.float32, "do not fit the pool"),
    ((2 ** 32, 2 ** 32), np.float32, "do not fit the pool"),
    # NumPy's reshape raised a bare ValueError for it
    ((2 ** 40, 2 ** 40, 0), np.float32, "holds more than an array may"),
    (4, np.void, "not one element of a fixed size"),
    (4, "S0", "not one element of a fixed size"),
    (4, "(2,)f8", "not one element of a fixed size"),
])
def test_bad_shapes_and_dtypes_are_refused_by_name(shape, dtype, what):
    with pytest.raises(pc.InvalidArgument, match=what):
        pc.empty(shape, dtype)


def test_an_array_larger_than_the_pool_is_refused_naming_the_setting():
    with pytest.raises(pc.InvalidArgument, match="PYCOLLECT_POOL_BYTES"):
        pc.empty(1 << 62, np.uint8)


def test_freed_arrays_give_their_pages_and_their_range_back():
    gc.collect()            # earlier tests' transports give their direct stages back now
    before = shared.pool_used()
    a = pc.empty(1 << 20, np.float32)
    b = pc.empty(3, np.float32)          # a whole page
    assert shared.pool_used() == before + (4 << 20) + 4096
    address = a.ctypes.data
    a[:] = 1
    del a
    assert shared.pool_used() == before + 4096
    c = pc.empty(1 << 20, np.float32)    # first fit: the range just freed
    assert c.ctypes.data == address
    assert not c.any(), "a freed block's pages are punched out: they come back as zeros"
    del b, c
    assert shared.pool_used() == before


def test_a_view_of_an_array_keeps_its_memory():
    gc.collect()
    a = pc.empty(1000, np.int32)
    a[:] = np.arange(1000)
    tail = a[500:]
    used = shared.pool_used()
    del a
    assert shared.pool_used() == used
    assert tail[0] == 500 and tail[-1] == 999


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_a_forked_child_frees_nothing_of_its_parent():
    a = pc.empty(4096, np.uint8)
    a[:] = 9
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:                       # the child: its own pool, and the parent's untouched
        try:
            b = pc.empty(4096, np.uint8)
            ok = b.ctypes.data != a.ctypes.data and a[0] == 9
            a[1] = 10                  # the inherited array still shares its pages
            del a, b
            os.write(w, b"1" if ok else b"0")
        finally:
            os._exit(0)
    os.close(w)
    assert os.read(r, 1) == b"1"
    os.close(r)
    os.waitpid(pid, 0)
    assert a[0] == 9 and a[1] == 10 and np.all(a[2:] == 9)


@pytest.mark.parametrize("size", [2, 3])
def test_direct_collectives_on_shared_arrays_use_the_peers_memory_in_place(size):
    """allreduce, broadcast and allgather on pool arrays, every rank's or some ranks'."""
    g = ThreadGroup(size)
    try:
        for n, dtype in ((1, np.float32), (100003, np.float64), (3 << 18, np.int64)):
            for pooled in ([True] * size, [True, False] + [True] * (size - 2)):
                def make(rank, count, fill):
                    out = pc.empty(count, dtype) if pooled[rank] else np.empty(count, dtype)
                    out[:] = fill
                    return out

                def body(ctx):
                    r = ctx.rank
                    a = make(r, n, np.arange(n) % 11 + r)
                    ctx.allreduce(a, algorithm="direct")
                    b = make(r, n, np.arange(n) % 5 if r == 1 else -1)
                    ctx.broadcast(b, root=1, algorithm="direct")
                    g_ = make(r, n * size, -1)
                    ctx.allgather(np.full(n, r, dtype), g_, algorithm="direct")
                    return a, b, g_

                before = _hits()
                results = g.run(body)
                # Every rank maps a pooled peer: at least one view per pooled pair and call.
                assert _hits() - before >= sum(pooled) - 1, (n, dtype, pooled)
                want = ((np.arange(n) % 11) * size + size * (size - 1) // 2).astype(dtype)
                for a, b, g_ in results:
                    np.testing.assert_array_equal(a, want)
                    np.testing.assert_array_equal(b, (np.arange(n) % 5).astype(dtype))
                    np.testing.assert_array_equal(
                        g_.reshape(size, n), np.repeat(np.arange(size), n).reshape(size, n))
    finally:
        g.close()


@pytest.mark.parametrize("cma_min", ["1", None])
def test_messages_by_address_from_shared_arrays_are_copied_from_the_view(monkeypatch, cma_min):
    """send/recv (and so every message-based algorithm) of a pooled buffer: the receiver
    copies from its view of the sender's pool; a plain buffer still goes by cross-memory
    attach. Sizes around the by-address threshold and across the 4 MiB read passes."""
    if cma_min:
        monkeypatch.setenv("PYCOLLECT_CMA_MIN_BYTES", cma_min)
    g = ThreadGroup(2, transport="shm")
    try:
        for n in (1, 1000, 1 << 16, (5 << 20) // 4 + 3):
            for pooled in (True, False):
                src = pc.empty(n, np.float32) if pooled else np.empty(n, np.float32)
                src[:] = np.arange(n) % 101
                dst = np.full(n, -1, np.float32)
                before, by_address = _hits(), [
                    sum(ctx._transport.messages_by_address()) for ctx in g.contexts]

                def body(ctx):
                    if ctx.rank == 0:
                        ctx.send(src, 1, tag=7)
                    else:
                        ctx.recv(dst, 0, tag=7)

                g.run(body)
                np.testing.assert_array_equal(dst, src)
                went = sum(sum(ctx._transport.messages_by_address())
                           for ctx in g.contexts) - sum(by_address)
                if went and pooled:
                    assert _hits() > before, (n, pooled)
                else:
                    assert _hits() == before, (n, pooled, went)
                if n * 4 >= int(cma_min or 65536):
                    assert went == 1, (n, pooled)
    finally:
        g.close()


def test_a_pooled_peer_that_cannot_be_read_takes_the_fallback():
    """Views follow readability: where cross-memory attach is refused, halving-doubling."""
    # Messages stream (none by address, which would map the pool for a copy): the count
    # of views is the direct algorithm's alone.
    engines = ring_engines(2, reads=lambda me, peer: me != 1, by_address_min=0)
    try:
        bufs = [pc.empty(5000, np.float64) for _ in range(2)]
        for r, b in enumerate(bufs):
            b[:] = np.arange(5000) + r
        before = _hits()
        assert direct_on(engines, bufs) == ["halving_doubling"] * 2
        assert _hits() == before
        for b in bufs:
            np.testing.assert_array_equal(b, 2 * np.arange(5000) + 1)
    finally:
        for t in engines:
            t.close()


_RANKS = shm_ranks(2, r"""
n = (1 << 20) + 7
ok = True
for step in range(20):
    a = pc.empty(n, np.float32)
    a[:] = np.arange(n, dtype=np.float32) % 13 + rank + step
    ctx.allreduce(a, algorithm="direct")
    ok &= bool(np.array_equal(a, 2 * (np.arange(n, dtype=np.float32) % 13) + 1 + 2 * step))
    b = pc.empty(n, np.float32) if step % 2 else np.empty(n, np.float32)
    b[:] = step if rank == 0 else -1
    ctx.broadcast(b, root=0, algorithm="direct")
    ok &= bool(np.all(b == step))
    if rank == 0:                           # a message by address from a pooled array
        ctx.send(a, 1, tag=step)
    else:
        got = np.empty(n, np.float32)
        ctx.recv(got, 0, tag=step)
        ok &= bool(np.array_equal(got, a))
mapped, hits = shared.view_stats()
ctx.close()
print(json.dumps({"ok": ok, "mapped": mapped, "hits": hits, "used": shared.pool_used()}))
""")


def test_processes_map_each_others_pools(tmp_path):
    """Two processes: a peer's pool is mapped once, used on every call, results exact, and
    each rank's freed arrays give their pages back."""
    results = last_json(run_script(tmp_path, _RANKS, size=2), (0, 1), timeout=120)
    for res in results:
        assert res["ok"], res
        assert res["mapped"] == 1, res          # one peer pool, mapped once
        assert res["hits"] >= 20, res           # ... and used by every allreduce
        if res is results[1]:
            assert res["hits"] >= 40, res       # ... and by every message received
        # The last step's two arrays, whole pages: every earlier one was given back.
        assert res["used"] == 2 * -(-((1 << 20) + 7) * 4 // 4096) * 4096, res


def test_a_rank_killed_during_pooled_direct_allreduces(tmp_path):
    """A peer dies while the survivors reduce straight from its mapped pages: PeerError
    naming it, no crash (its pages stay mapped until the survivors end)."""
    victim = _VICTIM.replace("buf = np.ones(4 << 20, np.float32)",
                             "buf = pc.empty(4 << 20, np.float32)\nbuf[:] = 1")
    assert victim != _VICTIM
    run_victims(tmp_path, victim.replace("SIGNAL", "SIGKILL").replace("TIMEOUT", "30"))


def test_a_stopped_pooled_rank_fails_its_peers_at_the_deadline(tmp_path):
    victim = _VICTIM.replace("buf = np.ones(4 << 20, np.float32)",
                             "buf = pc.empty(4 << 20, np.float32)\nbuf[:] = 1")
    run_victims(tmp_path, victim.replace("SIGNAL", "SIGSTOP").replace("TIMEOUT", "3"),
                stopped=True, bound_s=3 + 5)
