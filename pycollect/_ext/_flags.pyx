"""Small messages of one host through shared-memory flags instead of messages.

Where every pair of a transport is on one host's shared memory, the transport
(``pycollect/plugins/transports/shm.py``) maps a flag area beside the rings and
sets ``Transport.flag_area``.  The area holds, for each rank, a "sleeping"
line, FLAGS_DEPTH post lines, 2 * FLAGS_DEPTH descriptor lines and
FLAGS_DEPTH data slots of FLAGS_MAX_BYTES; one line above them all says
whether some rank's flags operation failed.  A post line is one cache line:
the rank's flag for one operation (its number + 1), that operation's
descriptor and, up to FLAGS_INLINE_BYTES, its data, so that a peer waiting
on a small message finds flag, descriptor and data in the one line that
the wait brought into its cache.

Every collective of the path is one synchronisation point.  For the k-th flags
operation (k counted alike on every rank, from 0; D = FLAGS_DEPTH, M =
FLAGS_OUTSTANDING), rank r

1. makes sure its slot k % D is free: every peer has entered operation
   k - D + M (a rank has at most M operations posted and not ended, so it
   has finished reading operation k - D, the slot's last use).  Only a
   broadcast's root, which does not wait for the others, ever waits here;
2. writes its descriptor into its post line k % D and its descriptor line
   k % 2D, and the data it contributes into the post line (up to
   FLAGS_INLINE_BYTES) or its data slot k % D;
3. posts: the post line's flag becomes k + 1 (a release store), and it rings
   the doorbell of each peer that sleeps;
4. waits: allreduce and barrier until every peer has posted operation k, a
   broadcast's other ranks for the root only, its root not at all;
5. checks descriptors: every peer's descriptor of every operation whose check
   is due (all operations up to k after a full wait; the root's, at once,
   where only the root was waited for) must equal its own, else
   MismatchError, worded as on the message path.  Operation k's is read
   from the post line where k is the rank's last post; checks left over (a
   root that returned at once) are done in step 1 of a later operation, at
   the latest D - M operations on, and any check of an operation with later
   posts is read from the peers' descriptor lines, which still hold them (a
   line is written again 2D operations later, only after this rank has
   posted D + M more times; a post line may already hold a later operation
   by then);
6. reads what it needs from the peers' posts: allreduce reduces every rank's
   contribution, in rank order, into its output (so all ranks get the same
   bits); reduce_scatter likewise, only its own block of each rank's whole send
   buffer; allgather copies every rank's block into its place, alltoall its own
   block of every rank's send buffer; broadcast copies the root's; barrier reads
   nothing.

An async allreduce, reduce_scatter, allgather, alltoall, broadcast or barrier begun on the
caller's thread (``flags_post``: steps 1 to 3) is ended later, by whichever thread drives
it next, with ``flags_allreduce_end``, ``flags_reduce_scatter_end``,
``flags_allgather_end``, ``flags_alltoall_end``, ``flags_broadcast_end`` or
``flags_barrier_end`` (steps 4 to 6).  Up to M operations may be posted and
not ended (``flags_slot_free`` says whether one more may), and they end in the
order of their posts (``Flags.ended``: the next to end), each before any
operation that runs without being posted this way; ``flags_ends_at_once``
says when the last one posted may end at once, ``posts_complete`` when the
next to end would wait for nobody.

No trailing barrier is needed and slots never need a "read by all" count: a
rank with operation j not ended has posted at most j + M - 1, and nobody
writes a slot for operation j + D before every peer has entered j + M.  A
post line's flag only grows (k + 1, then k + 1 + D...), so "peer p has
entered operation j" is "p's post line j % D holds at least j + 1".

Waiting spins on the flags with the CPU's pause hint (where more of the
host's ranks may run on this rank's CPUs than it has, ``plugins/hosts.oversubscribed``,
it yields the core instead: on every pass while a rank that may run on its CPUs,
``plugins/hosts.cpu_mates``, has not posted, else every CLOCK_EVERY-th), looks at the pairs
without sleeping every LOOK_NS (an abort frame, a peer's end, a message that
shows disagreement, abort() from another thread), and after the transport's
spin time sleeps in ``Transport.watch`` (poll() on the pairs' doorbells and the
abort eventfd) with its "sleeping" word set, so that a posting peer wakes it.
A peer that has not arrived by the deadline is named in the Timeout; one whose
pair ended fails the call with PeerError; any failure of a flags operation
sets the area's failure word, which every spinner checks on each pass (and
where it finds the word set, looks at the posts once more: those it waits for
may have come before the failure, which is then a later operation's), and the
transport's abort frames tell the peers what happened.
"""

