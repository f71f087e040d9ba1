"""A connected TCP socket as one pair's channel: sendmsg, readv and MSG_PEEK.

The socket is non-blocking; every write goes with ``MSG_NOSIGNAL |
MSG_DONTWAIT``, so a peer that died shows as an error, never as SIGPIPE.
"""

from libc.string cimport memset
from posix.uio cimport iovec, readv

from pycollect._ext._channel cimport HDR_BYTES, default_ops

cdef extern from "<sys/socket.h>" nogil:
    ctypedef unsigned int socklen_t
    struct msghdr:
        void* msg_name
        socklen_t msg_namelen
        iovec* msg_iov
        size_t msg_iovlen
        void* msg_control
        size_t msg_controllen
        int msg_flags
    ssize_t sendmsg(int fd, const msghdr* msg, int flags)
    ssize_t recv(int fd, void* buf, size_t n, int flags)
    int shutdown(int fd, int how)
    enum:
        MSG_NOSIGNAL
        MSG_DONTWAIT
        MSG_PEEK
        SHUT_WR

cdef extern from "<fcntl.h>" nogil:
    int fcntl(int fd, int cmd, ...)
    enum:
        F_GETFL
        F_SETFL
        O_NONBLOCK


cdef ssize_t _writev(ChannelBase* c, iovec* iov, int cnt) noexcept nogil:
    cdef msghdr msg
    memset(&msg, 0, sizeof(msg))
    msg.msg_iov = iov
    msg.msg_iovlen = cnt
    return sendmsg(c.fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT)


cdef ssize_t _readv(ChannelBase* c, iovec* iov, int cnt) noexcept nogil:
    return readv(c.fd, iov, cnt)


cdef int _peek(ChannelBase* c, MsgHeader* h) noexcept nogil:
    return <int>recv(c.fd, h, HDR_BYTES, MSG_PEEK | MSG_DONTWAIT)


cdef int _take_peeked(ChannelBase* c, MsgHeader* h) noexcept nogil:
    return <int>recv(c.fd, h, HDR_BYTES, MSG_DONTWAIT)


cdef void socket_shut(ChannelBase* c) noexcept nogil:
    shutdown(c.fd, SHUT_WR)


cdef ChannelOps SOCKET_OPS
default_ops(&SOCKET_OPS)
SOCKET_OPS.writev = _writev
SOCKET_OPS.readv = _readv
SOCKET_OPS.peek = _peek
SOCKET_OPS.take_peeked = _take_peeked
SOCKET_OPS.shut = socket_shut


cdef void socket_setup(ChannelBase* c, int fd, const ChannelOps* ops) except *:
    """Fill ``c`` for the connected socket ``fd`` (made non-blocking) with ``ops``."""
    cdef int flags
    if fd < 0:
        raise ValueError("a socket channel needs a connected socket")
    memset(c, 0, sizeof(ChannelBase))
    c.ops = ops
    c.fd = fd
    c.send_call = b"sendmsg"
    c.recv_call = b"readv"
    c.remote_call = b""
    c.write_call = b""
    flags = fcntl(fd, F_GETFL, 0)
    fcntl(fd, F_SETFL, flags | O_NONBLOCK)


cdef class SocketChannel(Channel):
    """A connected stream socket; takes ownership of ``fd``."""

    def __init__(self, int fd):
        socket_setup(&self.sock, fd, &SOCKET_OPS)
        self.base = &self.sock

    @property
    def kind(self):
        return "tcp"
