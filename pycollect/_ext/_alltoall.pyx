"""alltoall and alltoallv: through the flag area, or pairwise exchange.

Flags (every pair on one host's shared memory, equal blocks, the whole ``sendbuf`` of up
to _flags.FLAGS_MAX_BYTES): every rank copies its ``sendbuf`` into its slot of the
transport's flag area and posts its flag; once all have, each copies its own block of
every slot, in rank order, into ``recvbuf`` (_flags.pyx): one synchronisation point and
no messages.  Every rank decides alike (``flags_fit``: the same area, the same size), and
the operation's descriptor names the algorithm that ran.

Pairwise (the rest): every rank posts its receive from every peer and its send to every
peer at once (sends in the order r+1, r+2, ... so that no rank is everyone's first
target) and copies its own block locally; the progress engine drives all pairs together.
One message per pair each way, so size-1 steps happen in parallel and the slowest link
sets the time.

An async alltoall is begun in the call through the flags (``alltoall_begin`` posts
``sendbuf`` where the post would not wait for its slot; ``alltoall_end`` waits for the
peers' posts and copies), or, of 2 ranks without the flags and whose block goes in one
message, by copying its own block and sending the peer's; its end then receives the
peer's block into place.  The messages and posts are the blocking call's.
"""

from libc.stdlib cimport free
from libc.string cimport memmove

from pycollect._ext._algo cimport exchange_finish, exchange_fits, exchange_post, wrap
from pycollect._ext._buffer cimport (View, pin, check_count, check_pair, check_apart,
                                     counts_array, filled_array)
from pycollect._ext._flags cimport (Flags, flags_alltoall, flags_alltoall_end,
                                    flags_ends_at_once, flags_fit, flags_post, flags_slot_free)
from pycollect._ext._transport cimport *

from pycollect.errors import InvalidArgument

# The in-place form (``check_apart``), which the Python path stages in a copy.
cdef str IN_PLACE = ", or the very same array as both (in place)"


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


cpdef int alltoall(Transport t, object sendbuf, object sendcounts, object recvbuf,
                   object recvcounts, unsigned int seq, double timeout) except? -1:
    """Block p of ``sendbuf`` goes to rank p, block p of ``recvbuf`` comes from rank p."""
    name = "alltoall" if sendcounts is None else "alltoallv"
    cdef View sb
    held_sb = pin(sendbuf, &sb, name, "sendbuf", False)
    cdef View rb
    held_rb = pin(recvbuf, &rb, name, "recvbuf", True)
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
    cdef Flags* fl = NULL
    cdef int algo = ALGO_PAIRWISE
    try:
        rlen = (filled_array(P, block) if sendcounts is None
                else counts_array(recvcounts, P, name, "recvcounts"))
        soff = filled_array(P, 0)
        roff = filled_array(P, 0)
        check_count(sb, _prefix(soff, slen, P), name, "sendbuf", "the sum of sendcounts")
        check_count(rb, _prefix(roff, rlen, P), name, "recvbuf", "the sum of recvcounts")
        check_apart(sb, rb, name, IN_PLACE)
        if slen[t.rank] != rlen[t.rank]:
            raise InvalidArgument("%s: sendcounts[%d] = %d but recvcounts[%d] = %d (this "
                                  "rank's block to itself)" % (name, t.rank, slen[t.rank],
                                                               t.rank, rlen[t.rank]))
        if sendcounts is None and P > 1 and block > 0 and not t.solo:
            fl = flags_fit(t, sb.nbytes)
            if fl != NULL:
                algo = ALGO_FLAGS
        fill_desc(&d, seq, COLL_ALLTOALL if name == "alltoall" else COLL_ALLTOALLV,
                  sb.dtype, 0, algo, 0, block)
        with nogil:
            rc = t.begin(&d, timeout)
            if rc == 0 and fl != NULL:
                rc = flags_alltoall(t, fl, sb.ptr, rb.ptr, block * sb.itemsize)
            elif rc == 0:
                rc = pairwise_exchange(t, sb.ptr, soff, slen, rb.ptr, roff, rlen, sb.itemsize)
    finally:
        free(slen)
        free(rlen)
        free(soff)
        free(roff)
    if rc < 0:
        raise_error(t)
    return algo


