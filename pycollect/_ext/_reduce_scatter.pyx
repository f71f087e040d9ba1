"""reduce_scatter and reduce_scatterv: through the flag area, or the ring's reduce-scatter
phase.

Flags (every pair on one host's shared memory, equal blocks, the whole ``sendbuf`` of up
to _flags.FLAGS_MAX_BYTES): every rank copies its ``sendbuf`` into its slot of the
transport's flag area and posts its flag; once all have, each reduces its own block of
every slot, rank 0's first, into ``recvbuf`` (_flags.pyx): one synchronisation point, where
the ring takes P - 1 steps of messages.  Every rank decides alike (``flags_fit``: the same
area, the same size), and the operation's descriptor names the algorithm that ran.

Ring (the rest): ``sendbuf`` is copied into a working area (it is an input and is never
written), the ring reduce-scatter leaves rank r holding the reduced block r (see
_ring.pyx), and that block is copied into ``recvbuf``.

An async reduce_scatter is begun in the call through the flags (``reduce_scatter_begin``
posts ``sendbuf`` where the post would not wait for its slot; ``reduce_scatter_end``
waits for the peers' posts and reduces), or, of 2 ranks without the flags and whose
block goes in one message, as the ring's one exchange: the call sends the peer's block
of ``sendbuf``; its end receives the peer's part of this rank's block and reduces it
with this rank's own into ``recvbuf``, in the ring's order.  The messages and posts are
the blocking call's.
"""

from libc.stdlib cimport free
from libc.string cimport memcpy

from pycollect._ext._algo cimport exchange_finish, exchange_fits, exchange_post
from pycollect._ext._buffer cimport (View, pin, check_count, check_pair, check_apart,
                                     counts_array, filled_array)
from pycollect._ext._dtypes cimport OP_AVG
from pycollect._ext._flags cimport (Flags, flags_ends_at_once, flags_fit, flags_post,
                                    flags_reduce_scatter, flags_reduce_scatter_end,
                                    flags_slot_free)
from pycollect._ext._reduce cimport check_op, divide_by, reduce_into
from pycollect._ext._ring cimport Layout, layout_counts, layout_free, ring_reduce_scatter
from pycollect._ext._transport cimport *

from pycollect.errors import InvalidArgument

# The in-place form that an overlap of sendbuf and recvbuf may take (``check_apart``).
cdef str IN_PLACE = ", or recvbuf as exactly this rank's block of sendbuf (in place)"


cpdef int reduce_scatter(Transport t, object sendbuf, object recvbuf, object counts, int op,
                         unsigned int seq, double timeout, size_t segment_bytes) except? -1:
    """Reduce ``sendbuf`` across ranks; rank r receives block r (counts: reduce_scatterv)."""
    name = "reduce_scatter" if counts is None else "reduce_scatterv"
    cdef View sb
    held_sb = pin(sendbuf, &sb, name, "sendbuf", False)
    cdef View rb
    held_rb = pin(recvbuf, &rb, name, "recvbuf", True)
    check_pair(sb, rb, name)
    check_op(sb.dtype, op, name)
    cdef int P = t.size, r = t.rank, rc = 0, p
    cdef size_t* lens = (filled_array(P, rb.count) if counts is None
                         else counts_array(counts, P, name, "counts"))
    cdef Layout lay
    cdef size_t total = 0, own = 0, es = sb.itemsize
    cdef size_t seg = segment_bytes // es if segment_bytes >= es else 1
    cdef OpDesc d
    cdef char* work
    cdef Flags* fl = NULL
    cdef int algo = ALGO_RING
    try:
        for p in range(P):
            own = total if p == r else own
            total += lens[p]
        check_count(sb, total, name, "sendbuf", "size x len(recvbuf)" if counts is None
                    else "the sum of the counts")
        check_count(rb, lens[r], name, "recvbuf",
                    "counts[%d]" if counts is not None else "len(sendbuf) / size",
                    r if counts is not None else -1)
        check_apart(sb, rb, name, IN_PLACE, NULL, sb.ptr + own * es)
        if layout_counts(&lay, lens, P, -1) < 0:
            raise MemoryError()
    finally:
        free(lens)
    if P > 1 and total > 0 and not t.solo:
        fl = flags_fit(t, sb.nbytes)        # every rank's decision: the same total
        if fl != NULL:
            algo = ALGO_FLAGS
    fill_desc(&d, seq, COLL_REDUCE_SCATTER if counts is None else COLL_REDUCE_SCATTERV,
              sb.dtype, op, algo, 0 if counts is None else counts_digest(lay.len, P),
              rb.count if counts is None else total)
    with nogil:
        rc = t.begin(&d, timeout)
        if rc == 0 and fl != NULL:
            rc = flags_reduce_scatter(t, fl, sb.ptr, rb.ptr, lay.off[r], lay.len[r], total, es,
                                      sb.dtype, op)
        elif rc == 0 and total > 0:
            work = sb.ptr
            if P > 1:
                work = t.work_area(total * es)
                if work == NULL:
                    rc = -1
                else:
                    memcpy(work, sb.ptr, total * es)
                    rc = ring_reduce_scatter(t, work, &lay, es, sb.dtype, op, seg, 4)
            if rc == 0 and lay.len[r] and rb.ptr != work + lay.off[r] * es:
                memcpy(rb.ptr, work + lay.off[r] * es, lay.len[r] * es)
                if op == OP_AVG and P > 1:
                    divide_by(rb.ptr, lay.len[r], sb.dtype, P)
        layout_free(&lay)
    if rc < 0:
        raise_error(t)
    return algo


