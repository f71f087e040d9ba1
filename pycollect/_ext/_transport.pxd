# The C-level transport interface.  Algorithms are written against this class
# only, and never cimport a concrete transport: the engine (_engine.pyx, over
# its channels) and sub-groups (_group.pyx) subclass it, and so may a plugin.
#
# Vocabulary (after Gloo): a transport owns one pair per peer; an operation
# posts sends and receives of whole messages on pairs and waits for them.
# Messages between two ranks are matched in order of posting, so an
# algorithm must post, on each pair, its receives in the order the peer posts
# its sends.  Every message carries the operation's descriptor, checked on
# receipt: ranks that disagree get ERR_MISMATCH instead of a hang.
#
# One-sided reads and writes: where can_read_remote(peer) says so, read_remote
# copies bytes straight out of the peer's memory and write_remote into it
# (cross-memory attach between processes of one host today, RDMA later) with
# no message; the algorithm exchanges the addresses itself.  From Python every transport
# offers pair_kinds() (how each peer is reached) and host_ids (each rank's
# host identity, or None), declared here so that nobody has to probe.
from libc.stdint cimport int32_t, int64_t, uint8_t, uint32_t, uint64_t

from pycollect._ext._pool cimport PoolRef

cdef enum ErrorKind:
    ERR_NONE = 0
    ERR_PEER = 1        # a peer closed, reset, or broke the protocol
    ERR_TIMEOUT = 2     # the operation's deadline passed
    ERR_MISMATCH = 3    # ranks disagree on the operation
    ERR_ABORTED = 4     # abort() was called on this rank
    ERR_INTERNAL = 5    # out of memory, a bug
    ERR_REFUSED = 6     # a peer refused its arguments to this collective (origin: who)

cdef enum:
    REASON_BYTES = 160  # the most bytes of reason a refusal (Transport.refuse) carries
    PROBE_ONCE = -1     # probe_until's until_ns for one look that leaves a kick pending
    PROGRESS_ONCE = 1   # progress_until's until_ns for one pass (a time long past: no
                        # clock is read for it, only if the pass leaves something to do)

# Collective codes carried in the descriptor.
cdef enum Collective:
    COLL_BARRIER = 1
    COLL_BROADCAST = 2
    COLL_ALLREDUCE = 3
    COLL_REDUCE = 4
    COLL_ALLGATHER = 5
    COLL_ALLGATHERV = 6
    COLL_GATHER = 7
    COLL_GATHERV = 8
    COLL_SCATTER = 9
    COLL_SCATTERV = 10
    COLL_REDUCE_SCATTER = 11
    COLL_REDUCE_SCATTERV = 12
    COLL_ALLTOALL = 13
    COLL_ALLTOALLV = 14
    COLL_P2P = 15

cdef struct OpDesc:
    uint32_t group_id   # the group: 0 for a top-level context, a derived id for sub-groups
    uint32_t seq        # the context's collective sequence number
    uint8_t coll
    uint8_t dtype
    uint8_t redop
    uint8_t algo
    int32_t root
    uint64_t count

cdef struct TransportError:
    int kind
    int peer            # the peer involved, -1 when none
    int blamed          # for an error a peer reported: the rank it blamed
    int origin          # for an error a peer reported: the rank that failed first
    int origin_kind     # ... and its error kind
    int sys_errno
    char syscall[24]     # the longest: "process_vm_writev"
    char detail[200]
    OpDesc mine
    OpDesc theirs       # the peer's descriptor (mismatch, reported errors)
    int has_theirs

cdef struct Probe:
    int peer            # who sent the message
    uint64_t nbytes     # its payload size
    OpDesc desc         # its descriptor
    # In: for a probe of any rank (peer -1), NULL, or the ranks that may send it (those p
    # with within[p]): a sub-group's members, so that another rank's ended stream or
    # message is not the group's.  Whoever fills a Probe for probe/probe_until sets it.
    const uint8_t* within

# A point-to-point message that an operation run beside a batch's waiting receives read
# aside (Transport.stash): from ``peer`` with ``tag``, of ``nbytes`` at ``data`` (the bytes
# after the struct, in the one malloc'd block), stamped as its header was (``seq``: the
# sender's Transport.p2p_seq).
cdef struct Stashed:
    Stashed* next
    int peer
    int tag
    int dtype
    uint32_t seq
    size_t nbytes
    char* data

