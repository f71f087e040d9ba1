# The two phases of every ring algorithm, shared by allreduce, reduce,
# reduce_scatter(v) and allgather(v).
from pycollect._ext._transport cimport Transport

cdef enum:
    LAYOUT_INLINE = 8   # chunks a Layout holds in itself (more: allocated)

cdef struct Layout:
    size_t* off     # element offset of each rank's chunk
    size_t* len     # element count of each rank's chunk
    int shift       # the ring ends with rank r owning chunk (r + 1 + shift) mod size
    # off and len point here up to LAYOUT_INLINE chunks: a Layout lives on its caller's
    # stack and is passed by address, never copied
    size_t inline_off[LAYOUT_INLINE]
    size_t inline_len[LAYOUT_INLINE]

cdef int layout_even(Layout* lay, size_t n, int parts, int shift) noexcept nogil
cdef int layout_counts(Layout* lay, const size_t* counts, int parts, int shift) noexcept nogil
cdef void layout_free(Layout* lay) noexcept nogil

cdef int ring_reduce_scatter(Transport t, char* work, const Layout* lay, size_t es, int dtype,
                             int op, size_t seg, int window) noexcept nogil
cdef int ring_allgather(Transport t, char* buf, const Layout* lay, size_t es,
                        size_t seg) noexcept nogil
