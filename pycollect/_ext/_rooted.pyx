"""Rooted collectives: reduce, gather(v), scatter(v).

reduce, small messages (binomial tree): ranks renumbered relative to the root
(v = rank - root); for mask = 1, 2, 4, ...: a rank with bit ``mask`` set sends
its partial result to v - mask and stops, the others receive from v + mask
(when it exists) and combine, their own operand first.  log2(size) steps.

reduce, large messages: the ring's reduce-scatter leaves rank c holding the
reduced chunk c, then every rank sends its chunk to the root: each rank moves
about 2(size-1)/size of the buffer instead of log2(size) whole copies.

Non-root ranks reduce in a working copy: their buffer is an input and is
never written.

gather and scatter are linear: the root posts one receive (or send) per rank
at once and the progress engine drives them together.
"""

from libc.stdlib cimport free
from libc.string cimport memcpy, memmove

from pycollect._ext._algo cimport wrap
from pycollect._ext._buffer cimport (View, pin, check_count, check_pair, check_apart,
                                     counts_array, filled_array)
from pycollect._ext._dtypes cimport OP_AVG
from pycollect._ext._reduce cimport check_op, divide_by, reduce_into
from pycollect._ext._ring cimport Layout, layout_even, layout_free, ring_reduce_scatter
from pycollect._ext._transport cimport *

from pycollect.errors import InvalidArgument

# The in-place forms that an overlap of sendbuf and recvbuf may take (``check_apart``).
cdef str IN_PLACE_GATHER = ", or sendbuf as exactly the root's block of recvbuf (in place)"
cdef str IN_PLACE_SCATTER = ", or recvbuf as exactly the root's block of sendbuf (in place)"

REDUCE_ALGORITHMS = {"binomial": ALGO_BINOMIAL_REDUCE, "ring": ALGO_RING}


cdef int binomial_reduce(Transport t, char* work, size_t n, size_t es, int dtype, int op,
                         int root) noexcept nogil:
    cdef int P = t.size
    cdef int v = wrap(t.rank - root, P)
    cdef int mask = 1
    cdef size_t nbytes = n * es
    cdef char* incoming = t.scratch(nbytes)
    if incoming == NULL:
        return -1
    while mask < P:
        if v & mask:
            if t.post_send(wrap(v - mask + root, P), work, nbytes) < 0:
                return -1
            break
        if v + mask < P:
            if t.wait(t.post_recv(wrap(v + mask + root, P), incoming, nbytes)) < 0:
                return -1
            reduce_into(work, work, incoming, n, dtype, op)
        mask <<= 1
    return t.wait_all()


cdef int ring_reduce(Transport t, char* work, size_t n, size_t es, int dtype, int op,
                     int root, size_t seg) noexcept nogil:
    cdef Layout lay
    cdef int c, rc
    if layout_even(&lay, n, t.size, -1) < 0:
        return t.set_error(ERR_INTERNAL, -1, "calloc", 0, "out of memory")
    rc = ring_reduce_scatter(t, work, &lay, es, dtype, op, seg, 4)
    if rc == 0:
        if t.rank == root:
            for c in range(t.size):
                if c != root and lay.len[c]:
                    if t.post_recv(c, work + lay.off[c] * es, lay.len[c] * es) < 0:
                        rc = -1
                        break
        elif lay.len[t.rank]:
            rc = t.post_send(root, work + lay.off[t.rank] * es, lay.len[t.rank] * es)
        if rc == 0:
            rc = t.wait_all()
    layout_free(&lay)
    return rc


cpdef int reduce(Transport t, object buf, int root, int op, int algo, unsigned int seq,
                 double timeout, size_t segment_bytes) except? -1:
    """Reduce every rank's ``buf`` into root's ``buf``; other ranks' buffers are untouched."""
    cdef bint is_root = t.rank == root
    cdef View b
    held_b = pin(buf, &b, "reduce", "buf", is_root)
    check_op(b.dtype, op, "reduce")
    cdef OpDesc d
    fill_desc(&d, seq, COLL_REDUCE, b.dtype, op, algo, root, b.count)
    cdef size_t n = b.count, es = b.itemsize
    cdef size_t seg = segment_bytes // es if segment_bytes >= es else 1
    cdef char* work
    cdef int rc
    if algo != ALGO_BINOMIAL_REDUCE and algo != ALGO_RING:
        raise InvalidArgument("reduce: unknown algorithm code %d" % algo)
    with nogil:
        rc = t.begin(&d, timeout)
        if rc == 0 and t.size > 1 and n > 0:
            if is_root:
                work = b.ptr
            else:
                work = t.work_area(n * es)
                if work == NULL:
                    rc = -1
                else:
                    memcpy(work, b.ptr, n * es)
            if rc == 0:
                if algo == ALGO_BINOMIAL_REDUCE:
                    rc = binomial_reduce(t, work, n, es, b.dtype, op, root)
                else:
                    rc = ring_reduce(t, work, n, es, b.dtype, op, root, seg)
        if rc == 0 and is_root and op == OP_AVG and t.size > 1:
            divide_by(b.ptr, n, b.dtype, t.size)
    if rc < 0:
        raise_error(t)
    return algo


