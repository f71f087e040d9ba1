"""A connected TCP socket as one pair's channel: send/sendmsg out, a staging area in.

The socket is non-blocking; every write goes with ``MSG_NOSIGNAL |
MSG_DONTWAIT``, so a peer that died shows as an error, never as SIGPIPE.

Reads go through a staging area of STAGE_BYTES: a peek, or a read that wants
less than STAGE_DIRECT bytes, takes what the stream holds (up to the area's
room) in one ``recv()``, and later peeks and reads are served from it.  A small
message, header and payload, so costs one system call however the engine
reads it (a tagged receive peeks at the header, takes it, then reads the
payload: three calls with ``MSG_PEEK``), and a burst of small messages one
call for all of them.  A read that wants more goes to the socket with
``readv`` straight into the caller's buffers once the staged bytes are
copied, so large payloads are not copied twice.  Staged bytes are invisible
to ``poll()``: ``held`` reports them, and the engine looks before it sleeps.
"""

from libc.stdlib cimport free, malloc
from libc.string cimport memcpy, memmove, memset
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
    ssize_t send(int fd, const void* buf, size_t n, int flags)
    int shutdown(int fd, int how)
    int getsockopt(int fd, int level, int name, void* value, socklen_t* length)
    enum:
        SOL_SOCKET
        SO_SNDBUF
        MSG_NOSIGNAL
        MSG_DONTWAIT
        MSG_PEEK
        SHUT_WR

cdef extern from "<sys/ioctl.h>" nogil:
    int ioctl(int fd, unsigned long request, ...)

cdef extern from "<linux/sockios.h>" nogil:
    enum:
        SIOCOUTQ

cdef extern from "<fcntl.h>" nogil:
    int fcntl(int fd, int cmd, ...)
    enum:
        F_GETFL
        F_SETFL
        O_NONBLOCK


cdef enum:
    SMALL_SEND = 512    # a header and a payload up to this many bytes go as one buffer
    DIRECT_IOVS = 4     # the most buffers one direct read fills (the engine passes two)


cdef ssize_t _writev(ChannelBase* c, iovec* iov, int cnt) noexcept nogil:
    cdef SocketStage* s = _stage(c)
    cdef ssize_t n = _write_out(c, iov, cnt)
    if n > 0:       # what _room last saw shrinks by what went in since
        s.room_seen = s.room_seen - <size_t>n if <size_t>n < s.room_seen else 0
    return n


cdef inline ssize_t _write_out(ChannelBase* c, iovec* iov, int cnt) noexcept nogil:
    cdef msghdr msg
    cdef char small[SMALL_SEND]
    if cnt == 2 and iov[0].iov_len + iov[1].iov_len <= SMALL_SEND:
        # A header and a small payload: one contiguous send() is cheaper than sendmsg()
        # of two buffers.
        memcpy(small, iov[0].iov_base, iov[0].iov_len)
        memcpy(small + iov[0].iov_len, iov[1].iov_base, iov[1].iov_len)
        return send(c.fd, small, iov[0].iov_len + iov[1].iov_len, MSG_NOSIGNAL | MSG_DONTWAIT)
    if cnt == 1:
        return send(c.fd, iov[0].iov_base, iov[0].iov_len, MSG_NOSIGNAL | MSG_DONTWAIT)
    memset(&msg, 0, sizeof(msg))
    msg.msg_iov = iov
    msg.msg_iovlen = cnt
    return sendmsg(c.fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT)


cdef inline SocketStage* _stage(ChannelBase* c) noexcept nogil:
    return <SocketStage*>c.state


cdef ssize_t _fill(ChannelBase* c, SocketStage* s) noexcept nogil:
    """One recv() into the staging area's room, after the bytes it holds (moved to its
    start first): what recv() returned, the count then already added to ``tail``."""
    cdef ssize_t n
    if s.head:
        memmove(s.buf, s.buf + s.head, s.tail - s.head)
        s.tail -= s.head
        s.head = 0
    n = recv(c.fd, s.buf + s.tail, STAGE_BYTES - s.tail, MSG_DONTWAIT)
    if n > 0:
        s.tail += <size_t>n
    return n


cdef size_t _give(SocketStage* s, iovec* iov, int cnt, int* i, size_t* off) noexcept nogil:
    """Copy staged bytes into ``iov`` from entry ``i[0]``, offset ``off[0]`` on; both move."""
    cdef size_t k, given = 0
    while i[0] < cnt and s.head < s.tail:
        k = iov[i[0]].iov_len - off[0]
        if k > s.tail - s.head:
            k = s.tail - s.head
        memcpy(<char*>iov[i[0]].iov_base + off[0], s.buf + s.head, k)
        s.head += k
        given += k
        off[0] += k
        if off[0] == iov[i[0]].iov_len:
            i[0] += 1
            off[0] = 0
    return given


