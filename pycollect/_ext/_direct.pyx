"""The steps the direct algorithms share: address exchange, one-sided reads, release.

A direct algorithm runs between ranks that may read each other's memory (the
transport's ``can_read_remote``: shared memory with cross-memory attach).
1. Hello (``direct_hello``): every rank sends every other its buffer's
   address and whether it may read every peer; all ranks learn alike whether
   every pair can read, and where not they all run a message-based algorithm
   instead, in the same operation.
2. Reads (``direct_read``): a rank copies what it needs straight out of a
   peer's buffer, in pieces of DIRECT_READ_BYTES (a read of one piece pins and
   copies that many bytes of the peer's pages: pieces of about a megabyte keep
   the copy at memcpy's pace and the pieces in cache).  ``direct_write`` is the
   same in the other direction, for a rank that would otherwise sit idle (a
   broadcast's root), or whole, in one kernel copy, for a block nothing reads
   again (the allgather's).  Where the peer's buffer lies in its pool of shared
   buffers (``pycollect.empty``: the hello carries its PoolRef) and this rank
   maps that pool (``direct_view``, the transport's ``view_remote``), a read or
   write is a plain memcpy, with no system call and no pages pinned, and an
   algorithm may work on the peer's buffer in place (``DirectHello.view``).
   A plain buffer (not in the pool) may be staged (``direct_stage``): the
   rank copies what its peers read into a block of its own pool, kept on the
   transport, and offers that block instead, so the peers' reads and writes
   are memcpy too; the rank copies what they wrote back into its buffer once
   they are done.  Two copies in the rank's own cache cost less than the
   kernel's copies of the peers' pages (process_vm_readv pins every page it
   copies) while the buffers and blocks of every rank fit half the last-level
   cache together (DIRECT_STAGE_BYTES); above that, cross-memory attach's
   single copy is the faster (at the whole cache, 2 ranks of 2M floats and 4
   of 1M, it already was: docs/algorithms.md).  Allreduce stages; broadcast
   and allgather do not (staging measured slower there: docs/algorithms.md).
3. Release (``direct_release``): every rank tells every other that it reads
   and writes nobody's buffer any more, and returns only once every peer has
   said the same, so no caller uses a buffer that a peer still reads or
   writes.
An algorithm begun by an async call (the allreduce: ``_allreduce.allreduce_begin``)
sends its hello in the call and takes the peers' later, as a poll finds them there
(``direct_hello_send``, ``direct_hello_take``), and its release likewise
(``direct_release_send``, ``direct_release_take``): the messages on the wire are the
same, so a rank that runs the operation whole meets one that runs it in steps.
"""

from libc.string cimport memcpy

import os

from pycollect._ext._pool cimport PoolRef, block_address, pool_block, pool_ref
from pycollect._ext._transport cimport *

# One read_remote or write_remote call of direct_read/direct_write copies at most this
# many bytes.
DIRECT_READ_BYTES = 1 << 20
cdef size_t _read_bytes = DIRECT_READ_BYTES


def _cache_bytes():
    """The last-level cache of the CPU this process starts on, as the kernel describes it
    (the C library's sysconf may count every cache of the chip); 32 MiB where it says
    nothing."""
    best_level, best = 0, 32 << 20
    base = "/sys/devices/system/cpu/cpu0/cache"
    try:
        names = os.listdir(base)
    except OSError:
        return best
    for name in names:
        try:
            with open(os.path.join(base, name, "level")) as f:
                level = int(f.read())
            with open(os.path.join(base, name, "size")) as f:
                size = f.read().strip()
        except (OSError, ValueError):
            continue
        digits = size.rstrip("KMG")
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[len(digits):], 1)
        if level > best_level and digits.isdigit():
            best_level, best = level, int(digits) * scale
    return best


# Plain buffers are staged in the pool (direct_stage) while every rank's buffer and
# staging block fit this many bytes together: half the last-level cache (the rest holds
# the chunks in flight and whatever else the ranks touch).
DIRECT_STAGE_BYTES = _cache_bytes() // 2
cdef size_t _stage_bytes = DIRECT_STAGE_BYTES


