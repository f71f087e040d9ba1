"""Barrier: dissemination, or the shared-memory flags where the transport has them.

In round k (distance d = 2^k, while d < size) rank r sends an empty message to
r+d and waits for one from r-d.  After ceil(log2(size)) rounds every rank has
heard, directly or through others, from every rank, so none leaves before all
have arrived.  Works for any size, no root.  Where every pair is on one host's
shared memory (the transport's flag area, _flags.pyx) every rank posts its flag
and waits for all the others' instead.
"""

from pycollect._ext._algo cimport exchange_finish, exchange_post, wrap
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
    """Begin a barrier without waiting (an async call on the caller's thread), as ``barrier``
    would run it: through the flag area, posting this rank's flag; or, at 2 ranks without
    one, dissemination, whose one exchange starts with this rank's empty message.  1 when
    every peer had posted it already and it has ended; 0 when it is posted to the flag
    area and 2 when it is begun as an exchange, and ``barrier_end`` must finish it before
    the next collective; -2 when neither applies or the post would wait for its slot
    (nothing was done: run ``barrier``)."""
    cdef OpDesc d
    cdef Flags* fl = flags_fit(t, 0)
    cdef int rc
    cdef char token = 0
    if t.solo or t.size < 2 or (fl == NULL and t.size != 2) or (
            fl != NULL and not flags_slot_free(fl)):
        return -2
    fill_desc(&d, seq, COLL_BARRIER, 0, 0, ALGO_FLAGS if fl != NULL else ALGO_DISSEMINATION,
              0, 0)
    with nogil:
        rc = t.begin(&d, timeout)
        if rc == 0 and fl == NULL:
            rc = exchange_post(t, &token, 0)
            if rc == 0:
                rc = 2
        elif rc == 0:
            rc = flags_post(t, fl, NULL, 0)
            if rc == 0 and flags_ends_at_once(fl, -1):
                rc = flags_barrier_end(t, fl)
                if rc == 0:
                    rc = 1
    if rc < 0:
        raise_error(t)
    return rc


cpdef int barrier_end(Transport t, unsigned int seq, double timeout) except? -1:
    """Finish the barrier ``barrier_begin`` began (its deadline counts from now): wait for
    every flag, or for the peer's message; the algorithm's code."""
    cdef OpDesc d
    cdef Flags* fl = flags_fit(t, 0)
    cdef int rc
    cdef int algo = ALGO_FLAGS if fl != NULL else ALGO_DISSEMINATION
    cdef char token = 0
    fill_desc(&d, seq, COLL_BARRIER, 0, 0, algo, 0, 0)
    with nogil:
        rc = t.begin(&d, timeout)
        if rc == 0 and fl == NULL:
            rc = exchange_finish(t, &token, 0)
        elif rc == 0:
            rc = flags_barrier_end(t, fl)
    if rc < 0:
        raise_error(t)
    return algo
