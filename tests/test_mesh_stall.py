"""A rank that stalls between its connect and its hello, past the grace the accepting rank
gives a connection without one (``STRANGER_GRACE_S``, shortened here), is dropped as a
stranger would be; it connects again within its deadline and the job goes on."""

import logging
import time

import numpy as np
import pytest

import pycollect as pc
from group import run_ranks
from pycollect.plugins import mesh

GRACE_S = 0.3
_stores = iter(range(1 << 30))


def _tls_settings(tmp_path_factory):
    pytest.importorskip("pycollect._ext._tls", reason="built only where OpenSSL's headers exist")
    from tls_certs import MISSING, Authority
    if MISSING:
        pytest.skip("cannot make test certificates: " + MISSING)
    ca = Authority(str(tmp_path_factory.mktemp("pki")))
    return [{"transport": "tcp+tls", "tls_cert": cert, "tls_key": key, "tls_ca": ca.ca_file}
            for cert, key in (ca.issue("rank%d" % r) for r in range(2))]


@pytest.mark.parametrize("transport, stage", [("tcp", "hello"), ("tcp+tls", "hello"),
                                              ("tcp+tls", "handshake")])
def test_a_rank_that_stalls_before_its_hello_connects_again(
        transport, stage, monkeypatch, caplog, tmp_path_factory):
    settings = (_tls_settings(tmp_path_factory) if transport == "tcp+tls"
                else [{"transport": "tcp"}] * 2)
    monkeypatch.setattr(mesh, "STRANGER_GRACE_S", GRACE_S)
    # Rank 1's first connection to rank 0 stalls before the TLS handshake or the hello.
    name = "_connect_tls" if stage == "handshake" else "hello"
    original, stalled = getattr(mesh.Mesh, name), []

    def stall(self, *args):
        if self.rank == 1 and not stalled:
            stalled.append(True)
            time.sleep(2 * GRACE_S)
        return original(self, *args)

    monkeypatch.setattr(mesh.Mesh, name, stall)
    store = "hash://stall-%d" % next(_stores)
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="pycollect.tcp"):
        contexts = run_ranks(2, lambda r: pc.init(rank=r, size=2, store=store, timeout=10,
                                                  **settings[r]), timeout=30)
    try:
        assert time.monotonic() - start < 5
        assert stalled
        got = run_ranks(2, lambda r: contexts[r].allreduce(np.ones(3)).tolist(), timeout=30)
        assert got == [[2.0] * 3] * 2
    finally:
        for ctx in contexts:
            ctx.close()
    assert "rank 0: dropped a connection from 127.0.0.1:" in caplog.text
    assert "no hello within %g s" % GRACE_S in caplog.text
    assert "rank 1: rank 0 at 127.0.0.1:" in caplog.text and "connecting again" in caplog.text

