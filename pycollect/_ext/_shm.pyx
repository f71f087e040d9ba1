"""Shared-memory rings and cross-memory attach: the channel kind of same-host pairs.

A Segment is one file in /dev/shm per host and run, mapped by every local
rank, holding one single-producer single-consumer byte ring per ordered pair
of local ranks.  A ring carries exactly what a socket would (message headers
and payloads), so the transport's framing and checks are the same for both.
The segment is unlinked as soon as every local rank has mapped it: nothing is
left in /dev/shm, even after a crash.

Large messages travel with one copy instead of two: the sender puts only the
header and its buffer's address in the ring, the receiver copies the payload
straight from the sender's memory with process_vm_readv and acknowledges it.

``RingChannel`` is one pair's rings as a channel (_channel.pxd).  The pair's
TCP socket stays open as its doorbell: a reader about to sleep sets a flag in
the ring's header, and a writer that finds it set sends one byte; poll() on the
sockets therefore still wakes on data, on abort() and on a peer's end.
"""

from libc.errno cimport EAGAIN, EINTR, EPIPE, errno
from libc.stdint cimport uint32_t, uint64_t
from libc.string cimport memcpy, memset
from posix.fcntl cimport O_CREAT, O_EXCL, O_RDWR, open as c_open
from posix.mman cimport MAP_FAILED, MAP_SHARED, PROT_READ, PROT_WRITE, mmap, munmap
from posix.types cimport pid_t
from posix.unistd cimport close as c_close, ftruncate, unlink
from posix.uio cimport iovec

import os

from pycollect._ext._channel cimport HDR_BYTES, ChannelOps, MsgHeader, default_ops
from pycollect._ext._socket cimport socket_shut

cdef extern from "_sys.h" nogil:
    void pc_set_errno(int e)
    uint64_t pc_load_u64(uint64_t* p)
    void pc_store_u64(uint64_t* p, uint64_t v)
    void pc_store_u32_sc(uint32_t* p, uint32_t v)
    uint32_t pc_exchange_u32(uint32_t* p, uint32_t v)
    void pc_fence()

cdef extern from "<sys/socket.h>" nogil:
    ssize_t recv(int fd, void* buf, size_t n, int flags)
    ssize_t send(int fd, const void* buf, size_t n, int flags)
    enum:
        MSG_NOSIGNAL
        MSG_DONTWAIT

cdef extern from "<poll.h>" nogil:
    enum:
        POLLIN

cdef extern from "<sys/uio.h>" nogil:
    ssize_t process_vm_readv(pid_t pid, const iovec* local, unsigned long liovcnt,
                             const iovec* remote, unsigned long riovcnt, unsigned long flags)
    ssize_t process_vm_writev(pid_t pid, const iovec* local, unsigned long liovcnt,
                              const iovec* remote, unsigned long riovcnt, unsigned long flags)

RING_HEADER_BYTES = sizeof(RingHeader)


cdef void ring_attach(Ring* r, char* base, uint64_t ring_bytes) noexcept nogil:
    r.hdr = <RingHeader*>base
    r.data = base + sizeof(RingHeader)
    r.size = ring_bytes
    r.tail_seen = r.tail_mine = pc_load_u64(&r.hdr.tail)
    # Each side reads the position it owns from its own memory: the shared word's line
    # is the other side's to poll, and loading it there missed the cache each message.
    r.head_mine = pc_load_u64(&r.hdr.head)


cdef uint64_t ring_used(Ring* r) noexcept nogil:
    return pc_load_u64(&r.hdr.head) - pc_load_u64(&r.hdr.tail)


cdef inline void _copy_in(Ring* r, uint64_t pos, const char* src, size_t n) noexcept nogil:
    cdef uint64_t off = pos & (r.size - 1)
    cdef uint64_t first = r.size - off
    if first >= n:
        memcpy(r.data + off, src, n)
    else:
        memcpy(r.data + off, src, first)
        memcpy(r.data, src + first, n - first)