from libc.stdint cimport int64_t, uint32_t, uint64_t
from libc.stdio cimport snprintf
from libc.string cimport memcpy

from pycollect._ext._dtypes cimport OP_AVG
from pycollect._ext._reduce cimport divide_by, reduce_into
from pycollect._ext._transport cimport *

cdef extern from "_sys.h" nogil:
    int64_t pc_now_ns()
    uint64_t pc_load_u64(uint64_t* p)
    void pc_store_u64(uint64_t* p, uint64_t v)
    uint32_t pc_load_u32(uint32_t* p)
    void pc_store_u32_sc(uint32_t* p, uint32_t v)
    uint32_t pc_exchange_u32(uint32_t* p, uint32_t v)
    void pc_fence()
    void pc_pause()

cdef extern from "<sched.h>" nogil:
    int sched_yield()

cdef enum:
    CLOCK_EVERY = 8             # spins between looks at the clock
    LOOK_NS = 50000             # between looks at the pairs while spinning
    NAP_NS = 100000000          # the longest sleep in watch (then look again)
    RELAY_NS = 200000000        # how long a failure seen in the area waits for its report

MAX_BYTES = FLAGS_MAX_BYTES
OUTSTANDING = FLAGS_OUTSTANDING


def area_bytes(int nlocal):
    """The bytes of a flag area for ``nlocal`` ranks (a multiple of 64)."""
    return sizeof(AreaHeader) + nlocal * (sizeof(SleepLine) + FLAGS_DEPTH * sizeof(PostLine)
                                          + 2 * FLAGS_DEPTH * sizeof(DescLine)
                                          + FLAGS_DEPTH * FLAGS_MAX_BYTES)


cdef class FlagArea:
    """The flag area at ``address`` (64-byte aligned, ``area_bytes(n)`` long, zeroed when
    first mapped) in a shared mapping that ``owner`` keeps alive, for rank ``me`` of ``n``.
    With ``yield_spin``, a wait gives up the core on every pass while one of the ``mates``
    (the ranks that may run on this rank's CPUs; default: every peer) has not posted, and
    on every CLOCK_EVERY-th pass otherwise."""

    def __init__(self, owner, size_t address, int me, int n, double spin_us=50.0,
                 bint yield_spin=False, mates=None):
        if n < 2 or not 0 <= me < n or address % 64:
            raise ValueError("FlagArea: inconsistent rank, size or address")
        marks = bytearray(n)
        for p in (range(n) if mates is None else mates):
            if not 0 <= p < n:
                raise ValueError("FlagArea: mate %r is not a rank of %d" % (p, n))
            marks[p] = p != me
        self.mates = bytes(marks)
        self.f.mate = <const unsigned char*>self.mates
        if sizeof(PostLine) != 64 or sizeof(SleepLine) != 64 or sizeof(DescLine) != 64:
            raise RuntimeError("FlagArea: a line of the area is not one 64-byte cache line")
        self.owner = owner
        self.f.hdr = <AreaHeader*>address
        self.f.sleep = <SleepLine*>(self.f.hdr + 1)
        self.f.posts = <PostLine*>(self.f.sleep + n)
        self.f.descs = <DescLine*>(self.f.posts + n * FLAGS_DEPTH)
        self.f.data = <char*>(self.f.descs + n * 2 * FLAGS_DEPTH)
        self.f.me = me
        self.f.n = n
        self.f.ops = 0
        self.f.ended = 0
        self.f.checked = 0
        self.f.spin_ns = <int64_t>(spin_us * 1000.0)
        self.f.yield_spin = yield_spin

    @property
    def operations(self):
        """How many collectives this rank has posted to the area."""
        return self.f.ops

    @property
    def outstanding(self):
        """How many of them this rank has posted and not ended (at most FLAGS_OUTSTANDING)."""
        return self.f.ops - self.f.ended

    @property
    def mates(self):
        """The ranks a wait yields the core to at once while they have not posted (with
        yield_spin): those that may run on this rank's CPUs."""
        return tuple(p for p in range(self.f.n) if self.f.mate[p])

    @property
    def max_bytes(self):
        """The largest message the area carries."""
        return FLAGS_MAX_BYTES


