# Helpers shared by the algorithm families: how a buffer of n elements splits
# into one chunk per rank and each chunk into segments.
from libc.stddef cimport size_t

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
