"""Broadcast: a binomial tree for small messages, a pipelined chain for large ones.

Binomial: with ranks renumbered relative to the root (v = rank - root), rank
v receives the whole message from v minus its lowest set bit, then sends it
on to v + 2^k for every 2^k below that bit, largest first.  log2(size) steps,
one message each: the latency choice.

Pipelined: ranks form the chain root, root+1, ...; the message is cut into
segments, each received straight into the caller's buffer and forwarded to
the next rank as soon as it lands, so all links carry data at once.  Time is
about one message plus (size-2) segments: the bandwidth choice.

Direct (ranks of one host that may read the root's memory; one copy): the
root sends every rank its buffer's address.  Each rank that may read the
root's memory (the transport's ``can_read_remote``) copies the buffer
straight out of it (``direct_read``, in pieces) and then answers "done"; a
rank that may not answers "send it" and receives the buffer as a message
instead.  The root returns, and its caller may change the buffer, only once
every rank has answered and every message has gone: each byte crosses once,
and all receivers copy at the same time.

Flags (every pair on one host's shared memory, up to _flags.FLAGS_MAX_BYTES):
the root copies the buffer into its slot of the transport's flag area, every
rank posts its flag, and the others copy the root's slot out once all have
(_flags.pyx).  Where the transport has no flag area, or the buffer does not
fit, ``flags`` runs the binomial tree.
"""

from libc.stdlib cimport free, malloc

from pycollect._ext._algo cimport segment_count, segment_length, wrap
from pycollect._ext._buffer cimport Buffer, as_buffer
from pycollect._ext._direct cimport DirectHello, direct_read
from pycollect._ext._flags cimport Flags, flags_broadcast, flags_fit
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
    mask >>= 1
    while mask > 0:
        if v + mask < P:
            if t.post_send(wrap(v + mask + root, P), buf, nbytes) < 0:
                return -1
        mask >>= 1
    return t.wait_all()


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
    return t.wait_all()


cdef int direct_broadcast(Transport t, char* buf, size_t nbytes, int root) noexcept nogil:
    """One copy: every rank reads the root's buffer itself (see the module notes)."""
    cdef int P = t.size, p
    cdef DirectHello hello
    cdef uint64_t* answers
    if t.rank != root:
        if t.wait(t.post_recv(root, &hello, sizeof(DirectHello))) < 0:
            return -1
        hello.readable = <uint64_t>t.can_read_remote(root)
        if hello.readable and direct_read(t, root, buf, hello.addr, nbytes) < 0:
            return -1
        if t.post_send(root, &hello.readable, sizeof(uint64_t)) < 0:
            return -1
        if not hello.readable and t.post_recv(root, buf, nbytes) < 0:
            return -1
        return t.wait_all()
    answers = <uint64_t*>t.work_area(P * sizeof(uint64_t))
    if answers == NULL:
        return -1
    hello.addr = <uint64_t>buf
    hello.readable = 1
    for p in range(P):
        if p != root and (t.post_send(p, &hello, sizeof(DirectHello)) < 0 or
                          t.post_recv(p, &answers[p], sizeof(uint64_t)) < 0):
            return -1
    if t.wait_all() < 0:
        return -1
    for p in range(P):
        if p != root and not answers[p] and t.post_send(p, buf, nbytes) < 0:
            return -1
    return t.wait_all()


cpdef int broadcast(Transport t, object buf, int root, int algo, unsigned int seq, double timeout,
                    size_t segment_bytes) except? -1:
    """Copy root's ``buf`` into every rank's ``buf`` (one nogil call); return the algorithm code."""
    cdef Buffer b = as_buffer(buf, "broadcast", "buf", t.rank != root)
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