cdef inline void _copy_out(Ring* r, uint64_t pos, char* dst, size_t n) noexcept nogil:
    cdef uint64_t off = pos & (r.size - 1)
    cdef uint64_t first = r.size - off
    if first >= n:
        memcpy(dst, r.data + off, n)
    else:
        memcpy(dst, r.data + off, first)
        memcpy(dst + first, r.data, n - first)


cdef inline uint64_t _room(Ring* r, uint64_t head, uint64_t want) noexcept nogil:
    """The writer's free bytes, from the tail it last saw, looked at again only where that
    leaves less than ``want``: the tail's cache line is the reader's, written at every read,
    and loading it at every write moved it between the cores each message.  The tail only
    grows, so a stale one only understates the room."""
    cdef uint64_t room = r.size - (head - r.tail_seen)
    if room < want:
        r.tail_seen = pc_load_u64(&r.hdr.tail)
        room = r.size - (head - r.tail_seen)
    return room


cdef size_t ring_write(Ring* r, const iovec* iov, int cnt) noexcept nogil:
    """Append as much of ``iov`` as fits; return the bytes written."""
    cdef uint64_t head = r.head_mine
    cdef size_t total = 0, n, want = 0
    cdef int i
    for i in range(cnt):
        want += iov[i].iov_len
    cdef uint64_t room = _room(r, head, want)
    for i in range(cnt):
        if room == 0:
            break
        n = iov[i].iov_len if iov[i].iov_len < room else room
        _copy_in(r, head + total, <const char*>iov[i].iov_base, n)
        total += n
        room -= n
    if total:
        r.head_mine = head + total
        pc_store_u64(&r.hdr.head, head + total)
    return total


cdef size_t ring_read(Ring* r, iovec* iov, int cnt) noexcept nogil:
    """Consume into ``iov`` as much as is there; return the bytes read."""
    cdef uint64_t tail = r.tail_mine
    cdef uint64_t avail = pc_load_u64(&r.hdr.head) - tail
    cdef size_t total = 0, n
    cdef int i
    for i in range(cnt):
        if avail == 0:
            break
        n = iov[i].iov_len if iov[i].iov_len < avail else avail
        _copy_out(r, tail + total, <char*>iov[i].iov_base, n)
        total += n
        avail -= n
    if total:
        r.tail_mine = tail + total
        pc_store_u64(&r.hdr.tail, tail + total)
    return total


cdef size_t ring_peek(Ring* r, void* out, size_t n) noexcept nogil:
    """Copy up to ``n`` bytes from the front without consuming them."""
    cdef uint64_t tail = r.tail_mine
    cdef uint64_t avail = pc_load_u64(&r.hdr.head) - tail
    if avail < n:
        n = avail
    _copy_out(r, tail, <char*>out, n)
    return n


cdef ssize_t cma_read(int pid, void* local, uint64_t remote, size_t n) noexcept nogil:
    """Copy ``n`` bytes at ``remote`` in process ``pid`` into ``local``; -1 and errno on failure."""
    cdef iovec l, rm
    l.iov_base = local
    l.iov_len = n
    rm.iov_base = <void*>remote
    rm.iov_len = n
    return process_vm_readv(pid, &l, 1, &rm, 1, 0)


cdef ssize_t cma_write(int pid, uint64_t remote, const void* local, size_t n) noexcept nogil:
    """Copy ``n`` bytes at ``local`` to ``remote`` in process ``pid``; -1 and errno on failure."""
    cdef iovec l, rm
    l.iov_base = <void*>local
    l.iov_len = n
    rm.iov_base = <void*>remote
    rm.iov_len = n
    return process_vm_writev(pid, &l, 1, &rm, 1, 0)


