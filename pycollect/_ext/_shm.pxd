# Shared-memory rings between ranks on one host, and single-copy reads
# (cross-memory attach) for large messages: the channel kind RingChannel.
from libc.stdint cimport uint32_t, uint64_t
from posix.uio cimport iovec

from pycollect._ext._channel cimport Channel, ChannelBase

cdef struct RingHeader:
    uint64_t head               # bytes ever written (the writer's)
    char pad0[56]
    uint64_t tail               # bytes ever consumed (the reader's)
    char pad1[56]
    uint32_t reader_sleeping    # the reader waits in poll: ring its doorbell after writing
    uint32_t writer_sleeping    # the writer waits for space or acks: ring after reading
    char pad2[56]
    uint64_t acks               # large messages the reader has copied out (the reader's)
    char pad3[56]

cdef struct Ring:
    RingHeader* hdr
    char* data
    uint64_t size               # a power of two
    uint64_t tail_seen          # the writer's last look at hdr.tail (in its own memory)
    uint64_t head_mine          # hdr.head as the writer last stored it (its own memory)
    uint64_t tail_mine          # hdr.tail as the reader last stored it (its own memory)

cdef size_t ring_write(Ring* r, const iovec* iov, int cnt) noexcept nogil
cdef size_t ring_read(Ring* r, iovec* iov, int cnt) noexcept nogil
cdef size_t ring_peek(Ring* r, void* out, size_t n) noexcept nogil
cdef uint64_t ring_used(Ring* r) noexcept nogil
cdef void ring_attach(Ring* r, char* base, uint64_t ring_bytes) noexcept nogil
cdef ssize_t cma_read(int pid, void* local, uint64_t remote, size_t n) noexcept nogil
cdef ssize_t cma_write(int pid, uint64_t remote, const void* local, size_t n) noexcept nogil

cdef class Segment:
    cdef char* base
    cdef size_t length
    cdef readonly str path

cdef struct RingState:
    Ring out                    # our ring to the peer
    Ring inn                    # the peer's ring to us
    int peer_pid                # the peer's process, for reading its memory
    int peer_reads              # the peer may read our memory: large messages go by address
    unsigned int empty_looks    # peeks that found the inbound ring empty (_ring_peek)

cdef class RingChannel(Channel):
    cdef ChannelBase chan
    cdef RingState ring
    cdef Segment segment        # keeps the mapping alive
