"""Context.shrink and Context.agree (pycollect/recovery.py, recover() in _tcp.pyx): the
survivors of a lost rank go on over the same connections, over every transport, for
sub-groups, on purpose with ``exclude``, and after SIGKILL or SIGSTOP of real processes."""

import itertools
import os
import subprocess
import sys
import time

import numpy as np
import pytest

import pycollect as pc
from group import outcomes, run_ranks
from jobs import last_json
from tls_certs import MISSING, Authority

HERE = os.path.dirname(os.path.abspath(__file__))
_stores = itertools.count()


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    if MISSING:
        pytest.skip(MISSING)
    ca = Authority(str(tmp_path_factory.mktemp("pki")))
    return ca, [ca.issue("rank%d" % r) for r in range(4)]


def _open(size, transport, pki=None, timeout=10):
    store = "hash://shrink-%d" % next(_stores)

    def init(r):
        extra = {}
        if transport == "tcp+tls":
            ca, certs = pki
            extra = dict(tls_cert=certs[r][0], tls_key=certs[r][1], tls_ca=ca.ca_file)
        return pc.init(rank=r, size=size, store=store, transport=transport, timeout=timeout,
                       **extra)
    return run_ranks(size, init, timeout=60)


def _sums(ctxs, ranks_of):
    """Each context's allreduce of (its old rank + 1) over 1000 floats."""
    return outcomes(len(ctxs), lambda i: ctxs[i].allreduce(
        np.full(1000, ranks_of[i] + 1.0))[0], timeout=60)


@pytest.mark.parametrize("transport", ["tcp", "shm", "tcp+tls"])
def test_survivors_shrink_after_a_rank_leaves(transport, request):
    pki = request.getfixturevalue("pki") if transport == "tcp+tls" else None
    ctxs = _open(4, transport, pki)
    try:
        ctxs[2].close()         # rank 2 leaves: its peers see the end of its streams
        alive = [0, 1, 3]
        errors = outcomes(3, lambda i: ctxs[alive[i]].allreduce(np.ones(1000)), timeout=60)
        assert all(isinstance(e, pc.PeerError) for e in errors), errors
        new = outcomes(3, lambda i: ctxs[alive[i]].shrink(timeout=5), timeout=60)
        assert [(c.rank, c.size) for c in new] == [(0, 3), (1, 3), (2, 3)], new
        assert _sums(new, alive) == [7.0, 7.0, 7.0]
        got = outcomes(3, lambda i: new[i].broadcast(np.full(5, float(i)), root=2)[0],
                       timeout=60)
        assert got == [2.0, 2.0, 2.0]
        with pytest.raises(pc.PeerError, match="cannot be used"):
            ctxs[0].barrier()
        for c in new:
            c.close()
    finally:
        for c in ctxs:
            c.close()


def test_shrink_with_exclude_on_a_healthy_context():
    ctxs = _open(4, "auto")
    try:
        new = outcomes(4, lambda r: ctxs[r].shrink(exclude=[1]), timeout=60)
        assert new[1] is None
        kept = [new[0], new[2], new[3]]
        assert [(c.rank, c.size) for c in kept] == [(0, 3), (1, 3), (2, 3)]
        assert _sums(kept, [0, 2, 3]) == [8.0, 8.0, 8.0]
        got = outcomes(3, lambda i: kept[i].allgather(np.array([i * 10.0])).ravel().tolist(),
                       timeout=60)
        assert got == [[0.0, 10.0, 20.0]] * 3
        assert isinstance(ctxs[1].failed, pc.Aborted)
        for c in kept:
            c.close()
        with pytest.raises(pc.InvalidArgument, match="excluded rank 9"):
            ctxs[1].shrink(exclude=[9])
    finally:
        for c in ctxs:
            c.close()


def test_shrink_a_sub_group():
    ctxs = _open(4, "auto")
    try:
        groups = run_ranks(4, lambda r: ctxs[r].new_group([0, 2, 3]), timeout=60)
        assert groups[1] is None
        groups[3].close()
        ctxs[3].close()
        members = [0, 2]
        errors = outcomes(2, lambda i: groups[members[i]].allreduce(np.ones(10)), timeout=60)
        assert all(isinstance(e, pc.PeerError) for e in errors), errors
        new = outcomes(2, lambda i: groups[members[i]].shrink(timeout=5), timeout=60)
        assert [(c.rank, c.size) for c in new] == [(0, 2), (1, 2)]
        assert _sums(new, members) == [4.0, 4.0]
        for c in new:
            c.close()
    finally:
        for c in ctxs:
            c.close()


