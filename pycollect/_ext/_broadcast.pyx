"""Broadcast: a binomial tree for small messages, a pipelined chain for large ones.

Binomial: with ranks renumbered relative to the root (v = rank - root), rank
v receives the whole message from v minus its lowest set bit, then sends it
on to v + 2^k for every 2^k below that bit, largest first.  log2(size) steps,
one message each: the latency choice.

Pipelined: ranks form the chain root, root+1, ...; the message is cut into
segments, each received straight into the caller's buffer and forwarded to
the next rank as soon as it lands, so all links carry data at once.  Time is
about one message plus (size-2) segments: the bandwidth choice.  The
chain's last rank tells the root (an empty message) once it holds the
whole message, and the root returns only then: without it the root (and each
rank down the chain) could leave the call as soon as the sockets took its
bytes, run calls ahead of the ranks behind it while the socket buffers hold
whole messages, and every rank's call would then last as long as the
slowest link's backlog at a different moment (4 ranks over loopback TCP, 1M
floats back to back: the slowest rank's p50 3.0-3.3 ms against a period of
1.7-1.9 ms; with the answer 1.3-1.9 ms, the period unchanged:
docs/performance.md).

Direct (ranks of one host that may read the root's memory; one copy): the
root sends every rank its buffer's address, and each rank answers with its
own and whether it may read the root's memory (the transport's
``can_read_remote``).  A rank that may not receives the buffer as a message.
The others copy the buffer straight out of the root's (``direct_read``, in
pieces) from byte ``head`` on, while the root, which would otherwise wait,
writes bytes 0..head into their buffers itself (``direct_write``), one rank
after the other, telling each when its head is in ("written"; "read it
yourself" where the root may not write there).  ``head`` is 1/size of the
buffer, so that the root's writes to the size - 1 others take as long as each
one's own read: with a core per rank the copy takes half the time at 2 ranks.
Each rank answers "done" once it has read all it reads.  The root returns,
and its caller may change the buffer, only once every rank has answered and
every message has gone: each byte crosses once.  A rank whose broadcast
fails after it answered may still see the root's bytes land in its buffer
until the root learns of the failure (the output of a failed collective is
undefined).

Flags (every pair on one host's shared memory, up to _flags.FLAGS_MAX_BYTES):
the root copies the buffer into its slot of the transport's flag area, every
rank posts its flag, and the others copy the root's slot out once all have
(_flags.pyx).  Where the transport has no flag area, or the buffer does not
fit, ``flags`` runs the binomial tree.
"""

from libc.stdlib cimport free, malloc

from pycollect._ext._algo cimport segment_count, segment_length, wrap
from pycollect._ext._buffer cimport View, pin
from pycollect._ext._direct cimport (DirectHello, direct_offer, direct_read, direct_view,
                                     direct_write)
from pycollect._ext._flags cimport (Flags, flags_broadcast, flags_broadcast_end,
                                    flags_ends_at_once, flags_fit, flags_post, flags_slot_free)
from pycollect._ext._transport cimport *
from libc.stdint cimport uint64_t

from pycollect.errors import InvalidArgument

ALGORITHMS = {"binomial": ALGO_BINOMIAL, "pipelined": ALGO_PIPELINED, "direct": ALGO_DIRECT,
              "flags": ALGO_FLAGS}


cdef int binomial_broadcast(Transport t, char* buf, size_t nbytes, int root) noexcept nogil:
    cdef int P = t.size
    cdef int v = wrap(t.rank - root, P)
    cdef int mask = 1
    while mask < P:
        if v & mask:
            if t.wait(t.post_recv(wrap(v - mask + root, P), buf, nbytes)) < 0:
                return -1
            break
        mask <<= 1
    if _send_down(t, buf, nbytes, root, v, mask >> 1, 0) < 0:
        return -1
    return t.wait_all()


cdef inline int _send_down(Transport t, char* buf, size_t nbytes, int root, int v, int mask,
                           bint eager) noexcept nogil:
    """Binomial broadcast: relative rank ``v``'s sends to its children v + mask, v + mask/2,
    ... (those below the group's size), largest subtree first; ``eager``: each pushed as far
    as its channel takes it now (``post_send_async``, an async root's)."""
    cdef int P = t.size
    while mask > 0:
        if v + mask < P:
            if (t.post_send_async(wrap(v + mask + root, P), buf, nbytes) if eager
                    else t.post_send(wrap(v + mask + root, P), buf, nbytes)) < 0:
                return -1
        mask >>= 1
    return 0