def set_stage_bytes(size_t nbytes):
    """Stage plain buffers while 2 x ranks x the buffer's bytes <= ``nbytes`` (0: never);
    returns the previous bound.  For tests and benchmarks that compare staging with
    cross-memory attach."""
    global _stage_bytes
    old = _stage_bytes
    _stage_bytes = nbytes
    return old


cdef inline bint _reads_every_peer(Transport t) noexcept nogil:
    """Whether this rank may read every peer's memory (the transport's can_read_remote)."""
    cdef int p
    for p in range(t.size):
        if p != t.rank and not t.can_read_remote(p):
            return 0
    return 1


cdef char* direct_stage(Transport t, const void* buf, size_t nbytes):
    """A block of the pool of at least ``nbytes`` to stage ``buf`` in, or NULL: ``buf`` lies
    in the pool already, the ranks' buffers and blocks would not fit half the cache
    together (2 x ranks x nbytes > DIRECT_STAGE_BYTES), some peer's memory is not
    readable (the algorithm sends messages instead), or the pool has no room.  The block
    stays on the transport for the next call, grown to a power of two when a larger
    buffer comes."""
    cdef PoolRef ref
    cdef size_t want = 4096
    if nbytes == 0 or nbytes > _stage_bytes // (2 * <size_t>t.size) or \
            pool_ref(buf, nbytes, &ref) or not _reads_every_peer(t):
        return NULL
    if t.staging is None or t.staging.nbytes < nbytes:
        while want < nbytes:
            want <<= 1
        t.staging = None                # its pages go back before the larger block is made
        t.staging = pool_block(want)
        if t.staging is None:
            return NULL
    return block_address(t.staging)


cdef void direct_offer(DirectHello* mine, const void* addr, size_t nbytes) noexcept nogil:
    """Fill this rank's hello for its buffer ``addr`` of ``nbytes``: address and pool."""
    mine.addr = <uint64_t>addr
    pool_ref(addr, nbytes, &mine.pool)
    mine.view = 0


cdef void direct_view(Transport t, int peer, DirectHello* theirs, size_t nbytes) noexcept nogil:
    """Set ``theirs.view``: ``peer``'s buffer of ``nbytes`` as this process maps it, or 0."""
    theirs.view = <uint64_t>t.view_remote(peer, &theirs.pool, theirs.addr, nbytes)


cdef int direct_hello(Transport t, const void* addr, size_t nbytes,
                      DirectHello* hello) noexcept nogil:
    """Exchange (address, readable, pool) with every peer into ``hello[peer]``; where every
    rank may read every other's memory, map the peers' buffers that lie in a pool.

    Returns 1 when every rank may read every other's memory, 0 when some may not, -1 on error.
    """
    cdef int P = t.size, r = t.rank, p
    cdef DirectHello* mine = &hello[r]
    direct_offer(mine, addr, nbytes)
    mine.readable = _reads_every_peer(t)
    for p in range(P):
        if p != r and (t.post_send(p, mine, sizeof(DirectHello)) < 0 or
                       t.post_recv(p, &hello[p], sizeof(DirectHello)) < 0):
            return -1
    if t.wait_all() < 0:
        return -1
    return _agree(t, nbytes, hello)


cdef bint direct_may_begin(Transport t) noexcept nogil:
    """Whether a direct algorithm may be begun by an async call (``direct_hello_send``):
    this rank may read every peer's memory, so that its peers' hellos will most likely say
    the same and the rest runs without messages."""
    return t.size > 1 and _reads_every_peer(t)


cdef int direct_hello_send(Transport t, const void* addr, size_t nbytes,
                           DirectHello* hello) noexcept nogil:
    """The first half of ``direct_hello``, for a direct algorithm begun by an async call
    (after ``t.begin``): this rank's hello into ``hello[rank]`` (which must stay untouched
    until the next ``t.begin``, which finishes what the channel did not take) and sent to
    every peer without waiting.  0, or -1 after set_error."""
    cdef int P = t.size, r = t.rank, p
    cdef DirectHello* mine = &hello[r]
    direct_offer(mine, addr, nbytes)
    mine.readable = _reads_every_peer(t)
    for p in range(P):
        if p != r and t.post_send_async(p, mine, sizeof(DirectHello)) < 0:
            return -1
    return 0


