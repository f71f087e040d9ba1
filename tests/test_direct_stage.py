"""Direct allreduce on plain NumPy arrays, staged in the pool of shared buffers.

A rank whose buffer is not in its pool (``pycollect.empty``) copies the
slices its peers reduce into a block of its pool, and the peers read and
write that block with plain loads and stores (_direct.pyx, ``direct_stage``).
The witness that a stage was offered and mapped is ``view_stats()``'s count
of views handed out: plain buffers are otherwise never viewed.  Whether a
buffer is staged depends on its size (every rank's buffer and block must fit
the cache: ``set_stage_bytes`` sets the bound here).
"""

import gc

import numpy as np
import pytest

import pycollect as pc
from group import ThreadGroup
from jobs import last_json, run_script, run_victims, shm_ranks
from pycollect import shared
from pycollect._ext._direct import DIRECT_STAGE_BYTES, set_stage_bytes
from test_allreduce_direct import _VICTIM


def _hits():
    return shared.view_stats()[1]


@pytest.fixture
def stage_bound():
    """Set the staging bound for one test; the machine's own afterwards."""
    yield set_stage_bytes
    set_stage_bytes(DIRECT_STAGE_BYTES)


@pytest.mark.parametrize("size", [2, 3])
def test_plain_arrays_are_staged_and_reduce_exactly(size, stage_bound):
    """Counts that split unevenly, several dtypes and ops, some ranks' arrays pooled: every
    rank ends with the same exact result, and the peers worked on the stages (views)."""
    g = ThreadGroup(size, transport="shm")
    try:
        for n, dtype, op in ((1, np.float32, pc.SUM), (1001, np.int32, pc.MAX),
                             (100003, np.float64, pc.SUM), (3 << 16, np.int64, pc.PRODUCT)):
            for pooled in ([False] * size, [True] + [False] * (size - 1)):
                def body(ctx):
                    r = ctx.rank
                    a = pc.empty(n, dtype) if pooled[r] else np.empty(n, dtype)
                    a[:] = np.arange(n) % 3 + r + 1
                    ctx.allreduce(a, op=op, algorithm="direct")
                    return a

                before = _hits()
                results = g.run(body)
                ranks = np.arange(size)[:, None] + 1 + np.arange(n)[None, :] % 3
                want = {pc.SUM: ranks.sum(0), pc.MAX: ranks.max(0),
                        pc.PRODUCT: ranks.prod(0)}[op].astype(dtype)
                for a in results:
                    np.testing.assert_array_equal(a, want)
                # Every rank views every peer: a stage or a pooled array, each one.
                assert _hits() - before >= size * (size - 1), (n, dtype, pooled)
    finally:
        g.close()


def test_the_bound_decides_which_arrays_are_staged(stage_bound):
    """2 x ranks x bytes <= the bound: staged (views); above it, or with no bound, the peers
    copy with cross-memory attach (no view), and the result is the same."""
    g = ThreadGroup(2, transport="shm")
    try:
        stage_bound(2 * 2 * 4096)
        for n, staged in ((1024, True), (1025, False)):
            for bound in (2 * 2 * 4096, 0):
                stage_bound(bound)

                def body(ctx):
                    a = np.full(n, ctx.rank + 1, np.float32)
                    ctx.allreduce(a, algorithm="direct")
                    return a

                before = _hits()
                for a in g.run(body):
                    np.testing.assert_array_equal(a, np.full(n, 3, np.float32))
                assert (_hits() > before) == (staged and bound > 0), (n, bound)
    finally:
        g.close()


def test_the_stage_is_kept_between_calls_and_grows_once(stage_bound):
    """One block per transport, reused; a larger buffer gets a larger one (the old pages
    go back), so the pool holds one block per rank, not one per call."""
    g = ThreadGroup(2, transport="shm")
    try:
        def call(n):
            def body(ctx):
                a = np.ones(n, np.float32)
                ctx.allreduce(a, algorithm="direct")
                assert a[0] == 2 and a[-1] == 2
            g.run(body)

        gc.collect()        # earlier tests' transports give their stages back now, not later
        base = shared.pool_used()
        call(1000)
        held = shared.pool_used() - base
        assert held == 2 * 4096, held            # 4000 bytes: a page per rank
        for _ in range(5):
            call(1000)
        assert shared.pool_used() - base == held
        call(5000)                               # 20000 bytes: 32 KiB per rank
        assert shared.pool_used() - base == 2 * 32768
    finally:
        g.close()


def test_a_sub_group_stages_through_its_parent():
    """Ranks 1 and 3 of four: the group's transport stages, its peers map the stage through
    the parent's pairs, and the sum is exact."""
    g = ThreadGroup(4, transport="shm")
    try:
        def body(ctx):
            sub = ctx.new_group([1, 3])
            if ctx.rank not in (1, 3):
                return None
            a = np.arange(100003, dtype=np.float64) + ctx.rank
            sub.allreduce(a, algorithm="direct")
            return a

        before = _hits()
        results = g.run(body)
        assert _hits() - before >= 2
        for r in (1, 3):
            np.testing.assert_array_equal(results[r], 2 * np.arange(100003) + 4)
    finally:
        g.close()