cdef int pipelined_broadcast(Transport t, char* buf, size_t nbytes, int root,
                             size_t seg) noexcept nogil:
    cdef int P = t.size
    cdef int v = wrap(t.rank - root, P)
    cdef int next_rank = wrap(t.rank + 1, P), prev_rank = wrap(t.rank - 1, P)
    cdef size_t g, nseg = segment_count(nbytes, seg)
    cdef int* reqs
    cdef int rc = 0
    if v == 0:
        for g in range(nseg):
            if t.post_send(next_rank, buf + g * seg, segment_length(nbytes, seg, g)) < 0:
                return -1
        if t.post_recv(prev_rank, NULL, 0) < 0:    # the chain's end has it all
            return -1
        return t.wait_all()
    reqs = <int*>malloc((nseg + 1) * sizeof(int))
    if reqs == NULL:
        return t.set_error(ERR_INTERNAL, -1, "malloc", 0, "out of memory")
    for g in range(nseg):
        reqs[g] = t.post_recv(prev_rank, buf + g * seg, segment_length(nbytes, seg, g))
        if reqs[g] < 0:
            free(reqs)
            return -1
    for g in range(nseg):
        rc = t.wait(reqs[g])
        if rc == 0 and v < P - 1:
            rc = t.post_send(next_rank, buf + g * seg, segment_length(nbytes, seg, g))
        if rc < 0:
            break
    free(reqs)
    if rc < 0:
        return -1
    if v == P - 1 and t.post_send(next_rank, NULL, 0) < 0:
        return -1
    return t.wait_all()


cdef enum:
    HEAD_ALIGN = 4096           # the root's share ends on a page boundary of the buffer


cdef inline size_t _head(size_t nbytes, int P) noexcept nogil:
    """The bytes at the start of each receiver's buffer that the root writes."""
    return nbytes // <size_t>P // HEAD_ALIGN * HEAD_ALIGN


cdef int direct_broadcast(Transport t, char* buf, size_t nbytes, int root) noexcept nogil:
    """One copy, shared by the root and every receiver (see the module notes)."""
    cdef int P = t.size, p
    cdef size_t head = _head(nbytes, P)
    cdef DirectHello hello
    cdef DirectHello* answers
    cdef uint64_t written, done = 1
    cdef uint64_t* wrote
    cdef uint64_t* dones
    cdef int* reqs
    cdef int readable
    if t.rank != root:
        if t.wait(t.post_recv(root, &hello, sizeof(DirectHello))) < 0:
            return -1
        readable = t.can_read_remote(root)
        answers = <DirectHello*>t.work_area(sizeof(DirectHello))
        if answers == NULL:
            return -1
        direct_offer(answers, buf, nbytes)
        answers.readable = <uint64_t>readable
        if t.post_send(root, answers, sizeof(DirectHello)) < 0:
            return -1
        if not readable:
            if t.post_recv(root, buf, nbytes) < 0:
                return -1
            return t.wait_all()
        direct_view(t, root, &hello, nbytes)
        if direct_read(t, root, &hello, head, buf + head, nbytes - head) < 0:
            return -1
        if t.wait(t.post_recv(root, &written, sizeof(uint64_t))) < 0:
            return -1
        if not written and direct_read(t, root, &hello, 0, buf, head) < 0:
            return -1
        if t.post_send(root, &done, sizeof(uint64_t)) < 0:
            return -1
        return t.wait_all()
    # The root: per rank, its answer, "written", "done" and the answer's request.
    answers = <DirectHello*>t.work_area(P * (sizeof(DirectHello) + 2 * sizeof(uint64_t)
                                            + sizeof(int)))
    if answers == NULL:
        return -1
    wrote = <uint64_t*>(answers + P)
    dones = wrote + P
    reqs = <int*>(dones + P)
    direct_offer(&hello, buf, nbytes)
    hello.readable = 1
    for p in range(P):
        if p != root:
            if t.post_send(p, &hello, sizeof(DirectHello)) < 0:
                return -1
            reqs[p] = t.post_recv(p, &answers[p], sizeof(DirectHello))
            if reqs[p] < 0:
                return -1
    for p in range(P):
        if p == root:
            continue
        if t.wait(reqs[p]) < 0:
            return -1
        if not answers[p].readable:
            if t.post_send(p, buf, nbytes) < 0:
                return -1
            continue
        wrote[p] = <uint64_t>t.can_read_remote(p)
        if wrote[p]:
            direct_view(t, p, &answers[p], nbytes)
        if wrote[p] and head and direct_write(t, p, &answers[p], 0, buf, head, False) < 0:
            return -1
        if t.post_send(p, &wrote[p], sizeof(uint64_t)) < 0 or \
                t.post_recv(p, &dones[p], sizeof(uint64_t)) < 0:
            return -1
    return t.wait_all()


