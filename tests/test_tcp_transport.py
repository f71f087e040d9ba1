"""The TCP transport's rendezvous: interface choice, IPv4 and IPv6, refusals."""

import numpy as np
import pytest

import pycollect as pc
from group import ThreadGroup
from pycollect.plugins import hosts, interfaces


def _sum_check(g):
    res = g.run(lambda ctx: ctx.allreduce(np.full(1000, ctx.rank + 1.0)))
    for r in res:
        assert np.all(r == g.size * (g.size + 1) / 2)


@pytest.mark.parametrize("interface", ["127.0.0.1", "::1", "lo"])
def test_listen_on_the_chosen_interface(interface):
    g = ThreadGroup(3, interface=interface)
    try:
        _sum_check(g)
        addr = g.contexts[0]._transport.peer_address(1)
        if interface == "::1":
            assert addr.startswith("[::1]:"), addr
        else:
            assert addr.startswith("127.0.0.1:"), addr
    finally:
        g.close()


def test_interface_from_the_environment(monkeypatch):
    monkeypatch.setenv("PYCOLLECT_SOCKET_IFNAME", "lo")
    assert interfaces.choose_address(None, None)[0] == "127.0.0.1"
    monkeypatch.setenv("PYCOLLECT_SOCKET_IFNAME", "::1")
    assert interfaces.choose_address(None, None)[0] == "::1"


def test_an_argument_beats_the_environment(monkeypatch):
    monkeypatch.setenv("PYCOLLECT_SOCKET_IFNAME", "lo")
    assert interfaces.choose_address("::1", None)[0] == "::1"


def test_unknown_interface_is_named():
    with pytest.raises(pc.InvalidArgument, match="no-such-if0"):
        interfaces.choose_address("no-such-if0", None)


def test_default_routes_to_the_store_host():
    class FakeStore:
        host = "127.0.0.2"
    addr, why = interfaces.choose_address(None, FakeStore())
    assert addr.startswith("127.") and "127.0.0.2" in why


def test_loopback_is_refused_when_the_job_spans_hosts():
    addrs = [{"host": "127.0.0.1", "port": 1, "hostid": "a"},
             {"host": "198.18.0.2", "port": 1, "hostid": "b"}]
    with pytest.raises(pc.InvalidArgument, match="PYCOLLECT_SOCKET_IFNAME"):
        hosts.check_host_table(1, addrs)
    hosts.check_host_table(0, [dict(a, hostid="same") for a in addrs])


def test_segment_size_from_the_environment(monkeypatch):
    monkeypatch.setenv("PYCOLLECT_MAX_SEGMENT_BYTES", "128")
    g = ThreadGroup(2)
    try:
        assert g.contexts[0]._segment_bytes == 128
        res = g.run(lambda ctx: ctx.allreduce(np.arange(5000.0), algorithm="ring_chunked"))
        assert np.array_equal(res[0], 2 * np.arange(5000.0))
    finally:
        g.close()


def test_many_contexts_on_one_store_stay_apart():
    """Contexts opened one after another through one store get their own namespace."""
    from group import run_ranks
    opened = []
    try:
        for _ in range(3):
            ctxs = run_ranks(2, lambda r: pc.init(rank=r, size=2, store="hash://one-store"))
            opened.append(ctxs)
        for ctxs in opened:
            res = run_ranks(2, lambda r: ctxs[r].allreduce(np.full(10, r + 1.0)))
            assert all(np.all(x == 3.0) for x in res)
    finally:
        for ctxs in opened:
            for ctx in ctxs:
                ctx.close()


def test_ranks_may_spell_the_store_differently():
    """One embedded TCP store reached as localhost by one rank, 127.0.0.1 by the other."""
    import socket
    from group import run_ranks
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    urls = ["tcp://127.0.0.1:%d" % port, "tcp://localhost:%d" % port]
    ctxs = run_ranks(2, lambda r: pc.init(rank=r, size=2, store=urls[r], timeout=20))
    try:
        res = run_ranks(2, lambda r: ctxs[r].allreduce(np.full(4, r + 1.0)))
        assert all(np.all(x == 3.0) for x in res)
    finally:
        for c in reversed(ctxs):
            c.close()
