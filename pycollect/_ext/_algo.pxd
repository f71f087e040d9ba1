# Helpers shared by the algorithm families: how a buffer of n elements splits
# into one chunk per rank and each chunk into segments; the two halves of a
# 2-rank exchange begun by an async call.
from libc.stddef cimport size_t

from pycollect._ext._transport cimport Transport

cdef inline size_t chunk_offset(size_t n, int parts, int c) noexcept nogil:
    """Element offset of chunk c when n elements split into ``parts`` near-equal chunks."""
    cdef size_t base = n // parts, extra = n % parts
    return c * base + (<size_t>c if <size_t>c < extra else extra)

cdef inline size_t chunk_length(size_t n, int parts, int c) noexcept nogil:
    return n // parts + (1 if <size_t>c < n % parts else 0)

cdef inline size_t segment_count(size_t length, size_t seg) noexcept nogil:
    return (length + seg - 1) // seg

cdef inline size_t segment_length(size_t length, size_t seg, size_t g) noexcept nogil:
    cdef size_t rest = length - g * seg
    return rest if rest < seg else seg

cdef inline int wrap(int x, int size) noexcept nogil:
    return ((x % size) + size) % size

cdef inline bint exchange_fits(Transport t, size_t nbytes) noexcept nogil:
    """Whether a 2-rank exchange's send of ``nbytes`` goes out whole now, through the stream
    (``Transport.sends_now``: nothing queued to the peer, no copy by address, room in the
    channel).  Only such an exchange is begun by an async call: one whose send were left
    half-way, or waited for the peer to read it by address, would be finished by the next
    ``t.begin`` of this rank (its end's), before its receive is posted, while the peer's
    end waits the same way for this rank's (both ranks' ends deadlock)."""
    return t.sends_now(1 - t.rank, nbytes)

cdef inline int exchange_post(Transport t, const void* buf, size_t nbytes) noexcept nogil:
    """The first half of a 2-rank exchange begun by an async call (after ``t.begin``, where
    ``exchange_fits``): send ``buf`` to the peer through the stream (``post_send_async``),
    whole, without waiting.  0, or -1 after set_error."""
    return -1 if t.post_send_async(1 - t.rank, buf, nbytes) < 0 else 0

cdef inline int exchange_finish(Transport t, void* into, size_t nbytes) noexcept nogil:
    """The second half (after ``t.begin`` again, which finishes what is left of the send):
    receive the peer's message into ``into``.  0, or -1 after set_error."""
    if t.post_recv(1 - t.rank, into, nbytes) < 0:
        return -1
    return t.wait_all()
