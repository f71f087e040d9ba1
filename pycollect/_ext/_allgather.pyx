"""allgather and allgatherv: over the ring, direct, or through the flag area.

Rank r first places its own block at position r of ``recvbuf`` (skipped when
``sendbuf`` already is that block: the in-place form).

Ring: the ring's allgather phase circulates the blocks, each received straight
into its place and forwarded as it lands (see _ring.pyx).

Direct (every rank on one host, each able to reach the others' memory; one
copy per block): the ranks exchange the addresses of their ``recvbuf``
(``direct_hello``), then rank r places its own block and writes the whole
block into position r of every peer's ``recvbuf`` (``direct_write``, peers
r+1, r+2, ... in turn: one kernel copy per peer, or a memcpy where the peer's
``recvbuf`` is mapped here), and returns once every peer has said it has
finished writing (``direct_release``): no caller uses a ``recvbuf`` that a
peer still writes.  The block goes out whole, not in
cache-sized pieces: each process_vm_writev call costs microseconds beyond its
copy (2 ranks, 1M floats per rank, against MPI in turns: 1.31x MPI's time in
256 KiB pieces, 0.88x whole; docs/algorithms.md).  Where some rank may not
reach every peer's memory, all of them run the ring instead, in the same
operation.

Flags (every pair on one host's shared memory, equal blocks of up to
_flags.FLAGS_MAX_BYTES): every rank copies its block into its slot of the
transport's flag area and posts its flag; once all have, each copies every
slot into its place (_flags.pyx).  Where the transport has no flag area, or
the block does not fit, ``flags`` runs the ring.

An async direct allgather (equal blocks, up to DIRECT_BEGIN_BYTES of ``recvbuf``) is
begun in the call: it sends its hello (``allgather_begin``); a look that finds every
peer's hello places this rank's block, writes it to every peer and sends its release
(``allgather_step``), which waits for nobody; its end takes the peers' releases
(``allgather_end``).  An async ring allgather of 2 ranks whose block goes in one message
is begun as its one exchange: the call places the block and sends it, the end receives
the peer's (``_algo.exchange_post``, ``exchange_finish``).  The messages are the
blocking call's.
"""

from libc.stdlib cimport free
from libc.string cimport memmove

from pycollect._ext._algo cimport exchange_finish, exchange_fits, exchange_post
from pycollect._ext._buffer cimport (View, pin, check_count, check_pair, check_apart,
                                     counts_array, filled_array)
from pycollect._ext._flags cimport (Flags, flags_allgather, flags_allgather_end,
                                    flags_ends_at_once, flags_fit, flags_post,
                                    flags_slot_free)
from pycollect._ext._ring cimport (Layout, layout_counts, layout_even, layout_free,
                                   ring_allgather)
from pycollect._ext._direct cimport (BEGUN_DIRECT, DIRECT_BEGIN_BYTES, DirectHello,
                                     direct_hello, direct_hello_send, direct_hello_take,
                                     direct_may_begin, direct_release, direct_release_send,
                                     direct_release_take, direct_write)
from pycollect._ext._transport cimport *

from pycollect.errors import InvalidArgument

# The in-place form that an overlap of sendbuf and recvbuf may take (``check_apart``).
cdef str IN_PLACE = ", or sendbuf as exactly this rank's block of recvbuf (in place)"

ALGORITHMS = {"ring": ALGO_RING, "direct": ALGO_DIRECT, "flags": ALGO_FLAGS}


cdef int direct_allgather(Transport t, char* recv, const char* src, const Layout* lay,
                          size_t es, size_t total) noexcept nogil:
    """Place this rank's block and write it into every peer's ``recv`` of ``total`` elements
    (see the module notes).

    Returns 1 when some rank's memory was not reachable (nothing was written, the block is
    in place: run the ring).
    """
    cdef int P = t.size, reachable, rc
    cdef DirectHello* hello = <DirectHello*>t.work_area(P * sizeof(DirectHello))
    if hello == NULL:
        return -1
    reachable = direct_hello(t, recv, total * es, hello)
    if reachable < 0:
        return -1
    rc = _place_and_write(t, recv, src, lay, es, reachable, hello)
    return rc if rc != 0 else direct_release(t)