cpdef int broadcast(Transport t, object buf, int root, int algo, unsigned int seq, double timeout,
                    size_t segment_bytes) except? -1:
    """Copy root's ``buf`` into every rank's ``buf`` (one nogil call); return the algorithm code."""
    cdef View b
    held = pin(buf, &b, "broadcast", "buf", t.rank != root)
    cdef OpDesc d
    cdef Flags* fl = NULL
    if algo == ALGO_FLAGS:
        fl = flags_fit(t, b.nbytes)
        if fl == NULL:
            algo = ALGO_BINOMIAL
    fill_desc(&d, seq, COLL_BROADCAST, b.dtype, 0, algo, root, b.count)
    cdef size_t nbytes = b.nbytes
    cdef size_t seg = segment_bytes if segment_bytes > 0 else 1
    cdef int rc
    if algo != ALGO_BINOMIAL and algo != ALGO_PIPELINED and algo != ALGO_DIRECT \
            and algo != ALGO_FLAGS:
        raise InvalidArgument("broadcast: unknown algorithm code %d" % algo)
    if t.solo:
        rc = t.begin(&d, timeout)       # a world of one: nothing to copy or wait for
    else:
        with nogil:
            rc = t.begin(&d, timeout)
            if rc == 0 and t.size > 1 and nbytes > 0:
                if algo == ALGO_FLAGS:
                    rc = flags_broadcast(t, fl, b.ptr, nbytes, root)
                elif algo == ALGO_BINOMIAL:
                    rc = binomial_broadcast(t, b.ptr, nbytes, root)
                elif algo == ALGO_DIRECT:
                    rc = direct_broadcast(t, b.ptr, nbytes, root)
                else:
                    rc = pipelined_broadcast(t, b.ptr, nbytes, root, seg)
    if rc < 0:
        raise_error(t)
    return algo


cpdef int broadcast_begin(Transport t, object buf, int root, int algo, unsigned int seq,
                          double timeout) except? -1:
    """Begin a broadcast of ``buf`` without waiting (an async call on the caller's thread),
    as ``broadcast`` would run it with ``algo``: through the flag area, posting (the root its
    data, the others nothing); or, on the root of a binomial broadcast (asked for, or flags
    where no area serves, which runs it), by sending ``buf`` to each of its children now,
    as far as the channels take it (it receives nothing).  1 when it has ended (the root
    through the flags, once posted; another rank whose root had posted already); 0 when it
    is posted to the flag area and 2 when the root's sends are begun, and ``broadcast_end``
    (with ALGO_FLAGS or ALGO_BINOMIAL) must finish it before the next collective; -2 when
    neither applies (a binomial broadcast's other ranks receive first: queued as usual) or
    the post would wait for its slot (nothing was done: run ``broadcast``)."""
    cdef View b
    held = pin(buf, &b, "broadcast", "buf", t.rank != root)
    cdef Flags* fl = flags_fit(t, b.nbytes) if algo == ALGO_FLAGS else NULL
    cdef bint mine = t.rank == root
    cdef OpDesc d
    cdef int rc
    if t.solo or t.size < 2 or b.nbytes == 0:
        return -2
    if fl != NULL:
        if not flags_slot_free(fl):
            return -2
        fill_desc(&d, seq, COLL_BROADCAST, b.dtype, 0, ALGO_FLAGS, root, b.count)
        with nogil:
            rc = t.begin(&d, timeout)
            if rc == 0:
                rc = flags_post(t, fl, b.ptr if mine else NULL, b.nbytes if mine else 0)
            if rc == 0 and flags_ends_at_once(fl, root):
                rc = flags_broadcast_end(t, fl, b.ptr, b.nbytes, root)
                if rc == 0:
                    rc = 1
    elif mine and (algo == ALGO_BINOMIAL or algo == ALGO_FLAGS and t.flag_area is None):
        fill_desc(&d, seq, COLL_BROADCAST, b.dtype, 0, ALGO_BINOMIAL, root, b.count)
        with nogil:
            rc = t.begin(&d, timeout)
            if rc == 0:
                rc = _root_sends(t, b.ptr, b.nbytes, root)
            if rc == 0:
                rc = 2
    else:
        return -2
    if rc < 0:
        raise_error(t)
    return rc


cdef int _root_sends(Transport t, char* buf, size_t nbytes, int root) noexcept nogil:
    """A binomial broadcast's root, begun by an async call: its sends to its children, in
    the blocking call's order, each pushed as far as its channel takes it now."""
    cdef int mask = 1
    while mask < t.size:
        mask <<= 1
    return _send_down(t, buf, nbytes, root, 0, mask >> 1, 1)


cpdef int broadcast_end(Transport t, object buf, int root, int algo, unsigned int seq,
                        double timeout) except? -1:
    """Finish the broadcast ``broadcast_begin`` began, ``algo`` saying how (ALGO_FLAGS: it
    posted to the flag area; else the root began its sends), its deadline counting from
    now: wait for the root's post and copy it out, or finish the root's sends; the
    algorithm's code."""
    cdef View b
    held = pin(buf, &b, "broadcast", "buf", t.rank != root)
    cdef Flags* fl = flags_fit(t, b.nbytes) if algo == ALGO_FLAGS else NULL
    cdef OpDesc d
    cdef int rc
    if fl == NULL:
        algo = ALGO_BINOMIAL
    fill_desc(&d, seq, COLL_BROADCAST, b.dtype, 0, algo, root, b.count)
    with nogil:
        rc = t.begin(&d, timeout)       # the root's sends: what is left goes now
        if rc == 0 and fl != NULL:
            rc = flags_broadcast_end(t, fl, b.ptr, b.nbytes, root)
    if rc < 0:
        raise_error(t)
    return algo
