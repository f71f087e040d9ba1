# The steps every "direct" algorithm shares (allreduce, broadcast, allgather):
# ranks of one host exchange their buffers' addresses, read each other's
# memory with the transport's one-sided read_remote (or write into it with
# write_remote), or with plain loads and stores where the buffer lies in a
# pool of shared buffers (view_remote), and hold their buffers unchanged
# until every reader has said it is done.
from libc.stdint cimport uint64_t
from pycollect._ext._pool cimport PoolRef
from pycollect._ext._transport cimport Transport

cdef enum:
    # The chunk the direct allreduce works on (read from the peers, reduced, written to
    # them) where every peer's buffer is mapped here: small enough that the chunk of its own
    # buffer and the peer's chunk it was reduced from stay in the core's first-level cache
    # (32 KiB here) until the reduced chunk is written over the peer's, so that write finds
    # the peer's lines in the cache it just read them into.  8 KiB took 0.81-0.91 of 256
    # KiB's time at 2 and 4 ranks (docs/algorithms.md).
    DIRECT_CHUNK_BYTES = 8192
    # The same where some peer's memory is reached through the kernel (cross-memory
    # attach): a process_vm_readv/writev call costs microseconds beyond its copy (~7 µs
    # here: benchmarks/kernel_copy.py), so such a chunk is larger.
    DIRECT_KERNEL_CHUNK_BYTES = 1048576
    # An async direct allreduce or allgather of up to this many bytes (the allreduce's
    # buffer, the allgather's recvbuf) is begun in the call: its hello sent, its polls
    # take the later steps as the peers' messages come (_direct.pyx).  A larger one is
    # queued for the context's runner, which moves it while the caller computes (a look
    # that moved a larger one would hold its caller as long).
    DIRECT_BEGIN_BYTES = 1048576
    # What the algorithms' begin functions answer when they sent the hello: of the
    # buffer itself, or of its staged copy (beside 0: posted to the flag area, 1: ended,
    # 2: begun as an exchange).
    BEGUN_DIRECT = 3
    BEGUN_DIRECT_STAGED = 4

cdef struct DirectHello:
    uint64_t addr       # the sender's buffer
    uint64_t readable   # 1: the sender may read every peer's memory
    PoolRef pool        # where the sender's buffer lies in its pool of shared buffers
    uint64_t view       # set on receipt (direct_view): the sender's buffer as mapped here, or 0

# Where a direct algorithm copies a plain buffer of ``nbytes`` that its peers may then map
# (see _direct.pyx), or NULL where it works on the buffer itself.  Called with the GIL.
cdef char* direct_stage(Transport t, const void* buf, size_t nbytes)
cdef void direct_offer(DirectHello* mine, const void* addr, size_t nbytes) noexcept nogil
cdef void direct_view(Transport t, int peer, DirectHello* theirs, size_t nbytes) noexcept nogil
cdef int direct_hello(Transport t, const void* addr, size_t nbytes,
                      DirectHello* hello) noexcept nogil
cdef int direct_read(Transport t, int peer, const DirectHello* theirs, size_t off, void* dst,
                     size_t nbytes) noexcept nogil
cdef int direct_write(Transport t, int peer, const DirectHello* theirs, size_t off,
                      const void* src, size_t nbytes, bint whole) noexcept nogil
cdef int direct_release(Transport t) noexcept nogil
# A direct algorithm begun by an async call sends its hello in the call and receives the
# peers' later (direct_hello's halves), and likewise its release (see _direct.pyx).
cdef bint direct_may_begin(Transport t) noexcept nogil
cdef int direct_hello_send(Transport t, const void* addr, size_t nbytes,
                           DirectHello* hello) noexcept nogil
cdef int direct_hello_take(Transport t, size_t nbytes, DirectHello* hello) noexcept nogil
cdef int direct_release_send(Transport t) noexcept nogil
cdef int direct_release_take(Transport t) noexcept nogil
cdef char* direct_staged(Transport t)
