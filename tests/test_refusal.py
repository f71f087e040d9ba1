"""A rank that refuses its arguments to an array collective tells its peers (a refused
frame, pycollect/_ext/_engine.pyx): it raises its InvalidArgument, every rank that waits
on it fails at once with a MismatchError naming it, the call and the reason, and what
happens next is what docs/errors.md says (a rank that was only sending to it goes on)."""

import re

import numpy as np
import pytest

import pycollect as pc
from group import ThreadGroup

TIMEOUT = 60        # the contexts' deadline; each call below must end long before it
BOUND = 20          # ... the test's bound on a whole case


@pytest.fixture(params=["tcp", "shm"])
def trio(request):
    group = ThreadGroup(3, timeout=TIMEOUT, transport=request.param)
    group.transport = request.param
    yield group
    group.close()


def _ones(n, ctx):
    return np.full(n, ctx.rank + 1.0)


def _read_only(n):
    out = np.zeros(n)
    out.flags.writeable = False
    return out


# (call, the refusing rank, the ranks that must wait on it, the collective).  Whether the
# others wait depends on the algorithm (a broadcast's root waits for its leaves on the
# shared-memory flags path, not over TCP): each either returns or fails naming the refusal.
CASES = {
    "allgather recvbuf": (lambda ctx: ctx.allgather(
        _ones(2, ctx), np.zeros(5) if ctx.rank == 1 else None), 1, {0, 2}, "allgather"),
    "allgatherv counts": (lambda ctx: ctx.allgatherv(
        _ones(2, ctx), None, [2, 2, 2] if ctx.rank != 2 else [2, 2]), 2, {0, 1}, "allgatherv"),
    "gatherv counts off root": (lambda ctx: ctx.gatherv(
        _ones(2, ctx), None, [2, 2, 2] if ctx.rank != 1 else [2, 2]), 1, {0}, "gatherv"),
    "gatherv recvbuf on root": (lambda ctx: ctx.gatherv(
        _ones(2, ctx), np.zeros(5) if ctx.rank == 0 else None, [2, 2, 2]), 0, set(),
        "gatherv"),
    "gather root": (lambda ctx: ctx.gather(_ones(2, ctx), root=0 if ctx.rank != 1 else 3),
                    1, {0}, "gather"),
    "scatterv sendbuf on root": (lambda ctx: ctx.scatterv(
        np.ones(6 if ctx.rank else 5), [2, 2, 2]), 0, {1, 2}, "scatterv"),
    "scatter read-only recvbuf": (lambda ctx: ctx.scatter(
        np.ones(6), _read_only(2) if ctx.rank == 2 else None), 2, set(), "scatter"),
    "reduce_scatter recvbuf": (lambda ctx: ctx.reduce_scatter(
        np.ones(6), np.zeros(1) if ctx.rank == 0 else None), 0, {1, 2}, "reduce_scatter"),
    "reduce_scatterv counts": (lambda ctx: ctx.reduce_scatterv(
        np.ones(6), None, [2, 2, 2] if ctx.rank != 2 else [2, 2, "x"]), 2, {0, 1},
        "reduce_scatterv"),
    "alltoall sendbuf": (lambda ctx: ctx.alltoall(np.ones(6 if ctx.rank else 5)), 0, {1, 2},
                         "alltoall"),
    "alltoallv counts": (lambda ctx: ctx.alltoallv(
        np.ones(3), [1, 1, 1], None, [1, 1, 1] if ctx.rank != 1 else [1, 1]), 1, {0, 2},
        "alltoallv"),
    "allreduce op": (lambda ctx: ctx.allreduce(_ones(3, ctx), op=99 if ctx.rank == 2 else
                                               pc.SUM), 2, {0, 1}, "allreduce"),
    "allreduce AVG on int (the compiled path)": (lambda ctx: ctx.allreduce(
        np.ones(3, np.int32 if ctx.rank == 1 else np.float64), op=pc.AVG), 1, {0, 2},
        "allreduce"),
    "allreduce bcube base, async": (lambda ctx: ctx.allreduce(
        _ones(3, ctx), algorithm="bcube:99" if ctx.rank == 1 else "auto",
        async_op=True).wait(), 1, {0, 2}, "allreduce"),
    "reduce dtype": (lambda ctx: ctx.reduce(
        np.ones(3, np.int32 if ctx.rank == 0 else np.float64), op=pc.AVG), 0, set(),
        "reduce"),
    "broadcast root": (lambda ctx: ctx.broadcast(_ones(2, ctx), root=0 if ctx.rank != 2 else 7),
                       2, set(), "broadcast"),
}


FLAGS_PATH = ("barrier", "broadcast", "allreduce")   # small ones, on shared memory