cdef Flags* flags_fit(Transport t, size_t nbytes) noexcept:
    cdef FlagArea area
    if t.flag_area is None or nbytes > FLAGS_MAX_BYTES:
        return NULL
    area = <FlagArea>t.flag_area
    if area.f.n != t.size or area.f.me != t.rank:
        return NULL
    return &area.f


cdef inline OpDesc* _desc(Flags* f, int rank, uint64_t k) noexcept nogil:
    return &f.descs[<size_t>rank * 2 * FLAGS_DEPTH + k % (2 * FLAGS_DEPTH)].desc


cdef inline PostLine* _line(Flags* f, int rank, uint64_t k) noexcept nogil:
    return &f.posts[<size_t>rank * FLAGS_DEPTH + k % FLAGS_DEPTH]


cdef inline bint _entered(Flags* f, int rank, uint64_t want) noexcept nogil:
    """Rank ``rank`` has entered operation ``want - 1`` (``want`` >= 1)."""
    return pc_load_u64(&_line(f, rank, want - 1).posted) >= want


cdef inline char* _data(Flags* f, int rank, uint64_t k, size_t nbytes) noexcept nogil:
    """Where rank ``rank``'s ``nbytes`` of operation ``k`` lie."""
    if nbytes <= FLAGS_INLINE_BYTES:
        return _line(f, rank, k).data
    return f.data + (<size_t>rank * FLAGS_DEPTH + k % FLAGS_DEPTH) * FLAGS_MAX_BYTES


cdef inline int _same(const OpDesc* a, const OpDesc* b) noexcept nogil:
    return (a.group_id == b.group_id and a.seq == b.seq and a.coll == b.coll
            and a.dtype == b.dtype and a.redop == b.redop and a.algo == b.algo
            and a.root == b.root and a.count == b.count)


cdef void _post(Transport t, Flags* f, uint64_t k, const char* src, size_t nbytes) noexcept nogil:
    """Operation ``k``'s descriptor and data, then its flag; wake the peers that sleep."""
    cdef PostLine* line = _line(f, f.me, k)
    cdef int p
    _desc(f, f.me, k)[0] = t.op
    line.desc = t.op
    if nbytes:
        memcpy(_data(f, f.me, k, nbytes), src, nbytes)
    pc_store_u64(&line.posted, k + 1)
    pc_fence()      # the flag before the sleeping words: a peer about to sleep sees one
    for p in range(f.n):
        if p != f.me and pc_load_u32(&f.sleep[p].sleeping) \
                and pc_exchange_u32(&f.sleep[p].sleeping, 0):
            t.ring_bell(p)


cdef int _fail(Flags* f) noexcept nogil:
    """Note in the area that this rank's flags operation failed; -1."""
    if pc_load_u32(&f.hdr.failed) == 0:
        pc_store_u32_sc(&f.hdr.failed, <uint32_t>(f.me + 1))
    return -1


cdef int _check(Transport t, Flags* f, int p, uint64_t k) noexcept nogil:
    """Peer ``p`` has entered operation ``k``: its descriptor must be ours.  Read from its
    post line while that is sure to hold operation ``k`` (``k`` is this rank's operation in
    progress), else from its descriptor line."""
    cdef OpDesc* theirs = &_line(f, p, k).desc if k + 1 == f.ops else _desc(f, p, k)
    cdef OpDesc* mine = _desc(f, f.me, k)
    if _same(theirs, mine):
        return 0
    if not t.failed:
        t.err.theirs = theirs[0]
        t.err.has_theirs = 1
        t.op = mine[0]          # the error names the operation the ranks disagree on
    return t.set_error(ERR_MISMATCH, p, "", 0, "")


cdef int _check_upto(Transport t, Flags* f, uint64_t end) noexcept nogil:
    """Check every peer's descriptors of the operations not yet checked below ``end``
    (every flag is at least ``end``)."""
    cdef uint64_t j
    cdef int p
    for j in range(f.checked, end):
        for p in range(f.n):
            if p != f.me and _check(t, f, p, j) < 0:
                return -1
    if end > f.checked:
        f.checked = end
    return 0


cdef int _left(Transport t, Flags* f, uint64_t want, int first, int last) noexcept nogil:
    """-1 after set_error if a peer that has not arrived has ended its pair, else 0."""
    cdef int p
    for p in range(first, last + 1):
        if p != f.me and not _entered(f, p, want) and t.peer_left(p):
            return t.set_error(ERR_PEER, p, "", 0, "closed its connection (the process "
                               "exited or closed its context)")
    return 0


