"""The socket channel's staging area (pycollect/_ext/_socket.pyx): a burst of small
messages comes in with one read, and whatever the stream holds past the message a
receive wants is kept, in order, for the receives after it."""

import os
import socket
import threading

import numpy as np
import pytest

import pycollect as pc
from pycollect._ext import _allreduce, _p2p
from pycollect._ext._engine import Engine
from pycollect._ext._socket import SocketChannel

RD = _allreduce.ALGORITHMS["recursive_doubling"]
# Payload sizes on both sides of the channel's limits (STAGE_DIRECT 4096 and STAGE_BYTES
# 8192, the 40-byte header included or not) and far past them.
SIZES = [0, 1, 7, 40, 4015, 4016, 4055, 4056, 4057, 4095, 4096, 4097, 8151, 8152, 8192, 8193,
         100_003, 1 << 20]


@pytest.fixture
def pair():
    """Rank 0 and rank 1 of a 2-rank engine over one socketpair, and a spare descriptor of
    rank 0's socket (to look at what its kernel buffer still holds)."""
    a, b = socket.socketpair()
    spare = os.dup(a.fileno())
    ends = [Engine(0, 2, [None, SocketChannel(a.detach())], ["self", "peer"], spin_us=0),
            Engine(1, 2, [SocketChannel(b.detach()), None], ["peer", "self"], spin_us=0)]
    yield ends, spare
    for e in ends:
        e.close()
    os.close(spare)


def _payload(n, salt):
    return (np.arange(n, dtype=np.uint64) * 2654435761 + salt).astype(np.uint8)


def test_a_burst_of_small_messages_comes_in_one_read(pair):
    (zero, one), spare = pair
    for tag in range(3):
        _p2p.send(one, np.full(3, tag, np.float32), 0, tag, 5.0)
    got = np.zeros(3, np.float32)
    _p2p.recv(zero, _p2p.Mailbox(), got, 1, 0, 5.0)
    assert got.tolist() == [0, 0, 0]
    # The other two messages left the kernel with the first one's read.
    with pytest.raises(BlockingIOError):
        socket.socket(fileno=os.dup(spare)).recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    box = _p2p.Mailbox()
    for tag in (2, 1):
        _p2p.recv(zero, box, got, 1, tag, 5.0)
        assert got.tolist() == [tag] * 3


def test_messages_of_every_size_arrive_whole_and_in_order(pair):
    """The sender sends every size back to back, so that a read of a small message stages
    the start of the next; the receiver takes them in reverse tag order, then in order."""
    (zero, one), _ = pair
    sent = [_payload(n, i) for i, n in enumerate(SIZES)]
    done = []

    def sender():
        for tag, data in enumerate(sent):
            _p2p.send(one, data, 0, tag, 20.0)
        for tag, data in enumerate(sent):
            _p2p.send(one, data, 0, 100 + tag, 20.0)
        done.append(True)

    th = threading.Thread(target=sender)
    th.start()
    box = _p2p.Mailbox()
    try:
        for tag in reversed(range(len(SIZES))):
            got = np.zeros(SIZES[tag], np.uint8)
            _p2p.recv(zero, box, got, 1, tag, 20.0)
            assert np.array_equal(got, sent[tag]), SIZES[tag]
        for tag in range(len(SIZES)):
            got = np.zeros(SIZES[tag], np.uint8)
            _p2p.recv(zero, box, got, 1, 100 + tag, 20.0)
            assert np.array_equal(got, sent[tag]), SIZES[tag]
    finally:
        th.join(30)
    assert done


def test_collectives_after_staged_messages_find_their_bytes(pair):
    """A collective's message staged behind a point-to-point one is found there, without
    waiting on the socket (where poll() no longer shows it)."""
    (zero, one), _ = pair
    results = {}

    def rank1():
        _p2p.send(one, np.arange(5, dtype=np.float64), 0, 9, 10.0)
        for i in range(20):
            buf = np.full(3, float(i), np.float32)
            _allreduce.allreduce(one, buf, 0, RD, i + 1, 10.0, 1 << 20)
        results[1] = buf.tolist()

    th = threading.Thread(target=rank1)
    th.start()
    try:
        th.join(0.2)        # rank 1's first allreduce message follows the send on the wire
        got = np.zeros(5)
        _p2p.recv(zero, _p2p.Mailbox(), got, 1, 9, 10.0)
        assert got.tolist() == [0, 1, 2, 3, 4]
        for i in range(20):
            buf = np.full(3, 10.0 * i, np.float32)
            _allreduce.allreduce(zero, buf, 0, RD, i + 1, 10.0, 1 << 20)
    finally:
        th.join(30)
    assert buf.tolist() == results[1] == [11.0 * 19] * 3


def test_a_peer_that_closes_after_a_staged_message_is_named(pair):
    (zero, one), _ = pair
    _p2p.send(one, np.ones(2), 0, 0, 5.0)
    _p2p.send(one, np.ones(2), 0, 1, 5.0)
    one.close()
    box = _p2p.Mailbox()
    got = np.zeros(2)
    _p2p.recv(zero, box, got, 1, 0, 5.0)
    _p2p.recv(zero, box, got, 1, 1, 5.0)      # staged before the end of the stream
    with pytest.raises(pc.PeerError) as info:
        _p2p.recv(zero, box, got, 1, 2, 5.0)
    assert "rank 1" in str(info.value)


def test_the_fd_is_not_handed_over_with_bytes_staged(pair):
    (zero, one), _ = pair
    _p2p.send(one, np.ones(1), 0, 0, 5.0)
    _p2p.send(one, np.ones(1), 0, 1, 5.0)
    _p2p.recv(zero, _p2p.Mailbox(), np.zeros(1), 1, 0, 5.0)
    with pytest.raises(RuntimeError, match="staged"):
        zero.channel(1).release_fd()


def test_a_socket_channels_room_is_what_it_last_saw_less_what_it_wrote_since():
    """A socket channel's room (what a send that must not wait for the peer may write, the
    engine's ``sends_now``) is half the send buffer less what the kernel still holds, looked
    at with a system call only when what was last seen, less what was written since, falls
    below a quarter of the buffer: it never says more than the socket takes, and says all of
    it again once the peer has read everything."""
    a, b = socket.socketpair()
    spare = os.dup(a.fileno())
    ca, cb = SocketChannel(a.detach()), SocketChannel(b.detach())
    ends = [Engine(0, 2, [None, ca], ["self", "peer"], spin_us=0),
            Engine(1, 2, [cb, None], ["peer", "self"], spin_us=0)]
    try:
        with socket.socket(fileno=os.dup(spare)) as s:
            half = s.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) // 2
        assert ca.room == half                          # nothing sent yet
        data = np.zeros(1000, np.uint8)
        sent, rooms = 0, []
        while sent + 1040 <= half // 2:                 # a 40-byte header with each
            _p2p.send(ends[0], data, 1, 0, 5.0)
            sent += 1040
            rooms.append(ca.room)
        assert rooms == [half - 1040 * (k + 1) for k in range(len(rooms))]
        for _ in range(8):                              # below a quarter: looked at again
            _p2p.send(ends[0], data, 1, 0, 5.0)
            sent += 1040
            assert ca.room <= half - sent
        box, got = _p2p.Mailbox(), np.empty(1000, np.uint8)
        for _ in range(sent // 1040):
            _p2p.recv(ends[1], box, got, 0, 0, 5.0)
        assert ca.room == half                          # the peer read it all
    finally:
        for e in ends:
            e.close()
        os.close(spare)