# The descriptor and deadline of an operation in progress, set aside (Transport.save_op).
cdef struct OpState:
    OpDesc op
    int64_t deadline_ns
    double timeout_s

cdef extern from "_sys.h" nogil:
    int64_t _deadline_clock "pc_now_ns"()

cdef class Transport:
    cdef readonly int rank
    cdef readonly int size
    # No peer at all (a world of one): begin never waits, so the algorithms call it
    # without releasing the GIL.  False unless the transport knows (a sub-group of one
    # may wait in begin for its parent's sends).
    cdef readonly bint solo
    cdef OpDesc op
    # The operation's deadline on the monotonic clock; DEADLINE_LAZY: ``timeout_s`` from
    # the first time somebody asks (deadline_of), so that an operation that never waits
    # reads no clock.
    cdef int64_t deadline_ns
    cdef double timeout_s
    cdef TransportError err
    cdef int failed
    cdef char* scratch_buf[2]
    cdef size_t scratch_cap[2]
    cdef object interrupt       # a KeyboardInterrupt (or other signal exception) that ended an op
    cdef public list host_ids   # rendezvous' host identity of every rank, or None
    # The sequence number that point-to-point sends carry in their header: the number of
    # the owning context's next collective (a group's own; CallPath keeps it).  A receiver
    # that parks a message ahead of its receive keeps it, so that a collective numbered
    # below it does not count the message as one left unreceived (_p2p.Mailbox).
    cdef public unsigned int p2p_seq
    # The shared-memory flag area of the small-message path (_flags.FlagArea), set at
    # connect time where every pair is on one host's shared memory; None elsewhere.
    cdef public object flag_area
    # The direct algorithms' staging block in this process's pool of shared buffers
    # (_direct.pyx's direct_stage), or None.
    cdef object staging

    cdef int begin(self, const OpDesc* op, double timeout_s) noexcept nogil
    cdef int post_send(self, int peer, const void* buf, size_t nbytes) noexcept nogil
    # post_send for an async send: one the channel can take whole now, rather than have
    # the peer copy it from this process's memory later, so that it ends at once (a
    # channel's eager_max; the default is post_send).
    cdef int post_send_async(self, int peer, const void* buf, size_t nbytes) noexcept nogil
    cdef int post_recv(self, int peer, void* buf, size_t nbytes) noexcept nogil
    cdef int wait(self, int req) noexcept nogil
    cdef int wait_all(self) noexcept nogil
    cdef int probe(self, int peer, Probe* out) noexcept nogil
    # Point-to-point batches: several sends and receives of different
    # descriptors in flight at once (async send/recv).  set_op changes the
    # descriptor later posts carry without starting a new operation;
    # post_recv_upto takes the peer's next point-to-point message of at most
    # ``capacity`` bytes (its size is received(req) once done); progress_until
    # moves every request until all are done (0), ``until_ns`` passes (1; after one pass
    # for PROGRESS_ONCE) or an error (-1); probe_until is probe that gives up at
    # ``until_ns`` (-2), or after one look (PROBE_ONCE: a kick made meanwhile still ends
    # the next bounded wait).
    cdef int set_op(self, const OpDesc* op) noexcept nogil
    cdef int post_recv_upto(self, int peer, void* buf, size_t capacity) noexcept nogil
    cdef int done(self, int req) noexcept nogil
    cdef int64_t received(self, int req) noexcept nogil
    cdef int progress_until(self, int64_t until_ns) noexcept nogil
    cdef int probe_until(self, int peer, Probe* out, int64_t until_ns) noexcept nogil
    cdef void extend_deadline(self, double timeout_s) noexcept nogil
    # An operation run while a batch's receives wait for their messages, unposted (no
    # request of the transport's in flight): save_op keeps the descriptor and deadline
    # they run under, restore_op puts them back once that operation is done.
    cdef void save_op(self, OpState* saved) noexcept nogil
    cdef void restore_op(self, const OpState* saved) noexcept nogil
    # Such an operation may read a pair's stream where a point-to-point message of its
    # group stands before its own frame (the peer sent it before its part: the message a
    # waiting receive wants, as MPI delivers an Irecv's message around an Allreduce).
    # With stash(1) the transport reads such a message aside (whole, into a Stashed; one
    # sent by address is copied from the sender's memory and acknowledged) and reads on,
    # where it would otherwise fail the operation with ERR_MISMATCH; stashed() hands them
    # out, oldest first (the caller frees each with free()), for the batch's receives
    # (_p2p.stash_to).  can_stash: 1 where the transport does this (it owns its streams),
    # else 0: such an operation must not run beside the batch.
    cdef bint can_stash(self) noexcept nogil
    cdef void stash(self, bint on) noexcept nogil
    cdef Stashed* stashed(self) noexcept nogil
    # With stash(1), the waits (``watch``, the flag area's, and a stream operation's passes)
    # also read aside such messages that stand at the heads of streams no receive is reading
    # (an operation keeps the streams it does not read moving: a peer whose send waits for
    # this rank to take its message, by address or through a full channel, would otherwise
    # never reach the operation this rank waits in for it).  finish_aside: before stash(0),
    # read the rest of any message such a look began (its sender is writing it), within
    # the operation's deadline; 0, or -1 after set_error.
    cdef int finish_aside(self) noexcept nogil
    # A receive of a batch (async) that finds, at the head of the stream it waits on, the
    # peer's part of a collective of its group that this rank has not run yet waits on
    # behind it (past_collectives(1), where the transport can stash: that collective, run
    # beside the batch, reads the frame and sets aside the message behind it), where any
    # other receive fails with ERR_MISMATCH.
    cdef void past_collectives(self, bint on) noexcept nogil
    # 1 where a send of ``nbytes`` to ``peer`` posted now ends at once without the peer
    # reading anything (nothing queued to it, no copy by address, room in its channel):
    # such an operation may run beside a batch whose receives it would otherwise have to
    # move while it waits.  0 where it may wait for the peer, or the transport cannot tell.
    cdef bint sends_now(self, int peer, size_t nbytes) noexcept nogil
    # 1 if this rank may read and write ``peer``'s memory with read_remote and
    # write_remote, else 0.
    cdef int can_read_remote(self, int peer) noexcept nogil
    # Copy ``nbytes`` at ``remote_addr`` in ``peer``'s memory into ``dst``: 0, or -1
    # after set_error.
    cdef int read_remote(self, int peer, void* dst, uint64_t remote_addr,
                         size_t nbytes) noexcept nogil
    # Copy ``nbytes`` at ``src`` to ``remote_addr`` in ``peer``'s memory: 0, or -1 after
    # set_error.
    cdef int write_remote(self, int peer, uint64_t remote_addr, const void* src,
                          size_t nbytes) noexcept nogil
    # Where ``peer``'s buffer [remote_addr, + nbytes) lies in a pool of shared buffers
    # (``ref``, _pool.pxd) this process can map: the buffer as this process sees it, for
    # plain loads and stores; NULL where it cannot (read_remote and write_remote then).
    cdef char* view_remote(self, int peer, const PoolRef* ref, uint64_t remote_addr,
                           size_t nbytes) noexcept nogil
    # Waiting on shared memory instead of messages (the flags path, _flags.pyx):
    # watch looks at every pair without a posted receive, as wait does while it
    # waits (abort frames, disagreement, abort(), the ends of streams), without
    # sleeping when ``until_ns`` is 0, else sleeping in poll() until a pair's fd
    # or abort() wakes it, ``until_ns`` or the deadline: 0, or -1 after set_error.
    # ``waiting_for`` (or -1) has not entered this operation, which it owes no
    # message: a collective's message at the head of its stream is a disagreement.
    # peer_left(p): p's side of the pair has ended.  ring_bell(p): wake p if it
    # sleeps in watch (a byte on the pair's doorbell: only where flag_area is set,
    # whose pairs are all doorbell channels).
    cdef int watch(self, int64_t until_ns, int waiting_for) noexcept nogil
    cdef int peer_left(self, int peer) noexcept nogil
    # 1 if a receive from ``peer`` posted now would find something at once, without
    # reading it: a whole frame header at the head of the pair's stream, its end, or this
    # transport's failure (the receive then reports it); 0 where nothing is there yet, a
    # frame is half read, or the transport cannot tell.  A look only: nothing is consumed.
    cdef bint head_here(self, int peer) noexcept nogil
    # head_here, where the frame at the head is a data message of collective number ``seq``
    # of the group ``group_id`` (0: this transport's own operations; a group transport
    # asks its parent with its own id): ``peer`` has entered that collective.  1 also at
    # the stream's end or this transport's failure; 0 where the transport cannot tell.
    cdef bint head_of(self, int peer, uint32_t group_id, uint32_t seq) noexcept nogil
    cdef void ring_bell(self, int peer) noexcept nogil
    # This rank refused its arguments to collective ``op`` (which it will not run): tell
    # the peers (``peers``, ``npeers`` of them; NULL: every peer) why, in ``reason``
    # (``n`` bytes), so that a peer running ``op`` fails at once with ERR_REFUSED.
    # 0, or -1 after set_error.
    cdef int refuse(self, const OpDesc* op, double timeout_s, const char* reason, size_t n,
                    const int* peers, int npeers) noexcept nogil
    cdef int set_error(self, int kind, int peer, const char* syscall, int errnum,
                       const char* detail) noexcept nogil
    cdef char* scratch(self, size_t nbytes) noexcept nogil
    cdef char* work_area(self, size_t nbytes) noexcept nogil
    cdef char* _area(self, int which, size_t nbytes) noexcept nogil
    cdef void copy_error(self, Transport src) noexcept nogil