def cma_probe(int pid, unsigned long long address, bytes expected):
    """True if this process can read ``expected`` at ``address`` in process ``pid``."""
    cdef bytearray got = bytearray(len(expected))
    cdef char* dst = got
    cdef size_t want = len(expected)
    cdef ssize_t n
    with nogil:
        n = cma_read(pid, dst, address, want)
    return n == len(expected) and bytes(got) == expected


cdef class Segment:
    """One mapped /dev/shm file holding the rings of every local pair."""

    def __cinit__(self):
        self.base = NULL
        self.length = 0

    def __init__(self, str path, size_t length, bint create):
        cdef int fd
        cdef bytes bpath = path.encode()
        fd = c_open(bpath, O_RDWR | (O_CREAT | O_EXCL if create else 0), 0o600)
        if fd < 0:
            raise OSError(errno, os.strerror(errno), path)
        try:
            if create and ftruncate(fd, length) != 0:
                raise OSError(errno, os.strerror(errno), path)
            if not create and os.fstat(fd).st_size < length:
                raise OSError("shared segment %s is shorter than %d bytes" % (path, length))
            self.base = <char*>mmap(NULL, length, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)
            if <void*>self.base == MAP_FAILED:
                self.base = NULL
                raise OSError(errno, os.strerror(errno), "mmap " + path)
        finally:
            c_close(fd)
        self.length = length
        self.path = path

    def unlink(self):
        """Remove the name (the mappings live on until every rank unmaps)."""
        cdef bytes bpath = self.path.encode()
        unlink(bpath)

    @property
    def address(self):
        return <size_t>self.base

    def __dealloc__(self):
        if self.base != NULL:
            munmap(self.base, self.length)
            self.base = NULL


cdef inline void _wake_reader(Ring* out, int fd) noexcept nogil:
    """After writing into a ring: ring the peer's doorbell if it sleeps on it."""
    cdef char bell = 1
    pc_fence()
    if out.hdr.reader_sleeping and pc_exchange_u32(&out.hdr.reader_sleeping, 0):
        send(fd, &bell, 1, MSG_NOSIGNAL | MSG_DONTWAIT)


cdef inline void _wake_writer(Ring* inn, int fd) noexcept nogil:
    """After reading from a ring or acknowledging: wake a writer waiting for it."""
    cdef char bell = 1
    pc_fence()
    if inn.hdr.writer_sleeping and pc_exchange_u32(&inn.hdr.writer_sleeping, 0):
        send(fd, &bell, 1, MSG_NOSIGNAL | MSG_DONTWAIT)


cdef inline RingState* _ring(ChannelBase* c) noexcept nogil:
    return <RingState*>c.state


cdef ssize_t _ring_writev(ChannelBase* c, iovec* iov, int cnt) noexcept nogil:
    cdef size_t n
    if c.eof:
        pc_set_errno(EPIPE)
        return -1
    n = ring_write(&_ring(c).out, iov, cnt)
    if n == 0:
        pc_set_errno(EAGAIN)
        return -1
    _wake_reader(&_ring(c).out, c.fd)
    return <ssize_t>n


cdef ssize_t _ring_readv(ChannelBase* c, iovec* iov, int cnt) noexcept nogil:
    cdef RingState* r = _ring(c)
    cdef size_t n = ring_read(&r.inn, iov, cnt)
    if n == 0:
        if c.eof and ring_used(&r.inn) == 0:
            return 0
        pc_set_errno(EAGAIN)
        return -1
    _wake_writer(&r.inn, c.fd)
    return <ssize_t>n


cdef void _ring_woken(ChannelBase* c) noexcept nogil:
    """Consume wake-up bytes on the doorbell; note the peer's end."""
    cdef char junk[64]
    cdef ssize_t n
    while not c.eof:
        n = recv(c.fd, junk, sizeof(junk), MSG_DONTWAIT)
        if n == 0 or (n < 0 and errno != EAGAIN and errno != EINTR):
            c.eof = 1
        elif n < 0:
            break