cdef int _linear(Transport t, char* block_base, const size_t* offs, const size_t* lens,
                 size_t es, int root, bint gathering, char* mine) noexcept nogil:
    """Root receives (gather) or sends (scatter) one block per rank; others do the reverse."""
    cdef int i, p, rc = 0
    cdef char* own
    if t.rank == root:
        own = block_base + offs[root] * es
        for i in range(1, t.size):
            p = wrap(root + i, t.size)
            if gathering:
                rc = t.post_recv(p, block_base + offs[p] * es, lens[p] * es)
            else:
                rc = t.post_send(p, block_base + offs[p] * es, lens[p] * es)
            if rc < 0:
                return -1
        if mine != own and lens[root]:
            if gathering:
                memmove(own, mine, lens[root] * es)
            else:
                memmove(mine, own, lens[root] * es)
    elif gathering:
        if t.post_send(root, mine, lens[t.rank] * es) < 0:
            return -1
    else:
        if t.post_recv(root, mine, lens[t.rank] * es) < 0:
            return -1
    return t.wait_all()


cdef int _rooted_blocks(Transport t, object sendbuf, object recvbuf, object counts, int root,
                        unsigned int seq, double timeout, bint gathering, str name) except -1:
    """gather/gatherv (gathering) and scatter/scatterv: validation, then one nogil call."""
    cdef bint is_root = t.rank == root
    cdef int P = t.size, p
    cdef View mine, blocks
    cdef size_t* lens
    cdef size_t* offs = NULL
    cdef size_t total = 0
    cdef OpDesc d
    cdef int rc, coll
    cdef char* own
    held_mine = pin(sendbuf if gathering else recvbuf, &mine, name,
                    "sendbuf" if gathering else "recvbuf", not gathering)
    held_blocks = None
    if is_root:
        held_blocks = pin(recvbuf if gathering else sendbuf, &blocks, name,
                          "recvbuf" if gathering else "sendbuf", gathering)
        check_pair(mine if gathering else blocks, blocks if gathering else mine, name)
    if counts is None:
        lens = filled_array(P, mine.count)
    else:
        lens = counts_array(counts, P, name, "counts")
    try:
        offs = filled_array(P, 0)
        for p in range(P):
            offs[p] = total
            total += lens[p]
        check_count(mine, lens[t.rank], name, "sendbuf" if gathering else "recvbuf",
                    "counts[%d]" if counts is not None else "the block size",
                    t.rank if counts is not None else -1)
        if is_root:
            check_count(blocks, total, name, "recvbuf" if gathering else "sendbuf",
                        "the sum of the counts" if counts is not None else
                        "size x the block size")
            own = blocks.ptr + offs[root] * mine.itemsize
            if gathering:
                check_apart(mine, blocks, name, IN_PLACE_GATHER, own, NULL)
            else:
                check_apart(blocks, mine, name, IN_PLACE_SCATTER, NULL, own)
        if counts is None:
            coll = COLL_GATHER if gathering else COLL_SCATTER
            fill_desc(&d, seq, coll, mine.dtype, 0, ALGO_LINEAR, root, mine.count)
        else:
            coll = COLL_GATHERV if gathering else COLL_SCATTERV
            fill_desc(&d, seq, coll, mine.dtype, 0, ALGO_LINEAR, root, total)
        with nogil:
            rc = t.begin(&d, timeout)
            if rc == 0:
                rc = _linear(t, blocks.ptr if is_root else NULL, offs, lens, mine.itemsize,
                             root, gathering, mine.ptr)
    finally:
        free(lens)
        free(offs)       # NULL (a no-op) when its allocation failed
    if rc < 0:
        raise_error(t)
    return ALGO_LINEAR


cpdef int gather(Transport t, object sendbuf, object recvbuf, object counts, int root,
                 unsigned int seq, double timeout) except? -1:
    """Root's ``recvbuf`` receives every rank's ``sendbuf`` in rank order (counts: gatherv)."""
    return _rooted_blocks(t, sendbuf, recvbuf, counts, root, seq, timeout, True,
                          "gather" if counts is None else "gatherv")


cpdef int scatter(Transport t, object sendbuf, object recvbuf, object counts, int root,
                  unsigned int seq, double timeout) except? -1:
    """Rank r's ``recvbuf`` receives block r of root's ``sendbuf`` (counts: scatterv)."""
    return _rooted_blocks(t, sendbuf, recvbuf, counts, root, seq, timeout, False,
                          "scatter" if counts is None else "scatterv")