cdef int raise_error(Transport t) except -1

# Algorithm codes carried in the descriptor (ranks must agree on them too).
cdef enum Algorithm:
    ALGO_NONE = 0
    ALGO_RING = 1
    ALGO_RING_CHUNKED = 2
    ALGO_BINOMIAL = 3
    ALGO_PIPELINED = 4
    ALGO_DISSEMINATION = 5
    ALGO_RECURSIVE_DOUBLING = 7
    ALGO_HALVING_DOUBLING = 8
    ALGO_BCUBE = 9
    ALGO_BINOMIAL_REDUCE = 10
    ALGO_LINEAR = 11
    ALGO_PAIRWISE = 12
    ALGO_DIRECT = 13
    ALGO_HIERARCHICAL = 14
    ALGO_FLAGS = 15         # small messages through the shared-memory flag area (_flags.pyx)


cdef inline void fill_desc(OpDesc* d, unsigned int seq, int coll, int dtype, int redop, int algo,
                           int root, unsigned long long count) noexcept nogil:
    d.group_id = 0
    d.seq = seq
    d.coll = coll
    d.dtype = dtype
    d.redop = redop
    d.algo = algo
    d.root = root
    d.count = count


cdef inline int counts_digest(const size_t* counts, int n) noexcept nogil:
    """A v-variant's counts as one non-negative 31-bit number (FNV-1a over them), carried in
    the descriptor's ``root`` (unused by allgatherv and reduce_scatterv), so that ranks whose
    counts differ, even with the same total, disagree in a MismatchError."""
    cdef uint64_t h = 1469598103934665603ULL
    cdef int i
    for i in range(n):
        h = (h ^ <uint64_t>counts[i]) * 1099511628211ULL
    return <int>((h ^ (h >> 31)) & 0x7FFFFFFF)


cdef enum:
    DEADLINE_LAZY = 0


cdef inline int64_t deadline_from(Transport t, int64_t now) noexcept nogil:
    """``deadline_of`` for a caller that has just read the clock (``now``): a lazy
    deadline is fixed from it, without reading the clock again."""
    if t.deadline_ns == DEADLINE_LAZY:
        t.deadline_ns = now + <int64_t>(t.timeout_s * 1e9)
    return t.deadline_ns

cdef inline int64_t deadline_of(Transport t) noexcept nogil:
    """``t``'s deadline for the operation in progress, fixed at the first call."""
    if t.deadline_ns == DEADLINE_LAZY:
        return deadline_from(t, _deadline_clock())
    return t.deadline_ns