cdef int _late(Transport t, Flags* f, uint64_t want, int first, int last) noexcept nogil:
    """The deadline passed: ERR_TIMEOUT naming every peer that has not arrived."""
    cdef char detail[200]
    cdef int p, off
    off = snprintf(detail, sizeof(detail), "waiting for")
    for p in range(first, last + 1):
        if p != f.me and not _entered(f, p, want) and off < <int>sizeof(detail) - 40:
            off += snprintf(detail + off, sizeof(detail) - off, " rank %d (to arrive)", p)
    t.err.blamed = -1
    return t.set_error(ERR_TIMEOUT, first, "", 0, detail)


cdef int _failed_elsewhere(Transport t, Flags* f, uint64_t want, int first,
                           int last) noexcept nogil:
    """Another rank's flags operation failed: wait (briefly) for its abort frame to say
    why, then report the failure as the area shows it; where this rank's own deadline
    passes first, its own Timeout (the ranks it waits for are as late for it: peers that
    time out together on the same late rank each name that rank)."""
    cdef char detail[200]
    cdef int origin = <int>pc_load_u32(&f.hdr.failed) - 1
    cdef int64_t now = pc_now_ns(), until = now + RELAY_NS
    while now < until and now < deadline_of(t):
        if t.watch(now + 1000000, -1) < 0 or _left(t, f, want, first, last) < 0:
            return -1
        now = pc_now_ns()
    if now >= deadline_of(t):
        return _late(t, f, want, first, last)
    snprintf(detail, sizeof(detail), "failed (seen in the shared flag area) and left the "
             "group")
    return t.set_error(ERR_PEER, origin if 0 <= origin < f.n else -1, "", 0, detail)


cdef inline int _first_missing(Flags* f, uint64_t want, int p, int last) noexcept nogil:
    """The first peer from ``p`` to ``last`` that has not entered operation ``want - 1``;
    ``last + 1`` when every one has."""
    while p <= last and (p == f.me or _entered(f, p, want)):
        p += 1
    return p


cdef inline int _completed_anyway(Flags* f, uint64_t want, int p, int last) noexcept nogil:
    """After a failure seen on the pairs while waiting (an abort frame, a peer's end): 0
    when every post this wait needs is here by now, else -1.  A peer may post, finish
    this operation, and fail the next one (or exit) between this rank's look at its post
    and the look at the pairs; the operation then completed, as it would have had this
    rank looked a moment earlier, and the transport keeps the failure for the next one."""
    return 0 if _first_missing(f, want, p, last) > last else -1


cdef inline bint _mate_missing(Flags* f, uint64_t want, int p, int last) noexcept nogil:
    """A rank from ``p`` to ``last`` that may run on this rank's CPUs has not entered
    operation ``want - 1``."""
    while p <= last:
        if f.mate[p] and not _entered(f, p, want):
            return True
        p += 1
    return False


cdef inline void _spin_once(Flags* f, uint64_t want, int p, int last) noexcept nogil:
    """Between two looks at the flags, where the clock is not due: the pause hint, or,
    where this rank shares its CPUs with more ranks than they have and one it waits for
    may run on them, the CPU itself (a pause would only delay that rank: 4 ranks bound two
    to a core, barrier p50 3.9 -> 3.6 µs, average 2.5 -> 2.3)."""
    if f.yield_spin and _mate_missing(f, want, p, last):
        sched_yield()
    else:
        pc_pause()