@pytest.mark.parametrize("transport", ["tcp", "auto"])
def test_a_sub_groups_recovery_leaves_its_parent_whole(transport):
    """agree and shrink on a sub-group resync its members' pairs alone: the parent's pairs
    to other ranks stay open, the parent's flags stay (ranks 0 and 1 once took another
    algorithm than rank 2, which then timed out), and a shrink of the parent afterwards
    keeps every rank (it once split 0 and 1 from 2, each side computing its own sums)."""
    ctxs = _open(3, transport)
    try:
        groups = run_ranks(3, lambda r: ctxs[r].new_group([0, 1]), timeout=60)
        assert outcomes(2, lambda r: groups[r].agree(True), timeout=60) == [True] * 2
        assert _sums(ctxs, range(3)) == [6.0] * 3
        assert _sums(groups[:2], range(2)) == [3.0] * 2
        shrunk = outcomes(2, lambda r: groups[r].shrink(timeout=5), timeout=60)
        assert [(c.rank, c.size) for c in shrunk] == [(0, 2), (1, 2)]
        assert _sums(ctxs, range(3)) == [6.0] * 3
        new = outcomes(3, lambda r: ctxs[r].shrink(timeout=5), timeout=60)
        assert [(c.rank, c.size) for c in new] == [(0, 3), (1, 3), (2, 3)]
        assert _sums(new, range(3)) == [6.0] * 3
        assert _sums(shrunk, range(2)) == [3.0] * 2     # the group's own context goes on
        for c in new + shrunk:
            c.close()
    finally:
        for c in ctxs:
            c.close()


@pytest.mark.parametrize("transport", ["tcp", "auto"])
def test_a_sub_groups_agree_leaves_the_parents_sends_in_flight(transport):
    """Rank 0's async send to rank 2, outside the group, is still in flight when the group
    of 0 and 1 agrees: the recovery left that pair's request, and the group's next
    collectives reused its slot (rank 2 read freed memory, or timed out, while the send
    reported success)."""
    ctxs = _open(3, transport)
    try:
        groups = run_ranks(3, lambda r: ctxs[r].new_group([0, 1]), timeout=60)
        count = 1 << 21         # 16 MiB: in flight over TCP too (the sockets hold 8 MiB)

        def body(r):
            if r == 2:
                time.sleep(1.0)
                got = np.zeros(count)
                ctxs[2].recv(got, 0, tag=5)
                return got[0], got[-1]
            sent = None
            if r == 0:
                sent = ctxs[0].send(np.full(count, 7.0), 2, tag=5, async_op=True)
            assert groups[r].agree(True)
            sums = [groups[r].allreduce(np.full(count, 1.0 + r))[0] for _ in range(3)]
            if sent is not None:
                sent.wait(timeout=10)
            return sums
        assert outcomes(3, body, timeout=60) == [[3.0] * 3, [3.0] * 3, (7.0, 7.0)]
    finally:
        for c in ctxs:
            c.close()


def test_an_abort_not_yet_raised_fails_the_context_and_the_agree_goes_on():
    """abort() on an idle context: the context is failed (it was forgotten: the agree reset
    it, and it went on), and the agree, which runs on failed contexts, still runs with
    every rank (raised there, it left the peer waiting for this rank to its deadline, each
    then alone)."""
    ctxs = _open(2, "auto")
    try:
        ctxs[0].abort()
        assert outcomes(2, lambda r: ctxs[r].agree(True), timeout=60) == [True, True]
        assert isinstance(ctxs[0].failed, pc.Aborted) and ctxs[1].failed is None
        assert [c._transport.unreachable() for c in ctxs] == [[], []]
        again = outcomes(2, lambda r: ctxs[r].agree(True), timeout=60)
        assert again == [True, True], again
        new = outcomes(2, lambda r: ctxs[r].shrink(timeout=5), timeout=60)
        assert [(c.rank, c.size) for c in new] == [(0, 2), (1, 2)]
        assert _sums(new, range(2)) == [3.0, 3.0]
        for c in new:
            c.close()
        for what in (lambda c: c.shrink(timeout=float("inf")),
                     lambda c: c.agree(True, timeout=1e10)):
            with pytest.raises(pc.InvalidArgument, match="at most 2000000"):
                what(ctxs[0])
        groups = run_ranks(2, lambda r: ctxs[r].new_group([0, 1]), timeout=60)
        ctxs[0].close()
        for closed in (ctxs[0], groups[0]):     # a group of a closed parent: a bare ValueError
            with pytest.raises(pc.Error, match="the context is closed"):
                closed.agree(True)
    finally:
        for c in ctxs:
            c.close()


def test_agree():
    ctxs = _open(4, "auto")
    try:
        assert outcomes(4, lambda r: ctxs[r].agree(True), timeout=60) == [True] * 4
        assert outcomes(4, lambda r: ctxs[r].agree(r != 2), timeout=60) == [False] * 4
        assert _sums(ctxs, range(4)) == [10.0] * 4      # the context goes on after agree
        ctxs[1].close()
        alive = [0, 2, 3]
        # One rank dead: the live ones still agree, and the context is failed.
        assert outcomes(3, lambda i: ctxs[alive[i]].agree(True), timeout=60) == [True] * 3
        assert all(isinstance(ctxs[r].failed, pc.PeerError) for r in alive)
        assert outcomes(3, lambda i: ctxs[alive[i]].agree(alive[i] != 3), timeout=60) \
            == [False] * 3
        new = outcomes(3, lambda i: ctxs[alive[i]].shrink(timeout=5), timeout=60)
        assert [c.size for c in new] == [3, 3, 3]
        for c in new:
            c.close()
    finally:
        for c in ctxs:
            c.close()


