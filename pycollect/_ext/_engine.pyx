"""The engine: request queues, header checks and matching, the spin and poll loop,
deadlines and abort spreading, written once over the channels of its pairs.

``Engine`` is the transport every built-in transport factory returns.  It owns
one pair per peer; a pair's bytes go through its channel (``_channel.pxd``):
a TCP socket (``_socket.pyx``), TLS over that socket (``_tls.pyx``) or a
shared-memory ring (``_shm.pyx``).  The rendezvous (``pycollect/plugins/``)
connects the sockets and picks the channels; from then on everything runs here
without the GIL, and the engine never asks which kind a channel is.

Progress is driven by the calling thread.  ``wait`` loops over the pairs that
have work queued, writing and reading as much as the channels take without
blocking, so sends and receives to several peers advance together.  When a
pass makes no progress the engine spins for ``spin_us`` microseconds (a polled
round trip on loopback is several times faster than a woken one), yielding the
core between passes when more of this host's ranks may run on its CPUs than it has
(``plugins/hosts.oversubscribed``), and then
blocks in ``poll`` until a channel is ready, the deadline passes or
``abort()`` writes to the wake-up eventfd.

Wire format: every message is a 40-byte header followed by the payload.  The
header carries the operation descriptor, so a receiver checks that the sender
runs the same collective, count, dtype, op, root and algorithm before it
accepts a byte.  Receives are matched to messages in posting order per pair;
a receive reads header and payload with one ``readv`` straight into the
caller's buffer (a channel whose messages may carry an address instead of a
payload reads the header first).  A failing rank sends an abort frame (a
header with the ABORT magic and its error kind) to every peer whose stream is
at a message boundary, so the failure spreads in milliseconds instead of
waiting for every rank's timeout; where it is half-way through a message it
finishes the message first (after a lost rank, what the peer has not read
within FINISH_MS is copied for ``recover()`` to write), and only a stream it
cannot bring to a boundary either way it shuts down.  The other pairs stay
open: ``recover()`` brings them back to a frame boundary (a reset frame each way, what came before
it discarded), so the survivors of a failure go on over the same channels
(``Context.shrink``, ``Context.agree``).

Messages from a channel's ``by_address_min`` bytes go by address: the stream
carries the header, the sender's buffer address and where the buffer lies in
the sender's pool of shared buffers (``AddrBody``); the receiver copies the
payload with memcpy from its view of that pool where it maps it
(_pool.pyx), else with the channel's ``read_remote``, and acknowledges it,
and the send completes on the acknowledgement.
"""

from libc.errno cimport EAGAIN, EFAULT, EINTR, errno
from libc.stdint cimport int32_t, int64_t, uint8_t, uint32_t, uint64_t
from libc.stdio cimport snprintf
from libc.stdlib cimport calloc, free, malloc, realloc
from libc.string cimport memcpy, memmove, memset
from posix.unistd cimport close as c_close, read as c_read, write as c_write
from posix.uio cimport iovec

from pycollect._ext._transport cimport *
from pycollect._ext._pool cimport PoolRef, pool_ref, pool_view
from pycollect._ext._channel cimport (CHANNEL_ABI, HDR_BYTES, MAGIC_ABORT, MAGIC_BY_ADDRESS,
                                      MAGIC_DATA, MAGIC_REFUSED, MAGIC_RESET, Channel,
                                      ChannelBase, MsgHeader)

import os

from pycollect.errors import Error

cdef extern from "_sys.h" nogil:
    int64_t pc_now_ns()
    int pc_atomic_load(int* p)
    void pc_atomic_store(int* p, int v)
    int pc_atomic_exchange(int* p, int v)

cdef extern from "<poll.h>" nogil:
    struct pollfd:
        int fd
        short events
        short revents
    int poll(pollfd* fds, unsigned long nfds, int timeout)
    enum:
        POLLIN
        POLLOUT

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

cdef extern from "<sys/socket.h>" nogil:
    ssize_t send(int fd, const void* buf, size_t n, int flags)
    enum:
        MSG_NOSIGNAL
        MSG_DONTWAIT

cdef enum:
    ADDR_CHUNK = 4 << 20        # bytes read from a peer's memory per pass, so other pairs
                                # keep moving
    JUNK_BYTES = 65536          # recover() discards payloads in pieces of this size
    FINISH_MS = 1000            # a failing rank finishes the messages it is in the middle of
                                # for at most this long (then recover() writes their
                                # rest, up to CARRY_MAX_BYTES of it) ...
    QUIET_MS = 50               # ... and reads on until its peers have been quiet this long
    CARRY_MAX_BYTES = 64 << 20
    REFUSED_KEPT = 8            # the collectives this rank refused that it remembers, to
                                # drop their peers' messages
    ABORT_CALLED = 1            # abort_flag's values: abort() was called ...
    ABORT_CLOSING = 2           # ... or close(), from another thread, mid-operation

cdef struct AddrBody:
    # What a message by address streams after its header: the sender's buffer, and where
    # it lies in the sender's pool of shared buffers (base 0: in none), so that a receiver
    # that maps the pool copies with memcpy instead of process_vm_readv.
    uint64_t addr
    PoolRef pool

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
    int by_address      # the payload is read from the sender's memory
    AddrBody where      # ... at this address in the sender (and its pool, if in one)
    uint32_t addr_done  # bytes of ``where`` streamed
    char* view          # a receive by address: the sender's buffer mapped here, or NULL
    uint64_t ack_needed # a sender's by-address message is done when the peer's acks reach this
    OpDesc desc         # the operation the request belongs to (checked against headers)
    int flex            # a point-to-point receive: any message of at most nbytes

cdef size_t ADDR_BODY = sizeof(AddrBody)     # the bytes a message by address streams

cdef struct Pair:
    ChannelBase* ch     # the channel (its object is in Engine.channels)
    int pid             # the peer's process where the channel reads its memory, else -1
    int send_head
    int send_tail
    int recv_head
    int recv_tail
    uint32_t sent_msgs
    uint32_t recv_msgs
    int data_waiting    # a message is queued that no receive is posted for yet
    uint64_t by_address_sent    # messages sent by address
    uint64_t kernel_copies      # system calls that copied this peer's memory (read or write)
    int ack_head        # sent by address, waiting for the peer to copy them out
    int ack_tail
    # What recover() needs to find the next frame boundary of a failed stream:
    int lost            # our side broke the stream mid-frame (shut down): it cannot recover
    int rs_set          # a frame whose header failed its check was read: what is left of it
    uint64_t rs_skip    # ... its payload bytes still in the stream
    int rs_ack          # ... it was a by-address message: acknowledge it once skipped
    char* rs_carry      # ... bytes read past its end (the stream's next bytes), malloc'd
    size_t rs_carry_len
    int rs_reset        # ... it was the peer's reset frame (the peer recovers): its epoch + 1
    uint32_t resets     # recoveries of this pair (both ends take part in the same ones, the
                        # world's or a group's): the epoch its reset frames carry
    # A leftover frame being dropped (a refusal, or a message of a refused collective):
    uint64_t skip       # its bytes still in the stream, to discard before the next header
    int skip_ack        # ... it was a by-address message: acknowledge it once skipped
    int finishing       # failed in the middle of a message to the peer: finishing it
    # ... and where the peer did not read it all in time, its rest and the abort frame,
    # copied here (malloc'd) for recover() to write before its reset frame:
    char* out_carry
    size_t out_len
    size_t out_off
    # A point-to-point message being read aside (Transport.stash) whose body is still
    # partly in the stream: the Stashed it goes into, how much of the body has come, and
    # for one sent by address, the address being read (its payload copied once it has).
    Stashed* fill
    size_t fill_got
    int fill_by_address
    AddrBody fill_where


cdef struct Resync:
    MsgHeader hdr       # the frame header being read
    uint32_t hdr_done
    uint64_t skip       # payload bytes of the current frame still to discard
    int ack             # acknowledge a by-address message once its address is skipped
    uint32_t sent       # bytes of our reset frame written
    int got             # the peer's reset frame arrived
    size_t carry_off


cdef inline int _same_op(const MsgHeader* h, const OpDesc* d) noexcept nogil:
    return (h.word.group_id == d.group_id and h.coll == d.coll and h.dtype == d.dtype
            and h.redop == d.redop and h.algo == d.algo and h.root == d.root
            and h.count == d.count)


cdef inline void _give_up(Pair* pr) noexcept nogil:
    """The stream to this pair's peer cannot be brought back to a message boundary:
    ``recover()`` leaves the pair out, and its end (the channel shut) tells the peer at
    once."""
    pr.lost = 1
    pr.ch.ops.shut(pr.ch)


cdef inline uint64_t _stream_body(const MsgHeader* h) noexcept nogil:
    """The bytes that follow the data frame ``h``'s header in the stream: its payload, or
    for one sent by address, the address (the payload is read from the sender's memory)."""
    return ADDR_BODY if h.magic == MAGIC_BY_ADDRESS else h.nbytes


cdef inline size_t _fill_body(const Pair* pr) noexcept nogil:
    """The stream bytes of the message ``pr`` is reading aside (``Pair.fill``)."""
    return ADDR_BODY if pr.fill_by_address else pr.fill.nbytes


cdef inline int _past_frame(Req* r, size_t body) noexcept nogil:
    """The receive ``r`` read a frame's header that is not its own (dropped, or read aside)
    and ``r.done`` bytes after it, of which the frame's body is ``body``: move the bytes read
    past the body to where a read of the next frame would have put them (the rest of the
    body, if any, is read elsewhere).  1 if the next header is then complete in ``r.hdr``,
    else 0."""
    cdef size_t extra, head
    if r.done <= body:
        r.hdr_done = 0
        r.done = 0
        return 0
    extra = r.done - body
    head = extra if extra < HDR_BYTES else HDR_BYTES
    memcpy(&r.hdr, r.buf + body, head)
    memmove(r.buf, r.buf + body + head, extra - head)
    r.hdr_done = <uint32_t>head
    r.done = extra - head
    return head == HDR_BYTES


cdef inline int _would_block(int e) noexcept nogil:
    return e == EAGAIN  # EWOULDBLOCK == EAGAIN on Linux