cdef int _wait(Transport t, Flags* f, uint64_t want, int first, int last) noexcept nogil:
    """Wait until the flags of peers ``first``..``last`` are at least ``want``; 0, or -1
    after set_error."""
    cdef int p = _first_missing(f, want, first, last), rc
    cdef unsigned int spins = 0
    cdef int64_t now, spin_end, look_at, until
    if p > last:
        return 0        # every post is here (the common case): no look at the clock
    now = pc_now_ns()
    spin_end = now + f.spin_ns
    look_at = now + LOOK_NS
    while True:
        p = _first_missing(f, want, p, last)
        if p > last:
            return 0
        if pc_load_u32(&f.hdr.failed):
            # Look at the posts once more, after the failure word (an acquire load): a
            # rank preempted between its look at the posts and its look at the word may
            # find the word set by a later operation whose rank saw these very posts. If
            # every post this wait needs is here, the operation completes, as it would
            # have had this rank looked a moment earlier.
            p = _first_missing(f, want, p, last)
            if p > last:
                return 0
            return _failed_elsewhere(t, f, want, p, last)
        spins += 1
        if spins % CLOCK_EVERY:
            _spin_once(f, want, p, last)
            continue
        now = pc_now_ns()
        if now >= deadline_of(t):
            return _late(t, f, want, p, last)
        if now >= look_at:
            # Without sleeping: abort(), abort frames, disagreement (a message from the
            # peer we wait for), a peer's end.
            if t.watch(0, p) < 0 or _left(t, f, want, p, last) < 0:
                return _completed_anyway(f, want, p, last)
            look_at = now + LOOK_NS
        if now < spin_end:
            if f.yield_spin:
                sched_yield()
            else:
                pc_pause()
            continue
        # Sleep until a peer posts (it rings our bell), a pair or abort() wakes us.
        pc_store_u32_sc(&f.sleep[f.me].sleeping, 1)
        rc = 0
        if not _entered(f, p, want) and not pc_load_u32(&f.hdr.failed):
            until = now + NAP_NS
            rc = t.watch(until if until < deadline_of(t) else deadline_of(t), p)
        pc_exchange_u32(&f.sleep[f.me].sleeping, 0)
        if rc < 0 or _left(t, f, want, p, last) < 0:
            return _completed_anyway(f, want, p, last)
        now = pc_now_ns()
        spin_end = now + f.spin_ns
        look_at = now + LOOK_NS


cdef enum:
    WAIT_NONE = -2              # a broadcast's root
    WAIT_ALL = -1               # allreduce, barrier


cdef int flags_post(Transport t, Flags* f, const char* src, size_t nbytes) noexcept nogil:
    """Steps 1 to 3 for this rank's next operation (``src``: an allreduce's contribution or
    a broadcast root's data; NULL for a barrier and a broadcast's other ranks), without
    waiting for the peers.  An async call begun on the caller's thread (where
    ``flags_slot_free`` says step 1 will not wait either) stops here; ``flags_allreduce_end``,
    ``flags_barrier_end`` or ``flags_broadcast_end`` finishes it, on this thread or
    another, in the order of the posts (up to FLAGS_OUTSTANDING may be posted and not
    ended)."""
    cdef uint64_t k = f.ops, free_at
    if t.failed:
        return -1
    free_at = _free_at(k)
    if free_at:
        if _wait(t, f, free_at, 0, f.n - 1) < 0 or _check_upto(t, f, free_at) < 0:
            return _fail(f)
    f.ops = k + 1
    _post(t, f, k, src, nbytes)
    return 0


cdef inline uint64_t _free_at(uint64_t k) noexcept nogil:
    """Step 1 for operation ``k``: every peer must have entered operation ``_free_at(k) -
    1`` (0: nothing to wait for).  A peer that has entered operation k - D + M (D =
    FLAGS_DEPTH, M = FLAGS_OUTSTANDING) has ended operation k - D, the last to use slot
    k % D: it has at most M operations posted and not ended."""
    if k + 1 + FLAGS_OUTSTANDING > FLAGS_DEPTH:
        return k + 1 + FLAGS_OUTSTANDING - FLAGS_DEPTH
    return 0


cdef int _enter_wait(Transport t, Flags* f, int wait_for) noexcept nogil:
    """Steps 4 and 5 for the oldest operation this rank posted and has not ended
    (``wait_for``: WAIT_ALL, WAIT_NONE, or the one rank to wait for); it has ended on
    return 0."""
    cdef uint64_t k = f.ended
    if wait_for == WAIT_ALL:
        if _wait(t, f, k + 1, 0, f.n - 1) < 0 or _check_upto(t, f, k + 1) < 0:
            return _fail(f)
    elif wait_for >= 0:
        if _wait(t, f, k + 1, wait_for, wait_for) < 0 or _check(t, f, wait_for, k) < 0:
            return _fail(f)
    f.ended = k + 1
    return 0


cdef int _enter(Transport t, Flags* f, const char* src, size_t nbytes, int wait_for) noexcept nogil:
    """Steps 1 to 5 for this rank's next operation (``src``: its contribution, if any;
    ``wait_for``: WAIT_ALL, WAIT_NONE, or the one rank to wait for)."""
    if flags_post(t, f, src, nbytes) < 0:
        return -1
    return _enter_wait(t, f, wait_for)


