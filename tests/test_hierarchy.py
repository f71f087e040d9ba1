"""Hierarchical collectives and host identity over mixed topologies (shared memory + TCP).

Three ways to make several "hosts" on one machine:

- threads whose host identity a test sets (fast; every shape),
- processes with ``PYCOLLECT_HOST_ID`` (what a user can do; no root needed),
- processes in network namespaces (root and ``ip``, else skipped): each
  namespace is a host because the identity includes the namespace, with no
  override; the namespaces and their addresses in 198.18.0.0/15 come from
  the ``hosts`` fixture (tests/netns.py) and are removed afterwards.
"""

import contextlib
import json
import logging
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import pycollect as pc
from group import run_ranks
from jobs import collect, stop
from pycollect import hierarchy, selection
from pycollect.context import ALLREDUCE_ALGORITHMS
from pycollect.plugins import hosts as host_table
from pycollect.plugins.hosts import boot_id, check_host_table, host_identity, machine_identity
from reference import assert_matches, make_input, ops_for, reduce_reference
from netns import SUBNET

pytestmark = pytest.mark.timeout(60)

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "hierarchy_worker.py")
JOB_TIMEOUT_S = 45
HIERARCHICAL_MIN_BYTES = selection.min_bytes("allreduce", "hierarchical")


# -- host identity -----------------------------------------------------------

def test_identity_names_the_network_namespace_and_can_be_overridden(monkeypatch):
    machine = machine_identity()
    inode = os.stat("/proc/self/ns/net").st_ino
    assert machine.endswith("/net:%d" % inode) and boot_id() in machine
    monkeypatch.delenv("PYCOLLECT_HOST_ID", raising=False)
    assert host_identity(machine) == machine
    monkeypatch.setenv("PYCOLLECT_HOST_ID", " rack3-node7 ")
    assert host_identity(machine) == "id:rack3-node7"


def test_one_override_on_two_machines_is_refused():
    addrs = [{"host": "198.18.0.1", "port": 1, "hostid": "id:x", "machine": "a", "boot": "1"},
             {"host": "198.18.0.2", "port": 1, "hostid": "id:x", "machine": "b", "boot": "2"}]
    with pytest.raises(pc.InvalidArgument, match="PYCOLLECT_HOST_ID must differ"):
        check_host_table(1, addrs)
    # Split hosts on one machine may talk over loopback: it is one machine.
    split = [dict(a, host="127.0.0.1", hostid="id:%d" % i, machine="m", boot="1")
             for i, a in enumerate(addrs)]
    check_host_table(0, split)


@pytest.mark.parametrize("table, groups, multi", [
    (["a", "a", "b", "b"], [[0, 1], [2, 3]], True),
    (["b", "a", "b", "c", "a"], [[0, 2], [1, 4], [3]], True),
    (["a", "a", "a"], [[0, 1, 2]], False),
    (["a", "b", "c"], [[0], [1], [2]], False),
    (None, [[0], [1]], False),          # a transport that knows no hosts
])
def test_topology_from_the_host_table(table, groups, multi):
    size = len(groups) if table is None else len(table)
    topo = hierarchy.Topology(0, size, table, None, 1.0)
    assert topo.hosts == groups and topo.leaders == [g[0] for g in groups]
    assert topo.multi_level is multi


# -- threads as ranks of fake hosts -----------------------------------------

@contextlib.contextmanager
def fake_hosts(monkeypatch, placement, timeout=20):
    """Contexts for ranks as threads; rank r sits on host ``placement[r]``."""
    local = threading.local()
    monkeypatch.setattr(host_table, "host_identity", lambda machine: "fake:%s" % local.host)
    store = "hash://hierarchy-%d-%d" % (os.getpid(), time.monotonic_ns())

    def join(rank):
        local.host = placement[rank]
        return pc.init(rank=rank, size=len(placement), store=store, timeout=timeout)

    contexts = run_ranks(len(placement), join, timeout=30)
    try:
        yield contexts
    finally:
        for ctx in contexts:
            ctx.close()


def _run(contexts, fn):
    return run_ranks(len(contexts), lambda r: fn(contexts[r]), timeout=40)