cdef enum:
    # Empty looks at a ring between looks at its doorbell socket: about 50 us of a reader
    # spinning alone on its core, which then sleeps in poll() on that socket anyway.
    DOORBELL_EVERY = 1024


cdef int _ring_peek(ChannelBase* c, MsgHeader* h) noexcept nogil:
    """The ring first: a header there is returned without a system call.  On every
    DOORBELL_EVERY-th look that finds the ring empty, the doorbell socket too (what only
    wakes, and the peer's end: a spinning reader notices a dead peer within about 50
    microseconds, or when its spin ends and it sleeps in poll(); one asleep there at
    once), then the ring again: the peer's last messages lie in the ring before its end
    shows on the socket.  (Every 64th look, a reader waiting about a microsecond for each
    message made a system call every fourth message or so.)"""
    cdef RingState* r = _ring(c)
    cdef size_t n = ring_peek(&r.inn, h, HDR_BYTES)
    if n:
        return <int>n
    r.empty_looks += 1
    if r.empty_looks % DOORBELL_EVERY == 0:
        _ring_woken(c)
        n = ring_peek(&r.inn, h, HDR_BYTES)
        if n:
            return <int>n
    if c.eof:
        return 0
    pc_set_errno(EAGAIN)
    return -1


cdef int _ring_take_peeked(ChannelBase* c, MsgHeader* h) noexcept nogil:
    cdef iovec iov
    iov.iov_base = h
    iov.iov_len = HDR_BYTES
    return <int>ring_read(&_ring(c).inn, &iov, 1)


cdef size_t _ring_held(ChannelBase* c) noexcept nogil:
    return ring_used(&_ring(c).inn)


cdef short _ring_events(ChannelBase* c, int want_out, int want_in) noexcept nogil:
    # The socket carries only wake-ups and the end of the stream.
    return 0 if c.eof else POLLIN


cdef void _ring_disarm(ChannelBase* c) noexcept nogil:
    pc_store_u32_sc(&_ring(c).inn.hdr.reader_sleeping, 0)
    pc_store_u32_sc(&_ring(c).out.hdr.writer_sleeping, 0)


cdef int _ring_arm(ChannelBase* c, int want_in, int want_out, uint64_t ack_needed) noexcept nogil:
    cdef RingState* r = _ring(c)
    cdef int ready = 0
    if c.eof:
        return 0
    if want_in:
        pc_store_u32_sc(&r.inn.hdr.reader_sleeping, 1)
    if want_out or ack_needed:
        pc_store_u32_sc(&r.out.hdr.writer_sleeping, 1)
    pc_fence()
    if want_in and ring_used(&r.inn):
        ready = 1
    if want_out and ring_used(&r.out) < r.out.size:
        ready = 1
    if ack_needed and pc_load_u64(&r.out.hdr.acks) >= ack_needed:
        ready = 1
    if ready:
        _ring_disarm(c)
    return ready


cdef int _ring_send_frame(ChannelBase* c, const MsgHeader* h) noexcept nogil:
    cdef RingState* r = _ring(c)
    cdef iovec iov
    if r.out.size - ring_used(&r.out) >= HDR_BYTES:
        iov.iov_base = <void*>h
        iov.iov_len = HDR_BYTES
        ring_write(&r.out, &iov, 1)
        _wake_reader(&r.out, c.fd)
        return 1
    return 0


cdef ssize_t _ring_read_remote(ChannelBase* c, void* dst, uint64_t addr,
                               size_t n) noexcept nogil:
    return cma_read(_ring(c).peer_pid, dst, addr, n)


cdef ssize_t _ring_write_remote(ChannelBase* c, uint64_t addr, const void* src,
                                size_t n) noexcept nogil:
    return cma_write(_ring(c).peer_pid, addr, src, n)


