# The small-message path of one host: collectives through a shared-memory flag
# area (_flags.pyx) instead of messages.  The entry points of _barrier.pyx,
# _broadcast.pyx, _allreduce.pyx, _allgather.pyx, _reduce_scatter.pyx and _alltoall.pyx
# call these where the transport has a flag area (Transport.flag_area) and the message
# fits (flags_fit).
from libc.stdint cimport int64_t, uint32_t, uint64_t

from pycollect._ext._transport cimport OpDesc, Transport

cdef enum:
    FLAGS_MAX_BYTES = 16384     # the data area of a slot: the largest message of the path
    FLAGS_DEPTH = 16            # data slots per rank: how far a broadcast's root may run ahead
    FLAGS_INLINE_BYTES = 32     # a message this small travels in the post line itself
    FLAGS_OUTSTANDING = 8       # operations a rank may have posted and not yet ended

cdef struct AreaHeader:
    uint32_t failed             # 1 + the first rank whose flags operation failed; 0: none
    char pad[60]

cdef struct PostLine:           # one rank's post of one operation (one cache line, that rank's)
    uint64_t posted             # k + 1 once the rank has entered operation k (line k % depth)
    OpDesc desc                 # operation k's descriptor
    char data[FLAGS_INLINE_BYTES]   # its contribution, up to FLAGS_INLINE_BYTES

cdef struct SleepLine:          # one rank's "sleeping" word (a line of its own: read by posters)
    uint32_t sleeping           # it sleeps in poll(): ring its bell after posting
    char pad[60]

cdef struct DescLine:           # the descriptor of one of a rank's operations (late checks)
    OpDesc desc
    char pad[40]

cdef struct Flags:
    AreaHeader* hdr
    SleepLine* sleep            # one per rank
    PostLine* posts             # per rank, FLAGS_DEPTH (operation k in k % depth)
    DescLine* descs             # per rank, 2 * FLAGS_DEPTH (operation k in k % (2 * depth))
    char* data                  # per rank, FLAGS_DEPTH slots (operation k in k % depth)
    int me
    int n
    uint64_t ops                # flags operations this rank has posted
    uint64_t ended              # ... and ended (ends run in order: the next is this one)
    uint64_t checked            # operations below this one: every peer's descriptor checked
    int64_t spin_ns
    int yield_spin
    const unsigned char* mate   # per rank: 1 where it may run on this rank's CPUs

cdef class FlagArea:
    cdef Flags f
    cdef object owner           # keeps the shared mapping alive
    cdef bytes mates            # Flags.mate's bytes

# The flags path's object of ``t`` for a message of ``nbytes``, or NULL (no area, or too
# large); called with the GIL, before the nogil call.
cdef Flags* flags_fit(Transport t, size_t nbytes) noexcept
cdef int flags_barrier(Transport t, Flags* f) noexcept nogil
cdef int flags_broadcast(Transport t, Flags* f, char* buf, size_t nbytes,
                         int root) noexcept nogil
cdef int flags_allreduce(Transport t, Flags* f, char* buf, size_t n, size_t es, int dtype,
                         int op) noexcept nogil
cdef int flags_allgather(Transport t, Flags* f, const char* src, char* recv,
                         const size_t* off, const size_t* lens, size_t es) noexcept nogil
cdef int flags_reduce_scatter(Transport t, Flags* f, const char* src, char* recv, size_t off,
                              size_t n, size_t total, size_t es, int dtype,
                              int op) noexcept nogil
cdef int flags_alltoall(Transport t, Flags* f, const char* src, char* recv,
                        size_t nbytes) noexcept nogil
# An allreduce, reduce_scatter, allgather, alltoall, barrier or broadcast begun without
# waiting (an async call on the caller's thread), and its end, run before the next flags
# operation.
cdef int flags_post(Transport t, Flags* f, const char* src, size_t nbytes) noexcept nogil
cdef bint flags_slot_free(Flags* f) noexcept nogil
cdef bint flags_ends_at_once(Flags* f, int root) noexcept nogil
cdef int flags_broadcast_end(Transport t, Flags* f, char* buf, size_t nbytes,
                             int root) noexcept nogil
cdef int flags_barrier_end(Transport t, Flags* f) noexcept nogil
cdef int flags_allreduce_end(Transport t, Flags* f, char* buf, size_t n, size_t es, int dtype,
                             int op) noexcept nogil
cdef int flags_allgather_end(Transport t, Flags* f, char* recv, size_t nbytes) noexcept nogil
cdef int flags_reduce_scatter_end(Transport t, Flags* f, char* recv, size_t off, size_t n,
                                  size_t total, size_t es, int dtype, int op) noexcept nogil
cdef int flags_alltoall_end(Transport t, Flags* f, char* recv, size_t nbytes) noexcept nogil