def test_decide_leaves_out_one_end_of_a_broken_link():
    from pycollect.recovery import decide
    rows = np.zeros((4, 5), np.int8)
    rows[:, 0] = 1
    rows[3] = -1                  # rank 3: nobody heard from it
    rows[0, 4] = rows[1, 4] = rows[2, 4] = 1
    rows[0, 2] = rows[1, 1] = 1   # ranks 0 and 1 lost their link
    assert decide(rows) == ([0, 2], True)
    rows[2, 0] = 0
    assert decide(rows) == ([0, 2], False)


def _processes(tmp_path, size, collective, mode, hosts=None, transport=None):
    """Run shrink_worker.py on ``size`` ranks (rank r on host ``hosts[r]`` when given, over
    ``transport`` when given)."""
    store = "file://%s" % (tmp_path / "store")

    def env(r):
        extra = {"PYCOLLECT_HOST_ID": hosts[r]} if hosts else {}
        if transport:
            extra["PYCOLLECT_TRANSPORT"] = transport
        return dict(os.environ, **extra) if extra else None
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "shrink_worker.py"), str(r),
                               str(size), store, collective, mode],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env(r))
             for r in range(size)]
    return last_json(procs, range(size - (2 if mode == "second" else 1)), 90)


@pytest.mark.parametrize("collective", ["allreduce", "broadcast", "alltoall"])
def test_sigkill_mid_collective_then_shrink(tmp_path, collective):
    results = _processes(tmp_path, 4, collective, "kill")
    assert [(r["size"], r["rank"]) for r in results] == [(3, 0), (3, 1), (3, 2)], results
    assert all(r["correct"] and r["old_failed"] and r["error"] == "PeerError"
               for r in results), results
    assert all(r["agree"] is False for r in results), results     # rank 0 voted False


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_survivors_in_the_middle_of_messages_to_each_other_all_go_on(tmp_path, transport):
    # Rank 3 dies 10 ms into an alltoall of 16 MiB blocks: the survivors fail in the middle
    # of their messages to each other.  Each finishes those before it tells the peer (a
    # peer that reads late gets the rest from recover()), so no pair among them is broken
    # and every survivor is in the shrunk group.  Over TCP on 2 cores, a survivor often
    # notices the death more than FINISH_MS after the first one: before recover() wrote
    # the rest, the first one then broke its pairs and was left out, in most runs.
    results = _processes(tmp_path, 4, "alltoall-large", "kill", transport=transport)
    assert [(r["size"], r["rank"]) for r in results] == [(3, 0), (3, 1), (3, 2)], results
    assert all(r["correct"] and r["old_failed"] and r["error"] == "PeerError"
               for r in results), results


def test_sigkill_then_shrink_across_two_hosts(tmp_path):
    # Ranks 0-1 and 2-3 are two hosts: TCP between them, shared memory inside, and a
    # hierarchical allreduce (512 KiB) before and after the shrink.
    results = _processes(tmp_path, 4, "allreduce", "kill", hosts=["h0", "h0", "h1", "h1"])
    assert [(r["size"], r["rank"]) for r in results] == [(3, 0), (3, 1), (3, 2)], results
    assert all(r["correct"] for r in results), results
    assert all(r["algorithm"] == "hierarchical" for r in results), results


def test_sigstop_deadline_then_shrink_excludes_the_stopped_rank(tmp_path):
    start = time.monotonic()
    results = _processes(tmp_path, 4, "allreduce", "stop")
    assert [(r["size"], r["rank"]) for r in results] == [(3, 0), (3, 1), (3, 2)], results
    assert all(r["correct"] for r in results), results
    assert {r["error"] for r in results} <= {"Timeout", "PeerError"}, results
    assert time.monotonic() - start < 60


def test_a_second_rank_dies_during_the_shrink(tmp_path):
    results = _processes(tmp_path, 5, "allreduce", "second")
    assert [(r["size"], r["rank"]) for r in results] == [(3, 0), (3, 1), (3, 2)], results
    assert all(r["correct"] for r in results), results


def test_the_elastic_example_finishes_with_the_clean_runs_model():
    # Seed 6 kills rank 0 at step 8 of 12: the new rank 0 reports.
    example = os.path.join(os.path.dirname(HERE), "examples", "elastic.py")
    out = subprocess.run([sys.executable, example, "--seed", "6", "--steps", "12"],
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines[0] == "4 ranks, 12 steps; rank 0 is killed at step 8", lines
    assert "the survivors went on at size 3 from step 8" in lines, lines
    assert lines[-1] == "clean 3-rank run from step 8: identical", lines
