"""Every built-in channel kind passes the transport conformance suite (tests/abstract)."""

import importlib.util

import pytest

from abstract import TransportSuite
from tls_certs import Authority


class TestSocketChannel(TransportSuite):
    transport = "tcp"


class TestRingChannel(TransportSuite):
    transport = "shm"
    reads_remote = True     # thread ranks of one process may always read each other


class TestRingChannelWithoutMemoryReads(TransportSuite):
    transport = "shm"

    @pytest.fixture(autouse=True)
    def _no_reads(self, monkeypatch):
        monkeypatch.setenv("PYCOLLECT_CMA", "0")


@pytest.mark.skipif(importlib.util.find_spec("pycollect._ext._tls") is None,
                    reason="pycollect._ext._tls is built only where OpenSSL's headers exist")
class TestTlsChannel(TransportSuite):
    transport = "tcp+tls"

    @pytest.fixture(autouse=True, scope="class")
    @classmethod
    def _pki(cls, tmp_path_factory):
        ca = Authority(str(tmp_path_factory.mktemp("pki")))
        cls.certs = [ca.issue("rank%d" % r) for r in range(3)]
        cls.ca_file = ca.ca_file

    def options(self, rank):
        cert, key = self.certs[rank]
        return {"tls_cert": cert, "tls_key": key, "tls_ca": self.ca_file}