cdef int _place_and_write(Transport t, char* recv, const char* src, const Layout* lay,
                          size_t es, int reachable, DirectHello* hello) noexcept nogil:
    """Place this rank's block, and where every rank may reach every peer write it into
    every peer's ``recv`` (``hello``: the peers' hellos).  0; 1 where some rank may not
    (run the ring); -1."""
    cdef int P = t.size, r = t.rank, i, q
    cdef char* mine = recv + lay.off[r] * es
    cdef size_t nbytes = lay.len[r] * es
    if mine != src:
        memmove(mine, src, nbytes)
    if not reachable:
        return 1
    for i in range(1, P):
        q = (r + i) % P
        if direct_write(t, q, &hello[q], lay.off[r] * es, src, nbytes, True) < 0:
            return -1
    return 0


cpdef int allgather(Transport t, object sendbuf, object recvbuf, object counts, unsigned int seq,
                    double timeout, size_t segment_bytes, int algo=ALGO_RING) except? -1:
    """Every rank's ``recvbuf`` receives all ``sendbuf`` blocks in rank order (counts: allgatherv);
    return the algorithm code that ran (``direct`` falls back to the ring where some rank
    may not read every peer's memory)."""
    if algo != ALGO_RING and algo != ALGO_DIRECT and algo != ALGO_FLAGS:
        raise InvalidArgument("allgather: unknown algorithm code %d" % algo)
    name = "allgather" if counts is None else "allgatherv"
    cdef View sb
    held_sb = pin(sendbuf, &sb, name, "sendbuf", False)
    cdef View rb
    held_rb = pin(recvbuf, &rb, name, "recvbuf", True)
    check_pair(sb, rb, name)
    cdef int P = t.size, r = t.rank
    cdef size_t* lens = (filled_array(P, sb.count) if counts is None
                         else counts_array(counts, P, name, "counts"))
    cdef Layout lay
    cdef size_t total = 0, most = 0, own = 0, es = rb.itemsize
    cdef size_t seg = segment_bytes // es if segment_bytes >= es else 1
    cdef OpDesc d
    cdef int p, rc = 0
    cdef bint moves                 # bytes travel between ranks
    cdef bint vee = counts is not None
    cdef char* mine
    cdef Flags* fl = NULL
    if algo == ALGO_FLAGS:          # equal blocks that fit the flag area, else the ring
        fl = flags_fit(t, sb.nbytes) if counts is None else NULL
        if fl == NULL:
            algo = ALGO_RING
    try:
        for p in range(P):
            own = total if p == r else own
            total += lens[p]
            most = lens[p] if lens[p] > most else most
        check_count(sb, lens[r], name, "sendbuf", "counts[%d]" if vee else "its own size",
                    r if vee else -1)
        check_count(rb, total, name, "recvbuf", "size x len(sendbuf)" if counts is None
                    else "the sum of the counts")
        check_apart(sb, rb, name, IN_PLACE, rb.ptr + own * es)
        if layout_counts(&lay, lens, P, -1) < 0:
            raise MemoryError()
    finally:
        free(lens)
    if vee and algo == ALGO_RING and P > 1 and total > 0 and not t.solo:
        # allgatherv through the flag area where the largest block fits a slot: every rank
        # decides alike (the counts are the same everywhere)
        fl = flags_fit(t, most * es)
        if fl != NULL:
            algo = ALGO_FLAGS
    fill_desc(&d, seq, COLL_ALLGATHER if counts is None else COLL_ALLGATHERV, sb.dtype, 0,
              algo, counts_digest(lay.len, P) if vee else 0, total if vee else sb.count)
    with nogil:
        rc = t.begin(&d, timeout)
        mine = rb.ptr + lay.off[r] * es
        moves = P > 1 and total > 0
        if rc == 0 and mine != sb.ptr and lay.len[r] and not (
                moves and (algo == ALGO_DIRECT or algo == ALGO_FLAGS)):
            memmove(mine, sb.ptr, lay.len[r] * es)     # direct and flags place it themselves
        if rc == 0 and moves:
            if algo == ALGO_FLAGS:
                rc = flags_allgather(t, fl, sb.ptr, rb.ptr, lay.off, lay.len, es)
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


