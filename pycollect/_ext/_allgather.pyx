"""allgather and allgatherv over the ring.

Rank r first places its own block at position r of ``recvbuf`` (skipped when
``sendbuf`` already is that block: the in-place form), then the ring's
allgather phase circulates the blocks, each received straight into its place
and forwarded as it lands (see _ring.pyx).
"""

from libc.stdlib cimport free
from libc.string cimport memmove

from pycollect._ext._buffer cimport (Buffer, as_buffer, check_count, check_pair,
                                     counts_array)
from pycollect._ext._ring cimport Layout, layout_counts, layout_free, ring_allgather
from pycollect._ext._transport cimport *


def allgather(Transport t, object sendbuf, object recvbuf, object counts, unsigned int seq,
              double timeout, size_t segment_bytes):
    """Every rank's ``recvbuf`` receives all ``sendbuf`` blocks in rank order (counts: allgatherv)."""
    name = "allgather" if counts is None else "allgatherv"
    cdef Buffer sb = as_buffer(sendbuf, name, "sendbuf", False)
    cdef Buffer rb = as_buffer(recvbuf, name, "recvbuf", True)
    check_pair(sb, rb, name)
    cdef int P = t.size, r = t.rank
    cdef size_t* lens = counts_array([sb.count] * P if counts is None else counts, P, name,
                                     "counts")
    cdef Layout lay
    cdef size_t total = 0, es = rb.itemsize
    cdef size_t seg = segment_bytes // es if segment_bytes >= es else 1
    cdef OpDesc d
    cdef int p, rc = 0
    cdef char* mine
    try:
        for p in range(P):
            total += lens[p]
        check_count(sb, lens[r], name, "sendbuf",
                    "counts[%d]" % r if counts is not None else "its own size")
        check_count(rb, total, name, "recvbuf", "size x len(sendbuf)" if counts is None
                    else "the sum of the counts")
        if layout_counts(&lay, lens, P, -1) < 0:
            raise MemoryError()
    finally:
        free(lens)
    fill_desc(&d, seq, COLL_ALLGATHER if counts is None else COLL_ALLGATHERV, sb.dtype, 0,
              ALGO_RING, 0, sb.count if counts is None else total)
    with nogil:
        rc = t.begin(&d, timeout)
        mine = rb.ptr + lay.off[r] * es
        if rc == 0 and mine != sb.ptr and lay.len[r]:
            memmove(mine, sb.ptr, lay.len[r] * es)
        if rc == 0 and P > 1 and total > 0:
            rc = ring_allgather(t, rb.ptr, &lay, es, seg)
        layout_free(&lay)
    if rc < 0:
        raise_error(t)
    return ALGO_RING