cdef int _check_blocks(Transport t, View sb, View rb) except -1:
    """The arguments of a reduce_scatter of equal blocks begun in the call, checked as
    ``reduce_scatter`` checks them (InvalidArgument)."""
    check_pair(sb, rb, "reduce_scatter")
    check_count(sb, rb.count * t.size, "reduce_scatter", "sendbuf", "size x len(recvbuf)")
    check_apart(sb, rb, "reduce_scatter", IN_PLACE, NULL, sb.ptr + t.rank * rb.nbytes)
    return 0


cpdef int reduce_scatter_begin(Transport t, object sendbuf, object recvbuf, int op,
                               unsigned int seq, double timeout,
                               size_t segment_bytes) except? -1:
    """Begin a reduce_scatter without waiting (an async call on the caller's thread), as
    ``reduce_scatter`` would run it: through the flag area, posting ``sendbuf`` (where the
    post would not wait for its slot); or, of 2 ranks without the flags, where the ring's
    one message (the peer's block of ``sendbuf``) is no larger than ``segment_bytes`` and
    the channel takes it whole, sending that block.  1 when it has ended; 0 when it is
    posted to the flag area and 2 when it is begun as an exchange, and
    ``reduce_scatter_end`` must finish it before the next collective; -2 where none
    applies (nothing was done: run ``reduce_scatter``)."""
    cdef View sb
    held_sb = pin(sendbuf, &sb, "reduce_scatter", "sendbuf", False)
    cdef View rb
    held_rb = pin(recvbuf, &rb, "reduce_scatter", "recvbuf", True)
    cdef OpDesc d
    cdef int rc, state = 2
    cdef Flags* fl = NULL
    _check_blocks(t, sb, rb)
    check_op(sb.dtype, op, "reduce_scatter")
    if t.solo or t.size < 2 or rb.count == 0:
        return -2
    fl = flags_fit(t, sb.nbytes)
    if fl != NULL:
        if not flags_slot_free(fl):
            return -2
        state = 0
    elif (t.size != 2 or <size_t>rb.nbytes > segment_bytes
            or not exchange_fits(t, rb.nbytes)):
        return -2
    fill_desc(&d, seq, COLL_REDUCE_SCATTER, sb.dtype, op,
              ALGO_FLAGS if fl != NULL else ALGO_RING, 0, rb.count)
    with nogil:
        rc = t.begin(&d, timeout)
        if rc == 0 and fl != NULL:
            rc = flags_post(t, fl, sb.ptr, sb.nbytes)
            if rc == 0 and flags_ends_at_once(fl, -1):
                rc = flags_reduce_scatter_end(t, fl, rb.ptr, t.rank * rb.count, rb.count,
                                              sb.count, sb.itemsize, sb.dtype, op)
                state = 1
        elif rc == 0:
            rc = exchange_post(t, sb.ptr + (1 - t.rank) * rb.nbytes, rb.nbytes)
    if rc < 0:
        raise_error(t)
    return state


cpdef int reduce_scatter_end(Transport t, object sendbuf, object recvbuf, int op, int algo,
                             unsigned int seq, double timeout) except? -1:
    """Finish the reduce_scatter ``reduce_scatter_begin`` began with ``algo``: through the
    flag area, wait for every post and reduce this rank's block of each; the ring of 2,
    receive the peer's part of this rank's block and reduce it with this rank's own into
    ``recvbuf`` (this rank's first, as the ring reduces).  The algorithm's code."""
    cdef View sb
    held_sb = pin(sendbuf, &sb, "reduce_scatter", "sendbuf", False)
    cdef View rb
    held_rb = pin(recvbuf, &rb, "reduce_scatter", "recvbuf", True)
    cdef OpDesc d
    cdef int rc
    cdef char* other = NULL
    cdef Flags* fl = flags_fit(t, sb.nbytes) if algo == ALGO_FLAGS else NULL
    if fl == NULL:
        algo = ALGO_RING
    fill_desc(&d, seq, COLL_REDUCE_SCATTER, sb.dtype, op, algo, 0, rb.count)
    with nogil:
        rc = t.begin(&d, timeout)
        if rc == 0 and fl != NULL:
            rc = flags_reduce_scatter_end(t, fl, rb.ptr, t.rank * rb.count, rb.count, sb.count,
                                          sb.itemsize, sb.dtype, op)
        elif rc == 0:
            other = t.scratch(rb.nbytes)
            rc = -1 if other == NULL else exchange_finish(t, other, rb.nbytes)
            if rc == 0:
                reduce_into(rb.ptr, sb.ptr + t.rank * rb.nbytes, other, rb.count, sb.dtype,
                            op)
                if op == OP_AVG:
                    divide_by(rb.ptr, rb.count, sb.dtype, 2)
    if rc < 0:
        raise_error(t)
    return algo