cdef int _check_blocks(Transport t, View sb, View rb) except -1:
    """The arguments of an allgather of equal blocks begun in the call, checked as
    ``allgather`` checks them (InvalidArgument)."""
    check_pair(sb, rb, "allgather")
    check_count(rb, sb.count * t.size, "allgather", "recvbuf", "size x len(sendbuf)")
    check_apart(sb, rb, "allgather", IN_PLACE, rb.ptr + t.rank * sb.nbytes)
    return 0


cpdef int allgather_begin(Transport t, object sendbuf, object recvbuf, int algo,
                          unsigned int seq, double timeout, size_t segment_bytes) except? -1:
    """Begin an allgather of equal blocks without waiting (an async call on the caller's
    thread), as ``allgather`` would run it with ``algo``: through the flag area, posting
    this rank's block (where the post would not wait for its slot); direct, where
    ``recvbuf`` holds at most DIRECT_BEGIN_BYTES and this rank may read every peer, by
    sending this rank's hello (its ``recvbuf``); or the ring of 2 ranks (asked for, or flags
    where no area serves, which runs it), where the block goes in one message (no larger
    than ``segment_bytes``), by placing this rank's block and sending it to the peer (the
    ring's one exchange).  1 when it has ended; 0 when it is posted to the flag area,
    BEGUN_DIRECT when its hello is sent (``allgather_step`` may run) and 2 when it is begun
    as an exchange, and ``allgather_end`` must finish it before the next collective; -2
    where none applies (nothing was done)."""
    cdef View sb
    held_sb = pin(sendbuf, &sb, "allgather", "sendbuf", False)
    cdef View rb
    held_rb = pin(recvbuf, &rb, "allgather", "recvbuf", True)
    cdef OpDesc d
    cdef DirectHello* hello
    cdef char* mine = rb.ptr + t.rank * sb.nbytes
    cdef Flags* fl = flags_fit(t, sb.nbytes) if algo == ALGO_FLAGS else NULL
    cdef int rc, state
    if algo == ALGO_FLAGS and fl == NULL:
        algo = ALGO_RING
    _check_blocks(t, sb, rb)
    if fl != NULL:
        state = 0
    elif algo == ALGO_DIRECT:
        state = BEGUN_DIRECT
    else:
        state = 2
    if t.solo or t.size < 2 or sb.count == 0 or not (
            fl != NULL and flags_slot_free(fl)
            or state == BEGUN_DIRECT and rb.nbytes <= DIRECT_BEGIN_BYTES and direct_may_begin(t)
            or algo == ALGO_RING and t.size == 2 and <size_t>sb.nbytes <= segment_bytes
            and exchange_fits(t, sb.nbytes)):
        return -2
    fill_desc(&d, seq, COLL_ALLGATHER, sb.dtype, 0, algo, 0, sb.count)
    with nogil:
        rc = t.begin(&d, timeout)
        if rc == 0 and fl != NULL:
            rc = flags_post(t, fl, sb.ptr, sb.nbytes)
            if rc == 0 and flags_ends_at_once(fl, -1):
                rc = flags_allgather_end(t, fl, rb.ptr, sb.nbytes)
                state = 1
        elif rc == 0 and state == BEGUN_DIRECT:
            hello = <DirectHello*>t.work_area(t.size * sizeof(DirectHello))
            rc = -1 if hello == NULL else direct_hello_send(t, rb.ptr, rb.nbytes, hello)
        elif rc == 0:
            if mine != sb.ptr:
                memmove(mine, sb.ptr, sb.nbytes)
            rc = exchange_post(t, mine, sb.nbytes)
    if rc < 0:
        raise_error(t)
    return state