cdef int _check_blocks(Transport t, View sb, View rb) except -1:
    """The arguments of an alltoall begun in the call, checked as ``alltoall`` checks them
    (InvalidArgument)."""
    check_pair(sb, rb, "alltoall")
    if sb.count % t.size:
        raise InvalidArgument("alltoall: 'sendbuf' holds %d elements, not a multiple of "
                              "the group size %d" % (sb.count, t.size))
    check_count(rb, sb.count, "alltoall", "recvbuf", "the sum of recvcounts")
    check_apart(sb, rb, "alltoall", IN_PLACE)
    return 0


cpdef int alltoall_begin(Transport t, object sendbuf, object recvbuf, unsigned int seq,
                         double timeout) except? -1:
    """Begin an alltoall without waiting (an async call on the caller's thread), as
    ``alltoall`` would run it: through the flag area, posting ``sendbuf`` (where the post
    would not wait for its slot); or, of 2 ranks without the flags, where its blocks go in
    one message each and the channel takes it whole, copying this rank's own block into
    place and sending the peer's.  1 when it has ended; 0 when it is posted to the flag
    area and 2 when it is begun as an exchange, and ``alltoall_end`` must finish it before
    the next collective; -2 where none applies (nothing was done: run ``alltoall``)."""
    cdef View sb
    held_sb = pin(sendbuf, &sb, "alltoall", "sendbuf", False)
    cdef View rb
    held_rb = pin(recvbuf, &rb, "alltoall", "recvbuf", True)
    cdef OpDesc d
    cdef int rc, r = t.rank, state = 2
    cdef size_t nbytes
    cdef Flags* fl = NULL
    _check_blocks(t, sb, rb)
    if t.solo or t.size < 2 or sb.count == 0:
        return -2
    nbytes = sb.nbytes // t.size
    fl = flags_fit(t, sb.nbytes)
    if fl != NULL:
        if not flags_slot_free(fl):
            return -2
        state = 0
    elif t.size != 2 or not exchange_fits(t, nbytes):
        return -2
    fill_desc(&d, seq, COLL_ALLTOALL, sb.dtype, 0, ALGO_FLAGS if fl != NULL else ALGO_PAIRWISE,
              0, sb.count // t.size)
    with nogil:
        rc = t.begin(&d, timeout)
        if rc == 0 and fl != NULL:
            rc = flags_post(t, fl, sb.ptr, sb.nbytes)
            if rc == 0 and flags_ends_at_once(fl, -1):
                rc = flags_alltoall_end(t, fl, rb.ptr, nbytes)
                state = 1
        elif rc == 0:
            rc = exchange_post(t, sb.ptr + (1 - r) * nbytes, nbytes)
            if rc == 0:
                memmove(rb.ptr + r * nbytes, sb.ptr + r * nbytes, nbytes)
    if rc < 0:
        raise_error(t)
    return state


cpdef int alltoall_end(Transport t, object sendbuf, object recvbuf, int algo,
                       unsigned int seq, double timeout) except? -1:
    """Finish the alltoall ``alltoall_begin`` began with ``algo``: through the flag area,
    wait for every post and copy this rank's block of each into place; the exchange of 2,
    receive the peer's block into its place.  The algorithm's code."""
    cdef View sb
    held_sb = pin(sendbuf, &sb, "alltoall", "sendbuf", False)
    cdef View rb
    held_rb = pin(recvbuf, &rb, "alltoall", "recvbuf", True)
    cdef OpDesc d
    cdef int rc
    cdef size_t nbytes = sb.nbytes // t.size
    cdef Flags* fl = flags_fit(t, sb.nbytes) if algo == ALGO_FLAGS else NULL
    if fl == NULL:
        algo = ALGO_PAIRWISE
    fill_desc(&d, seq, COLL_ALLTOALL, sb.dtype, 0, algo, 0, sb.count // t.size)
    with nogil:
        rc = t.begin(&d, timeout)
        if rc == 0 and fl != NULL:
            rc = flags_alltoall_end(t, fl, rb.ptr, nbytes)
        elif rc == 0:
            rc = exchange_finish(t, rb.ptr + (1 - t.rank) * nbytes, nbytes)
    if rc < 0:
        raise_error(t)
    return algo
