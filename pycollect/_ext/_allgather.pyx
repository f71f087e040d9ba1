"""allgather and allgatherv: over the ring, or direct.

Rank r first places its own block at position r of ``recvbuf`` (skipped when
``sendbuf`` already is that block: the in-place form).

Ring: the ring's allgather phase circulates the blocks, each received straight
into its place and forwarded as it lands (see _ring.pyx).

Direct (every rank on one host, each able to reach the others' memory; one
copy per block): the ranks exchange the addresses of their ``recvbuf``
(``direct_hello``), then rank r places its own block and writes the whole
block into position r of every peer's ``recvbuf`` (``direct_write``, peers
r+1, r+2, ... in turn: one kernel copy per read piece of _direct.pyx, or a
memcpy where the peer's ``recvbuf`` is mapped here), and returns once every
peer has said it has finished writing (``direct_release``): no caller uses a
``recvbuf`` that a peer still writes.  The block goes out whole, not in
cache-sized pieces: each process_vm_writev call costs microseconds beyond its
copy (2 ranks, 1M floats per rank, against MPI in turns: 1.31x MPI's time in
256 KiB pieces, 0.88x whole; docs/algorithms.md).  Where some rank may not
reach every peer's memory, all of them run the ring instead, in the same
operation.
"""

from libc.stdlib cimport free
from libc.string cimport memmove

from pycollect._ext._buffer cimport (Buffer, as_buffer, check_count, check_pair,
                                     counts_array, filled_array)
from pycollect._ext._ring cimport Layout, layout_counts, layout_free, ring_allgather
from pycollect._ext._direct cimport DirectHello, direct_hello, direct_release, direct_write
from pycollect._ext._transport cimport *

from pycollect.errors import InvalidArgument

ALGORITHMS = {"ring": ALGO_RING, "direct": ALGO_DIRECT}


cdef int direct_allgather(Transport t, char* recv, const char* src, const Layout* lay,
                          size_t es, size_t total) noexcept nogil:
    """Place this rank's block and write it into every peer's ``recv`` of ``total`` elements
    (see the module notes).

    Returns 1 when some rank's memory was not reachable (nothing was written, the block is
    in place: run the ring).
    """
    cdef int P = t.size, r = t.rank, i, q, reachable
    cdef char* mine = recv + lay.off[r] * es
    cdef size_t nbytes = lay.len[r] * es
    cdef DirectHello* hello = <DirectHello*>t.work_area(P * sizeof(DirectHello))
    if hello == NULL:
        return -1
    reachable = direct_hello(t, recv, total * es, hello)
    if reachable < 0:
        return -1
    if mine != src:
        memmove(mine, src, nbytes)
    if not reachable:
        return 1
    for i in range(1, P):
        q = (r + i) % P
        if direct_write(t, q, &hello[q], lay.off[r] * es, src, nbytes) < 0:
            return -1
    return direct_release(t)


def allgather(Transport t, object sendbuf, object recvbuf, object counts, unsigned int seq,
              double timeout, size_t segment_bytes, int algo=ALGO_RING):
    """Every rank's ``recvbuf`` receives all ``sendbuf`` blocks in rank order (counts: allgatherv);
    return the algorithm code that ran (``direct`` falls back to the ring where some rank
    may not read every peer's memory)."""
    if algo != ALGO_RING and algo != ALGO_DIRECT:
        raise InvalidArgument("allgather: unknown algorithm code %d" % algo)
    name = "allgather" if counts is None else "allgatherv"
    cdef Buffer sb = as_buffer(sendbuf, name, "sendbuf", False)
    cdef Buffer rb = as_buffer(recvbuf, name, "recvbuf", True)
    check_pair(sb, rb, name)
    cdef int P = t.size, r = t.rank
    cdef size_t* lens = (filled_array(P, sb.count) if counts is None
                         else counts_array(counts, P, name, "counts"))
    cdef Layout lay
    cdef size_t total = 0, es = rb.itemsize
    cdef size_t seg = segment_bytes // es if segment_bytes >= es else 1
    cdef OpDesc d
    cdef int p, rc = 0
    cdef bint moves                 # bytes travel between ranks
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
              algo, 0, sb.count if counts is None else total)
    with nogil:
        rc = t.begin(&d, timeout)
        mine = rb.ptr + lay.off[r] * es
        moves = P > 1 and total > 0
        if rc == 0 and mine != sb.ptr and lay.len[r] and not (moves and algo == ALGO_DIRECT):
            memmove(mine, sb.ptr, lay.len[r] * es)     # direct places it as it writes it
        if rc == 0 and moves:
            if algo == ALGO_DIRECT:
                rc = direct_allgather(t, rb.ptr, sb.ptr, &lay, es, total)
                if rc == 1:
                    algo = ALGO_RING
                    rc = 0
            if rc == 0 and algo == ALGO_RING:
                rc = ring_allgather(t, rb.ptr, &lay, es, seg)
        layout_free(&lay)
    if rc < 0:
        raise_error(t)
    return algo
