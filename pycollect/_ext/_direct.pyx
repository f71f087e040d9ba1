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
   broadcast's root).
3. Release (``direct_release``): every rank tells every other that it reads
   and writes nobody's buffer any more, and returns only once every peer has
   said the same, so no caller uses a buffer that a peer still reads or
   writes.
"""

from pycollect._ext._transport cimport *

# One read_remote or write_remote call of direct_read/direct_write copies at most this
# many bytes.
DIRECT_READ_BYTES = 1 << 20
cdef size_t _read_bytes = DIRECT_READ_BYTES


cdef int direct_hello(Transport t, const void* addr, DirectHello* hello) noexcept nogil:
    """Exchange (address, readable) with every peer into ``hello[peer]``.

    Returns 1 when every rank may read every other's memory, 0 when some may not, -1 on error.
    """
    cdef int P = t.size, r = t.rank, p, all_readable
    cdef DirectHello* mine = &hello[r]
    mine.addr = <uint64_t>addr
    mine.readable = 1
    for p in range(P):
        if p != r and not t.can_read_remote(p):
            mine.readable = 0
    for p in range(P):
        if p != r and (t.post_send(p, mine, sizeof(DirectHello)) < 0 or
                       t.post_recv(p, &hello[p], sizeof(DirectHello)) < 0):
            return -1
    if t.wait_all() < 0:
        return -1
    all_readable = 1
    for p in range(P):
        if not hello[p].readable:
            all_readable = 0
    return all_readable


cdef int direct_read(Transport t, int peer, void* dst, uint64_t addr,
                     size_t nbytes) noexcept nogil:
    """Copy ``nbytes`` at ``addr`` in ``peer``'s memory into ``dst``, a piece at a time."""
    return _pieces(t, peer, <char*>dst, addr, nbytes, 0)


cdef int direct_write(Transport t, int peer, uint64_t addr, const void* src,
                      size_t nbytes) noexcept nogil:
    """Copy ``nbytes`` at ``src`` to ``addr`` in ``peer``'s memory, a piece at a time."""
    return _pieces(t, peer, <char*>src, addr, nbytes, 1)


cdef int _pieces(Transport t, int peer, char* local, uint64_t addr, size_t nbytes,
                 bint write) noexcept nogil:
    cdef size_t take
    cdef int rc
    while nbytes > 0:
        take = nbytes if nbytes < _read_bytes else _read_bytes
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