cdef class Engine(Transport):
    """One pair per peer, each over its own channel."""

    cdef Pair* pairs
    cdef Req* reqs
    cdef int nreqs
    cdef int cap_reqs
    cdef int wake_fd
    cdef int abort_flag
    cdef int kick_flag      # kick(): a bounded wait for a head returns now
    cdef int closed
    cdef int64_t spin_ns
    cdef int yield_spin
    cdef pollfd* pfds
    cdef int* pfd_peer
    cdef list addrs
    cdef unsigned long main_thread
    cdef list channels          # owns the pairs' channels (None for self)
    cdef uint32_t refused_gid[REFUSED_KEPT]     # the collectives this rank refused (group,
    cdef uint32_t refused_seq[REFUSED_KEPT]     # sequence number), the last REFUSED_KEPT
    cdef uint32_t refused_n                     # ... and how many it refused in all
    cdef int stashing           # stash(1): read point-to-point messages aside (_stash)
    cdef int past_colls         # past_collectives(1): a probe waits behind a collective's frame
    cdef Stashed* stash_head    # the messages read aside, oldest first, for stashed()
    cdef Stashed* stash_tail

    def __cinit__(self):
        self.pairs = NULL
        self.reqs = NULL
        self.pfds = NULL
        self.pfd_peer = NULL
        self.wake_fd = -1
        self.closed = 0

    def __init__(self, int rank, int size, channels, addrs, double spin_us=50.0,
                 bint yield_spin=False):
        """Take ownership of ``channels`` (one ``Channel`` per peer, None for self)."""
        if size < 1 or not 0 <= rank < size or len(channels) != size or len(addrs) != size:
            raise ValueError("Engine: inconsistent rank, size, channels or addrs")
        self.rank = rank
        self.size = size
        self.solo = size == 1       # no pairs: begin has nothing to wait for
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
        self.channels = [None] * size
        cdef int p
        for p in range(size):
            self.pairs[p].send_head = self.pairs[p].send_tail = -1
            self.pairs[p].recv_head = self.pairs[p].recv_tail = -1
            self.pairs[p].ack_head = self.pairs[p].ack_tail = -1
            if p != rank:
                self.set_channel(p, channels[p])
        import threading
        self.main_thread = threading.main_thread().ident
        self.wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)
        if self.wake_fd < 0:
            raise OSError(errno, os.strerror(errno), "eventfd")

    def set_channel(self, int peer, Channel channel not None):
        """Carry ``peer``'s messages over ``channel`` from now on (at rendezvous, before
        any operation: a channel made from the old one takes over its fd)."""
        if not 0 <= peer < self.size or peer == self.rank:
            raise ValueError("Engine: no pair for peer %d" % peer)
        if channel.base == NULL or channel.base.ops == NULL \
                or channel.base.ops.abi != CHANNEL_ABI:
            raise ValueError("Engine: %r is not a ready channel of interface version %d"
                             % (channel, CHANNEL_ABI))
        self.channels[peer] = channel
        self.pairs[peer].ch = channel.base
        self.pairs[peer].pid = channel.pid

    def channel(self, int peer):
        """The channel that carries ``peer``'s messages."""
        return self.channels[peer]

    def pair_kinds(self):
        """How each peer is reached: "self", "tcp", "shm" or "shm+cma" (TLS pairs: "tcp")."""
        return ["self" if p == self.rank else self.channels[p].kind for p in range(self.size)]

    def tls_pairs(self):
        """Which peers this rank talks to through an encrypted channel."""
        return [p != self.rank and self.channels[p].encrypted for p in range(self.size)]

    def messages_by_address(self):
        """How many messages this rank has sent each peer by address (its memory read by the
        peer instead of streamed)."""
        return [self.pairs[p].by_address_sent for p in range(self.size)]

    def kernel_copies(self):
        """How many system calls have copied each peer's memory (cross-memory attach reads
        and writes of the direct algorithms and of messages sent by address)."""
        return [self.pairs[p].kernel_copies for p in range(self.size)]

    @property
    def spin_us(self):
        """How long a wait polls without sleeping, in microseconds."""
        return self.spin_ns / 1000.0

    @property
    def yields_spin(self):
        """Whether a spinning wait yields the core between passes (its CPUs shared by more ranks
        than it has)."""
        return bool(self.yield_spin)

    def peer_pids(self):
        """Each peer's process id where its memory can be read (this process's own for
        self), -1 elsewhere."""
        return [os.getpid() if p == self.rank else self.channels[p].pid
                for p in range(self.size)]

    def __dealloc__(self):
        cdef int p
        self._close_fds()
        if self.pairs != NULL:
            for p in range(self.size):
                free(self.pairs[p].rs_carry)
                free(self.pairs[p].out_carry)
                free(self.pairs[p].fill)
        self._drop_stashed()
        free(self.pairs)
        free(self.reqs)
        free(self.pfds)
        free(self.pfd_peer)

    cdef void _drop_stashed(self, object peers=None):
        """Free the messages read aside that nobody took (from ``peers`` alone, where given:
        the others stay, in their order)."""
        cdef Stashed* s = self.stashed()
        cdef Stashed* head = NULL
        cdef Stashed* tail = NULL
        while s != NULL:
            if peers is None or s.peer in peers:
                free(s)
            elif tail == NULL:
                head = tail = s
            else:
                tail.next = s
                tail = s
            s = self.stashed()
        self.stash_head, self.stash_tail = head, tail

    cdef void _close_fds(self) noexcept:
        if self.channels is not None:
            for channel in self.channels:
                if channel is not None:
                    channel.close()
        if self.wake_fd >= 0:
            c_close(self.wake_fd)
            self.wake_fd = -1

    def close(self):
        """Close every channel; later operations fail."""
        if not self.closed:
            self.closed = 1
            # A graceful close: no abort frames, the peers just see end of stream.
            with nogil:
                Transport.set_error(self, ERR_INTERNAL, -1, "", 0, "the transport is closed")
            self._close_fds()

    def abort(self, bint closing=False):
        """End the operation in progress (from any thread) with ERR_ABORTED; ``closing``:
        the context is being closed (the error says so, not that abort() was called)."""
        self._raise_flag(&self.abort_flag, ABORT_CLOSING if closing else ABORT_CALLED)

    def kick(self):
        """Have the bounded wait for a point-to-point head in progress (a batch's slice:
        ``probe_until`` with a time limit), or the next one, return at once as if its time
        were up, from any thread: its driver then takes what was queued meanwhile."""
        self._raise_flag(&self.kick_flag, 1)

    cdef void _raise_flag(self, int* flag, int value) noexcept nogil:
        """Set ``flag`` (abort's, kick's) to ``value``, then wake a thread asleep in poll()
        on the wake eventfd, so that it looks at the flag now."""
        cdef uint64_t one = 1
        pc_atomic_store(flag, value)
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
            return self._aborted()
        self.timeout_s = timeout_s
        self.deadline_ns = DEADLINE_LAZY       # read the clock only if the operation waits
        # Sends of the previous operation still in flight (a large message the
        # peer has not acknowledged yet) finish before their slots are reused.  With no
        # request posted since the last begin (a flags operation, a world of one) nothing
        # can be in flight: the pairs are not looked at.
        if self.nreqs and not self._all_done(-1) and self._progress(-1) < 0:
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
        return self._post_send(peer, buf, nbytes, 0)

    cdef int post_send_async(self, int peer, const void* buf, size_t nbytes) noexcept nogil:
        return self._post_send(peer, buf, nbytes, 1)

    cdef int _post_send(self, int peer, const void* buf, size_t nbytes, bint eager) noexcept nogil:
        """Queue a send; ``eager``: an async send, through the stream up to the channel's
        eager_max even where it would go by address (see _channel.pxd)."""
        cdef int idx = self._new_req(peer, 1, <void*>buf, nbytes)
        if idx < 0:
            return -1
        cdef Req* r = &self.reqs[idx]
        cdef Pair* pr = &self.pairs[peer]
        cdef size_t by_address_min = pr.ch.by_address_min
        r.hdr.magic = MAGIC_DATA
        if by_address_min and nbytes >= by_address_min and not (
                eager and nbytes <= pr.ch.eager_max):
            r.hdr.magic = MAGIC_BY_ADDRESS
            r.by_address = 1
            r.where.addr = <uint64_t>buf
            pool_ref(buf, nbytes, &r.where.pool)
        r.hdr.msgno = pr.sent_msgs
        pr.sent_msgs += 1
        self._fill_desc(&r.hdr)
        r.hdr.nbytes = nbytes
        return self._queue_send(peer, idx)

    cdef bint sends_now(self, int peer, size_t nbytes) noexcept nogil:
        """post_send would end at once (see _transport.pxd): nothing is queued to ``peer``
        or waits for its acknowledgement, the message goes through the stream (not by
        address) and the channel has room for it and its header."""
        cdef Pair* pr
        if self.failed or peer < 0 or peer >= self.size or peer == self.rank:
            return 0
        pr = &self.pairs[peer]
        if pr.ch == NULL or pr.send_head >= 0 or pr.ack_head >= 0 or (
                pr.ch.by_address_min and nbytes >= pr.ch.by_address_min):
            return 0
        return pr.ch.ops.room(pr.ch) >= HDR_BYTES + nbytes

    cdef int _queue_send(self, int peer, int idx) noexcept nogil:
        """Queue the send ``idx`` (its header filled) on ``peer``'s pair: ``idx``, or -1."""
        cdef Pair* pr = &self.pairs[peer]
        if pr.send_tail >= 0:
            self.reqs[pr.send_tail].next = idx
        else:
            pr.send_head = idx
        pr.send_tail = idx
        # Push eagerly: a message the channel takes now is on the wire while
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

    cdef int refuse(self, const OpDesc* op, double timeout_s, const char* reason, size_t n,
                    const int* peers, int npeers) noexcept nogil:
        """Send a refused frame for ``op`` (header and reason) to each peer, after what is
        still in flight; messages of ``op`` that peers send later are dropped on arrival."""
        cdef int i, p, idx
        cdef Req* r
        if self.begin(op, timeout_s) < 0:
            return -1
        self.refused_gid[self.refused_n % REFUSED_KEPT] = op.group_id
        self.refused_seq[self.refused_n % REFUSED_KEPT] = op.seq
        self.refused_n += 1
        for i in range(npeers if peers != NULL else self.size):
            p = peers[i] if peers != NULL else i
            if p == self.rank:
                continue
            idx = self._new_req(p, 1, <void*>reason, n)
            if idx < 0:
                return -1
            r = &self.reqs[idx]
            r.hdr.magic = MAGIC_REFUSED
            r.hdr.msgno = <uint32_t>(self.rank + 1)
            self._fill_desc(&r.hdr)
            r.hdr.nbytes = n
            if self._queue_send(p, idx) < 0:
                return -1
        return self._progress(-1)

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
        """probe, giving up with -2 (no error) once ``until_ns`` passes, when not 0; after
        one look for PROBE_ONCE, which leaves a kick for the next bounded wait."""
        cdef int n, k, rc
        cdef int64_t now, spin_end = 0      # read from the clock once a look finds nothing
        cdef uint64_t drained
        self._look_again(peer)
        while True:
            rc = self._probe_pass(peer, out, &k)
            if rc != -2:
                return rc
            if until_ns > 0 and pc_atomic_load(&self.kick_flag):
                pc_atomic_store(&self.kick_flag, 0)
                return -2
            now = pc_now_ns()
            if spin_end == 0:
                spin_end = now + self.spin_ns
            if now >= deadline_from(self, now):
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
            n = ((deadline_of(self) if until_ns == 0 or until_ns > deadline_of(self)
                  else until_ns) - now) // 1000000 + 1
            if not self._arm():
                rc = poll(self.pfds, k, n if n < 1000 else 1000)
                self._disarm()
                if rc > 0 and self.pfds[0].revents:
                    c_read(self.wake_fd, &drained, 8)
                for n in range(1, k):
                    if self.pfds[n].revents:
                        self.pairs[self.pfd_peer[n]].ch.ops.woken(self.pairs[self.pfd_peer[n]].ch)

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
        cdef int p, n, k = 1, rc, candidate, ended = -1
        cdef short ev
        cdef Pair* pr
        cdef ChannelBase* ch
        cdef MsgHeader h
        if self.failed:
            return -1
        if pc_atomic_load(&self.abort_flag):
            return self._aborted()
        for p in range(self.size):
            pr = &self.pairs[p]
            if (pr.send_head >= 0 or pr.ack_head >= 0) and self._do_send(p) < 0:
                return -1
            if pr.recv_head >= 0 and self._do_recv(p) < 0:
                return -1
        for p in range(self.size):
            if p == self.rank:
                continue
            pr = &self.pairs[p]
            ch = pr.ch
            if ch.fd < 0:
                continue
            # A peer whose stream ended is a candidate of a receive from any rank too: its
            # end fails the receive (PeerError) where no other peer's message matches (a
            # ring's reader skipped it, and waited to its deadline).  Only the ranks that
            # may send it are (``out.within``: a sub-group's members).
            candidate = (p == peer or (peer < 0 and (out.within == NULL or out.within[p]))) \
                and pr.recv_head < 0 and not (peer < 0 and pr.data_waiting)
            if candidate and pr.skip:
                rc = self._skip(p, 1)
                if rc < 0:
                    return -1
                candidate = rc
            if candidate:
                n = ch.ops.peek(ch, &h)
                if n == HDR_BYTES and self._leftover(&h, 1):
                    if self._drop_peeked(p, &h) < 0:
                        return -1
                    n = -1
                    errno = EAGAIN          # looked at afresh on the next pass
                if n == HDR_BYTES and (h.magic == MAGIC_DATA or h.magic == MAGIC_BY_ADDRESS) \
                        and h.coll == COLL_P2P and h.word.group_id == self.op.group_id \
                        and (self.op.root < 0 or h.root == self.op.root):
                    out.peer = p
                    out.nbytes = h.nbytes
                    out.desc.group_id = h.word.group_id
                    out.desc.seq = h.seq
                    out.desc.coll = h.coll
                    out.desc.dtype = h.dtype
                    out.desc.redop = h.redop
                    out.desc.algo = h.algo
                    out.desc.root = h.root
                    out.desc.count = h.count
                    return p
                if n == HDR_BYTES and (h.magic == MAGIC_DATA or h.magic == MAGIC_BY_ADDRESS
                                       or h.magic == MAGIC_RESET) and peer < 0:
                    pr.data_waiting = 1     # the head is for another operation
                    candidate = 0
                elif n == HDR_BYTES and self.past_colls and h.coll != COLL_P2P and (
                        h.magic == MAGIC_DATA or h.magic == MAGIC_BY_ADDRESS) \
                        and h.word.group_id == self.op.group_id:
                    # The peer's part of a collective of this group that this rank has not
                    # run yet (it would have read the frame): the message waited for comes
                    # after it, once this rank's collective has read it (run beside the
                    # batch, Transport.stash).  Not a disagreement: wait on.
                    pr.data_waiting = 1
                    candidate = 0
                elif peer < 0 and n != HDR_BYTES and (n == 0 or not _would_block(errno)):
                    if ended < 0:
                        ended = p           # fails the receive if no other peer's matches
                    candidate = 0
                elif n == HDR_BYTES or n == 0 or (n < 0 and not _would_block(errno)):
                    # A mismatch, an abort frame, or end of stream: let the
                    # receive path name it.
                    rc = self.post_recv(p, NULL, 0)
                    if rc < 0 or self._do_recv(p) < 0:
                        return -1
                    return self.set_error(ERR_INTERNAL, p, "", 0, "probe lost its message")
            ev = ch.ops.events(ch, pr.send_head >= 0 or pr.ack_head >= 0, candidate or pr.recv_head >= 0)
            if ev:
                self.pfds[k].fd = ch.fd
                self.pfds[k].events = ev
                self.pfds[k].revents = 0
                self.pfd_peer[k] = p
                k += 1
        if ended >= 0:
            # No peer's message matched: the ended stream fails the receive, named by the
            # receive path.
            rc = self.post_recv(ended, NULL, 0)
            if rc < 0 or self._do_recv(ended) < 0:
                return -1
            return self.set_error(ERR_INTERNAL, ended, "", 0, "probe lost its message")
        npfds[0] = k
        return -2

    cdef int watch(self, int64_t until_ns, int waiting_for) noexcept nogil:
        cdef MsgHeader h
        cdef ChannelBase* ch
        cdef int n
        if self.failed:
            return -1
        if pc_atomic_load(&self.abort_flag):
            return self._aborted()
        if self.stashing and self._read_aside() < 0:
            return -1
        if 0 <= waiting_for < self.size and waiting_for != self.rank:
            ch = self.pairs[waiting_for].ch
            if self.pairs[waiting_for].skip:
                n = self._skip(waiting_for, 1)
                if n < 0:
                    return -1
            n = (0 if self.pairs[waiting_for].skip or self.pairs[waiting_for].fill != NULL
                 else ch.ops.peek(ch, &h))
            if n == HDR_BYTES and self._leftover(&h, 0):
                if self._drop_peeked(waiting_for, &h) < 0:
                    return -1
            elif n == HDR_BYTES and h.coll != COLL_P2P and (
                    h.magic == MAGIC_DATA or h.magic == MAGIC_BY_ADDRESS) and not (
                    # a later collective's: the peer finished this one after our last
                    # look at its flag
                    h.word.group_id == self.op.group_id
                    and <int32_t>(h.seq - self._coll_seq()) > 0):
                self._note_theirs(&h)
                return self.set_error(ERR_MISMATCH, waiting_for, "", 0, "")
        if self._block(pc_now_ns(), until_ns, until_ns != 0) < 0:
            return -1
        if pc_atomic_load(&self.abort_flag):
            return self._aborted()
        return 0

    cdef int peer_left(self, int peer) noexcept nogil:
        cdef Pair* pr = &self.pairs[peer]
        return pr.ch.eof or pr.lost or pr.ch.fd < 0

    cdef bint head_here(self, int peer) noexcept nogil:
        return self._head(peer, NULL) != 0

    cdef bint head_of(self, int peer, uint32_t group_id, uint32_t seq) noexcept nogil:
        cdef MsgHeader h
        cdef int got = self._head(peer, &h)
        if got != 2:
            return got == 1
        return ((h.magic == MAGIC_DATA or h.magic == MAGIC_BY_ADDRESS) and h.seq == seq
                and h.word.group_id == group_id and h.coll != COLL_P2P)

    cdef int _head(self, int peer, MsgHeader* out) noexcept nogil:
        """head_here's look: 2 where a whole frame header is at the head of ``peer``'s
        stream (copied into ``out`` unless NULL), 1 at its end or this engine's failure,
        0 where nothing is there yet or a frame is half read."""
        cdef MsgHeader h
        cdef Pair* pr
        cdef int n
        if self.failed:
            return 1
        if self.pairs == NULL or not 0 <= peer < self.size or peer == self.rank:
            return 0
        pr = &self.pairs[peer]
        if pr.lost or pr.ch.fd < 0 or pr.ch.eof:
            return 1
        if pr.skip or pr.fill != NULL or pr.recv_head >= 0:
            return 0            # inside a frame: only its receive can tell
        n = pr.ch.ops.peek(pr.ch, &h)
        if n == HDR_BYTES:
            if out != NULL:
                out[0] = h
            return 2
        return 1 if n == 0 or (n < 0 and not _would_block(errno)) else 0

    cdef bint can_stash(self) noexcept nogil:
        return 1

    cdef void stash(self, bint on) noexcept nogil:
        self.stashing = on

    cdef void past_collectives(self, bint on) noexcept nogil:
        self.past_colls = on

    cdef int _read_aside(self) noexcept nogil:
        """The look of ``watch`` and of every pass of ``_progress_to`` while stashing (see
        _transport.pxd): on every stream that no receive is reading, read aside the
        point-to-point messages of the operation's group at its head, as a collective's
        receive would (``_stash``), as far as their bytes are here (the rest by later
        looks, ``_peek_idle`` or ``finish_aside``).  0, or -1 after set_error."""
        cdef int p, n, rc
        cdef Pair* pr
        cdef ChannelBase* ch
        cdef MsgHeader h
        cdef Stashed* s
        for p in range(self.size):
            if p == self.rank:
                continue
            pr = &self.pairs[p]
            ch = pr.ch
            if ch == NULL or ch.fd < 0 or ch.eof or pr.lost or pr.skip or pr.recv_head >= 0:
                continue
            while True:
                if pr.fill != NULL:
                    rc = self._fill(p)
                    if rc < 0:
                        return -1
                    if rc == 0:
                        break
                    continue
                n = ch.ops.peek(ch, &h)
                if n != HDR_BYTES or not self._next_p2p(p, &h):
                    break
                s = self._new_stashed(p, &h)
                if s == NULL:
                    return -1
                ch.ops.take_peeked(ch, &h)
                pr.data_waiting = 0     # the message's rest: poll() watches the stream
                pr.recv_msgs += 1
                pr.fill_by_address = h.magic == MAGIC_BY_ADDRESS
                pr.fill = s
                pr.fill_got = 0
        return 0

    cdef int finish_aside(self) noexcept nogil:
        cdef int p, rc
        cdef bint left
        while True:
            left = False
            for p in range(self.size):
                if p != self.rank and self.pairs[p].fill != NULL:
                    rc = self._fill(p)
                    if rc < 0:
                        return -1
                    left = left or rc == 0
            if not left:
                return 0
            if self.failed:
                return -1
            if pc_now_ns() >= deadline_of(self):
                return self._timeout()
            sched_yield()

    cdef Stashed* stashed(self) noexcept nogil:
        cdef Stashed* s = self.stash_head
        if s != NULL:
            self.stash_head = s.next
            if self.stash_head == NULL:
                self.stash_tail = NULL
            s.next = NULL
        return s

    cdef void ring_bell(self, int peer) noexcept nogil:
        cdef char bell = 1
        cdef ChannelBase* ch = self.pairs[peer].ch
        if ch.fd >= 0 and not ch.eof:
            send(ch.fd, &bell, 1, MSG_NOSIGNAL | MSG_DONTWAIT)

    cdef int can_read_remote(self, int peer) noexcept nogil:
        return 0 <= peer < self.size and peer != self.rank and self.pairs[peer].ch.reads_remote

    cdef int read_remote(self, int peer, void* dst, uint64_t remote_addr,
                         size_t nbytes) noexcept nogil:
        return self._remote(peer, <char*>dst, remote_addr, nbytes, 0)

    cdef int write_remote(self, int peer, uint64_t remote_addr, const void* src,
                          size_t nbytes) noexcept nogil:
        return self._remote(peer, <char*>src, remote_addr, nbytes, 1)

    cdef char* view_remote(self, int peer, const PoolRef* ref, uint64_t remote_addr,
                           size_t nbytes) noexcept nogil:
        if not self.can_read_remote(peer):
            return NULL
        return pool_view(self.pairs[peer].pid, ref, remote_addr, nbytes)

    cdef int _remote(self, int peer, char* local, uint64_t remote_addr, size_t nbytes,
                     bint write) noexcept nogil:
        """read_remote (``write`` 0) or write_remote (1): the whole ``nbytes``, or -1."""
        cdef ChannelBase* ch
        cdef ssize_t done
        if not self.can_read_remote(peer):
            return self.set_error(ERR_INTERNAL, peer, "", 0, "write to a peer's memory that "
                                  "its pair does not offer" if write else "read of a peer's "
                                  "memory that its pair does not offer")
        ch = self.pairs[peer].ch
        while nbytes > 0:
            done = ch.ops.write_remote(ch, remote_addr, local, nbytes) if write \
                else ch.ops.read_remote(ch, local, remote_addr, nbytes)
            if done <= 0:
                return self.set_error(ERR_PEER, peer, ch.write_call if write else ch.remote_call,
                                      errno if done < 0 else EFAULT,
                                      "has a buffer this rank cannot write" if write
                                      else "has a buffer this rank cannot read")
            self.pairs[peer].kernel_copies += 1
            local += done
            remote_addr += <uint64_t>done
            nbytes -= <size_t>done
        return 0

    cdef int set_error(self, int kind, int peer, const char* syscall, int errnum,
                       const char* detail) noexcept nogil:
        if self.failed:
            return -1
        Transport.set_error(self, kind, peer, syscall, errnum, detail)
        self._spread_failure()
        return -1

    # -- the engine -----------------------------------------------------

    cdef inline uint32_t _coll_seq(self) noexcept nogil:
        """The operation in progress's collective number, to compare a collective's frame
        with: 0 for a point-to-point operation, whose descriptor carries the sender's stamp
        (Transport.p2p_seq, which _fill_desc puts in its messages' headers) and is no
        collective's number."""
        return 0 if self.op.coll == COLL_P2P else self.op.seq

    cdef inline void _fill_desc(self, MsgHeader* h) noexcept nogil:
        h.word.group_id = self.op.group_id
        h.seq = self.op.seq
        h.coll = self.op.coll
        h.dtype = self.op.dtype
        h.redop = self.op.redop
        h.algo = self.op.algo
        h.root = self.op.root
        h.count = self.op.count

    cdef void _spread_failure(self) noexcept nogil:
        """Tell every peer we failed: an abort frame where the stream is at a message
        boundary (the pair stays open for recover()); where a message is half written,
        finish it first (_finish_messages), and shut the pair down only if that fails."""
        cdef MsgHeader h
        cdef Pair* pr
        cdef ChannelBase* ch
        cdef int p, head, finishing = 0
        if self.pairs == NULL:
            return
        memset(&h, 0, sizeof(h))
        h.magic = MAGIC_ABORT
        self._fill_desc(&h)
        # An abort frame carries the failure as first seen: the kind, the rank
        # that failed first (in msgno, plus one) and the rank it blamed (in
        # nbytes, plus one; 0: none), so a relayed failure keeps its origin.
        if self.err.origin >= 0:
            h.word.error_kind = self.err.origin_kind
            h.msgno = <uint32_t>(self.err.origin + 1)
        else:
            h.word.error_kind = self.err.kind
            h.msgno = <uint32_t>(self.rank + 1)
        h.nbytes = <uint64_t>((self.err.blamed if self.err.blamed >= 0 else self.err.peer) + 1)
        for p in range(self.size):
            if p == self.rank:
                continue
            pr = &self.pairs[p]
            ch = pr.ch
            if ch.fd < 0 or pr.lost:
                continue
            head = pr.send_head
            if head >= 0 and self.reqs[head].hdr_done != 0 and not self.reqs[head].by_address:
                pr.finishing = 1        # told once the message is whole
                finishing = 1
            elif (head >= 0 and self.reqs[head].hdr_done != 0) or not ch.ops.send_frame(ch, &h):
                # A by-address message is read from our memory after we return, and a frame
                # may not fit: end the stream, so the peer fails at once; recover() cannot
                # bring this pair back.
                _give_up(pr)
        if finishing:
            self._finish_messages(&h)

    cdef void _finish_messages(self, const MsgHeader* abort) noexcept nogil:
        """After a failure, write the rest of the messages this rank is in the middle of
        (the peer is reading them, or finishing its own to us) and then their pair's abort
        frame, so that the pairs stay whole for recover(); read on meanwhile, so that peers
        finishing theirs to us can, until they are quiet.  A pair whose peer is gone (its
        end met, or a write failed) is given up at once.  Bounded by FINISH_MS: a message
        still half written then is handed to recover() (_carry_out) when the failure is a
        lost rank, whose survivors all recover; otherwise, or where it cannot be copied,
        its pair is shut, so that a peer waiting on it fails at once."""
        cdef int64_t now = pc_now_ns()
        cdef int64_t end = now + FINISH_MS * 1000000, quiet = now + QUIET_MS * 1000000
        cdef int p, n, busy, moved, rc
        cdef Pair* pr
        cdef ChannelBase* ch
        while True:
            busy = moved = n = 0
            for p in range(self.size):
                pr = &self.pairs[p]
                ch = pr.ch
                if p == self.rank or pr.lost or ch.fd < 0:
                    continue
                if pr.finishing:
                    rc = self._do_send(p)           # never starts a message after a failure
                    if rc < 0 or ch.eof:
                        # The peer is gone (its end met here, or the write failed): there is
                        # nobody to finish the message for.
                        pr.finishing = 0
                        _give_up(pr)
                        continue
                    moved |= rc
                    if pr.send_head >= 0 and self.reqs[pr.send_head].hdr_done != 0:
                        busy = 1
                    else:
                        pr.finishing = 0
                        if not ch.ops.send_frame(ch, abort):
                            _give_up(pr)
                            continue
                if pr.recv_head >= 0 and not (pr.rs_set or ch.eof):
                    rc = self._do_recv(p)
                    if rc < 0 and not pr.rs_set:
                        ch.eof = 1          # the connection failed: nothing more comes on it
                    moved |= rc > 0
                    if rc >= 0 and pr.recv_head >= 0 and self.reqs[pr.recv_head].hdr_done != 0 \
                            and not pr.rs_set:
                        busy = 1            # a message of the peer's half read
                self.pfds[n].fd = ch.fd
                self.pfds[n].events = ch.ops.events(ch, pr.finishing, 1)
                self.pfds[n].revents = 0
                n += 1
            now = pc_now_ns()
            if moved:
                quiet = now + QUIET_MS * 1000000
            if now >= end or (not busy and now >= quiet):
                break
            if not moved:
                poll(self.pfds, n, 1)       # 1 ms: rings have no doorbell armed here
        for p in range(self.size):
            pr = &self.pairs[p]
            if p != self.rank and pr.finishing:
                pr.finishing = 0
                # After a lost rank the survivors recover() together: the late reader gets
                # the rest then.  After any other failure (a refusal, a deadline) the peer
                # may wait on this pair without failing itself: its end tells it at once.
                if abort.word.error_kind != ERR_PEER or self._carry_out(p, abort) < 0:
                    _give_up(pr)

    cdef int _carry_out(self, int peer, const MsgHeader* abort) noexcept nogil:
        """Copy the rest of the message half written to ``peer`` (the caller's buffer is
        the caller's again once the operation returns) and the abort frame after it, for
        recover() to write before its reset frame: the stream stays whole for a peer that
        reads late.  -1 where the rest is over CARRY_MAX_BYTES or memory is short."""
        cdef Pair* pr = &self.pairs[peer]
        cdef Req* r = &self.reqs[pr.send_head]
        cdef size_t hrem = HDR_BYTES - r.hdr_done, body = r.nbytes - r.done
        if body > CARRY_MAX_BYTES:
            return -1
        cdef char* out = <char*>malloc(hrem + body + HDR_BYTES)
        if out == NULL:
            return -1
        memcpy(out, (<char*>&r.hdr) + r.hdr_done, hrem)
        if body:
            memcpy(out + hrem, r.buf + r.done, body)
        memcpy(out + hrem + body, abort, HDR_BYTES)
        free(pr.out_carry)
        pr.out_carry = out
        pr.out_len = hrem + body + HDR_BYTES
        pr.out_off = 0
        pr.send_head = pr.send_tail = -1    # the operation failed: nothing else goes out
        return 0

    cdef int _do_send(self, int peer) noexcept nogil:
        """Write queued messages to ``peer`` until its channel is full; 1 if progress."""
        cdef Pair* pr = &self.pairs[peer]
        cdef ChannelBase* ch = pr.ch
        cdef Req* r
        cdef iovec iov[2]
        cdef int cnt
        cdef ssize_t n
        cdef size_t hrem, body, sent
        cdef int progressed = 0
        cdef uint64_t acks
        if pr.ack_head >= 0:
            # Messages sent by address are done once the peer has copied them out.
            acks = ch.ops.acked(ch)
            while pr.ack_head >= 0 and self.reqs[pr.ack_head].ack_needed <= acks:
                r = &self.reqs[pr.ack_head]
                r.complete = 1
                pr.ack_head = r.next
                if pr.ack_head < 0:
                    pr.ack_tail = -1
                progressed = 1
            if pr.ack_head >= 0 and ch.eof:
                # The reader left before copying a message from our memory: no ack will
                # come.  What it wrote before leaving comes first: an abort frame says why.
                if ch.ops.held(ch) >= HDR_BYTES and not pr.data_waiting:
                    if pr.recv_head >= 0:
                        return progressed       # the posted receive reads it
                    if self._peek_idle(peer) < 0:
                        return -1
                return self.set_error(ERR_PEER, peer, "", 0, "exited or closed its context "
                                      "before copying our data")
        while pr.send_head >= 0:
            r = &self.reqs[pr.send_head]
            if self.failed and r.hdr_done == 0:
                return progressed       # after a failure, only half-written messages go on
            cnt = 0
            hrem = HDR_BYTES - r.hdr_done
            if hrem:
                iov[0].iov_base = (<char*>&r.hdr) + r.hdr_done
                iov[0].iov_len = hrem
                cnt = 1
            # A message by address streams only its address (and pool); the peer reads the rest.
            body = ADDR_BODY if r.by_address else r.nbytes
            sent = r.addr_done if r.by_address else r.done
            if sent < body:
                iov[cnt].iov_base = ((<char*>&r.where) + sent) if r.by_address \
                    else (r.buf + sent)
                iov[cnt].iov_len = body - sent
                cnt += 1
            n = ch.ops.writev(ch, iov, cnt)
            if n < 0:
                if errno == EINTR:
                    continue
                if _would_block(errno):
                    return progressed
                return self.set_error(ERR_PEER, peer, ch.send_call, errno,
                                      "connection lost while sending")
            progressed = 1
            if <size_t>n >= hrem:
                r.hdr_done = HDR_BYTES
                if r.by_address:
                    r.addr_done += <uint32_t>(<size_t>n - hrem)
                else:
                    r.done += <size_t>n - hrem
            else:
                r.hdr_done += <uint32_t>n
            if r.hdr_done < HDR_BYTES or (r.addr_done if r.by_address else r.done) < body:
                return progressed
            pr.send_head = r.next
            if pr.send_head < 0:
                pr.send_tail = -1
            if r.by_address:
                pr.by_address_sent += 1
                r.ack_needed = pr.by_address_sent
                r.next = -1
                if pr.ack_tail >= 0:
                    self.reqs[pr.ack_tail].next = <int>(r - self.reqs)
                else:
                    pr.ack_head = <int>(r - self.reqs)
                pr.ack_tail = <int>(r - self.reqs)
            else:
                r.complete = 1
        return progressed

    cdef int _check_header(self, int peer, Req* r) noexcept nogil:
        """Validate a complete header against the posted receive; on a failure, note where
        the stream's next frame starts (recover() resumes there)."""
        if self._check_frame(peer, r) == 0:
            return 0
        self._keep_rest(peer, r)
        return -1

    cdef void _keep_rest(self, int peer, Req* r) noexcept nogil:
        """After a header that failed its check: the frame's payload bytes still in the
        stream, or the bytes ``r`` read past the frame's end (copied out of the caller's
        buffer while it still exists)."""
        cdef Pair* pr = &self.pairs[peer]
        cdef uint64_t body
        if pr.rs_set:
            return
        pr.rs_set = 1
        if r.hdr.magic == MAGIC_ABORT:
            body = 0
        elif r.hdr.magic == MAGIC_RESET:
            body = 0
            pr.rs_reset = <int>r.hdr.seq + 1
        elif r.hdr.magic == MAGIC_DATA or r.hdr.magic == MAGIC_REFUSED:
            body = r.hdr.nbytes
        elif r.hdr.magic == MAGIC_BY_ADDRESS:
            body = ADDR_BODY
            pr.rs_ack = 1
        else:
            pr.lost = 1         # not a frame: no boundary to find
            return
        if r.done > body:
            self._carry(pr, r.buf + body, r.done - body)
        else:
            pr.rs_skip = body - r.done

    cdef void _carry(self, Pair* pr, const char* src, size_t n) noexcept nogil:
        """Keep ``n`` stream bytes read past a failed frame for recover()."""
        pr.rs_carry_len = n
        pr.rs_carry = <char*>realloc(NULL, n)
        if pr.rs_carry == NULL:
            pr.lost = 1
            return
        memcpy(pr.rs_carry, src, n)

    cdef int _refusal(self, int peer, Req* r) noexcept nogil:
        """The refused frame whose header ``r`` read: read its reason (``r.done`` bytes of the
        stream are in ``r.buf`` already) and fail this collective with ERR_REFUSED."""
        cdef MsgHeader* h = &r.hdr
        cdef Pair* pr = &self.pairs[peer]
        cdef char reason[REASON_BYTES + 1]
        cdef size_t body = <size_t>h.nbytes, have
        cdef int origin = <int>h.msgno - 1 if 0 < h.msgno <= <uint32_t>self.size else peer
        pr.rs_set = 1           # recover() resumes after the frame
        if h.nbytes > REASON_BYTES:
            pr.lost = 1
            return self.set_error(ERR_PEER, peer, "", 0, "sent a refusal longer than any")
        have = r.done if r.done < body else body
        if have:
            memcpy(reason, r.buf, have)
        if r.done > body:
            self._carry(pr, r.buf + body, r.done - body)
        elif have < body and self._read_exact(peer, reason + have, body - have) < 0:
            pr.lost = 1
            body = have
        reason[body] = 0
        self._note_theirs(h)
        if h.word.group_id != self.op.group_id or h.seq != self._coll_seq():
            return self.set_error(ERR_MISMATCH, peer, "", 0, "it refused its arguments to a "
                                  "later collective while this rank runs this one")
        if not self.failed:
            self.err.origin = origin
            self.err.blamed = origin
            self.err.origin_kind = ERR_REFUSED
        return self.set_error(ERR_REFUSED, peer, "", 0, reason)

    cdef int _read_exact(self, int peer, char* dst, size_t n) noexcept nogil:
        """Read ``n`` bytes of a frame whose start arrived (a refusal's reason), waiting at
        most until the deadline: 0, or -1 if they do not come."""
        cdef ChannelBase* ch = self.pairs[peer].ch
        cdef iovec iov
        cdef ssize_t got
        cdef pollfd pfd
        while n:
            iov.iov_base = dst
            iov.iov_len = n
            got = ch.ops.readv(ch, &iov, 1)
            if got > 0:
                dst += got
                n -= <size_t>got
                continue
            if got == 0 or not (_would_block(errno) or errno == EINTR) \
                    or pc_now_ns() >= deadline_of(self):
                return -1
            ch.ops.woken(ch)
            pfd.fd = ch.fd
            pfd.events = POLLIN
            poll(&pfd, 1, 1)        # 1 ms: a ring's bytes come without a doorbell here
        return 0

    cdef int _leftover(self, const MsgHeader* h, int posted) noexcept nogil:
        """1 if the frame ``h`` belongs to a collective this rank is done with, to be dropped:
        a message or refusal of a collective this rank refused, a refusal of an earlier
        collective of this group (this rank finished it before the refusal came) or, at a
        posted receive (``posted``), of another group's; else 0."""
        cdef uint32_t i, kept = self.refused_n if self.refused_n < REFUSED_KEPT \
            else REFUSED_KEPT
        if h.magic == MAGIC_REFUSED or ((h.magic == MAGIC_DATA or h.magic == MAGIC_BY_ADDRESS)
                                         and h.coll != COLL_P2P):
            for i in range(kept):
                if self.refused_gid[i] == h.word.group_id and self.refused_seq[i] == h.seq:
                    return 1
        if h.magic != MAGIC_REFUSED:
            return 0
        if h.word.group_id != self.op.group_id or self.op.coll == COLL_P2P:
            return posted
        return <int32_t>(h.seq - self.op.seq) < 0

    cdef void _skip_frame(self, int peer, const MsgHeader* h, size_t read) noexcept nogil:
        """Drop the frame ``h`` of which ``read`` bytes past the header are read: the rest is
        skipped before the peer's next header."""
        cdef Pair* pr = &self.pairs[peer]
        cdef uint64_t body = _stream_body(h)
        if h.magic != MAGIC_REFUSED:
            pr.recv_msgs += 1       # a message: it had its number
        pr.skip = body - read
        pr.skip_ack = h.magic == MAGIC_BY_ADDRESS
        if pr.skip == 0 and pr.skip_ack:
            pr.ch.ops.ack(pr.ch)
            pr.skip_ack = 0

    cdef int _drop(self, int peer, Req* r) noexcept nogil:
        """Drop the leftover frame whose header the posted receive ``r`` read, and move the
        bytes read past it to where a read of the next frame would have put them: 1 if that
        next header is then complete in ``r.hdr``, else 0."""
        cdef uint64_t body = _stream_body(&r.hdr)
        self._skip_frame(peer, &r.hdr, r.done if r.done < body else <size_t>body)
        return _past_frame(r, <size_t>body)

    cdef int _skip(self, int peer, int idle) noexcept nogil:
        """Discard what is left of a dropped frame: 1 once it is gone, 0 while its bytes are
        still to come, -1 on an error (at the end of the stream only when not ``idle``)."""
        cdef Pair* pr = &self.pairs[peer]
        cdef ChannelBase* ch = pr.ch
        cdef char junk[JUNK_BYTES]
        cdef ssize_t n
        while pr.skip:
            n = self._read_body(peer, junk, JUNK_BYTES if pr.skip > JUNK_BYTES
                                else <size_t>pr.skip, idle)
            if n <= 0:
                return n
            pr.skip -= <uint64_t>n
        if pr.skip_ack:
            ch.ops.ack(ch)
            pr.skip_ack = 0
        return 1

    cdef ssize_t _read_body(self, int peer, char* into, size_t want, int idle) noexcept nogil:
        """Read up to ``want`` bytes of a frame's body from ``peer``'s stream (one that is
        dropped, or read aside): how many came, 0 while none has, or -1 after set_error.
        At the end of the stream: -1, or with ``idle`` (nobody waits on the pair) 0, the
        channel marked ended."""
        cdef ChannelBase* ch = self.pairs[peer].ch
        cdef iovec iov
        cdef ssize_t n
        iov.iov_base = into
        iov.iov_len = want
        while True:
            n = ch.ops.readv(ch, &iov, 1)
            if n > 0:
                return n
            if n == 0:
                ch.eof = 1
                return 0 if idle else self.set_error(
                    ERR_PEER, peer, "", 0, "closed its connection (the process exited or "
                    "closed its context)")
            if errno == EINTR:
                continue
            if _would_block(errno):
                return 0
            return self.set_error(ERR_PEER, peer, ch.recv_call, errno,
                                  "connection lost while receiving")

    cdef int _header_in(self, int peer, Req* r) noexcept nogil:
        """A posted receive read a whole header: 0 if it is the receive's message, 1 if
        leftover frames were dropped or messages read aside (read on), -1 on an error."""
        cdef int rc
        while True:
            if self._leftover(&r.hdr, 1):
                rc = self._drop(peer, r)
            elif self._stashable(peer, &r.hdr, r):
                rc = self._stash(peer, r)
            else:
                return self._check_header(peer, r)
            if rc <= 0:
                return -1 if rc < 0 else 1

    cdef inline bint _stashable(self, int peer, const MsgHeader* h, const Req* r) noexcept nogil:
        """Whether a collective's receive ``r`` reads the frame ``h`` aside (stash(1)): a
        point-to-point message of the collective's group (inline or by address), the next
        the pair numbers; anything else is checked as ever."""
        return (self.stashing and not r.flex and self.op.coll != COLL_P2P
                and self._next_p2p(peer, h))

    cdef inline bint _next_p2p(self, int peer, const MsgHeader* h) noexcept nogil:
        """The frame ``h`` is the next message the pair from ``peer`` numbers, and a
        point-to-point one of the operation's group (inline or by address): what a
        collective beside waiting receives reads aside (``_stashable``, ``_read_aside``)."""
        return ((h.magic == MAGIC_DATA or h.magic == MAGIC_BY_ADDRESS)
                and h.coll == COLL_P2P and h.word.group_id == self.op.group_id
                and h.msgno == self.pairs[peer].recv_msgs)

    cdef int _stash(self, int peer, Req* r) noexcept nogil:
        """Read aside the point-to-point message whose header the collective's receive ``r``
        read, with what ``r`` read past that header, and move the bytes read past the
        message to where a read of the next frame would have put them, as ``_drop`` does:
        1 if that next header is then complete in ``r.hdr``, 0 if not (the message's rest,
        or the next header, is still to come), -1 on an error."""
        cdef Pair* pr = &self.pairs[peer]
        cdef bint by_address = r.hdr.magic == MAGIC_BY_ADDRESS
        cdef size_t body = <size_t>_stream_body(&r.hdr)
        cdef size_t have
        cdef Stashed* s = self._new_stashed(peer, &r.hdr)
        if s == NULL:
            return -1
        have = r.done if r.done < body else body
        memcpy((<char*>&pr.fill_where) if by_address else s.data, r.buf, have)
        pr.recv_msgs += 1
        pr.fill_by_address = by_address
        if have < body:
            pr.fill = s
            pr.fill_got = have
        elif self._stash_done(peer, s) < 0:
            return -1
        return _past_frame(r, body)

    cdef Stashed* _new_stashed(self, int peer, const MsgHeader* h) noexcept nogil:
        """A ``Stashed`` for the point-to-point message from ``peer`` whose header is ``h``,
        its payload still to read; NULL after set_error."""
        cdef Stashed* s = <Stashed*>malloc(sizeof(Stashed) + <size_t>h.nbytes)
        if s == NULL:
            self.set_error(ERR_INTERNAL, peer, "malloc", 0, "out of memory for a "
                           "point-to-point message read beside a collective")
            return NULL
        s.next = NULL
        s.peer = peer
        s.tag = h.root
        s.dtype = h.dtype
        s.seq = h.seq
        s.nbytes = <size_t>h.nbytes
        s.data = <char*>(s + 1)
        return s

    cdef int _stash_done(self, int peer, Stashed* s) noexcept nogil:
        """The message read aside has its body: one sent by address has its payload copied
        from the sender's memory and acknowledged (its send then ends), as a receive's is;
        then it joins the others for ``stashed``.  0, or -1 after set_error (``s`` freed)."""
        cdef Pair* pr = &self.pairs[peer]
        cdef char* view
        if pr.fill_by_address:
            pr.fill_by_address = 0
            view = self.view_remote(peer, &pr.fill_where.pool, pr.fill_where.addr, s.nbytes)
            if view != NULL:
                memcpy(s.data, view, s.nbytes)
            elif s.nbytes and self.read_remote(peer, s.data, pr.fill_where.addr, s.nbytes) < 0:
                free(s)
                return -1
            pr.ch.ops.ack(pr.ch)
        if self.stash_tail != NULL:
            self.stash_tail.next = s
        else:
            self.stash_head = s
        self.stash_tail = s
        return 0

    cdef int _fill(self, int peer) noexcept nogil:
        """Read more of the message being read aside from ``peer``: 1 once it is whole, 0
        while its bytes are still to come, -1 on an error."""
        cdef Pair* pr = &self.pairs[peer]
        cdef Stashed* s = pr.fill
        cdef char* into = (<char*>&pr.fill_where) if pr.fill_by_address else s.data
        cdef size_t body = _fill_body(pr)
        cdef ssize_t n
        while pr.fill_got < body:
            n = self._read_body(peer, into + pr.fill_got, body - pr.fill_got, 0)
            if n <= 0:
                return n
            pr.fill_got += <size_t>n
        pr.fill = NULL
        return -1 if self._stash_done(peer, s) < 0 else 1

    cdef int _check_frame(self, int peer, Req* r) noexcept nogil:
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
                self.err.origin_kind = h.word.error_kind
            if h.word.error_kind == ERR_REFUSED:
                return self.set_error(ERR_REFUSED, peer, "", 0, "")
            if h.word.error_kind == ERR_MISMATCH:
                # A third rank out of step is named (raise_error then leads with the peer's
                # call, which this rank's may well match); else it is this rank or the peer.
                if blamed >= 0 and blamed != self.rank and blamed != peer and origin == peer:
                    snprintf(detail, sizeof(detail), "reported that rank %d disagrees with "
                             "it", blamed)
                elif blamed >= 0 and blamed != self.rank and blamed != peer:
                    snprintf(detail, sizeof(detail), "relayed rank %d's report that rank %d "
                             "disagrees with it", origin, blamed)
                elif origin == peer:
                    snprintf(detail, sizeof(detail), "it reported that ranks disagree")
                else:
                    snprintf(detail, sizeof(detail), "it relayed rank %d's report that ranks "
                             "disagree", origin)
                return self.set_error(ERR_MISMATCH, peer, "", 0, detail)
            if origin != peer:
                snprintf(detail, sizeof(detail), "relayed that rank %d failed (%s error "
                         "involving rank %d)", origin, _kind_name(h.word.error_kind), blamed)
            elif blamed >= 0 and blamed != peer:
                snprintf(detail, sizeof(detail), "failed (%s error involving rank %d) and "
                         "left the group", _kind_name(h.word.error_kind), blamed)
            else:
                snprintf(detail, sizeof(detail), "failed (%s error) and left the group",
                         _kind_name(h.word.error_kind))
            return self.set_error(ERR_PEER, peer, "", 0, detail)
        if h.magic == MAGIC_RESET:
            return self.set_error(ERR_MISMATCH, peer, "", 0, "it called shrink() or agree() "
                                  "while this rank runs this operation")
        if h.magic == MAGIC_REFUSED:
            return self._refusal(peer, r)
        if h.magic != MAGIC_DATA and h.magic != MAGIC_BY_ADDRESS:
            snprintf(detail, sizeof(detail), "sent bytes that are not a pycollect message "
                     "(magic 0x%08x)", h.magic)
            return self.set_error(ERR_PEER, peer, "", 0, detail)
        if r.flex:
            if h.coll != COLL_P2P or h.word.group_id != r.desc.group_id or h.dtype != r.desc.dtype \
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
        self.err.theirs.group_id = h.word.group_id if h.magic == MAGIC_DATA else self.op.group_id
        self.err.theirs.seq = h.seq
        self.err.theirs.coll = h.coll
        self.err.theirs.dtype = h.dtype
        self.err.theirs.redop = h.redop
        self.err.theirs.algo = h.algo
        self.err.theirs.root = h.root
        self.err.theirs.count = h.count
        self.err.has_theirs = 1

    cdef int _do_recv(self, int peer) noexcept nogil:
        """Read into posted receives from ``peer`` until its channel is empty; 1 if progress."""
        cdef Pair* pr = &self.pairs[peer]
        cdef ChannelBase* ch = pr.ch
        cdef Req* r
        cdef iovec iov[2]
        cdef int cnt
        cdef ssize_t n
        cdef size_t hrem, want
        cdef int progressed = 0, rc
        while pr.recv_head >= 0:
            if pr.skip:
                rc = self._skip(peer, 0)
                if rc <= 0:
                    return rc if rc < 0 else progressed
                progressed = 1
            if pr.fill != NULL:
                rc = self._fill(peer)
                if rc <= 0:
                    return rc if rc < 0 else progressed
                progressed = 1
            r = &self.reqs[pr.recv_head]
            if r.by_address:
                # The header is in: the address, then the payload from the peer's memory.
                if r.addr_done < ADDR_BODY:
                    iov[0].iov_base = (<char*>&r.where) + r.addr_done
                    iov[0].iov_len = ADDR_BODY - r.addr_done
                    n = ch.ops.readv(ch, iov, 1)
                    if n <= 0:
                        if n < 0 and (errno == EINTR or _would_block(errno)):
                            return progressed
                        return self._lost(peer, ch, r, n)
                    progressed = 1
                    r.addr_done += <uint32_t>n
                    if r.addr_done < ADDR_BODY:
                        return progressed
                    r.view = self.view_remote(peer, &r.where.pool, r.where.addr, r.nbytes)
                want = r.nbytes - r.done
                if want > ADDR_CHUNK:
                    want = ADDR_CHUNK
                if want and r.view != NULL:        # the sender's pool is mapped here
                    memcpy(r.buf + r.done, r.view + r.done, want)
                    r.done += want
                    progressed = 1
                    if r.done < r.nbytes:
                        return progressed
                elif want:
                    n = ch.ops.read_remote(ch, r.buf + r.done, r.where.addr + r.done, want)
                    if n <= 0:
                        return self.set_error(ERR_PEER, peer, ch.remote_call, errno,
                                              "cannot read the peer's memory")
                    pr.kernel_copies += 1
                    r.done += <size_t>n
                    progressed = 1
                    if r.done < r.nbytes:
                        return progressed   # the next pass reads more; other pairs move
                ch.ops.ack(ch)
                self._complete_recv(pr, r)
                continue
            hrem = HDR_BYTES - r.hdr_done
            cnt = 0
            if hrem:
                iov[0].iov_base = (<char*>&r.hdr) + r.hdr_done
                iov[0].iov_len = hrem
                cnt = 1
            if r.done < r.nbytes and not (hrem and (r.flex or ch.split_header)):
                iov[cnt].iov_base = r.buf + r.done
                iov[cnt].iov_len = r.nbytes - r.done
                cnt += 1
            n = ch.ops.readv(ch, iov, cnt)
            if n <= 0:
                if n < 0 and errno == EINTR:
                    continue
                if n < 0 and _would_block(errno):
                    return progressed
                return self._lost(peer, ch, r, n)
            progressed = 1
            if hrem:
                if <size_t>n >= hrem:
                    r.hdr_done = HDR_BYTES
                    r.done += <size_t>n - hrem
                    rc = self._header_in(peer, r)
                    if rc < 0:
                        return -1
                    if rc > 0:
                        continue    # a leftover frame was dropped: read on
                    if r.hdr.magic == MAGIC_BY_ADDRESS:
                        r.by_address = 1
                        continue
                    if r.done < r.nbytes and (r.flex or ch.split_header):
                        continue    # the header alone was read: now the payload
                else:
                    r.hdr_done += <uint32_t>n
                    return progressed
            else:
                r.done += <size_t>n
            if r.done == r.nbytes:
                self._complete_recv(pr, r)
            else:
                return progressed
        return progressed

    cdef inline void _complete_recv(self, Pair* pr, Req* r) noexcept nogil:
        r.complete = 1
        pr.recv_head = r.next
        if pr.recv_head < 0:
            pr.recv_tail = -1

    cdef int _lost(self, int peer, ChannelBase* ch, Req* r, ssize_t n) noexcept nogil:
        """A receive's channel ended (``n`` 0) or failed (-1, errno set): the error."""
        cdef char detail[200]
        if n < 0:
            return self.set_error(ERR_PEER, peer, ch.recv_call, errno,
                                  "connection lost while receiving")
        ch.eof = 1
        if r.hdr_done == 0:
            return self.set_error(ERR_PEER, peer, "", 0, "closed its connection (the process "
                                  "exited or closed its context)")
        snprintf(detail, sizeof(detail), "closed its connection in the middle of a "
                 "message (%llu of %llu bytes received)",
                 <unsigned long long>r.done, <unsigned long long>r.nbytes)
        return self.set_error(ERR_PEER, peer, "", 0, detail)

    cdef int _peek_idle(self, int peer) noexcept nogil:
        """A peer we expect nothing from became readable: an abort frame, EOF or early data."""
        cdef Pair* pr = &self.pairs[peer]
        cdef ChannelBase* ch = pr.ch
        cdef MsgHeader h
        cdef int n
        if pr.skip:
            n = self._skip(peer, 1)
            if n <= 0:
                return n
        if pr.fill != NULL:
            # The rest of a message being read aside (_read_aside), not a frame's header.
            n = self._fill(peer)
            if n <= 0:
                return n
        n = ch.ops.peek(ch, &h)
        if n == 0:
            ch.eof = 1
            return 0
        if n < 0:
            if not _would_block(errno) and errno != EINTR:
                ch.eof = 1
            return 0
        if n < 4:
            return 0
        if h.magic == MAGIC_RESET:
            pr.data_waiting = 1     # the peer recovers: for this rank's next recover()
            return 0
        if n == HDR_BYTES and self._leftover(&h, 0):
            return self._drop_peeked(peer, &h)
        if h.magic == MAGIC_REFUSED:
            if n < HDR_BYTES:
                return 0
            if h.word.group_id != self.op.group_id or h.seq != self._coll_seq() \
                    or self.op.coll == COLL_P2P:
                pr.data_waiting = 1     # a later collective's: its receive reads it
                return 0
        elif h.magic == MAGIC_DATA or h.magic == MAGIC_BY_ADDRESS:
            # An early message is normal when the peer is ahead (a later
            # collective, another group's, or a point-to-point message, which
            # carries no collective sequence number).  One of this collective
            # that no receive here will ever match, or one of an earlier
            # collective of this group, means disagreement.
            if n == HDR_BYTES and h.word.group_id == self.op.group_id and h.coll != COLL_P2P and (
                    <int32_t>(h.seq - self._coll_seq()) < 0 or (
                        h.seq == self._coll_seq() and not _same_op(&h, &self.op))):
                self._note_theirs(&h)
                return self.set_error(ERR_MISMATCH, peer, "", 0, "")
            pr.data_waiting = 1
            return 0
        if h.magic == MAGIC_ABORT and n < HDR_BYTES:
            return 0
        ch.ops.take_peeked(ch, &h)
        cdef Req fake
        memset(&fake, 0, sizeof(Req))
        fake.hdr = h
        return self._check_header(peer, &fake)

    cdef int _drop_peeked(self, int peer, MsgHeader* h) noexcept nogil:
        """Consume the leftover frame whose header a peek found, and what of it is there."""
        cdef ChannelBase* ch = self.pairs[peer].ch
        ch.ops.take_peeked(ch, h)
        self._skip_frame(peer, h, 0)
        return -1 if self._skip(peer, 1) < 0 else 0

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

    cdef int _block(self, int64_t now, int64_t until_ns, int sleep) noexcept nogil:
        """Sleep in poll() until some pair can move, the deadline (or ``until_ns``, when
        not 0), or abort(); with ``sleep`` 0, only look (poll() returns at once)."""
        cdef int n = 0, p, i, rc
        cdef short ev
        cdef Pair* pr
        cdef ChannelBase* ch
        cdef uint64_t drained
        cdef int64_t end = deadline_of(self) if until_ns == 0 or until_ns > deadline_of(self) \
            else until_ns
        cdef int64_t left_ms = (end - now) // 1000000 + 1 if sleep else 0
        self.pfds[0].fd = self.wake_fd
        self.pfds[0].events = POLLIN
        self.pfds[0].revents = 0
        n = 1
        for p in range(self.size):
            # Bytes a channel holds where poll() cannot see them (a ring, a decrypted
            # record): a receive waiting for them runs now; from a peer we expect nothing
            # from they are looked at (an abort, a disagreement, or later work).
            if p == self.rank:
                continue
            pr = &self.pairs[p]
            if pr.data_waiting and pr.recv_head < 0:
                continue
            if pr.ch.ops.held(pr.ch):
                if pr.recv_head >= 0:
                    return 0
                if self._peek_idle(p) < 0:
                    return -1
        if sleep and self._arm():
            return 0        # something arrived while we got ready to sleep
        for p in range(self.size):
            if p == self.rank:
                continue
            pr = &self.pairs[p]
            ch = pr.ch
            if ch.fd < 0:
                continue
            ev = ch.ops.events(ch, pr.send_head >= 0,
                           pr.recv_head >= 0 or not (ch.eof or pr.data_waiting))
            if ev:
                self.pfds[n].fd = ch.fd
                self.pfds[n].events = ev
                self.pfds[n].revents = 0
                self.pfd_peer[n] = p
                n += 1
        if left_ms > 1000:
            left_ms = 1000
        if sleep and self._signalled():
            self._disarm()
            return -1
        rc = poll(self.pfds, n, <int>left_ms)
        if sleep:
            self._disarm()
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
            self.pairs[p].ch.ops.woken(self.pairs[p].ch)
            if self.pairs[p].recv_head < 0 and self._peek_idle(p) < 0:
                return -1
        return 0

    cdef int _arm(self) noexcept nogil:
        """Ask every channel to wake us when it can move; 1 (all disarmed again) if one
        already can."""
        cdef int p
        cdef Pair* pr
        for p in range(self.size):
            if p == self.rank:
                continue
            pr = &self.pairs[p]
            if pr.ch.ops.arm(pr.ch, pr.recv_head >= 0 or not pr.data_waiting, pr.send_head >= 0,
                           self.reqs[pr.ack_head].ack_needed if pr.ack_head >= 0 else 0):
                self._disarm()
                return 1
        return 0

    cdef void _disarm(self) noexcept nogil:
        cdef int p
        for p in range(self.size):
            if p != self.rank:
                self.pairs[p].ch.ops.disarm(self.pairs[p].ch)

    cdef int _aborted(self) noexcept nogil:
        """Fail the operation for the abort_flag found raised, saying who raised it."""
        return self.set_error(ERR_ABORTED, -1, "", 0,
                              "the context was closed (close() from another thread)"
                              if pc_atomic_load(&self.abort_flag) == ABORT_CLOSING
                              else "abort() was called")

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
        spin_end = 0        # read from the clock once a pass leaves something to do
        while True:
            if pc_atomic_load(&self.abort_flag):
                return self._aborted()
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
            # Beside a batch of receives that wait (stash(1)): messages for them at the
            # heads of streams this operation does not read, read aside as watch does
            # (a peer's send that waits for this rank to take its message may be what
            # keeps the peer from its part of this operation).
            if self.stashing and self._read_aside() < 0:
                return -1
            now = pc_now_ns()
            if now >= deadline_from(self, now):
                return self._timeout()
            if until_ns and now >= until_ns:
                return 1
            if progressed or spin_end == 0:
                spin_end = now + self.spin_ns
                continue
            if now < spin_end:
                if self.yield_spin:
                    sched_yield()
                continue
            if self._block(now, until_ns, 1) < 0:
                return -1


    # -- recovery after a failure: back to a frame boundary on every live pair --

    def recover(self, peers, double timeout_s, within=None):
        """Bring the streams to ``peers`` back to a message boundary and clear the failure.

        This rank sends a reset frame on each pair and discards what the peer sent
        before the peer's reset frame: the rest of a message cut short, abort frames,
        messages nobody will receive.  Then the pair starts afresh (message numbers from
        0).  Pairs this rank broke mid-message, peers that ended their stream, and peers
        whose reset frame does not come within ``timeout_s`` seconds are closed, and so
        is every other pair of ``within`` (the ranks of the group that recovers; None: the
        world).  The pairs to ranks outside ``within`` stay as they are, with the messages
        read aside from them: a group's recovery closes no pair its parent may still use.
        Returns the peers of ``peers`` that could not be brought back.

        An abort() during it ends it where it stands (the pairs not yet brought back are
        lost) and raises Aborted, leaving the transport failed for the next recovery; one
        from before is the caller's to take first (``take_abort``).
        """
        cdef int p, n = self.size
        cdef Pair* pr
        cdef bint outside_busy = 0
        if self.closed:
            raise Error("rank %d: the context is closed" % self.rank)
        cdef char* want = <char*>calloc(n, 1)
        cdef Resync* rs = <Resync*>calloc(n, sizeof(Resync))
        if want == NULL or rs == NULL:
            free(want)
            free(rs)
            raise MemoryError()
        for p in peers:
            if 0 <= p < n and p != self.rank:
                want[p] = 1
        for p in range(n):
            if want[p]:
                self.pairs[p].resets += 1
        cdef int64_t until = pc_now_ns() + <int64_t>(timeout_s * 1e9)
        with nogil:
            aborted = self._resync(want, rs, until)
        lost = [p for p in peers if 0 <= p < n and p != self.rank and want[p] != 2]
        for p in range(n):
            if p == self.rank:
                continue
            pr = &self.pairs[p]
            if within is not None and p not in within:
                # the parent's own, left as they are: a send or receive still in flight
                # there keeps its request (the next operation finishes it first)
                outside_busy |= pr.send_head >= 0 or pr.recv_head >= 0 or pr.ack_head >= 0
                continue
            pr.send_head = pr.send_tail = -1
            pr.recv_head = pr.recv_tail = -1
            pr.ack_head = pr.ack_tail = -1
            pr.data_waiting = 0
            pr.rs_set = 0
            pr.rs_skip = 0
            pr.rs_ack = 0
            pr.rs_reset = 0
            pr.skip = 0
            pr.skip_ack = 0
            pr.finishing = 0
            free(pr.fill)
            pr.fill = NULL
            pr.fill_got = 0
            free(pr.rs_carry)
            pr.rs_carry = NULL
            pr.rs_carry_len = 0
            free(pr.out_carry)
            pr.out_carry = NULL
            pr.out_len = pr.out_off = 0
            if want[p] == 2:
                pr.sent_msgs = 0
                pr.recv_msgs = 0
            elif pr.ch.fd >= 0:
                self.channels[p].close()
                pr.ch.eof = 1
                pr.lost = 1
        free(want)
        free(rs)
        if not outside_busy:
            self.nreqs = 0
        self.stashing = 0
        # messages of the epoch that ended, as those on the wire
        self._drop_stashed(None if within is None else set(within))
        if within is None:
            self.flag_area = None   # the flags path ends with the world that used it (a
                                    # group's operations never take it)
        self.failed = 0
        memset(&self.err, 0, sizeof(TransportError))
        self.err.peer = self.err.blamed = self.err.origin = -1
        self.interrupt = None
        if aborted:
            Transport.set_error(self, ERR_ABORTED, -1, "", 0,
                                "abort() was called during the recovery")
            raise_error(self)
        return lost

    def take_abort(self):
        """Whether an abort() is pending that no operation has raised yet (none failed this
        transport since), clearing it either way: a recovery, which runs on a failed
        context, takes it as the context's failure and goes on (were it raised there, this
        rank's peers would wait for its reset frames to their deadline)."""
        return bool(pc_atomic_exchange(&self.abort_flag, 0) and not self.failed)

    def unreachable(self):
        """The peers whose pair has ended (end of stream seen, broken or closed)."""
        return [p for p in range(self.size) if p != self.rank and (
            self.pairs[p].ch.eof or self.pairs[p].lost or self.pairs[p].ch.fd < 0)]

    cdef bint _resync(self, char* want, Resync* rs, int64_t until) noexcept nogil:
        """recover()'s loop: ``want[p]`` becomes 2 for a pair brought back, 0 for one lost;
        whether abort() ended it."""
        cdef bint aborted = 0
        cdef int p, left, progressed, k
        cdef Pair* pr
        cdef Req* r
        cdef MsgHeader reset
        memset(&reset, 0, sizeof(reset))
        reset.magic = MAGIC_RESET
        for p in range(self.size):
            if not want[p]:
                continue
            pr = &self.pairs[p]
            if pr.lost or pr.ch.eof or pr.ch.fd < 0:
                want[p] = 0         # broken here, or the peer ended or broke its side
                continue
            # Where the stream stands: a failed frame's rest, or a receive cut short.
            if pr.rs_reset and <int32_t>(<uint32_t>(pr.rs_reset - 1) - pr.resets) >= 0:
                rs[p].got = 1           # its reset frame came during an operation
                rs[p].carry_off = pr.rs_carry_len
            elif pr.rs_set:
                rs[p].skip = pr.rs_skip
                rs[p].ack = pr.rs_ack
            elif pr.skip:
                rs[p].skip = pr.skip        # a leftover frame's rest
                rs[p].ack = pr.skip_ack
            elif pr.fill != NULL:           # a message read aside: the rest of its body
                rs[p].skip = _fill_body(pr) - pr.fill_got
                rs[p].ack = pr.fill_by_address
            elif pr.recv_head >= 0:
                r = &self.reqs[pr.recv_head]
                if r.hdr_done < HDR_BYTES:
                    memcpy(&rs[p].hdr, &r.hdr, r.hdr_done)
                    rs[p].hdr_done = r.hdr_done
                elif r.by_address:
                    if r.addr_done < ADDR_BODY:
                        rs[p].skip = ADDR_BODY - r.addr_done
                        rs[p].ack = 1
                    else:
                        pr.ch.ops.ack(pr.ch)
                else:
                    rs[p].skip = r.nbytes - r.done
        while True:
            left = 0
            progressed = 0
            for p in range(self.size):
                if want[p] != 1:
                    continue
                reset.seq = self.pairs[p].resets
                k = self._resync_pair(p, &rs[p], &reset)
                if k < 0:
                    want[p] = 0
                    continue
                progressed |= k
                if rs[p].got and rs[p].sent == HDR_BYTES:
                    want[p] = 2
                else:
                    left += 1
            if not left or pc_now_ns() >= until:
                break
            if pc_atomic_load(&self.abort_flag):
                aborted = 1
                break
            if not progressed:
                self._resync_wait(want)
        for p in range(self.size):
            if want[p] == 1:
                want[p] = 0         # no reset frame in time: a stopped or absent peer
        return aborted

    cdef int _resync_pair(self, int p, Resync* rs, MsgHeader* reset) noexcept nogil:
        """Move one pair's recovery on: 1 if it progressed, 0 if not, -1 if it is lost."""
        cdef Pair* pr = &self.pairs[p]
        cdef ChannelBase* ch = pr.ch
        cdef char junk[JUNK_BYTES]
        cdef iovec iov
        cdef ssize_t n
        cdef size_t need
        cdef int progressed = 0
        ch.ops.woken(ch)            # a doorbell's bytes; the end of the peer's stream
        while pr.out_off < pr.out_len:
            # The rest of the message this rank failed in the middle of, and its abort frame.
            iov.iov_base = pr.out_carry + pr.out_off
            iov.iov_len = pr.out_len - pr.out_off
            n = ch.ops.writev(ch, &iov, 1)
            if n < 0:
                if not (_would_block(errno) or errno == EINTR):
                    return -1
                break
            pr.out_off += <size_t>n
            progressed = 1
        if rs.sent < HDR_BYTES and pr.out_off == pr.out_len:
            iov.iov_base = (<char*>reset) + rs.sent
            iov.iov_len = HDR_BYTES - rs.sent
            n = ch.ops.writev(ch, &iov, 1)
            if n < 0 and not (_would_block(errno) or errno == EINTR):
                return -1
            if n > 0:
                rs.sent += <uint32_t>n
                progressed = 1
        while not rs.got and rs.carry_off < pr.rs_carry_len:
            need = self._resync_need(rs)
            if need > pr.rs_carry_len - rs.carry_off:
                need = pr.rs_carry_len - rs.carry_off
            if self._resync_take(p, rs, pr.rs_carry + rs.carry_off, need) < 0:
                return -1
            rs.carry_off += need
            progressed = 1
        while not rs.got:
            # Read exactly what the current frame still holds, never past the reset frame:
            # what follows it belongs to the group the pair serves next.
            need = self._resync_need(rs)
            iov.iov_base = junk
            iov.iov_len = need
            n = ch.ops.readv(ch, &iov, 1)
            if n == 0:
                ch.eof = 1
                return -1
            if n < 0:
                if _would_block(errno) or errno == EINTR:
                    break
                return -1
            if self._resync_take(p, rs, junk, <size_t>n) < 0:
                return -1
            progressed = 1
        return progressed

    cdef inline size_t _resync_need(self, Resync* rs) noexcept nogil:
        if rs.skip:
            return JUNK_BYTES if rs.skip > JUNK_BYTES else <size_t>rs.skip
        return HDR_BYTES - rs.hdr_done

    cdef int _resync_take(self, int p, Resync* rs, const char* src, size_t n) noexcept nogil:
        """Account ``n`` stream bytes (at most _resync_need): -1 if they are not frames."""
        cdef ChannelBase* ch = self.pairs[p].ch
        if rs.skip:
            rs.skip -= n
            if rs.skip == 0 and rs.ack:
                ch.ops.ack(ch)      # a by-address message skipped counts as copied out
                rs.ack = 0
            return 0
        memcpy((<char*>&rs.hdr) + rs.hdr_done, src, n)
        rs.hdr_done += <uint32_t>n
        if rs.hdr_done < HDR_BYTES:
            return 0
        rs.hdr_done = 0
        if rs.hdr.magic == MAGIC_RESET:
            # An older recovery's frame is skipped; this one's (or a later one's) ends it.
            if <int32_t>(rs.hdr.seq - self.pairs[p].resets) >= 0:
                rs.got = 1
        elif rs.hdr.magic == MAGIC_DATA or rs.hdr.magic == MAGIC_REFUSED:
            rs.skip = rs.hdr.nbytes
        elif rs.hdr.magic == MAGIC_BY_ADDRESS:
            rs.skip = ADDR_BODY
            rs.ack = 1
        elif rs.hdr.magic != MAGIC_ABORT:
            return -1
        return 0

    cdef void _resync_wait(self, char* want) noexcept nogil:
        """Sleep until a recovering pair is readable, or writable where it has a message's
        rest to write (at most 1 ms: rings have no doorbell armed here)."""
        cdef int p, k = 0
        for p in range(self.size):
            if want[p] != 1 or self.pairs[p].ch.fd < 0:
                continue
            self.pfds[k].fd = self.pairs[p].ch.fd
            self.pfds[k].events = self.pairs[p].ch.ops.events(
                self.pairs[p].ch, self.pairs[p].out_off < self.pairs[p].out_len, 1)
            self.pfds[k].revents = 0
            k += 1
        poll(self.pfds, k, 1)


cdef const char* _kind_name(uint32_t kind) noexcept nogil:
    if kind == ERR_PEER:
        return "peer"
    if kind == ERR_TIMEOUT:
        return "timeout"
    if kind == ERR_MISMATCH:
        return "mismatch"
    if kind == ERR_ABORTED:
        return "abort"
    if kind == ERR_REFUSED:
        return "refused"
    return "internal"