_PLAIN = shm_ranks(2, r"""
n = (1 << 18) + 3
ok = True
for step in range(10):
    a = np.arange(n, dtype=np.float32) % 7 + rank + step
    ctx.allreduce(a, algorithm="direct")
    ok &= bool(np.array_equal(a, 2 * (np.arange(n, dtype=np.float32) % 7) + 1 + 2 * step))
mapped, hits = shared.view_stats()
ctx.close()
print(json.dumps({"ok": ok, "mapped": mapped, "hits": hits}))
""")


def test_processes_stage_plain_arrays_in_their_pools(tmp_path):
    """Two processes on plain arrays: each maps the other's pool once and reduces from the
    peer's stage on every call."""
    for res in last_json(run_script(tmp_path, _PLAIN, size=2), (0, 1), timeout=120):
        assert res["ok"], res
        assert res["mapped"] == 1, res
        assert res["hits"] >= 10, res


_STAGED_VICTIM = _VICTIM.replace("buf = np.ones(4 << 20, np.float32)",
                                 "buf = np.ones(1 << 18, np.float32)")


def test_a_staged_rank_killed_during_direct_allreduces(tmp_path):
    """Peers reduce from the dead rank's stage, whose pages stay mapped: the end of its
    stream still fails them with PeerError naming it."""
    assert _STAGED_VICTIM != _VICTIM
    run_victims(tmp_path, _STAGED_VICTIM.replace("SIGNAL", "SIGKILL").replace("TIMEOUT", "30"))


def test_a_stopped_staged_rank_fails_its_peers_at_the_deadline(tmp_path):
    run_victims(tmp_path, _STAGED_VICTIM.replace("SIGNAL", "SIGSTOP").replace("TIMEOUT", "3"),
                stopped=True, bound_s=3 + 5, min_s=2.5)     # at the deadline, not before


_NO_POOL = r"""
import json, os, resource, sys
# An address space of 16 GiB: the pool's 64 GiB (PYCOLLECT_POOL_BYTES, 2^46 at most) cannot
# be mapped
resource.setrlimit(resource.RLIMIT_AS, (16 << 30, 16 << 30))
import numpy as np
import pycollect as pc
from pycollect import shared
rank, store = int(sys.argv[1]), sys.argv[2]
ctx = pc.init(rank=rank, size=2, store=store, timeout=30, transport="shm")
a = np.full(1000, rank + 1, np.float32)
ctx.allreduce(a, algorithm="direct")            # no pool to stage in: cross-memory attach
errors = []
for _ in range(2):                              # the second ask gets the same answer
    try:
        pc.empty(10)
    except pc.InvalidArgument as exc:
        errors.append(str(exc))
ctx.close()
print(json.dumps({"ok": bool(np.all(a == 3)), "views": shared.view_stats(),
                  "used": shared.pool_used(), "errors": errors}))
"""


def test_a_pool_that_cannot_be_made_leaves_plain_arrays_to_cross_memory_attach(tmp_path,
                                                                               monkeypatch):
    """PYCOLLECT_POOL_BYTES larger than the address space: ``pc.empty`` raises naming the
    setting (each time), and a direct allreduce on plain arrays still runs, unstaged."""
    monkeypatch.setenv("PYCOLLECT_POOL_BYTES", str(64 << 30))
    for res in last_json(run_script(tmp_path, _NO_POOL, size=2), (0, 1), timeout=120):
        assert res["ok"], res
        assert res["views"] == [0, 0] and res["used"] == 0, res
        assert len(res["errors"]) == 2, res
        for message in res["errors"]:
            assert "cannot be made" in message and "PYCOLLECT_POOL_BYTES" in message, res


@pytest.mark.parametrize("size", [2, 3])
def test_every_chunk_size_reduces_exactly(size, stage_bound):
    """The mapped chunk (set_mapped_chunk_bytes) cut anywhere: one element, a size that is
    not a multiple of the element, the default, a whole slice; staged and pooled arrays
    end with the same exact sums."""
    from pycollect._ext._allreduce import set_mapped_chunk_bytes
    default = set_mapped_chunk_bytes(0)
    set_mapped_chunk_bytes(default)
    assert 4096 <= default <= 65536          # small enough to stay in the first-level cache
    g = ThreadGroup(size, transport="shm")
    n = 50021
    try:
        for chunk in (1, 12, default, 1 << 20):
            for pooled in ([False] * size, [True] * size):
                def body(ctx):
                    r = ctx.rank
                    a = pc.empty(n, np.int64) if pooled[r] else np.empty(n, np.int64)
                    a[:] = np.arange(n) * (r + 1)
                    ctx.allreduce(a, algorithm="direct")
                    return a

                before = _hits()
                old = set_mapped_chunk_bytes(chunk)
                try:
                    results = g.run(body)
                finally:
                    set_mapped_chunk_bytes(old)
                want = np.arange(n) * (size * (size + 1) // 2)
                for a in results:
                    np.testing.assert_array_equal(a, want)
                assert _hits() - before >= size * (size - 1), (chunk, pooled)
    finally:
        g.close()