cdef size_t _ring_room(ChannelBase* c) noexcept nogil:
    """The free bytes of the outgoing ring: a write of that many goes in whole now."""
    cdef Ring* out = &_ring(c).out
    # The tail looked at again where the last look leaves less than half the ring.
    return 0 if c.eof else <size_t>_room(out, out.head_mine, out.size >> 1)


cdef uint64_t _ring_acked(ChannelBase* c) noexcept nogil:
    return pc_load_u64(&_ring(c).out.hdr.acks)


cdef void _ring_ack(ChannelBase* c) noexcept nogil:
    cdef RingState* r = _ring(c)
    pc_store_u64(&r.inn.hdr.acks, r.inn.hdr.acks + 1)
    _wake_writer(&r.inn, c.fd)


cdef ChannelOps RING_OPS
default_ops(&RING_OPS)
RING_OPS.writev = _ring_writev
RING_OPS.readv = _ring_readv
RING_OPS.peek = _ring_peek
RING_OPS.take_peeked = _ring_take_peeked
RING_OPS.held = _ring_held
RING_OPS.events = _ring_events
RING_OPS.arm = _ring_arm
RING_OPS.disarm = _ring_disarm
RING_OPS.woken = _ring_woken
RING_OPS.send_frame = _ring_send_frame
RING_OPS.shut = socket_shut      # the doorbell's end tells the peer
RING_OPS.read_remote = _ring_read_remote
RING_OPS.write_remote = _ring_write_remote
RING_OPS.acked = _ring_acked
RING_OPS.ack = _ring_ack
RING_OPS.room = _ring_room


# The largest async send (a send begun with async_op=True) that goes through the ring
# where it would go by address, up to a quarter of the ring: it ends at once instead of
# waiting for the peer to copy it out (docs/performance.md, "Async exchanges").  Above it
# the single copy by address is worth the wait.
ASYNC_EAGER_BYTES = 256 << 10


cdef class RingChannel(Channel):
    """The rings between this rank (local index ``me``) and a same-host peer (``other``)
    in ``segment``, with ``doorbell``'s socket as the wake-up and end-of-stream channel
    (its fd moves here).  ``peer_reads``: the peer may read this process's memory, so
    sends from ``by_address_min`` bytes go by address; ``reads_peer``: this process may
    read the peer's (``read_remote``)."""

    def __init__(self, Channel doorbell, Segment segment, int me, int other, int nlocal,
                 size_t ring_bytes, int pid, bint peer_reads, bint reads_peer,
                 size_t by_address_min):
        cdef size_t stride = sizeof(RingHeader) + ring_bytes
        memset(&self.chan, 0, sizeof(ChannelBase))
        self.chan.ops = &RING_OPS
        self.chan.state = &self.ring
        self.chan.fd = doorbell.release_fd()
        self.chan.split_header = 1       # the payload may be an address
        self.chan.by_address_min = by_address_min if peer_reads else 0
        # An async send through the ring ends as soon as it is copied in; by address it
        # waits for the peer's copy, and the caller's next calls for the runner.
        self.chan.eager_max = min(ASYNC_EAGER_BYTES, ring_bytes // 4)
        self.chan.reads_remote = reads_peer
        self.chan.send_call = b""
        self.chan.recv_call = b""
        self.chan.remote_call = b"process_vm_readv"
        self.chan.write_call = b"process_vm_writev"
        self.base = &self.chan
        self.segment = segment
        ring_attach(&self.ring.out, segment.base + (me * nlocal + other) * stride, ring_bytes)
        ring_attach(&self.ring.inn, segment.base + (other * nlocal + me) * stride, ring_bytes)
        self.ring.peer_pid = pid
        self.ring.peer_reads = peer_reads

    @property
    def kind(self):
        return "shm+cma" if self.ring.peer_reads else "shm"

    @property
    def pid(self):
        return self.ring.peer_pid

    @property
    def segment_path(self):
        """The name the rings' segment had in /dev/shm (unlinked once every rank mapped it)."""
        return self.segment.path
