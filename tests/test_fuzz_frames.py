"""Whatever bytes a connected peer sends, a receive ends in a clear error: no crash,
no hang, nothing allocated from a size read off the wire."""

import os
import socket
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pycollect as pc
from pycollect._ext import _allreduce, _p2p
from pycollect._ext._engine import Engine
from pycollect._ext._socket import SocketChannel

HEADER = struct.Struct("<IIIBBBBiIQQ")     # the 40-byte message header
MAGIC_DATA, MAGIC_ABORT = 0x314D4350, 0x414D4350
RD = _allreduce.ALGORITHMS["recursive_doubling"]


def _resident_kib():
    """This process's resident memory now (not its lifetime peak, which only grows)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * (os.sysconf("SC_PAGE_SIZE") // 1024)


def _receive_from(payload, close=True):
    """Rank 0 of a 2-rank transport whose peer sends ``payload``; return what recv raised."""
    ours, theirs = socket.socketpair()
    t = Engine(0, 2, [None, SocketChannel(ours.detach())], ["self", "fuzzer"], spin_us=0)
    try:
        theirs.sendall(payload)
        if close:
            theirs.shutdown(socket.SHUT_WR)
        with pytest.raises(pc.Error) as info:
            _allreduce.allreduce(t, np.ones(4, np.float32), 0, RD, 1, 2.0, 1 << 20)
        return info.value
    finally:
        t.close()
        theirs.close()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=200))
def test_random_bytes(payload):
    exc = _receive_from(payload)
    assert isinstance(exc, (pc.PeerError, pc.MismatchError)), exc
    assert "rank 1" in str(exc)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(magic=st.sampled_from([MAGIC_DATA, MAGIC_ABORT, 0, 0xFFFFFFFF]),
       msgno=st.integers(0, 2**32 - 1), seq=st.integers(0, 2**32 - 1),
       small=st.tuples(*[st.integers(0, 255)] * 4), root=st.integers(-2**31, 2**31 - 1),
       kind=st.integers(0, 2**32 - 1), count=st.integers(0, 2**64 - 1),
       nbytes=st.integers(0, 2**64 - 1), tail=st.binary(max_size=64))
def test_well_formed_headers_that_lie(magic, msgno, seq, small, root, kind, count, nbytes, tail):
    """Headers with any field values, terabyte sizes included."""
    before = _resident_kib()
    exc = _receive_from(HEADER.pack(magic, msgno, seq, *small, root, kind, count, nbytes) + tail)
    assert isinstance(exc, (pc.PeerError, pc.MismatchError)), exc
    grown_kib = _resident_kib() - before
    assert grown_kib < 64 << 10, "resident memory grew by %d KiB" % grown_kib


def test_a_peer_that_sends_half_a_header_and_stalls_meets_the_deadline():
    exc = _receive_from(b"PCM1\x00\x00", close=False)
    assert isinstance(exc, pc.Timeout) and "rank 1" in str(exc)


def test_point_to_point_probe_survives_garbage():
    ours, theirs = socket.socketpair()
    t = Engine(0, 2, [None, SocketChannel(ours.detach())], ["self", "fuzzer"], spin_us=0)
    try:
        theirs.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" * 3)
        with pytest.raises((pc.PeerError, pc.MismatchError)):
            _p2p.recv(t, _p2p.Mailbox(), np.zeros(4), 1, 0, 2.0)
    finally:
        t.close()
        theirs.close()
