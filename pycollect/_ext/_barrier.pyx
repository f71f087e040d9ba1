"""Barrier: dissemination, or the shared-memory flags where the transport has them.

In round k (distance d = 2^k, while d < size) rank r sends an empty message to
r+d and waits for one from r-d.  After ceil(log2(size)) rounds every rank has
heard, directly or through others, from every rank, so none leaves before all
have arrived.  Works for any size, no root.  Where every pair is on one host's
shared memory (the transport's flag area, _flags.pyx) every rank posts its flag
and waits for all the others' instead.
"""

from pycollect._ext._algo cimport wrap
from pycollect._ext._flags cimport (Flags, flags_barrier, flags_barrier_end,
                                    flags_ends_at_once, flags_fit, flags_post, flags_slot_free)
from pycollect._ext._transport cimport *


cdef int dissemination_barrier(Transport t) noexcept nogil:
    cdef int P = t.size, r = t.rank, d = 1
    cdef char token = 0
    while d < P:
        if t.post_send(wrap(r + d, P), &token, 0) < 0:
            return -1
        if t.wait(t.post_recv(wrap(r - d, P), &token, 0)) < 0:
            return -1
        d <<= 1
    return t.wait_all()


cpdef int barrier(Transport t, unsigned int seq, double timeout) except? -1:
    """Return once every rank of ``t`` has entered the barrier (one nogil call)."""
    cdef OpDesc d
    cdef Flags* fl = flags_fit(t, 0)
    cdef int algo = ALGO_FLAGS if fl != NULL else ALGO_DISSEMINATION
    fill_desc(&d, seq, COLL_BARRIER, 0, 0, algo, 0, 0)
    cdef int rc
    if t.solo:
        rc = t.begin(&d, timeout)       # a world of one: nothing to wait for, GIL kept
    else:
        with nogil:
            rc = t.begin(&d, timeout)
            if rc == 0 and t.size > 1:
                rc = flags_barrier(t, fl) if fl != NULL else dissemination_barrier(t)
    if rc < 0:
        raise_error(t)
    return algo


cpdef int barrier_begin(Transport t, unsigned int seq, double timeout) except? -1:
    """Begin a barrier through the flag area without waiting (an async call on the caller's
    thread): 1 when every peer had posted it already and it has ended, 0 when it is posted
    and ``barrier_end`` must finish it before the next collective, -2 when the flags path
    does not apply or the post would wait for its slot (nothing was done: run
    ``barrier``)."""
    cdef OpDesc d
    cdef Flags* fl = flags_fit(t, 0)
    cdef int rc
    if fl == NULL or t.solo or t.size < 2 or not flags_slot_free(fl):
        return -2
    fill_desc(&d, seq, COLL_BARRIER, 0, 0, ALGO_FLAGS, 0, 0)
    with nogil:
        rc = t.begin(&d, timeout)
        if rc == 0:
            rc = flags_post(t, fl, NULL, 0)
        if rc == 0 and flags_ends_at_once(fl, -1):
            rc = flags_barrier_end(t, fl)
            if rc == 0:
                rc = 1
    if rc < 0:
        raise_error(t)
    return rc


cpdef int barrier_end(Transport t, unsigned int seq, double timeout) except? -1:
    """Finish the barrier ``barrier_begin`` posted (its deadline counts from now); the
    algorithm's code."""
    cdef OpDesc d
    cdef Flags* fl = flags_fit(t, 0)
    cdef int rc
    fill_desc(&d, seq, COLL_BARRIER, 0, 0, ALGO_FLAGS, 0, 0)
    with nogil:
        rc = t.begin(&d, timeout)
        if rc == 0:
            rc = flags_barrier_end(t, fl)
    if rc < 0:
        raise_error(t)
    return ALGO_FLAGS
