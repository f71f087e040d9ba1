# Shared buffers: arrays that every process of the host may map (see _pool.pyx).
#
# pool_ref tells where a buffer of this process lies in its pool; a peer that
# receives the PoolRef maps the same pages with pool_view and works on the
# buffer with plain loads and stores, where cross-memory attach would copy it
# through the kernel.  Neither touches the GIL or a transport.
from libc.stdint cimport int64_t, uint64_t

cdef struct PoolRef:
    uint64_t base       # the pool's first address in its owner; 0: the buffer is in no pool
    uint64_t nbytes     # the pool's length
    uint64_t ino        # the pool file's inode, so that a reused fd number is not mistaken
    int64_t fd          # the pool file's descriptor in its owner

# 1 and ``out`` filled when [addr, addr + nbytes) lies in this process's pool, else 0
# and ``out`` zeroed.
cdef int pool_ref(const void* addr, size_t nbytes, PoolRef* out) noexcept nogil

# This process's view of [addr, addr + nbytes) in process ``pid``'s pool ``ref``, mapped
# on first use and kept until the process ends; NULL where ``ref`` is no pool, the range
# lies outside it, or the pool cannot be mapped (the caller copies with cross-memory
# attach instead).
cdef char* pool_view(int pid, const PoolRef* ref, uint64_t addr, size_t nbytes) noexcept nogil

# A Block of at least ``nbytes`` from this process's pool (made on first use: _pool.pyx's
# process_pool), or None where the pool cannot be made or has no room; its memory starts
# at block_address(block) and lasts as long as the Block does.
cdef object pool_block(size_t nbytes)
cdef char* block_address(object block) noexcept