cdef bint flags_all_posted(Flags* f) noexcept nogil:
    """Every peer has posted the oldest operation this rank has posted and not ended: its
    end waits for nobody."""
    return _first_missing(f, f.ended + 1, 0, f.n - 1) > f.n - 1


cdef bint flags_root_posted(Flags* f, int root) noexcept nogil:
    """The root has posted the broadcast this rank ends next: its end waits for nobody."""
    return root == f.me or _entered(f, root, f.ended + 1)


cdef bint flags_slot_free(Flags* f) noexcept nogil:
    """This rank may post its next operation at once: fewer than FLAGS_OUTSTANDING of its
    operations are posted and not ended, and step 1 would not wait (every peer has entered
    the operation that frees the slot; only after a broadcast's root ran ahead may one
    not have)."""
    cdef uint64_t free_at = _free_at(f.ops)
    return f.ops - f.ended < FLAGS_OUTSTANDING and (
        free_at == 0 or _first_missing(f, free_at, 0, f.n - 1) > f.n - 1)


cdef bint flags_ends_at_once(Flags* f, int root) noexcept nogil:
    """The operation this rank posted last may end now, waiting for nobody: no earlier one
    waits for its end, and every peer it waits for has posted it (``root`` >= 0: a
    broadcast's root; -1: every peer)."""
    return f.ended + 1 == f.ops and (flags_all_posted(f) if root < 0
                                     else flags_root_posted(f, root))


def posts_complete(Transport t, int root=-1):
    """Whether every peer (``root`` >= 0: the root) has posted the flags operation this
    rank ends next (the oldest it posted and has not ended), so that its end
    (``flags_allreduce_end``, ``flags_barrier_end``, ``flags_broadcast_end``) waits for
    nobody."""
    cdef Flags* f = flags_fit(t, 0)
    if f == NULL:
        return False
    return flags_all_posted(f) if root < 0 else flags_root_posted(f, root)


cdef int flags_barrier(Transport t, Flags* f) noexcept nogil:
    """Every rank posts; each returns once it has seen every flag."""
    return _enter(t, f, NULL, 0, WAIT_ALL)


cdef int flags_barrier_end(Transport t, Flags* f) noexcept nogil:
    """The rest of a barrier that ``flags_post`` began: wait for every flag."""
    return _enter_wait(t, f, WAIT_ALL)


cdef int flags_broadcast(Transport t, Flags* f, char* buf, size_t nbytes,
                         int root) noexcept nogil:
    """The root copies ``buf`` into its slot and returns; the others copy it out once the
    root has posted."""
    if flags_post(t, f, buf if t.rank == root else NULL, nbytes if t.rank == root else 0) < 0:
        return -1
    return flags_broadcast_end(t, f, buf, nbytes, root)


cdef int flags_broadcast_end(Transport t, Flags* f, char* buf, size_t nbytes,
                             int root) noexcept nogil:
    """The rest of a broadcast that ``flags_post`` began (the root's post carried
    ``buf``, the others' nothing): the root is done; the others wait for the root's post
    and copy it out."""
    if t.rank == root:
        return _enter_wait(t, f, WAIT_NONE)
    if _enter_wait(t, f, root) < 0:
        return -1
    memcpy(buf, _data(f, root, f.ended - 1, nbytes), nbytes)
    return 0


cdef int flags_allreduce(Transport t, Flags* f, char* buf, size_t n, size_t es, int dtype,
                         int op) noexcept nogil:
    """Every rank copies ``buf`` into its slot; once all have posted each reduces every
    slot, rank 0's first, into ``buf`` (AVG sums: the caller divides)."""
    if flags_post(t, f, buf, n * es) < 0:
        return -1
    return flags_allreduce_end(t, f, buf, n, es, dtype, op)


cdef int flags_allreduce_end(Transport t, Flags* f, char* buf, size_t n, size_t es, int dtype,
                             int op) noexcept nogil:
    """The rest of an allreduce that ``flags_post`` began with ``buf``: wait for every
    post, then reduce every slot, rank 0's first, into ``buf``."""
    cdef uint64_t k
    cdef int p
    if _enter_wait(t, f, WAIT_ALL) < 0:
        return -1
    k = f.ended - 1
    reduce_into(buf, _data(f, 0, k, n * es), _data(f, 1, k, n * es), n, dtype, op)
    for p in range(2, f.n):
        reduce_into(buf, buf, _data(f, p, k, n * es), n, dtype, op)
    return 0