cdef ssize_t _readv(ChannelBase* c, iovec* iov, int cnt) noexcept nogil:
    cdef SocketStage* s = _stage(c)
    cdef int i = 0, j, k
    cdef size_t off = 0, given, want = 0
    cdef ssize_t n
    cdef iovec rest[DIRECT_IOVS]
    while i < cnt and iov[i].iov_len == 0:
        i += 1
    given = _give(s, iov, cnt, &i, &off)
    if i == cnt:
        return <ssize_t>given
    for j in range(i, cnt):
        want += iov[j].iov_len
    want -= off
    if want < STAGE_DIRECT:
        n = _fill(c, s)
        if n > 0:
            given += _give(s, iov, cnt, &i, &off)
    else:
        # Straight into the caller's buffers (the first few of them: a short read is
        # a read).
        k = cnt - i if cnt - i < DIRECT_IOVS else DIRECT_IOVS
        for j in range(k):
            rest[j] = iov[i + j]
        rest[0].iov_base = <char*>rest[0].iov_base + off
        rest[0].iov_len -= off
        n = readv(c.fd, rest, k)
        if n > 0:
            given += <size_t>n
    return <ssize_t>given if given else n


cdef int _peek(ChannelBase* c, MsgHeader* h) noexcept nogil:
    cdef SocketStage* s = _stage(c)
    cdef size_t k
    cdef ssize_t n
    if s.tail - s.head < HDR_BYTES:
        n = _fill(c, s)
        if n <= 0 and s.tail == s.head:
            return <int>n       # 0: the end of the stream; -1: nothing yet, or an error
    k = s.tail - s.head
    if k > HDR_BYTES:
        k = HDR_BYTES
    memcpy(h, s.buf + s.head, k)
    return <int>k


cdef int _take_peeked(ChannelBase* c, MsgHeader* h) noexcept nogil:
    cdef SocketStage* s = _stage(c)
    memcpy(h, s.buf + s.head, HDR_BYTES)
    s.head += HDR_BYTES
    return HDR_BYTES


cdef size_t _held(ChannelBase* c) noexcept nogil:
    return _stage(c).tail - _stage(c).head


cdef size_t _room(ChannelBase* c) noexcept nogil:
    """What the socket takes whole now: half its send buffer, less the bytes it holds not
    yet acknowledged by the peer (SIOCOUTQ).  The kernel counts a buffer's bookkeeping
    against SO_SNDBUF as well, hence only half; a socket whose buffer the channel does
    not know, or that cannot tell, takes nothing for sure.  The look is a system call, so
    its answer, less what was written since (``_writev``), is served again while it is at
    least a quarter of the buffer: what the peer acknowledges meanwhile only adds room,
    so the kept answer never overstates it."""
    cdef SocketStage* s = _stage(c)
    cdef int queued = 0
    cdef size_t half = s.sndbuf // 2
    if c.eof or half == 0:
        return 0
    if s.room_seen >= half // 2:
        return s.room_seen
    if ioctl(c.fd, SIOCOUTQ, &queued) < 0 or queued < 0:
        s.room_seen = 0
    else:
        s.room_seen = half - <size_t>queued if <size_t>queued < half else 0
    return s.room_seen


cdef void socket_shut(ChannelBase* c) noexcept nogil:
    shutdown(c.fd, SHUT_WR)


cdef ChannelOps SOCKET_OPS
default_ops(&SOCKET_OPS)
SOCKET_OPS.writev = _writev
SOCKET_OPS.readv = _readv
SOCKET_OPS.peek = _peek
SOCKET_OPS.take_peeked = _take_peeked
SOCKET_OPS.held = _held
SOCKET_OPS.shut = socket_shut
SOCKET_OPS.room = _room


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
        cdef int sndbuf = 0
        cdef socklen_t length = sizeof(int)
        socket_setup(&self.sock, fd, &SOCKET_OPS)
        self.stage = <SocketStage*>malloc(sizeof(SocketStage))
        if self.stage == NULL:
            raise MemoryError()
        self.stage.head = self.stage.tail = 0
        self.stage.sndbuf = self.stage.room_seen = 0
        if getsockopt(fd, SOL_SOCKET, SO_SNDBUF, &sndbuf, &length) == 0 and sndbuf > 0:
            self.stage.sndbuf = <size_t>sndbuf
        self.sock.state = self.stage
        self.base = &self.sock

    def release_fd(self):
        """Hand the fd over to another channel (which will close it); return it.  Only
        before anything was read: staged bytes would be lost."""
        if self.stage != NULL and self.stage.tail != self.stage.head:
            raise RuntimeError("a socket channel gives up its fd with %d bytes staged"
                               % (self.stage.tail - self.stage.head))
        return Channel.release_fd(self)

    def __dealloc__(self):
        free(self.stage)

    @property
    def kind(self):
        return "tcp"