cpdef int allgather_step(Transport t, object sendbuf, object recvbuf, unsigned int seq,
                         double timeout, size_t segment_bytes) except? -1:
    """The middle of the allgather ``allgather_begin`` began, for a look that found every
    peer's hello there: place this rank's block, write it to every peer, tell them so
    without waiting.  ALGO_DIRECT (``allgather_end`` with ``stepped`` finishes it), or
    ALGO_RING where some rank may not reach every peer and the ring ran (it has ended)."""
    return _steps(t, sendbuf, recvbuf, seq, timeout, segment_bytes, False, True)


cpdef int allgather_end(Transport t, object sendbuf, object recvbuf, int algo,
                        unsigned int seq, double timeout, size_t segment_bytes,
                        bint stepped) except? -1:
    """Finish the allgather ``allgather_begin`` began with ``algo`` (``stepped``:
    ``allgather_step`` ran since, with ALGO_DIRECT): direct, the step unless it ran, then
    the peers' releases; through the flag area, wait for every post and copy every block
    into place; the ring of 2, receive the peer's block into its place.  The algorithm's
    code."""
    cdef View sb
    cdef View rb
    cdef Flags* fl
    cdef OpDesc d
    cdef int rc
    if algo == ALGO_DIRECT:
        return _steps(t, sendbuf, recvbuf, seq, timeout, segment_bytes, not stepped, False)
    held_sb = pin(sendbuf, &sb, "allgather", "sendbuf", False)
    held_rb = pin(recvbuf, &rb, "allgather", "recvbuf", True)
    fl = flags_fit(t, sb.nbytes) if algo == ALGO_FLAGS else NULL
    if fl == NULL:
        algo = ALGO_RING
    fill_desc(&d, seq, COLL_ALLGATHER, sb.dtype, 0, algo, 0, sb.count)
    with nogil:
        rc = t.begin(&d, timeout)
        if rc == 0 and fl != NULL:
            rc = flags_allgather_end(t, fl, rb.ptr, sb.nbytes)
        elif rc == 0:
            rc = exchange_finish(t, rb.ptr + (1 - t.rank) * sb.nbytes, sb.nbytes)
    if rc < 0:
        raise_error(t)
    return algo


cdef int _steps(Transport t, object sendbuf, object recvbuf, unsigned int seq, double timeout,
                size_t segment_bytes, bint step, bint step_only) except -1:
    cdef View sb
    held_sb = pin(sendbuf, &sb, "allgather", "sendbuf", False)
    cdef View rb
    held_rb = pin(recvbuf, &rb, "allgather", "recvbuf", True)
    cdef size_t es = rb.itemsize
    cdef size_t seg = segment_bytes // es if segment_bytes >= es else 1
    cdef Layout lay
    cdef OpDesc d
    cdef DirectHello* hello
    cdef int rc, algo = ALGO_DIRECT
    _check_blocks(t, sb, rb)
    if layout_even(&lay, sb.count * t.size, t.size, -1) < 0:
        raise MemoryError()
    fill_desc(&d, seq, COLL_ALLGATHER, sb.dtype, 0, ALGO_DIRECT, 0, sb.count)
    with nogil:
        rc = t.begin(&d, timeout)
        if rc == 0 and (step or step_only):
            hello = <DirectHello*>t.work_area(t.size * sizeof(DirectHello))
            rc = -1 if hello == NULL else direct_hello_take(t, rb.nbytes, hello)
            if rc >= 0:
                rc = _place_and_write(t, rb.ptr, sb.ptr, &lay, es, rc, hello)
            if rc == 1:         # some rank may not reach every peer: the ring
                algo = ALGO_RING
                rc = ring_allgather(t, rb.ptr, &lay, es, seg)
            elif rc == 0:
                rc = direct_release_send(t)
        if rc == 0 and algo == ALGO_DIRECT and not step_only:
            rc = direct_release_take(t)
        layout_free(&lay)
    if rc < 0:
        raise_error(t)
    return algo
