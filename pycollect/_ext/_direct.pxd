# The steps every "direct" algorithm shares (allreduce, broadcast, allgather):
# ranks of one host exchange their buffers' addresses, read each other's
# memory with the transport's one-sided read_remote (or write into it with
# write_remote), and hold their buffers
# unchanged until every reader has said it is done.
from libc.stdint cimport uint64_t
from pycollect._ext._transport cimport Transport

cdef enum:
    # The piece a direct algorithm works on while it is in cache: read from a peer and
    # reduced (allreduce), or placed and written to the peers (allgather).
    DIRECT_CHUNK_BYTES = 262144

cdef struct DirectHello:
    uint64_t addr       # the sender's buffer
    uint64_t readable   # 1: the sender may read every peer's memory

cdef int direct_hello(Transport t, const void* addr, DirectHello* hello) noexcept nogil
cdef int direct_read(Transport t, int peer, void* dst, uint64_t addr,
                     size_t nbytes) noexcept nogil
cdef int direct_write(Transport t, int peer, uint64_t addr, const void* src,
                      size_t nbytes) noexcept nogil
cdef int direct_release(Transport t) noexcept nogil
