"""The TCP transport: a full mesh of non-blocking sockets and a nogil progress engine.

The rendezvous (listener, connect, handshake) happens in Python, in
``pycollect/plugins/tcp.py``; it hands this class one connected socket per
peer.  From then on everything runs here without the GIL.

Progress is driven by the calling thread.  ``wait`` loops over the pairs that
have work queued, writing and reading as much as the sockets take without
blocking, so sends and receives to several peers advance together.  When a
pass makes no progress the engine spins for ``spin_us`` microseconds (a polled
round trip on loopback is several times faster than a woken one), yielding the
core between passes when this host runs more ranks than it has cores, and then
blocks in ``poll`` until a socket is ready, the deadline passes or
``abort()`` writes to the wake-up eventfd.

Wire format: every message is a 40-byte header followed by the payload.  The
header carries the operation descriptor, so a receiver checks that the sender
runs the same collective, count, dtype, op, root and algorithm before it
accepts a byte.  Receives are matched to messages in posting order per pair;
a receive reads header and payload with one ``readv`` straight into the
caller's buffer.  A failing rank sends an abort frame (a header with the
ABORT magic and its error kind) to every peer whose stream is at a message
boundary, then shuts its sockets down, so the failure spreads in
milliseconds instead of waiting for every rank's timeout.
"""

from libc.errno cimport EAGAIN, EINTR, errno
from libc.stdint cimport int32_t, int64_t, uint8_t, uint32_t, uint64_t
from libc.stdio cimport snprintf
from libc.stdlib cimport calloc, free, realloc
from libc.string cimport memcpy, memmove, memset
from posix.unistd cimport close as c_close, read as c_read, write as c_write
from posix.uio cimport iovec, readv

from pycollect._ext._transport cimport *
from pycollect._ext._tls cimport TlsOps
from cpython.pycapsule cimport PyCapsule_GetPointer
from pycollect._ext._shm cimport (Ring, RingHeader, Segment, cma_read, ring_attach, ring_peek, ring_read,
                                  ring_used, ring_write)

import os

cdef extern from "_sys.h" nogil:
    int64_t pc_now_ns()
    int pc_atomic_load(int* p)
    void pc_atomic_store(int* p, int v)
    uint64_t pc_load_u64(uint64_t* p)
    void pc_store_u64(uint64_t* p, uint64_t v)
    void pc_store_u32_sc(uint32_t* p, uint32_t v)
    uint32_t pc_exchange_u32(uint32_t* p, uint32_t v)
    void pc_fence()

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
    enum:
        MSG_NOSIGNAL
        MSG_DONTWAIT
        MSG_PEEK
        SHUT_WR
        SHUT_RDWR

cdef extern from "<poll.h>" nogil:
    struct pollfd:
        int fd
        short events
        short revents
    int poll(pollfd* fds, unsigned long nfds, int timeout)
    enum:
        POLLIN
        POLLOUT
        POLLERR
        POLLHUP

cdef extern from "<sys/eventfd.h>" nogil:
    int eventfd(unsigned int initval, int flags)
    enum:
        EFD_NONBLOCK
        EFD_CLOEXEC

cdef extern from "Python.h":
    int PyErr_CheckSignals() except -1

cdef extern from "pythread.h" nogil:
    unsigned long PyThread_get_thread_ident()

cdef extern from "<sched.h>" nogil:
    int sched_yield()

cdef extern from "<fcntl.h>" nogil:
    int fcntl(int fd, int cmd, ...)
    enum:
        F_GETFL
        F_SETFL
        O_NONBLOCK

cdef enum:
    MAGIC_DATA = 0x314d4350     # "PCM1" little-endian
    MAGIC_ABORT = 0x414d4350    # "PCMA"
    MAGIC_CMA = 0x434d4350      # "PCMC": a data message whose payload the receiver reads
                                # from the sender's memory (the stream carries its address)
    HDR_BYTES = 40
    CMA_CHUNK = 4 << 20         # bytes copied per pass, so other pairs keep moving

cdef packed struct MsgHeader:
    uint32_t magic
    uint32_t msgno      # per pair and direction, counts every message
    uint32_t seq
    uint8_t coll
    uint8_t dtype
    uint8_t redop
    uint8_t algo
    int32_t root
    uint32_t kind       # data frames: the context (group) id; abort frames: the error kind
    uint64_t count
    uint64_t nbytes

cdef struct Req:
    char* buf
    size_t nbytes
    size_t done
    int peer
    int is_send
    int complete
    int next
    uint32_t hdr_done
    MsgHeader hdr
    int cma             # payload by cross-memory attach
    uint64_t addr       # ... at this address in the sender
    uint32_t addr_done  # bytes of the address streamed
    uint64_t ack_needed # a sender's large message is done when the peer's acks reach this
    OpDesc desc         # the operation the request belongs to (checked against headers)
    int flex            # a point-to-point receive: any message of at most nbytes

cdef struct Pair:
    int fd
    int send_head
    int send_tail
    int recv_head
    int recv_tail
    uint32_t sent_msgs
    uint32_t recv_msgs
    int eof             # the peer shut its side down (or reset)
    int data_waiting    # a message is queued that no receive is posted for yet
    int shm             # same host: messages go through rings, the socket only wakes and
                        # signals the end
    int cma             # this peer can read our memory: large messages go by address
    int pid             # the peer's process, for reading its memory
    Ring out            # our ring to the peer
    Ring inn            # the peer's ring to us
    uint64_t cma_sent   # large messages sent by address
    int ack_head        # sent by address, waiting for the peer to copy them out
    int ack_tail
    void* tls           # transport "tcp+tls": this pair's SSL*, through which all its bytes go
    uint32_t tls_peeked # bytes of the next header already decrypted (TLS has no MSG_PEEK)
    char tls_peek[HDR_BYTES]


cdef inline int _same_op(const MsgHeader* h, const OpDesc* d) noexcept nogil:
    return (h.kind == d.context and h.coll == d.coll and h.dtype == d.dtype and h.redop == d.redop
            and h.algo == d.algo and h.root == d.root and h.count == d.count)


cdef inline int _would_block(int e) noexcept nogil:
    return e == EAGAIN  # EWOULDBLOCK == EAGAIN on Linux


