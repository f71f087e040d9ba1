"""alltoall and alltoallv: pairwise exchange.

Every rank posts its receive from every peer and its send to every peer at
once (sends in the order r+1, r+2, ... so that no rank is everyone's first
target) and copies its own block locally; the progress engine drives all
pairs together.  One message per pair each way, so size-1 steps happen in
parallel and the slowest link sets the time.
"""

from libc.stdlib cimport free
from libc.string cimport memmove

from pycollect._ext._algo cimport wrap
from pycollect._ext._buffer cimport (Buffer, as_buffer, check_count, check_pair,
                                     counts_array, filled_array)
from pycollect._ext._transport cimport *

from pycollect.errors import InvalidArgument


cdef int pairwise_exchange(Transport t, char* sbase, const size_t* soff, const size_t* slen,
                           char* rbase, const size_t* roff, const size_t* rlen,
                           size_t es) noexcept nogil:
    cdef int P = t.size, r = t.rank, i, p
    for i in range(1, P):
        p = wrap(r - i, P)
        if t.post_recv(p, rbase + roff[p] * es, rlen[p] * es) < 0:
            return -1
    for i in range(1, P):
        p = wrap(r + i, P)
        if t.post_send(p, sbase + soff[p] * es, slen[p] * es) < 0:
            return -1
    if slen[r]:
        memmove(rbase + roff[r] * es, sbase + soff[r] * es, slen[r] * es)
    return t.wait_all()


cdef size_t _prefix(size_t* offs, const size_t* lens, int n) noexcept nogil:
    cdef size_t total = 0
    cdef int i
    for i in range(n):
        offs[i] = total
        total += lens[i]
    return total


def alltoall(Transport t, object sendbuf, object sendcounts, object recvbuf, object recvcounts,
             unsigned int seq, double timeout):
    """Block p of ``sendbuf`` goes to rank p, block p of ``recvbuf`` comes from rank p."""
    name = "alltoall" if sendcounts is None else "alltoallv"
    cdef Buffer sb = as_buffer(sendbuf, name, "sendbuf", False)
    cdef Buffer rb = as_buffer(recvbuf, name, "recvbuf", True)
    check_pair(sb, rb, name)
    cdef int P = t.size, rc = 0
    cdef size_t block = 0
    if sendcounts is None:
        if sb.count % P:
            raise InvalidArgument("alltoall: 'sendbuf' holds %d elements, not a multiple of "
                                  "the group size %d" % (sb.count, P))
        block = sb.count // P
    elif recvcounts is None:
        raise InvalidArgument("alltoallv: 'recvcounts' is required with 'sendcounts'")
    cdef size_t* slen = (filled_array(P, block) if sendcounts is None
                         else counts_array(sendcounts, P, name, "sendcounts"))
    cdef size_t* rlen = NULL
    cdef size_t* soff = NULL
    cdef size_t* roff = NULL
    cdef OpDesc d
    try:
        rlen = (filled_array(P, block) if sendcounts is None
                else counts_array(recvcounts, P, name, "recvcounts"))
        soff = filled_array(P, 0)
        roff = filled_array(P, 0)
        check_count(sb, _prefix(soff, slen, P), name, "sendbuf", "the sum of sendcounts")
        check_count(rb, _prefix(roff, rlen, P), name, "recvbuf", "the sum of recvcounts")
        if slen[t.rank] != rlen[t.rank]:
            raise InvalidArgument("%s: sendcounts[%d] = %d but recvcounts[%d] = %d (this "
                                  "rank's block to itself)" % (name, t.rank, slen[t.rank],
                                                               t.rank, rlen[t.rank]))
        fill_desc(&d, seq, COLL_ALLTOALL if name == "alltoall" else COLL_ALLTOALLV,
                  sb.dtype, 0, ALGO_PAIRWISE, 0, block)
        with nogil:
            rc = t.begin(&d, timeout)
            if rc == 0:
                rc = pairwise_exchange(t, sb.ptr, soff, slen, rb.ptr, roff, rlen, sb.itemsize)
    finally:
        free(slen)
        free(rlen)
        free(soff)
        free(roff)
    if rc < 0:
        raise_error(t)
    return ALGO_PAIRWISE