cdef int direct_hello_take(Transport t, size_t nbytes, DirectHello* hello) noexcept nogil:
    """The second half (after ``t.begin`` again): receive every peer's hello; as
    ``direct_hello`` returns."""
    cdef int P = t.size, r = t.rank, p
    for p in range(P):
        if p != r and t.post_recv(p, &hello[p], sizeof(DirectHello)) < 0:
            return -1
    if t.wait_all() < 0:
        return -1
    return _agree(t, nbytes, hello)


cdef int _agree(Transport t, size_t nbytes, DirectHello* hello) noexcept nogil:
    """Whether every rank's hello says it may read every peer (every rank comes to the same
    answer); if so, map the peers' buffers that lie in a pool."""
    cdef int P = t.size, r = t.rank, p, all_readable = 1
    for p in range(P):
        if not hello[p].readable:
            all_readable = 0
    for p in range(P):
        if p != r:
            if all_readable:
                direct_view(t, p, &hello[p], nbytes)
            else:
                hello[p].view = 0
    return all_readable


cdef int direct_read(Transport t, int peer, const DirectHello* theirs, size_t off, void* dst,
                     size_t nbytes) noexcept nogil:
    """Copy ``nbytes`` at ``off`` in ``peer``'s buffer into ``dst``, a piece at a time."""
    if theirs.view:
        memcpy(dst, <char*>theirs.view + off, nbytes)
        return 0
    return _pieces(t, peer, <char*>dst, theirs.addr + off, nbytes, 0, _read_bytes)


cdef int direct_write(Transport t, int peer, const DirectHello* theirs, size_t off,
                      const void* src, size_t nbytes, bint whole) noexcept nogil:
    """Copy ``nbytes`` at ``src`` to ``off`` in ``peer``'s buffer, a piece at a time, or
    with ``whole`` in one kernel copy (where nothing of it is read again soon, pieces only
    add system calls: the allgather's block)."""
    if theirs.view:
        memcpy(<char*>theirs.view + off, src, nbytes)
        return 0
    return _pieces(t, peer, <char*>src, theirs.addr + off, nbytes, 1,
                   nbytes if whole else _read_bytes)


cdef int _pieces(Transport t, int peer, char* local, uint64_t addr, size_t nbytes,
                 bint write, size_t piece) noexcept nogil:
    cdef size_t take
    cdef int rc
    while nbytes > 0:
        take = nbytes if nbytes < piece else piece
        rc = t.write_remote(peer, addr, local, take) if write \
            else t.read_remote(peer, local, addr, take)
        if rc < 0:
            return -1
        local += take
        addr += take
        nbytes -= take
    return 0


cdef int direct_release(Transport t) noexcept nogil:
    """Tell every peer this rank reads no more; return once every peer has said so."""
    cdef int p
    for p in range(t.size):
        if p != t.rank and (t.post_send(p, NULL, 0) < 0 or t.post_recv(p, NULL, 0) < 0):
            return -1
    return t.wait_all()


cdef int direct_release_send(Transport t) noexcept nogil:
    """The first half of ``direct_release``, for a direct algorithm begun by an async call:
    tell every peer this rank reads no more, without waiting.  0, or -1 after set_error."""
    cdef int p
    for p in range(t.size):
        if p != t.rank and t.post_send_async(p, NULL, 0) < 0:
            return -1
    return 0


cdef int direct_release_take(Transport t) noexcept nogil:
    """The second half (after ``t.begin`` again): return once every peer has said so."""
    cdef int p
    for p in range(t.size):
        if p != t.rank and t.post_recv(p, NULL, 0) < 0:
            return -1
    return t.wait_all()


cdef char* direct_staged(Transport t):
    """The staging block ``direct_stage`` last gave, or NULL: for the later steps of a
    direct algorithm begun by an async call.  Called with the GIL."""
    return NULL if t.staging is None else block_address(t.staging)