cdef class TcpTransport(Transport):
    """A connected full mesh of TCP sockets, one per peer."""

    cdef Pair* pairs
    cdef Req* reqs
    cdef int nreqs
    cdef int cap_reqs
    cdef int wake_fd
    cdef int abort_flag
    cdef int closed
    cdef int64_t spin_ns
    cdef int yield_spin
    cdef pollfd* pfds
    cdef int* pfd_peer
    cdef list addrs
    cdef unsigned long main_thread
    cdef Segment segment
    cdef size_t cma_min
    cdef const TlsOps* tls_ops
    cdef list tls_streams       # the objects that own the pairs' SSL*
    cdef public list host_ids   # rendezvous' host identity of every rank, or None

    def __cinit__(self):
        self.pairs = NULL
        self.reqs = NULL
        self.pfds = NULL
        self.pfd_peer = NULL
        self.wake_fd = -1
        self.closed = 0

    def __init__(self, int rank, int size, fds, addrs, double spin_us=50.0,
                 bint yield_spin=False):
        """Take ownership of ``fds`` (one connected socket per peer, -1 for self)."""
        if size < 1 or not 0 <= rank < size or len(fds) != size or len(addrs) != size:
            raise ValueError("TcpTransport: inconsistent rank, size, fds or addrs")
        self.rank = rank
        self.size = size
        self.addrs = [str(a) for a in addrs]
        self.spin_ns = <int64_t>(spin_us * 1000.0)
        self.yield_spin = yield_spin
        self.timeout_s = 0
        self.pairs = <Pair*>calloc(size, sizeof(Pair))
        self.pfds = <pollfd*>calloc(size + 1, sizeof(pollfd))
        self.pfd_peer = <int*>calloc(size + 1, sizeof(int))
        self.cap_reqs = 64
        self.reqs = <Req*>calloc(self.cap_reqs, sizeof(Req))
        if not (self.pairs and self.pfds and self.pfd_peer and self.reqs):
            raise MemoryError()
        cdef int p, fd, flags
        for p in range(size):
            fd = int(fds[p])
            self.pairs[p].fd = fd
            self.pairs[p].send_head = self.pairs[p].send_tail = -1
            self.pairs[p].recv_head = self.pairs[p].recv_tail = -1
            self.pairs[p].ack_head = self.pairs[p].ack_tail = -1
            if p != rank:
                if fd < 0:
                    raise ValueError("TcpTransport: no socket for peer %d" % p)
                flags = fcntl(fd, F_GETFL, 0)
                fcntl(fd, F_SETFL, flags | O_NONBLOCK)
        import threading
        self.main_thread = threading.main_thread().ident
        self.wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)
        if self.wake_fd < 0:
            raise OSError(errno, os.strerror(errno), "eventfd")

    def attach_shared(self, Segment segment, local_of, size_t ring_bytes, pids, cma_peers,
                      size_t cma_min_bytes):
        """Route same-host peers through ``segment``'s rings.

        ``local_of[p]`` is rank p's index on this host (-1 elsewhere);
        ``cma_peers`` are the peers that can read this process's memory.
        """
        cdef int p, other, me = local_of[self.rank]
        cdef int nlocal = sum(1 for x in local_of if x >= 0)
        cdef size_t stride = sizeof(RingHeader) + ring_bytes
        cdef Pair* pr
        self.segment = segment
        self.cma_min = cma_min_bytes
        for p in range(self.size):
            if p == self.rank or local_of[p] < 0:
                continue
            pr = &self.pairs[p]
            other = local_of[p]
            ring_attach(&pr.out, segment.base + (me * nlocal + other) * stride, ring_bytes)
            ring_attach(&pr.inn, segment.base + (other * nlocal + me) * stride, ring_bytes)
            pr.pid = pids[p]
            pr.cma = p in cma_peers
            pr.shm = 1

    def pair_kinds(self):
        """How each peer is reached: "self", "tcp", "shm" or "shm+cma" (TLS pairs: "tcp")."""
        return ["self" if p == self.rank else ("shm+cma" if self.pairs[p].cma else "shm")
                if self.pairs[p].shm else "tcp" for p in range(self.size)]

    def tls_pairs(self):
        """Which peers this rank talks to through TLS."""
        return [self.pairs[p].tls != NULL for p in range(self.size)]

    def peer_pids(self):
        """Each same-host peer's process id (this process's own for self), -1 elsewhere."""
        return [os.getpid() if p == self.rank else (self.pairs[p].pid if self.pairs[p].shm
                                                    else -1) for p in range(self.size)]

    def attach_tls(self, ops, streams):
        """Send and receive through TLS: ``streams[p].handle()`` is peer p's ``SSL*``
        (None for self); ``ops`` is ``_tls.engine_ops()``.  Keeps ``streams`` alive."""
        cdef int p
        self.tls_ops = <const TlsOps*>PyCapsule_GetPointer(ops, b"pycollect._ext._tls.TlsOps")
        self.tls_streams = list(streams)
        for p in range(self.size):
            if p != self.rank:
                self.pairs[p].tls = <void*><size_t>self.tls_streams[p].handle()

    def __dealloc__(self):
        self._close_fds()
        free(self.pairs)
        free(self.reqs)
        free(self.pfds)
        free(self.pfd_peer)

    cdef void _close_fds(self) noexcept:
        cdef int p
        if self.pairs != NULL:
            for p in range(self.size):
                if self.pairs[p].fd >= 0:
                    c_close(self.pairs[p].fd)
                    self.pairs[p].fd = -1
        if self.wake_fd >= 0:
            c_close(self.wake_fd)
            self.wake_fd = -1

    def close(self):
        """Close every socket; later operations fail."""
        if not self.closed:
            self.closed = 1
            # A graceful close: no abort frames, the peers just see end of stream.
            with nogil:
                Transport.set_error(self, ERR_INTERNAL, -1, "", 0, "the transport is closed")
            self._close_fds()

    def abort(self):
        """End the operation in progress (from any thread) with ERR_ABORTED."""
        cdef uint64_t one = 1
        pc_atomic_store(&self.abort_flag, 1)
        if self.wake_fd >= 0:
            c_write(self.wake_fd, &one, 8)

    def peer_address(self, int peer):
        return self.addrs[peer] if 0 <= peer < self.size else "?"

    # -- the interface --------------------------------------------------

    cdef int begin(self, const OpDesc* op, double timeout_s) noexcept nogil:
        self.op = op[0]
        if self.failed:
            return -1
        if pc_atomic_load(&self.abort_flag):
            return self.set_error(ERR_ABORTED, -1, "", 0, "abort() was called")
        self.timeout_s = timeout_s
        self.deadline_ns = pc_now_ns() + <int64_t>(timeout_s * 1e9)
        # Sends of the previous operation still in flight (a large message the
        # peer has not acknowledged yet) finish before their slots are reused.
        if not self._all_done(-1) and self._progress(-1) < 0:
            return -1
        self.nreqs = 0
        return 0

    cdef int _new_req(self, int peer, int is_send, void* buf, size_t nbytes) noexcept nogil:
        cdef Req* grown
        cdef Req* r
        if self.failed:
            return -1
        if peer < 0 or peer >= self.size or peer == self.rank:
            return self.set_error(ERR_INTERNAL, peer, "", 0, "message to an invalid peer")
        if self.nreqs == self.cap_reqs:
            grown = <Req*>realloc(self.reqs, 2 * self.cap_reqs * sizeof(Req))
            if grown == NULL:
                return self.set_error(ERR_INTERNAL, peer, "realloc", 0, "out of memory")
            self.reqs = grown
            self.cap_reqs *= 2
        r = &self.reqs[self.nreqs]
        memset(r, 0, sizeof(Req))
        r.buf = <char*>buf
        r.nbytes = nbytes
        r.peer = peer
        r.is_send = is_send
        r.next = -1
        r.desc = self.op
        self.nreqs += 1
        return self.nreqs - 1

    cdef int post_send(self, int peer, const void* buf, size_t nbytes) noexcept nogil:
        cdef int idx = self._new_req(peer, 1, <void*>buf, nbytes)
        if idx < 0:
            return -1
        cdef Req* r = &self.reqs[idx]
        cdef Pair* pr = &self.pairs[peer]
        r.hdr.magic = MAGIC_DATA
        if pr.cma and nbytes >= self.cma_min:
            r.hdr.magic = MAGIC_CMA
            r.cma = 1
            r.addr = <uint64_t>buf
        r.hdr.msgno = pr.sent_msgs
        pr.sent_msgs += 1
        self._fill_desc(&r.hdr)
        r.hdr.nbytes = nbytes
        if pr.send_tail >= 0:
            self.reqs[pr.send_tail].next = idx
        else:
            pr.send_head = idx
        pr.send_tail = idx
        # Push eagerly: a message the socket takes now is on the wire while
        # the caller posts the rest.
        if pr.send_head == idx and self._do_send(peer) < 0:
            return -1
        return idx

    cdef int post_recv(self, int peer, void* buf, size_t nbytes) noexcept nogil:
        cdef int idx = self._new_req(peer, 0, buf, nbytes)
        if idx < 0:
            return -1
        cdef Pair* pr = &self.pairs[peer]
        if pr.recv_tail >= 0:
            self.reqs[pr.recv_tail].next = idx
        else:
            pr.recv_head = idx
        pr.recv_tail = idx
        pr.data_waiting = 0
        return idx

    cdef int post_recv_upto(self, int peer, void* buf, size_t capacity) noexcept nogil:
        cdef int idx = self.post_recv(peer, buf, capacity)
        if idx >= 0:
            self.reqs[idx].flex = 1
        return idx

    cdef int done(self, int req) noexcept nogil:
        return 0 <= req < self.nreqs and self.reqs[req].complete

    cdef int64_t received(self, int req) noexcept nogil:
        if 0 <= req < self.nreqs and self.reqs[req].complete:
            return <int64_t>self.reqs[req].nbytes
        return -1

    cdef int progress_until(self, int64_t until_ns) noexcept nogil:
        return self._progress_to(-1, until_ns)

    cdef int wait(self, int req) noexcept nogil:
        if req < 0 or req >= self.nreqs:
            return self.set_error(ERR_INTERNAL, -1, "", 0, "wait on an invalid request")
        return self._progress(req)

    cdef int wait_all(self) noexcept nogil:
        return self._progress(-1)

    cdef int probe(self, int peer, Probe* out) noexcept nogil:
        """Wait for a point-to-point message of this context at the head of ``peer``'s
        stream (-1: of any peer's); describe it in ``out`` without consuming it."""
        return self.probe_until(peer, out, 0)

    cdef int probe_until(self, int peer, Probe* out, int64_t until_ns) noexcept nogil:
        """probe, giving up with -2 (no error) once ``until_ns`` passes, when not 0."""
        cdef int n, k, rc
        cdef int64_t now, spin_end = pc_now_ns() + self.spin_ns
        cdef uint64_t drained
        self._look_again(peer)
        while True:
            rc = self._probe_pass(peer, out, &k)
            if rc != -2:
                return rc
            now = pc_now_ns()
            if now >= self.deadline_ns:
                return self.set_error(ERR_TIMEOUT, peer, "", 0,
                                      "waiting for a message" if peer >= 0 else
                                      "waiting for a message from any rank")
            if until_ns and now >= until_ns:
                return -2
            if now < spin_end:
                if self.yield_spin:
                    sched_yield()
                continue
            if self._signalled():
                return -1
            self.pfds[0].fd = self.wake_fd
            self.pfds[0].events = POLLIN
            self.pfds[0].revents = 0
            n = ((self.deadline_ns if until_ns == 0 or until_ns > self.deadline_ns
                  else until_ns) - now) // 1000000 + 1
            if not self._arm_rings():
                rc = poll(self.pfds, k, n if n < 1000 else 1000)
                self._disarm_rings()
                if rc > 0 and self.pfds[0].revents:
                    c_read(self.wake_fd, &drained, 8)
                for n in range(1, k):
                    if self.pfds[n].revents and self.pairs[self.pfd_peer[n]].shm:
                        self._drain_doorbell(self.pfd_peer[n])

    cdef void _look_again(self, int peer) noexcept nogil:
        """Heads set aside while a collective ran may be the message a probe wants."""
        cdef int p
        for p in range(self.size):
            if peer < 0 or p == peer:
                self.pairs[p].data_waiting = 0

    cdef int _probe_pass(self, int peer, Probe* out, int* npfds) noexcept nogil:
        """One look for probe(): the peer whose head matches, -2 when none does yet
        (``pfds[1:npfds]`` then lists what to wait on), or -1 on an error.

        Requests already posted (a batch of sends and receives) move on meanwhile,
        and a pair with receives posted is theirs first: its head is not a candidate.
        """
        cdef int p, n, k = 1, rc, candidate
        cdef short ev
        cdef Pair* pr
        cdef MsgHeader h
        if self.failed:
            return -1
        if pc_atomic_load(&self.abort_flag):
            return self.set_error(ERR_ABORTED, -1, "", 0, "abort() was called")
        for p in range(self.size):
            pr = &self.pairs[p]
            if (pr.send_head >= 0 or pr.ack_head >= 0) and self._do_send(p) < 0:
                return -1
            if pr.recv_head >= 0 and self._do_recv(p) < 0:
                return -1
        for p in range(self.size):
            pr = &self.pairs[p]
            if p == self.rank or pr.fd < 0:
                continue
            candidate = (peer < 0 or p == peer) and pr.recv_head < 0 \
                and not (peer < 0 and (pr.data_waiting or pr.eof))
            if candidate:
                n = self._peek_header(p, &h)
                if n == HDR_BYTES and (h.magic == MAGIC_DATA or h.magic == MAGIC_CMA) \
                        and h.coll == COLL_P2P and h.kind == self.op.context \
                        and (self.op.root < 0 or h.root == self.op.root):
                    out.peer = p
                    out.nbytes = h.nbytes
                    out.desc.context = h.kind
                    out.desc.seq = h.seq
                    out.desc.coll = h.coll
                    out.desc.dtype = h.dtype
                    out.desc.redop = h.redop
                    out.desc.algo = h.algo
                    out.desc.root = h.root
                    out.desc.count = h.count
                    return p
                if n == HDR_BYTES and (h.magic == MAGIC_DATA or h.magic == MAGIC_CMA) \
                        and peer < 0:
                    pr.data_waiting = 1     # the head is for another operation
                    candidate = 0
                elif n == HDR_BYTES or n == 0 or (n < 0 and not _would_block(errno)):
                    # A mismatch, an abort frame, or end of stream: let the
                    # receive path name it.
                    rc = self.post_recv(p, NULL, 0)
                    if rc < 0 or self._do_recv(p) < 0:
                        return -1
                    return self.set_error(ERR_INTERNAL, p, "", 0, "probe lost its message")
            ev = 0
            if pr.shm:
                # Same host: the socket carries wake-ups and the end of stream.
                if not pr.eof and (candidate or pr.recv_head >= 0 or pr.send_head >= 0
                                   or pr.ack_head >= 0):
                    ev = POLLIN
            else:
                if candidate or pr.recv_head >= 0:
                    ev = POLLIN
                if pr.send_head >= 0:
                    ev |= POLLOUT
            if ev:
                self.pfds[k].fd = pr.fd
                self.pfds[k].events = ev
                self.pfds[k].revents = 0
                self.pfd_peer[k] = p
                k += 1
        npfds[0] = k
        return -2

    cdef int set_error(self, int kind, int peer, const char* syscall, int errnum,
                       const char* detail) noexcept nogil:
        if self.failed:
            return -1
        Transport.set_error(self, kind, peer, syscall, errnum, detail)
        self._spread_failure()
        return -1

    # -- the engine -----------------------------------------------------

    cdef inline void _fill_desc(self, MsgHeader* h) noexcept nogil:
        h.kind = self.op.context
        h.seq = self.op.seq
        h.coll = self.op.coll
        h.dtype = self.op.dtype
        h.redop = self.op.redop
        h.algo = self.op.algo
        h.root = self.op.root
        h.count = self.op.count

    cdef void _spread_failure(self) noexcept nogil:
        """Tell every peer we failed (abort frame where possible), then shut down."""
        cdef MsgHeader h
        cdef Pair* pr
        cdef iovec iov
        cdef int p, head
        if self.pairs == NULL:
            return
        memset(&h, 0, sizeof(h))
        h.magic = MAGIC_ABORT
        self._fill_desc(&h)
        # An abort frame carries the failure as first seen: the kind, the rank
        # that failed first (in msgno, plus one) and the rank it blamed (in
        # nbytes, plus one; 0: none), so a relayed failure keeps its origin.
        if self.err.origin >= 0:
            h.kind = self.err.origin_kind
            h.msgno = <uint32_t>(self.err.origin + 1)
        else:
            h.kind = self.err.kind
            h.msgno = <uint32_t>(self.rank + 1)
        h.nbytes = <uint64_t>((self.err.blamed if self.err.blamed >= 0 else self.err.peer) + 1)
        for p in range(self.size):
            pr = &self.pairs[p]
            if p == self.rank or pr.fd < 0:
                continue
            head = pr.send_head
            if head < 0 or (self.reqs[head].hdr_done == 0):
                if not pr.shm:
                    iov.iov_base = &h
                    iov.iov_len = HDR_BYTES
                    self._sock_send(pr, &iov, 1)
                elif pr.out.size - ring_used(&pr.out) >= HDR_BYTES:
                    iov.iov_base = &h
                    iov.iov_len = HDR_BYTES
                    ring_write(&pr.out, &iov, 1)
                    _wake_reader(pr)
            shutdown(pr.fd, SHUT_WR)

    # -- socket I/O: plain, or through the pair's TLS session --------------

    cdef ssize_t _sock_send(self, Pair* pr, iovec* iov, int cnt) noexcept nogil:
        cdef msghdr msg
        if pr.tls != NULL:
            return self.tls_ops.writev(pr.tls, iov, cnt)
        memset(&msg, 0, sizeof(msg))
        msg.msg_iov = iov
        msg.msg_iovlen = cnt
        return sendmsg(pr.fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT)

    cdef ssize_t _sock_readv(self, Pair* pr, iovec* iov, int cnt) noexcept nogil:
        """readv; on a TLS pair the peeked header bytes come first, then what OpenSSL has."""
        cdef size_t taken = 0, k
        cdef int i, left = 0
        cdef iovec rest[2]
        cdef ssize_t n
        if pr.tls == NULL:
            return readv(pr.fd, iov, cnt)
        if pr.tls_peeked == 0:
            return self.tls_ops.readv(pr.tls, iov, cnt)
        for i in range(cnt):
            k = iov[i].iov_len
            if k > pr.tls_peeked - taken:
                k = pr.tls_peeked - taken
            memcpy(iov[i].iov_base, pr.tls_peek + taken, k)
            taken += k
            if k < iov[i].iov_len and left < 2:
                rest[left].iov_base = (<char*>iov[i].iov_base) + k
                rest[left].iov_len = iov[i].iov_len - k
                left += 1
        pr.tls_peeked -= <uint32_t>taken
        memmove(pr.tls_peek, pr.tls_peek + taken, pr.tls_peeked)
        # Read on as readv would: a short count tells the caller the socket is empty,
        # and bytes left inside OpenSSL would wake no poll().
        n = self.tls_ops.readv(pr.tls, rest, left) if left and pr.tls_peeked == 0 else 0
        return <ssize_t>taken + (n if n > 0 else 0)

    cdef int _sock_peek(self, Pair* pr, MsgHeader* h) noexcept nogil:
        """recv(MSG_PEEK) of a header; a TLS pair decrypts it into ``tls_peek``."""
        cdef iovec iov
        cdef ssize_t n
        if pr.tls == NULL:
            return <int>recv(pr.fd, h, HDR_BYTES, MSG_PEEK | MSG_DONTWAIT)
        if pr.tls_peeked < HDR_BYTES:
            iov.iov_base = pr.tls_peek + pr.tls_peeked
            iov.iov_len = HDR_BYTES - pr.tls_peeked
            n = self.tls_ops.readv(pr.tls, &iov, 1)
            if n > 0:
                pr.tls_peeked += <uint32_t>n
            elif pr.tls_peeked == 0:
                return <int>n
        memcpy(h, pr.tls_peek, pr.tls_peeked)
        return <int>pr.tls_peeked

    cdef int _sock_take_peeked(self, Pair* pr, MsgHeader* h) noexcept nogil:
        """Consume the header that _sock_peek returned."""
        if pr.tls == NULL:
            return <int>recv(pr.fd, h, HDR_BYTES, MSG_DONTWAIT)
        pr.tls_peeked = 0
        return HDR_BYTES

    cdef int _tls_ready(self) noexcept nogil:
        """1 if a TLS pair holds decrypted bytes a receive waits for (poll() cannot see
        them), -1 on an error; idle pairs' held bytes are looked at like early messages."""
        cdef int p
        cdef Pair* pr
        if self.tls_ops == NULL:
            return 0
        for p in range(self.size):
            pr = &self.pairs[p]
            if pr.tls == NULL or not (pr.tls_peeked or self.tls_ops.pending(pr.tls)):
                continue
            if pr.recv_head >= 0:
                return 1
            if not pr.data_waiting and self._peek_idle(p) < 0:
                return -1
        return 0

    cdef int _shm_send(self, int peer) noexcept nogil:
        """Copy queued messages into ``peer``'s ring until it is full; 1 if progress."""
        cdef Pair* pr = &self.pairs[peer]
        cdef Req* r
        cdef iovec iov[2]
        cdef int cnt, progressed = 0
        cdef size_t n, hrem, body, sent
        cdef uint64_t acks = pc_load_u64(&pr.out.hdr.acks)
        while pr.ack_head >= 0 and self.reqs[pr.ack_head].ack_needed <= acks:
            r = &self.reqs[pr.ack_head]
            r.complete = 1
            pr.ack_head = r.next
            if pr.ack_head < 0:
                pr.ack_tail = -1
            progressed = 1
        if pr.ack_head >= 0 and pr.eof:
            # The reader left before copying a message from our memory: no ack will come.
            # What it wrote before leaving comes first: an abort frame says why it left.
            if ring_used(&pr.inn) >= HDR_BYTES and not pr.data_waiting:
                if pr.recv_head >= 0:
                    return progressed       # the posted receive reads it
                if self._peek_idle(peer) < 0:
                    return -1
            return self.set_error(ERR_PEER, peer, "", 0, "exited or closed its context before "
                                  "copying our data (shared memory)")
        while pr.send_head >= 0:
            r = &self.reqs[pr.send_head]
            if pr.eof:
                return self.set_error(ERR_PEER, peer, "", 0, "exited or closed its context "
                                      "(shared memory)")
            cnt = 0
            hrem = HDR_BYTES - r.hdr_done
            if hrem:
                iov[0].iov_base = (<char*>&r.hdr) + r.hdr_done
                iov[0].iov_len = hrem
                cnt = 1
            # A large message streams only its address; the peer copies the rest.
            body = 8 if r.cma else r.nbytes
            sent = r.addr_done if r.cma else r.done
            if sent < body:
                iov[cnt].iov_base = ((<char*>&r.addr) + sent) if r.cma else (r.buf + sent)
                iov[cnt].iov_len = body - sent
                cnt += 1
            n = ring_write(&pr.out, iov, cnt)
            if n == 0:
                break
            progressed = 1
            if n >= hrem:
                r.hdr_done = HDR_BYTES
                if r.cma:
                    r.addr_done += <uint32_t>(n - hrem)
                else:
                    r.done += n - hrem
            else:
                r.hdr_done += <uint32_t>n
            if r.hdr_done < HDR_BYTES or (r.addr_done if r.cma else r.done) < body:
                break
            pr.send_head = r.next
            if pr.send_head < 0:
                pr.send_tail = -1
            if r.cma:
                pr.cma_sent += 1
                r.ack_needed = pr.cma_sent
                r.next = -1
                if pr.ack_tail >= 0:
                    self.reqs[pr.ack_tail].next = self.reqs_index(r)
                else:
                    pr.ack_head = self.reqs_index(r)
                pr.ack_tail = self.reqs_index(r)
            else:
                r.complete = 1
        if progressed:
            _wake_reader(pr)
        return progressed

    cdef inline int reqs_index(self, Req* r) noexcept nogil:
        return <int>(r - self.reqs)

    cdef int _do_send(self, int peer) noexcept nogil:
        """Write queued messages to ``peer`` until the socket is full; 1 if progress."""
        cdef Pair* pr = &self.pairs[peer]
        cdef Req* r
        cdef iovec iov[2]
        cdef msghdr msg
        cdef ssize_t n
        cdef size_t hrem
        cdef int progressed = 0
        if pr.shm:
            return self._shm_send(peer)
        memset(&msg, 0, sizeof(msg))
        msg.msg_iov = iov
        while pr.send_head >= 0:
            r = &self.reqs[pr.send_head]
            msg.msg_iovlen = 0
            hrem = HDR_BYTES - r.hdr_done
            if hrem:
                iov[0].iov_base = (<char*>&r.hdr) + r.hdr_done
                iov[0].iov_len = hrem
                msg.msg_iovlen = 1
            if r.done < r.nbytes:
                iov[msg.msg_iovlen].iov_base = r.buf + r.done
                iov[msg.msg_iovlen].iov_len = r.nbytes - r.done
                msg.msg_iovlen += 1
            n = self._sock_send(pr, iov, <int>msg.msg_iovlen)
            if n < 0:
                if errno == EINTR:
                    continue
                if _would_block(errno):
                    return progressed
                return self.set_error(ERR_PEER, peer, "SSL_write" if pr.tls else "sendmsg", errno,
                                      "connection lost while sending")
            progressed = 1
            if <size_t>n >= hrem:
                r.hdr_done = HDR_BYTES
                r.done += <size_t>n - hrem
            else:
                r.hdr_done += <uint32_t>n
            if r.hdr_done == HDR_BYTES and r.done == r.nbytes:
                r.complete = 1
                pr.send_head = r.next
                if pr.send_head < 0:
                    pr.send_tail = -1
            else:
                return progressed
        return progressed

    cdef int _check_header(self, int peer, Req* r) noexcept nogil:
        """Validate a complete header against the posted receive."""
        cdef MsgHeader* h = &r.hdr
        cdef Pair* pr = &self.pairs[peer]
        cdef char detail[200]
        cdef int blamed, origin
        if h.magic == MAGIC_ABORT:
            self._note_theirs(h)
            blamed = <int>h.nbytes - 1 if h.nbytes <= <uint64_t>self.size else -1
            origin = <int>h.msgno - 1 if 0 < h.msgno <= <uint32_t>self.size else peer
            if not self.failed:
                self.err.blamed = blamed
                self.err.origin = origin
                self.err.origin_kind = h.kind
            if h.kind == ERR_MISMATCH:
                if origin == peer:
                    snprintf(detail, sizeof(detail), "it reported that ranks disagree")
                else:
                    snprintf(detail, sizeof(detail), "it relayed rank %d's report that ranks "
                             "disagree", origin)
                return self.set_error(ERR_MISMATCH, peer, "", 0, detail)
            if origin != peer:
                snprintf(detail, sizeof(detail), "relayed that rank %d failed (%s error "
                         "involving rank %d)", origin, _kind_name(h.kind), blamed)
            elif blamed >= 0 and blamed != peer:
                snprintf(detail, sizeof(detail), "failed (%s error involving rank %d) and "
                         "left the group", _kind_name(h.kind), blamed)
            else:
                snprintf(detail, sizeof(detail), "failed (%s error) and left the group",
                         _kind_name(h.kind))
            return self.set_error(ERR_PEER, peer, "", 0, detail)
        if h.magic != MAGIC_DATA and h.magic != MAGIC_CMA:
            snprintf(detail, sizeof(detail), "sent bytes that are not a pycollect message "
                     "(magic 0x%08x)", h.magic)
            return self.set_error(ERR_PEER, peer, "", 0, detail)
        if r.flex:
            if h.coll != COLL_P2P or h.kind != r.desc.context or h.dtype != r.desc.dtype \
                    or (r.desc.root >= 0 and h.root != r.desc.root) or h.nbytes > r.nbytes:
                self._note_theirs(h)
                return self.set_error(ERR_MISMATCH, peer, "", 0, "the message does not match "
                                      "this receive (tag, dtype, or larger than the buffer)")
            r.nbytes = <size_t>h.nbytes     # the message as it is described
        elif h.seq != r.desc.seq or not _same_op(h, &r.desc):
            self._note_theirs(h)
            return self.set_error(ERR_MISMATCH, peer, "", 0, "")
        if h.msgno != pr.recv_msgs:
            snprintf(detail, sizeof(detail), "message %u arrived where %u was expected",
                     h.msgno, pr.recv_msgs)
            return self.set_error(ERR_PEER, peer, "", 0, detail)
        if h.nbytes != r.nbytes:
            snprintf(detail, sizeof(detail), "a message of %llu bytes arrived where %llu "
                     "were expected", <unsigned long long>h.nbytes,
                     <unsigned long long>r.nbytes)
            return self.set_error(ERR_MISMATCH, peer, "", 0, detail)
        pr.recv_msgs += 1
        return 0

    cdef void _note_theirs(self, const MsgHeader* h) noexcept nogil:
        if self.failed:
            return
        self.err.theirs.context = h.kind if h.magic == MAGIC_DATA else self.op.context
        self.err.theirs.seq = h.seq
        self.err.theirs.coll = h.coll
        self.err.theirs.dtype = h.dtype
        self.err.theirs.redop = h.redop
        self.err.theirs.algo = h.algo
        self.err.theirs.root = h.root
        self.err.theirs.count = h.count
        self.err.has_theirs = 1

    cdef int _gone(self, int peer) noexcept nogil:
        """A same-host peer whose socket ended and whose ring is drained has left."""
        return self.set_error(ERR_PEER, peer, "", 0, "exited or closed its context before "
                              "sending what this rank waits for (shared memory)")

    cdef ssize_t _ring_take(self, int peer, char* dst, size_t want) noexcept nogil:
        """Read up to ``want`` bytes from ``peer``'s ring: the count, or -1 once it is gone."""
        cdef Pair* pr = &self.pairs[peer]
        cdef iovec iov
        iov.iov_base = dst
        iov.iov_len = want
        cdef size_t n = ring_read(&pr.inn, &iov, 1)
        if n == 0 and pr.eof and ring_used(&pr.inn) == 0:
            return self._gone(peer)
        return <ssize_t>n

    cdef int _shm_recv(self, int peer) noexcept nogil:
        """Copy messages out of ``peer``'s ring (or its memory) into posted receives."""
        cdef Pair* pr = &self.pairs[peer]
        cdef Req* r
        cdef size_t want
        cdef ssize_t got
        cdef int progressed = 0
        while pr.recv_head >= 0:
            r = &self.reqs[pr.recv_head]
            if r.hdr_done < HDR_BYTES:
                got = self._ring_take(peer, (<char*>&r.hdr) + r.hdr_done,
                                      HDR_BYTES - r.hdr_done)
                if got < 0:
                    return -1
                if got == 0:
                    break
                progressed = 1
                r.hdr_done += <uint32_t>got
                if r.hdr_done < HDR_BYTES:
                    break
                if self._check_header(peer, r) < 0:
                    return -1
                r.cma = r.hdr.magic == MAGIC_CMA
            if r.cma:
                if r.addr_done < 8:
                    got = self._ring_take(peer, (<char*>&r.addr) + r.addr_done, 8 - r.addr_done)
                    if got < 0:
                        return -1
                    if got == 0:
                        break
                    progressed = 1
                    r.addr_done += <uint32_t>got
                    if r.addr_done < 8:
                        break
                want = r.nbytes - r.done
                if want > CMA_CHUNK:
                    want = CMA_CHUNK
                if want:
                    got = cma_read(pr.pid, r.buf + r.done, r.addr + r.done, want)
                    if got <= 0:
                        return self.set_error(ERR_PEER, peer, "process_vm_readv", errno,
                                              "cannot read the peer's memory")
                    r.done += <size_t>got
                    progressed = 1
                    if r.done < r.nbytes:
                        break       # the next pass copies more; other pairs move meanwhile
                pc_store_u64(&pr.inn.hdr.acks, pr.inn.hdr.acks + 1)
            elif r.done < r.nbytes:
                got = self._ring_take(peer, r.buf + r.done, r.nbytes - r.done)
                if got < 0:
                    return -1
                if got == 0:
                    break
                progressed = 1
                r.done += <size_t>got
                if r.done < r.nbytes:
                    break
            r.complete = 1
            pr.recv_head = r.next
            if pr.recv_head < 0:
                pr.recv_tail = -1
        if progressed:
            _wake_writer(pr)
        return progressed

    cdef int _do_recv(self, int peer) noexcept nogil:
        """Read into posted receives from ``peer`` until the socket is empty; 1 if progress."""
        cdef Pair* pr = &self.pairs[peer]
        cdef Req* r
        cdef iovec iov[2]
        cdef int cnt
        cdef ssize_t n
        cdef size_t hrem
        cdef int progressed = 0
        cdef char detail[200]
        if pr.shm:
            return self._shm_recv(peer)
        while pr.recv_head >= 0:
            r = &self.reqs[pr.recv_head]
            hrem = HDR_BYTES - r.hdr_done
            cnt = 0
            if hrem:
                iov[0].iov_base = (<char*>&r.hdr) + r.hdr_done
                iov[0].iov_len = hrem
                cnt = 1
            if r.done < r.nbytes and not (hrem and r.flex):
                iov[cnt].iov_base = r.buf + r.done
                iov[cnt].iov_len = r.nbytes - r.done
                cnt += 1
            n = self._sock_readv(pr, iov, cnt)
            if n < 0:
                if errno == EINTR:
                    continue
                if _would_block(errno):
                    return progressed
                return self.set_error(ERR_PEER, peer, "SSL_read" if pr.tls else "readv", errno,
                                      "connection lost while receiving")
            if n == 0:
                pr.eof = 1
                if r.hdr_done == 0:
                    return self.set_error(ERR_PEER, peer, "", 0,
                                          "closed its connection (the process exited or "
                                          "closed its context)")
                snprintf(detail, sizeof(detail), "closed its connection in the middle of a "
                         "message (%llu of %llu bytes received)",
                         <unsigned long long>r.done, <unsigned long long>r.nbytes)
                return self.set_error(ERR_PEER, peer, "", 0, detail)
            progressed = 1
            if hrem:
                if <size_t>n >= hrem:
                    r.hdr_done = HDR_BYTES
                    r.done += <size_t>n - hrem
                    if self._check_header(peer, r) < 0:
                        return -1
                    if r.flex and r.done < r.nbytes:
                        continue    # the header alone was read: now the payload
                else:
                    r.hdr_done += <uint32_t>n
                    return progressed
            else:
                r.done += <size_t>n
            if r.done == r.nbytes:
                r.complete = 1
                pr.recv_head = r.next
                if pr.recv_head < 0:
                    pr.recv_tail = -1
            else:
                return progressed
        return progressed

    cdef int _peek_header(self, int peer, MsgHeader* h) noexcept nogil:
        """Copy the next header from ``peer``'s stream without consuming it: byte count,
        0 at the end of the stream, -1 (errno EAGAIN) when it is not all there yet."""
        cdef Pair* pr = &self.pairs[peer]
        cdef size_t n
        if not pr.shm:
            return self._sock_peek(pr, h)
        self._drain_doorbell(peer)
        n = ring_peek(&pr.inn, h, HDR_BYTES)
        if n == HDR_BYTES or (n == 0 and pr.eof):
            return <int>n
        errno = EAGAIN
        return -1

    cdef void _drain_doorbell(self, int peer) noexcept nogil:
        """Consume wake-up bytes on a same-host peer's socket; note its end."""
        cdef char junk[64]
        cdef ssize_t n
        cdef Pair* pr = &self.pairs[peer]
        while not pr.eof:
            n = recv(pr.fd, junk, sizeof(junk), MSG_DONTWAIT)
            if n == 0 or (n < 0 and not _would_block(errno) and errno != EINTR):
                pr.eof = 1
            elif n < 0:
                break

    cdef int _peek_idle(self, int peer) noexcept nogil:
        """A peer we expect nothing from became readable: an abort frame, EOF or early data."""
        cdef Pair* pr = &self.pairs[peer]
        cdef MsgHeader h
        cdef iovec iov
        cdef ssize_t n
        if pr.shm:
            self._drain_doorbell(peer)
            n = <ssize_t>ring_peek(&pr.inn, &h, HDR_BYTES)
            if n == HDR_BYTES and h.magic == MAGIC_ABORT:
                iov.iov_base = &h
                iov.iov_len = HDR_BYTES
                ring_read(&pr.inn, &iov, 1)
        else:
            n = self._sock_peek(pr, &h)
        if n == 0 and not pr.shm:
            pr.eof = 1
            return 0
        if n < 0:
            if not _would_block(errno) and errno != EINTR:
                pr.eof = 1
            return 0
        if n < 4:
            return 0
        if h.magic == MAGIC_DATA or h.magic == MAGIC_CMA:
            # An early message is normal when the peer is ahead (a later
            # collective, another group's, or a point-to-point message, which
            # carries no collective sequence number).  One of this collective
            # that no receive here will ever match, or one of an earlier
            # collective of this group, means disagreement.
            if n == HDR_BYTES and h.kind == self.op.context and h.coll != COLL_P2P and (
                    <int32_t>(h.seq - self.op.seq) < 0 or (
                        h.seq == self.op.seq and not _same_op(&h, &self.op))):
                self._note_theirs(&h)
                return self.set_error(ERR_MISMATCH, peer, "", 0, "")
            pr.data_waiting = 1
            return 0
        if h.magic == MAGIC_ABORT and n < HDR_BYTES:
            return 0
        if not pr.shm:
            n = self._sock_take_peeked(pr, &h)
        cdef Req fake
        memset(&fake, 0, sizeof(Req))
        fake.hdr = h
        return self._check_header(peer, &fake)

    cdef int _all_done(self, int target) noexcept nogil:
        cdef int p
        if target >= 0:
            return self.reqs[target].complete
        for p in range(self.size):
            if (self.pairs[p].send_head >= 0 or self.pairs[p].recv_head >= 0
                    or self.pairs[p].ack_head >= 0):
                return 0
        return 1

    cdef int _timeout(self) noexcept nogil:
        """Fail with ERR_TIMEOUT, naming the peers still owed data."""
        cdef char detail[200]
        cdef int p, off = 0
        cdef Pair* pr
        off = snprintf(detail, sizeof(detail), "waiting for")
        for p in range(self.size):
            pr = &self.pairs[p]
            if p == self.rank or (pr.recv_head < 0 and pr.send_head < 0 and pr.ack_head < 0):
                continue
            if off < <int>sizeof(detail) - 40:
                off += snprintf(detail + off, sizeof(detail) - off, " rank %d (%s)", p,
                                "for its data" if pr.recv_head >= 0 else
                                "to take our data")
        self.err.blamed = -1
        cdef int first = -1
        for p in range(self.size):
            if p != self.rank and (self.pairs[p].recv_head >= 0 or self.pairs[p].send_head >= 0
                                   or self.pairs[p].ack_head >= 0):
                first = p
                break
        return self.set_error(ERR_TIMEOUT, first, "", 0, detail)

    cdef int _block(self, int64_t now, int64_t until_ns) noexcept nogil:
        """Sleep in poll() until some pair can move, the deadline (or ``until_ns``, when
        not 0), or abort()."""
        cdef int n = 0, p, i, rc
        cdef short ev
        cdef Pair* pr
        cdef uint64_t drained
        cdef int64_t end = self.deadline_ns if until_ns == 0 or until_ns > self.deadline_ns \
            else until_ns
        cdef int64_t left_ms = (end - now) // 1000000 + 1
        self.pfds[0].fd = self.wake_fd
        self.pfds[0].events = POLLIN
        self.pfds[0].revents = 0
        n = 1
        for p in range(self.size):
            # Early messages already in a ring from a peer we expect nothing
            # from: look at them now (an abort, a disagreement, or later work).
            pr = &self.pairs[p]
            if pr.shm and pr.recv_head < 0 and not pr.data_waiting \
                    and ring_used(&pr.inn) >= HDR_BYTES and self._peek_idle(p) < 0:
                return -1
        if self._arm_rings():
            return 0        # something arrived while we got ready to sleep
        rc = self._tls_ready()
        if rc:
            return 0 if rc > 0 else -1   # bytes OpenSSL holds wake no poll()
        for p in range(self.size):
            pr = &self.pairs[p]
            if p == self.rank or pr.fd < 0:
                continue
            ev = 0
            if pr.shm:
                # Same host: the socket carries only wake-ups and the end of stream.
                if not pr.eof:
                    ev = POLLIN
            else:
                if pr.send_head >= 0:
                    ev |= POLLOUT
                if pr.recv_head >= 0 or not (pr.eof or pr.data_waiting):
                    ev |= POLLIN
            if ev:
                self.pfds[n].fd = pr.fd
                self.pfds[n].events = ev
                self.pfds[n].revents = 0
                self.pfd_peer[n] = p
                n += 1
        if left_ms > 1000:
            left_ms = 1000
        if self._signalled():
            return -1
        rc = poll(self.pfds, n, <int>left_ms)
        self._disarm_rings()
        if rc < 0:
            if errno == EINTR:
                return -1 if self._signalled() else 0
            return self.set_error(ERR_INTERNAL, -1, "poll", errno, "poll failed")
        if self.pfds[0].revents:
            c_read(self.wake_fd, &drained, 8)
        for i in range(1, n):
            p = self.pfd_peer[i]
            if not self.pfds[i].revents:
                continue
            if self.pairs[p].shm:
                self._drain_doorbell(p)
                if self.pairs[p].recv_head < 0 and self._peek_idle(p) < 0:
                    return -1
            elif self.pairs[p].recv_head < 0:
                if self._peek_idle(p) < 0:
                    return -1
        return 0

    cdef int _arm_rings(self) noexcept nogil:
        """Ask same-host peers to ring our doorbell; 1 if there is already work."""
        cdef int p, ready = 0
        cdef Pair* pr
        for p in range(self.size):
            pr = &self.pairs[p]
            if not pr.shm or pr.eof:
                continue
            if not pr.data_waiting:
                pc_store_u32_sc(&pr.inn.hdr.reader_sleeping, 1)
            if pr.send_head >= 0 or pr.ack_head >= 0:
                pc_store_u32_sc(&pr.out.hdr.writer_sleeping, 1)
        pc_fence()
        for p in range(self.size):
            pr = &self.pairs[p]
            if not pr.shm or pr.eof:
                continue
            if ring_used(&pr.inn) and (pr.recv_head >= 0 or not pr.data_waiting):
                ready = 1
            if pr.send_head >= 0 and ring_used(&pr.out) < pr.out.size:
                ready = 1
            if pr.ack_head >= 0 and \
                    pc_load_u64(&pr.out.hdr.acks) >= self.reqs[pr.ack_head].ack_needed:
                ready = 1
        if ready:
            self._disarm_rings()
        return ready

    cdef void _disarm_rings(self) noexcept nogil:
        cdef int p
        for p in range(self.size):
            if self.pairs[p].shm:
                pc_store_u32_sc(&self.pairs[p].inn.hdr.reader_sleeping, 0)
                pc_store_u32_sc(&self.pairs[p].out.hdr.writer_sleeping, 0)

    cdef int _signalled(self) noexcept nogil:
        """On the main thread, run Python's signal handlers; a raising one ends the op."""
        if PyThread_get_thread_ident() != self.main_thread:
            return 0
        with gil:
            try:
                PyErr_CheckSignals()
            except BaseException as exc:
                self.interrupt = exc
        if self.interrupt is None:
            return 0
        return self.set_error(ERR_ABORTED, -1, "", 0, "interrupted by a signal")

    cdef int _progress(self, int target) noexcept nogil:
        """Drive every pair until ``target`` (or, for -1, everything) completes."""
        return self._progress_to(target, 0)

    cdef int _progress_to(self, int target, int64_t until_ns) noexcept nogil:
        """_progress that also returns 1 once ``until_ns`` (when not 0) has passed."""
        cdef int p, rc, progressed
        cdef int64_t now, spin_end
        cdef Pair* pr
        if self.failed:
            return -1
        spin_end = pc_now_ns() + self.spin_ns
        while True:
            if pc_atomic_load(&self.abort_flag):
                return self.set_error(ERR_ABORTED, -1, "", 0, "abort() was called")
            progressed = 0
            for p in range(self.size):
                pr = &self.pairs[p]
                if pr.send_head >= 0 or pr.ack_head >= 0:
                    rc = self._do_send(p)
                    if rc < 0:
                        return -1
                    progressed |= rc
                if pr.recv_head >= 0:
                    rc = self._do_recv(p)
                    if rc < 0:
                        return -1
                    progressed |= rc
            if self._all_done(target):
                return 0
            now = pc_now_ns()
            if now >= self.deadline_ns:
                return self._timeout()
            if until_ns and now >= until_ns:
                return 1
            if progressed:
                spin_end = now + self.spin_ns
                continue
            if now < spin_end:
                if self.yield_spin:
                    sched_yield()
                continue
            if self._block(now, until_ns) < 0:
                return -1


cdef inline void _wake_reader(Pair* pr) noexcept nogil:
    """After writing into a ring: ring the peer's doorbell if it sleeps on it."""
    cdef char bell = 1
    pc_fence()
    if pr.out.hdr.reader_sleeping and pc_exchange_u32(&pr.out.hdr.reader_sleeping, 0):
        send(pr.fd, &bell, 1, MSG_NOSIGNAL | MSG_DONTWAIT)


cdef inline void _wake_writer(Pair* pr) noexcept nogil:
    """After reading from a ring or acknowledging: wake a writer waiting for it."""
    cdef char bell = 1
    pc_fence()
    if pr.inn.hdr.writer_sleeping and pc_exchange_u32(&pr.inn.hdr.writer_sleeping, 0):
        send(pr.fd, &bell, 1, MSG_NOSIGNAL | MSG_DONTWAIT)


cdef const char* _kind_name(uint32_t kind) noexcept nogil:
    if kind == ERR_PEER:
        return "peer"
    if kind == ERR_TIMEOUT:
        return "timeout"
    if kind == ERR_MISMATCH:
        return "mismatch"
    if kind == ERR_ABORTED:
        return "abort"
    return "internal"