def _check(outcome, rank, refuser, waits, call):
    if rank == refuser:
        assert isinstance(outcome, pc.InvalidArgument), (rank, outcome)
        assert outcome.caused_elsewhere is False        # its own (pycollect-run blames it)
    elif rank in waits or isinstance(outcome, pc.Error):
        assert isinstance(outcome, pc.MismatchError), (rank, outcome)
        assert re.search(r"rank %d\b.*refused its arguments to %s #\d+" % (refuser, call),
                         str(outcome)), outcome
        assert outcome.caused_elsewhere is True         # the refuser's, not this rank's


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_peers_of_a_refusing_rank_fail_at_once_and_name_it(trio, case):
    call, refuser, waits, name = CASES[case]
    # BOUND, well under the contexts' TIMEOUT: a rank left waiting would fail the run.
    first = trio.outcomes(call, timeout=BOUND)
    for rank, outcome in enumerate(first):
        _check(outcome, rank, refuser, waits, name)
    failed = {r for r, o in enumerate(first) if r != refuser and isinstance(o, pc.Error)}
    if failed:
        assert any(str(first[refuser]) in str(first[r]) for r in failed), first  # the reason
    after = trio.outcomes(lambda ctx: ctx.allreduce(np.ones(4))[0], timeout=BOUND)
    if failed:
        # Those that failed fail their context (quoting the refusal); the others, the
        # refuser among them, learn it from them.
        assert all(isinstance(o, pc.Error) for o in after), after
        assert all("refused its arguments to %s" % name in str(after[r]) for r in failed), \
            after
    elif trio.transport == "shm" and name in FLAGS_PATH:
        # The refuser did not take the flags operation its peers took: the next one fails
        # on every rank as a disagreement (docs/errors.md).
        assert all(isinstance(o, pc.MismatchError) for o in after), after
    else:
        # Nobody waited on the refuser: every rank took the number, and goes on in step.
        assert after == [3.0, 3.0, 3.0], after


def test_every_rank_refusing_keeps_the_context_usable(trio):
    for _ in range(3):
        out = trio.outcomes(lambda ctx: ctx.allgather(np.ones(2), np.zeros(1)), timeout=BOUND)
        assert all(isinstance(o, pc.InvalidArgument) for o in out), out
    assert trio.run(lambda ctx: ctx.allreduce(np.ones(2))[0], timeout=BOUND) == [3.0] * 3


@pytest.mark.parametrize("n", [1 << 15, 1 << 23])
def test_large_messages_to_a_refusing_root(trio, n):
    # Senders whose message the channel took go on, and the root drops the messages at
    # its next call; senders left waiting on a root that never reads (64 MiB) fail at once.
    out = trio.outcomes(lambda ctx: ctx.gatherv(
        np.ones(n), np.zeros(5) if ctx.rank == 0 else None, [n] * 3), timeout=BOUND)
    assert isinstance(out[0], pc.InvalidArgument), out
    waited = {r for r in (1, 2) if out[r] is not None}
    for rank in (1, 2):
        _check(out[rank], rank, 0, waited, "gatherv")
    if n == 1 << 23:
        assert waited == {1, 2}, out
    # A barrier first: the dropped message is larger than its receive.
    after = trio.outcomes(lambda ctx: (ctx.barrier(), ctx.allreduce(np.ones(n))[n - 1])[1],
                          timeout=BOUND)
    if waited:
        assert all(isinstance(o, pc.Error) for o in after), after
    else:
        assert after == [3.0] * 3, after


def test_a_refusal_in_a_sub_group():
    group = ThreadGroup(3, timeout=TIMEOUT)
    try:
        subs = group.run(lambda ctx: ctx.new_group([1, 2]), timeout=BOUND)
        out = group.outcomes(lambda ctx: None if subs[ctx.rank] is None else
                             subs[ctx.rank].allgather(np.ones(2), np.zeros(3)
                                                      if ctx.rank == 2 else None),
                             timeout=BOUND)
        assert out[0] is None and isinstance(out[2], pc.InvalidArgument), out
        _check(out[1], 0, 1, {0}, "allgather")     # group ranks: global 1 waits on 2
        # The group's connections are its parent's: the parent failed with it.
        after = group.outcomes(lambda ctx: ctx.allreduce(np.ones(1)), timeout=BOUND)
        assert all(isinstance(o, pc.Error) for o in after), after
    finally:
        group.close()


def test_a_refusal_for_a_group_of_one_sends_nothing():
    ctx = pc.init(rank=0, size=1, store="hash://refusal-one", timeout=5)
    try:
        with pytest.raises(pc.InvalidArgument, match="gatherv"):
            ctx.gatherv(np.ones(3), None, [2])
        assert ctx.allreduce(np.ones(2))[0] == 1.0
    finally:
        ctx.close()


def test_a_refusal_relayed_back_to_its_maker_is_its_own(trio):
    """The peers that waited on the refuser fail; the refuser hears of it at its next call
    as a relay of its own refusal, which is no other rank's failure (caused_elsewhere is
    what pycollect-run blames by)."""
    first = trio.outcomes(lambda ctx: ctx.scatterv(None if ctx.rank == 0 else np.ones(6),
                                                   [2, 2, 2]), timeout=BOUND)
    assert isinstance(first[0], pc.InvalidArgument) and not first[0].caused_elsewhere, first
    after = trio.outcomes(lambda ctx: ctx.barrier(), timeout=BOUND)
    for rank, outcome in enumerate(after):
        if isinstance(outcome, pc.MismatchError) and re.search(
                r"that rank 0 refused its arguments|rank 0\b[^;]* refused its arguments",
                str(outcome)):
            assert outcome.caused_elsewhere is (rank != 0), (rank, outcome)
    assert any(isinstance(o, pc.Error) for o in after), after
