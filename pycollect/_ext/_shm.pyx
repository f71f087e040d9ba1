"""Shared-memory rings and cross-memory attach, the same-host half of the transport.

A Segment is one file in /dev/shm per host and run, mapped by every local
rank, holding one single-producer single-consumer byte ring per ordered pair
of local ranks.  A ring carries exactly what a socket would (message headers
and payloads), so the transport's framing and checks are the same for both.
The segment is unlinked as soon as every local rank has mapped it: nothing is
left in /dev/shm, even after a crash.

Large messages travel with one copy instead of two: the sender puts only the
header and its buffer's address in the ring, the receiver copies the payload
straight from the sender's memory with process_vm_readv and acknowledges it.
"""

from libc.errno cimport errno
from libc.stdint cimport uint32_t, uint64_t
from libc.string cimport memcpy
from posix.fcntl cimport O_CREAT, O_EXCL, O_RDWR, open as c_open
from posix.mman cimport MAP_FAILED, MAP_SHARED, PROT_READ, PROT_WRITE, mmap, munmap
from posix.types cimport pid_t
from posix.unistd cimport close as c_close, ftruncate, unlink
from posix.uio cimport iovec

import os

cdef extern from "_sys.h" nogil:
    uint64_t pc_load_u64(uint64_t* p)
    void pc_store_u64(uint64_t* p, uint64_t v)

cdef extern from "<sys/uio.h>" nogil:
    ssize_t process_vm_readv(pid_t pid, const iovec* local, unsigned long liovcnt,
                             const iovec* remote, unsigned long riovcnt, unsigned long flags)

RING_HEADER_BYTES = sizeof(RingHeader)


cdef void ring_attach(Ring* r, char* base, uint64_t ring_bytes) noexcept nogil:
    r.hdr = <RingHeader*>base
    r.data = base + sizeof(RingHeader)
    r.size = ring_bytes


cdef uint64_t ring_used(Ring* r) noexcept nogil:
    return pc_load_u64(&r.hdr.head) - pc_load_u64(&r.hdr.tail)


cdef inline void _copy_in(Ring* r, uint64_t pos, const char* src, size_t n) noexcept nogil:
    cdef uint64_t off = pos & (r.size - 1)
    cdef uint64_t first = r.size - off
    if first >= n:
        memcpy(r.data + off, src, n)
    else:
        memcpy(r.data + off, src, first)
        memcpy(r.data, src + first, n - first)


cdef inline void _copy_out(Ring* r, uint64_t pos, char* dst, size_t n) noexcept nogil:
    cdef uint64_t off = pos & (r.size - 1)
    cdef uint64_t first = r.size - off
    if first >= n:
        memcpy(dst, r.data + off, n)
    else:
        memcpy(dst, r.data + off, first)
        memcpy(dst + first, r.data, n - first)


cdef size_t ring_write(Ring* r, const iovec* iov, int cnt) noexcept nogil:
    """Append as much of ``iov`` as fits; return the bytes written."""
    cdef uint64_t head = r.hdr.head
    cdef uint64_t room = r.size - (head - pc_load_u64(&r.hdr.tail))
    cdef size_t total = 0, n
    cdef int i
    for i in range(cnt):
        if room == 0:
            break
        n = iov[i].iov_len if iov[i].iov_len < room else room
        _copy_in(r, head + total, <const char*>iov[i].iov_base, n)
        total += n
        room -= n
    if total:
        pc_store_u64(&r.hdr.head, head + total)
    return total


cdef size_t ring_read(Ring* r, iovec* iov, int cnt) noexcept nogil:
    """Consume into ``iov`` as much as is there; return the bytes read."""
    cdef uint64_t tail = r.hdr.tail
    cdef uint64_t avail = pc_load_u64(&r.hdr.head) - tail
    cdef size_t total = 0, n
    cdef int i
    for i in range(cnt):
        if avail == 0:
            break
        n = iov[i].iov_len if iov[i].iov_len < avail else avail
        _copy_out(r, tail + total, <char*>iov[i].iov_base, n)
        total += n
        avail -= n
    if total:
        pc_store_u64(&r.hdr.tail, tail + total)
    return total


cdef size_t ring_peek(Ring* r, void* out, size_t n) noexcept nogil:
    """Copy up to ``n`` bytes from the front without consuming them."""
    cdef uint64_t tail = r.hdr.tail
    cdef uint64_t avail = pc_load_u64(&r.hdr.head) - tail
    if avail < n:
        n = avail
    _copy_out(r, tail, <char*>out, n)
    return n


cdef ssize_t cma_read(int pid, void* local, uint64_t remote, size_t n) noexcept nogil:
    """Copy ``n`` bytes at ``remote`` in process ``pid`` into ``local``; -1 and errno on failure."""
    cdef iovec l, rm
    l.iov_base = local
    l.iov_len = n
    rm.iov_base = <void*>remote
    rm.iov_len = n
    return process_vm_readv(pid, &l, 1, &rm, 1, 0)


def cma_probe(int pid, unsigned long long address, bytes expected):
    """True if this process can read ``expected`` at ``address`` in process ``pid``."""
    cdef bytearray got = bytearray(len(expected))
    cdef char* dst = got
    cdef size_t want = len(expected)
    cdef ssize_t n
    with nogil:
        n = cma_read(pid, dst, address, want)
    return n == len(expected) and bytes(got) == expected


cdef class Segment:
    """One mapped /dev/shm file holding the rings of every local pair."""

    def __cinit__(self):
        self.base = NULL
        self.length = 0

    def __init__(self, str path, size_t length, bint create):
        cdef int fd
        cdef bytes bpath = path.encode()
        fd = c_open(bpath, O_RDWR | (O_CREAT | O_EXCL if create else 0), 0o600)
        if fd < 0:
            raise OSError(errno, os.strerror(errno), path)
        try:
            if create and ftruncate(fd, length) != 0:
                raise OSError(errno, os.strerror(errno), path)
            if not create and os.fstat(fd).st_size < length:
                raise OSError("shared segment %s is shorter than %d bytes" % (path, length))
            self.base = <char*>mmap(NULL, length, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)
            if <void*>self.base == MAP_FAILED:
                self.base = NULL
                raise OSError(errno, os.strerror(errno), "mmap " + path)
        finally:
            c_close(fd)
        self.length = length
        self.path = path

    def unlink(self):
        """Remove the name (the mappings live on until every rank unmaps)."""
        cdef bytes bpath = self.path.encode()
        unlink(bpath)

    @property
    def address(self):
        return <size_t>self.base

    def __dealloc__(self):
        if self.base != NULL:
            munmap(self.base, self.length)
            self.base = NULL
