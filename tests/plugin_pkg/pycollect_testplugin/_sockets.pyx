"""A channel that another package writes in Cython against pycollect's installed .pxd files.

It carries a pair's bytes over the pair's connected socket with plain
``send``/``recv``, one piece of the gather list at a time (pycollect's own
socket channel uses ``sendmsg``/``readv``), and counts what it moves, so a
test can see that its bytes went this way.
"""

from libc.errno cimport errno
from libc.string cimport memset
from posix.uio cimport iovec

from pycollect._ext._channel cimport (HDR_BYTES, Channel, ChannelBase, ChannelOps, MsgHeader,
                                      default_ops)

cdef extern from "<sys/socket.h>" nogil:
    ssize_t send(int fd, const void* buf, size_t n, int flags)
    ssize_t recv(int fd, void* buf, size_t n, int flags)
    int shutdown(int fd, int how)
    enum:
        MSG_NOSIGNAL
        MSG_DONTWAIT
        MSG_PEEK
        SHUT_WR


cdef struct Counts:
    unsigned long long sent
    unsigned long long received


cdef inline Counts* _counts(ChannelBase* c) noexcept nogil:
    return <Counts*>c.state


cdef ssize_t _writev(ChannelBase* c, iovec* iov, int cnt) noexcept nogil:
    cdef size_t total = 0
    cdef ssize_t n
    cdef int i
    for i in range(cnt):
        if iov[i].iov_len == 0:
            continue
        n = send(c.fd, iov[i].iov_base, iov[i].iov_len, MSG_NOSIGNAL | MSG_DONTWAIT)
        if n < 0:
            if total:
                break
            return -1
        total += <size_t>n
        if <size_t>n < iov[i].iov_len:
            break
    _counts(c).sent += total
    return <ssize_t>total


cdef ssize_t _readv(ChannelBase* c, iovec* iov, int cnt) noexcept nogil:
    cdef size_t total = 0
    cdef ssize_t n
    cdef int i
    for i in range(cnt):
        if iov[i].iov_len == 0:
            continue
        n = recv(c.fd, iov[i].iov_base, iov[i].iov_len, MSG_DONTWAIT)
        if n <= 0:
            if total:
                break
            return n
        total += <size_t>n
        if <size_t>n < iov[i].iov_len:
            break
    _counts(c).received += total
    return <ssize_t>total


cdef int _peek(ChannelBase* c, MsgHeader* h) noexcept nogil:
    return <int>recv(c.fd, h, HDR_BYTES, MSG_PEEK | MSG_DONTWAIT)


cdef int _take_peeked(ChannelBase* c, MsgHeader* h) noexcept nogil:
    cdef ssize_t n = recv(c.fd, h, HDR_BYTES, MSG_DONTWAIT)
    if n > 0:
        _counts(c).received += <size_t>n
    return <int>n


cdef void _shut(ChannelBase* c) noexcept nogil:
    shutdown(c.fd, SHUT_WR)


# pycollect's defaults, then this channel's own byte path.
cdef ChannelOps OPS
default_ops(&OPS)
OPS.writev = _writev
OPS.readv = _readv
OPS.peek = _peek
OPS.take_peeked = _take_peeked
OPS.shut = _shut


cdef class CountingSocketChannel(Channel):
    """The connected socket of ``sock`` (its fd moves here), read and written piecewise."""

    cdef ChannelBase chan
    cdef Counts counts

    def __init__(self, Channel sock):
        memset(&self.chan, 0, sizeof(ChannelBase))
        memset(&self.counts, 0, sizeof(Counts))
        self.chan.ops = &OPS
        self.chan.state = &self.counts
        self.chan.fd = sock.release_fd()
        self.chan.send_call = b"send"
        self.chan.recv_call = b"recv"
        self.chan.remote_call = b""
        self.base = &self.chan

    @property
    def kind(self):
        return "testplugin-socket"

    @property
    def bytes_sent(self):
        return self.counts.sent

    @property
    def bytes_received(self):
        return self.counts.received