cdef int flags_reduce_scatter(Transport t, Flags* f, const char* src, char* recv, size_t off,
                              size_t n, size_t total, size_t es, int dtype,
                              int op) noexcept nogil:
    """Every rank copies its whole send buffer ``src`` (``total`` elements of ``es`` bytes)
    into its slot; once all have posted each reduces its block (``n`` elements from element
    ``off``: f.me of f.n equal ones, or reduce_scatterv's) of every slot, rank 0's first,
    into ``recv`` (AVG: the sum over f.n)."""
    if flags_post(t, f, src, total * es) < 0:
        return -1
    return flags_reduce_scatter_end(t, f, recv, off, n, total, es, dtype, op)


cdef int flags_reduce_scatter_end(Transport t, Flags* f, char* recv, size_t off, size_t n,
                                  size_t total, size_t es, int dtype, int op) noexcept nogil:
    """The rest of a reduce_scatter that ``flags_post`` began with the whole send buffer
    (``total`` elements): wait for every post, then reduce this rank's block (``n``
    elements from element ``off``) of every slot, rank 0's first, into ``recv`` (AVG: the
    sum over f.n)."""
    cdef uint64_t k
    cdef int p
    if _enter_wait(t, f, WAIT_ALL) < 0:
        return -1
    k = f.ended - 1
    total *= es
    off *= es
    reduce_into(recv, _data(f, 0, k, total) + off, _data(f, 1, k, total) + off, n, dtype, op)
    for p in range(2, f.n):
        reduce_into(recv, recv, _data(f, p, k, total) + off, n, dtype, op)
    if op == OP_AVG:
        divide_by(recv, n, dtype, f.n)
    return 0


cdef int flags_allgather_end(Transport t, Flags* f, char* recv, size_t nbytes) noexcept nogil:
    """The rest of an allgather that ``flags_post`` began with this rank's block: wait for
    every post, then copy every rank's block, in rank order, into ``recv``."""
    cdef uint64_t k
    cdef int p
    if _enter_wait(t, f, WAIT_ALL) < 0:
        return -1
    k = f.ended - 1
    for p in range(f.n):
        memcpy(recv + p * nbytes, _data(f, p, k, nbytes), nbytes)
    return 0


cdef int flags_allgather(Transport t, Flags* f, const char* src, char* recv,
                         const size_t* off, const size_t* lens, size_t es) noexcept nogil:
    """Every rank copies its block ``src`` (``lens[f.me]`` elements of ``es`` bytes: equal
    blocks, or allgatherv's) into its slot; once all have posted each copies rank p's block
    to element ``off[p]`` of ``recv``, for every p.  (An allgather begun in the call ends
    with ``flags_allgather_end``, its blocks equal.)"""
    cdef uint64_t k
    cdef int p
    if flags_post(t, f, src, lens[f.me] * es) < 0 or _enter_wait(t, f, WAIT_ALL) < 0:
        return -1
    k = f.ended - 1
    for p in range(f.n):
        if lens[p]:
            memcpy(recv + off[p] * es, _data(f, p, k, lens[p] * es), lens[p] * es)
    return 0


cdef int flags_alltoall(Transport t, Flags* f, const char* src, char* recv,
                        size_t nbytes) noexcept nogil:
    """Every rank copies its whole send buffer ``src`` (f.n blocks of ``nbytes``) into its
    slot; once all have posted each copies block ``f.me`` of every slot, in rank order,
    into ``recv``."""
    if flags_post(t, f, src, f.n * nbytes) < 0:
        return -1
    return flags_alltoall_end(t, f, recv, nbytes)


cdef int flags_alltoall_end(Transport t, Flags* f, char* recv, size_t nbytes) noexcept nogil:
    """The rest of an alltoall that ``flags_post`` began with the whole send buffer: wait
    for every post, then copy this rank's block of every slot, in rank order, into
    ``recv``."""
    cdef uint64_t k
    cdef size_t total = f.n * nbytes, off = f.me * nbytes
    cdef int p
    if _enter_wait(t, f, WAIT_ALL) < 0:
        return -1
    k = f.ended - 1
    for p in range(f.n):
        memcpy(recv + p * nbytes, _data(f, p, k, total) + off, nbytes)
    return 0
