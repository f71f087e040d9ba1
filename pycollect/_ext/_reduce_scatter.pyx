"""reduce_scatter and reduce_scatterv: the ring's reduce-scatter phase.

``sendbuf`` is copied into a working area (it is an input and is never
written), the ring reduce-scatter leaves rank r holding the reduced block r
(see _ring.pyx), and that block is copied into ``recvbuf``.
"""

from libc.stdlib cimport free
from libc.string cimport memcpy

from pycollect._ext._buffer cimport (Buffer, as_buffer, check_count, check_pair,
                                     counts_array, filled_array)
from pycollect._ext._dtypes cimport OP_AVG
from pycollect._ext._reduce cimport check_op, divide_by
from pycollect._ext._ring cimport Layout, layout_counts, layout_free, ring_reduce_scatter
from pycollect._ext._transport cimport *

from pycollect.errors import InvalidArgument


def reduce_scatter(Transport t, object sendbuf, object recvbuf, object counts, int op,
                   unsigned int seq, double timeout, size_t segment_bytes):
    """Reduce ``sendbuf`` across ranks; rank r receives block r (counts: reduce_scatterv)."""
    name = "reduce_scatter" if counts is None else "reduce_scatterv"
    cdef Buffer sb = as_buffer(sendbuf, name, "sendbuf", False)
    cdef Buffer rb = as_buffer(recvbuf, name, "recvbuf", True)
    check_pair(sb, rb, name)
    check_op(sb.dtype, op, name)
    cdef int P = t.size, r = t.rank, rc = 0, p
    cdef size_t* lens = (filled_array(P, rb.count) if counts is None
                         else counts_array(counts, P, name, "counts"))
    cdef Layout lay
    cdef size_t total = 0, es = sb.itemsize
    cdef size_t seg = segment_bytes // es if segment_bytes >= es else 1
    cdef OpDesc d
    cdef char* work
    try:
        for p in range(P):
            total += lens[p]
        check_count(sb, total, name, "sendbuf", "size x len(recvbuf)" if counts is None
                    else "the sum of the counts")
        check_count(rb, lens[r], name, "recvbuf",
                    "counts[%d]" % r if counts is not None else "len(sendbuf) / size")
        if layout_counts(&lay, lens, P, -1) < 0:
            raise MemoryError()
    finally:
        free(lens)
    fill_desc(&d, seq, COLL_REDUCE_SCATTER if counts is None else COLL_REDUCE_SCATTERV,
              sb.dtype, op, ALGO_RING, 0, rb.count if counts is None else total)
    with nogil:
        rc = t.begin(&d, timeout)
        if rc == 0 and total > 0:
            work = sb.ptr
            if P > 1:
                work = t.work_area(total * es)
                if work == NULL:
                    rc = -1
                else:
                    memcpy(work, sb.ptr, total * es)
                    rc = ring_reduce_scatter(t, work, &lay, es, sb.dtype, op, seg, 4)
            if rc == 0 and lay.len[r]:
                memcpy(rb.ptr, work + lay.off[r] * es, lay.len[r] * es)
                if op == OP_AVG and P > 1:
                    divide_by(rb.ptr, lay.len[r], sb.dtype, P)
        layout_free(&lay)
    if rc < 0:
        raise_error(t)
    return ALGO_RING