@pytest.mark.parametrize("placement", [
    [0, 0, 1, 1],           # 2 x 2
    [0, 1, 1, 2, 2],        # 1 + 2 + 2
    [0, 0, 0, 1],           # 3 + 1
    [0, 1, 0, 1, 0],        # hosts interleaved in rank order
])
def test_allreduce_every_algorithm_on_fake_hosts(monkeypatch, placement):
    size = len(placement)
    with fake_hosts(monkeypatch, placement) as contexts:
        kinds = contexts[0]._transport.pair_kinds()
        for peer in range(1, size):
            same = placement[peer] == placement[0]
            assert kinds[peer].startswith("shm") == same, kinds
        for name in ("float32", "int64", "float16", "complex128", "uint8"):
            for op in ops_for(name):
                for count in (0, 1, 2 * size + 1, 20000):
                    inputs = [make_input(name, count, r, op) for r in range(size)]
                    expected = reduce_reference(name, inputs, op)
                    for algo in ALLREDUCE_ALGORITHMS:
                        def body(ctx):
                            buf = inputs[ctx.rank].copy()
                            ctx.allreduce(buf, op=op, algorithm=algo)
                            return buf
                        for rank, got in enumerate(_run(contexts, body)):
                            assert_matches(name, op, got, expected,
                                           "rank %d %s %d" % (rank, algo, count))


@pytest.mark.parametrize("placement", [[0, 1, 1, 2, 2], [0, 0, 0, 1]])
def test_broadcast_hierarchical_from_every_root(monkeypatch, placement):
    with fake_hosts(monkeypatch, placement) as contexts:
        for count in (0, 3, 70000):
            for root in range(len(placement)):
                data = make_input("float64", count, root, pc.SUM, seed=7)
                data.flags.writeable = False        # the root's buffer may be read-only

                def body(ctx):
                    buf = data if ctx.rank == root else np.zeros(count)
                    work = ctx.broadcast(buf, root=root, algorithm="hierarchical",
                                         async_op=True)
                    work.wait()
                    return buf, work.algorithm
                for got, algo in _run(contexts, body):
                    assert algo == "hierarchical"
                    assert np.array_equal(got, data)


def test_auto_chooses_hierarchical_for_large_buffers_and_says_so(monkeypatch, caplog):
    big = HIERARCHICAL_MIN_BYTES // 4
    monkeypatch.setenv("PYCOLLECT_DEBUG", "1")
    with caplog.at_level(logging.DEBUG, logger="pycollect"), \
            fake_hosts(monkeypatch, [0, 0, 1, 1]) as contexts:
        def body(ctx):
            chosen = []
            for count in (4, big - 1, big):
                work = ctx.allreduce(np.ones(count, np.float32), async_op=True)
                work.wait()
                chosen.append(work.algorithm)
            bcast = ctx.broadcast(np.ones(big, np.float32), async_op=True)
            bcast.wait()
            return chosen + [bcast.algorithm]
        for chosen in _run(contexts, body):
            assert chosen[0] == "recursive_doubling"
            assert chosen[1] != "hierarchical"
            assert chosen[2] == "hierarchical"
            assert chosen[3] == "binomial"      # measured: the tree is as good on 2 x 2
    assert any("ran hierarchical" in r.getMessage() for r in caplog.records)
    assert any("hierarchy of 2 hosts" in r.getMessage() for r in caplog.records)


def test_auto_stays_flat_on_one_host_or_one_rank_per_host(monkeypatch):
    big = np.ones(HIERARCHICAL_MIN_BYTES, np.float32)
    for placement in ([0, 0, 0], [0, 1, 2]):
        with fake_hosts(monkeypatch, placement) as contexts:
            works = _run(contexts, lambda ctx: ctx.allreduce(big.copy(), async_op=True))
            for w in works:
                w.wait()
                assert w.algorithm != "hierarchical"
            # Asked for, it still runs (as a flat allreduce among hosts or inside one): every
            # rank's own data, summed and averaged.
            n = len(contexts)
            got = _run(contexts, lambda ctx: (
                ctx.allreduce(big * (ctx.rank + 1), algorithm="hierarchical"),
                ctx.allreduce(big * (ctx.rank + 1), op=pc.AVG, algorithm="hierarchical")))
            for summed, averaged in got:
                assert np.array_equal(summed, big * (n * (n + 1) // 2))
                np.testing.assert_allclose(averaged, big * ((n + 1) / 2), rtol=1e-6)


def test_bad_input_is_refused_on_every_rank_and_the_context_stays_usable(monkeypatch):
    with fake_hosts(monkeypatch, [0, 0, 1, 1]) as contexts:
        def body(ctx):
            errors = []
            for bad in (lambda: ctx.allreduce(np.ones(8, np.int32), op=pc.AVG,
                                              algorithm="hierarchical"),
                        lambda: ctx.allreduce(np.ones(8, np.float32), op=pc.BAND,
                                              algorithm="hierarchical"),
                        lambda: ctx.allreduce(np.ones(8)[::2], algorithm="hierarchical")):
                with pytest.raises(pc.InvalidArgument) as info:
                    bad()
                errors.append(str(info.value))
            ro = np.ones(8)
            ro.flags.writeable = False
            with pytest.raises(pc.InvalidArgument):
                ctx.allreduce(ro, algorithm="hierarchical")
            buf = np.full(8, ctx.rank + 1.0)
            ctx.allreduce(buf, algorithm="hierarchical")
            return errors, buf
        for errors, buf in _run(contexts, body):
            assert "AVG is defined for floating and complex types only" in errors[0]
            assert "bitwise ops need an integer" in errors[1]
            assert "C-contiguous" in errors[2], errors[2]
            assert np.all(buf == 10.0)


def test_a_rank_that_never_comes_is_named_at_the_deadline_on_every_host(monkeypatch):
    timeout = 1.5
    with fake_hosts(monkeypatch, [0, 0, 1, 1], timeout=timeout) as contexts:
        def body(ctx):
            if ctx.rank == 3:
                return None         # never calls; the others give up at their deadline
            start = time.monotonic()
            with pytest.raises((pc.Timeout, pc.PeerError)) as info:
                ctx.allreduce(np.ones(50000, np.float32), algorithm="hierarchical")
            return time.monotonic() - start, str(info.value), ctx.failed
        results = _run(contexts, body)
    for rank, (elapsed, message, failed) in enumerate(results[:3]):
        assert elapsed < timeout + 2, (rank, elapsed, message)
        assert "rank 3" in message and "hierarchical allreduce" in message, message
        assert failed is not None


def test_ranks_that_disagree_on_the_size_all_get_mismatch(monkeypatch):
    """One rank's small buffer takes a flat algorithm, the others' the hierarchy: no hang."""
    timeout = 5.0
    with fake_hosts(monkeypatch, [0, 0, 1, 1], timeout=timeout) as contexts:
        def body(ctx):
            start = time.monotonic()
            count = 1000 if ctx.rank == 0 else HIERARCHICAL_MIN_BYTES
            with pytest.raises((pc.MismatchError, pc.PeerError)) as info:
                ctx.allreduce(np.ones(count, np.float32))
            return time.monotonic() - start, info.value
        results = _run(contexts, body)
    for elapsed, exc in results:
        assert elapsed < timeout, exc
    # The ranks that meet the other side's message say so; a rank whose peer left
    # with that message still queued to it sees a departed peer.
    assert any(isinstance(exc, pc.MismatchError) for _, exc in results), results


def test_split_groups_and_user_numbering_are_untouched(monkeypatch):
    """The hierarchy's sub-groups take no number from split/new_group."""
    with fake_hosts(monkeypatch, [0, 0, 1, 1]) as contexts:
        def body(ctx):
            ctx.allreduce(np.ones(8), algorithm="hierarchical")
            made = ctx._groups_made
            sub = ctx.split(ctx.rank % 2)      # {0, 2} and {1, 3}: one rank per host
            buf = np.full(HIERARCHICAL_MIN_BYTES, ctx.rank, np.float32)
            sub.allreduce(buf, algorithm="hierarchical")
            return made, buf, sub._topology.hosts
        for rank, (made, buf, sub_hosts) in enumerate(_run(contexts, body)):
            assert made == 0
            assert np.all(buf == (0 + 2 if rank % 2 == 0 else 1 + 3))
            assert sub_hosts == [[0], [1]]


def test_hierarchical_inside_a_group_that_spans_hosts(monkeypatch):
    """A group's phases nest one GroupTransport in another: each keeps its own group id."""
    with fake_hosts(monkeypatch, [0, 0, 1, 1, 1]) as contexts:
        def body(ctx):
            sub = ctx.new_group([4, 0, 3, 1])       # hosts {4, 3} and {0, 1}
            if sub is None:
                return None
            buf = np.full(HIERARCHICAL_MIN_BYTES, ctx.rank + 1.0, np.float32)
            work = sub.allreduce(buf, async_op=True)
            work.wait()
            data = np.arange(5000.0) if sub.rank == 3 else np.zeros(5000)
            sub.broadcast(data, root=3, algorithm="hierarchical")
            return work.algorithm, buf, data, sub._topology.hosts
        results = _run(contexts, body)
    assert results[2] is None
    for algo, buf, data, hosts in filter(None, results):
        assert algo == "hierarchical" and hosts == [[0, 2], [1, 3]]
        assert np.all(buf == 1 + 2 + 4 + 5) and np.array_equal(data, np.arange(5000.0))


# -- processes -------------------------------------------------------------

def _start(rank, size, store, mode, host_env=None, netns=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYCOLLECT_")}
    env.update(PYCOLLECT_RANK=str(rank), PYCOLLECT_SIZE=str(size), PYCOLLECT_STORE=store,
               **(host_env or {}))
    command = [sys.executable, WORKER, mode, "--timeout", "20"]
    if netns is not None:
        command = ["ip", "netns", "exec", netns] + command
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL)


def _finish(procs):
    """Wait for every rank; return [(code, output)] by rank, killing any left at the end."""
    return collect(procs, time.monotonic() + JOB_TIMEOUT_S)


def _reports(results):
    reports = []
    for rank, (code, out) in enumerate(results):
        assert code == 0, "rank %d:\n%s" % (rank, out)
        reports.append(json.loads(out.strip().splitlines()[-1]))
    return reports


def _check_matrix(reports, placement):
    groups = [[r for r, h in enumerate(placement) if h == host]
              for host in dict.fromkeys(placement)]
    for rank, report in enumerate(reports):
        assert report["rank"] == rank and report["hosts"] == groups
        for peer, kind in enumerate(report["kinds"]):
            if peer == rank:
                assert kind == "self"
            elif placement[peer] == placement[rank]:
                assert kind.startswith("shm"), report
            else:
                assert kind == "tcp", report
        assert report["checks"] > 1000
        assert report["auto_allreduce"] == "hierarchical"
        assert report["auto_broadcast"] in ("binomial", "pipelined")
        assert report["auto_small"] == "recursive_doubling"


def _shm_names():
    return {n for n in os.listdir("/dev/shm") if n.startswith("pycollect-")}


def test_matrix_three_hosts_of_one_two_and_two_ranks_by_override():
    """1 + 2 + 2 ranks split by PYCOLLECT_HOST_ID on one machine (loopback between hosts)."""
    placement = ["h1", "h2", "h2", "h3", "h3"]
    store = "tcp://127.0.0.1:%d" % (20000 + os.getpid() % 20000)
    procs = [_start(r, len(placement), store, "matrix", {"PYCOLLECT_HOST_ID": h})
             for r, h in enumerate(placement)]
    _check_matrix(_reports(_finish(procs)), placement)


def test_a_large_shared_memory_send_fails_at_once_when_its_reader_exits():
    """The sender waits for the reader to copy from its memory; the reader's exit ends that."""
    before = _shm_names()
    store = "tcp://127.0.0.1:%d" % (20000 + (os.getpid() + 7) % 20000)
    results = _finish([_start(r, 2, store, "leave") for r in range(2)])
    code, out = results[0]
    assert code == 0 and "FAILED PeerError" in out, out
    assert "rank 1" in out, out
    assert float(out.split("FAILED PeerError ")[1].split()[0]) < 5, out
    assert _shm_names() - before == set()


def _netns_job(names, placement, mode):
    store = "tcp://%s.1:%d" % (SUBNET, 29500)
    return [_start(r, len(placement), store, mode, netns=names[h - 1])
            for r, h in enumerate(placement)]


def test_matrix_two_namespace_hosts_of_two_ranks(hosts):  # noqa: F811
    placement = [1, 1, 2, 2]
    _check_matrix(_reports(_finish(_netns_job(hosts, placement, "matrix"))), placement)


@pytest.mark.parametrize("victim", [1, 2])
def test_a_rank_killed_on_one_host_fails_the_other_hosts_fast(hosts, victim):  # noqa: F811
    """Rank ``victim`` (a non-leader on host 1, or host 2's leader) dies mid-allreduce."""
    before = _shm_names()
    procs = _netns_job(hosts, [1, 1, 2, 2], "loop")
    try:
        for rank, proc in enumerate(procs):
            line = proc.stdout.readline().decode()
            assert line.startswith("READY"), "rank %d: %s" % (rank, line)
        time.sleep(0.3)
        procs[victim].kill()
        killed = time.monotonic()
        results = _finish(procs)
    finally:
        stop(procs)
    elapsed = time.monotonic() - killed
    assert elapsed < 5, "the survivors took %.1f s" % elapsed
    for rank, (code, out) in enumerate(results):
        if rank == victim:
            continue
        assert code == 0 and "FAILED PeerError" in out, "rank %d:\n%s" % (rank, out)
    time.sleep(0.2)
    assert _shm_names() - before == set()
