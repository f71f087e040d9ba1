"""Shared buffers: memory that every process of the host may map (_pool.pxd).

A ``Pool`` is one memfd file, sparse (a page exists once touched), mapped
once with MAP_SHARED; ``Pool.block`` carves page-aligned blocks out of it
(first fit from a free list that merges neighbours) and a freed block's pages
go back to the kernel (a hole punched in the file).  ``pycollect.shared``
makes this process's pool and hands its blocks to users as NumPy arrays.

A direct algorithm (_direct.pyx) sends each peer, beside its buffer's
address, the buffer's PoolRef (``pool_ref``).  The peer maps the owner's pool
through /proc/<pid>/fd/<fd> (``pool_view``: the permission that cross-memory
attach needs, too) and then reduces and copies with plain loads and stores,
as a single process would, where process_vm_readv/writev would copy every
byte through the kernel first.  A view is kept until the process ends, so it
never goes away under a thread that uses it; the table of views is
append-only, read without a lock and extended under a spin lock.
"""

from libc.errno cimport errno
from libc.stdint cimport int64_t, uint32_t, uint64_t
from libc.stdio cimport snprintf
from libc.string cimport memset, strerror
from posix.fcntl cimport O_CLOEXEC, O_RDWR, open as c_open
from posix.mman cimport MAP_FAILED, MAP_SHARED, PROT_READ, PROT_WRITE, mmap, munmap
from posix.stat cimport fstat, struct_stat
from posix.unistd cimport close as c_close, ftruncate, getpid

from cpython.buffer cimport PyBuffer_FillInfo

import threading
from mmap import PAGESIZE

from pycollect import settings

cdef extern from "_sys.h" nogil:
    uint32_t pc_exchange_u32(uint32_t* p, uint32_t v)
    void pc_store_u32_sc(uint32_t* p, uint32_t v)
    uint32_t pc_load_u32(uint32_t* p)
    void pc_pause()
    void pc_count_u64(uint64_t* p)

cdef extern from "<sys/mman.h>" nogil:
    int memfd_create(const char* name, unsigned int flags)
    enum:
        MFD_CLOEXEC
        MAP_NORESERVE

cdef extern from "<fcntl.h>" nogil:
    int fallocate(int fd, int mode, long offset, long length)
    enum:
        FALLOC_FL_KEEP_SIZE
        FALLOC_FL_PUNCH_HOLE

cdef enum:
    VIEWS_MAX = 256     # peers' pools one process maps at most (then: cross-memory attach)


cdef struct View:
    int pid
    int failed          # mapping was tried and refused: do not try again
    uint64_t ino
    uint64_t base       # the pool's address in its owner
    uint64_t nbytes
    char* local         # the same pages here


# This process's pool (base 0: none yet), set by Pool.current for the pool that
# pycollect.shared makes current.
cdef PoolRef _mine
memset(&_mine, 0, sizeof(PoolRef))

cdef View _views[VIEWS_MAX]
cdef uint32_t _nviews = 0       # entries below this are complete (a release store)
cdef uint32_t _views_lock = 0
cdef uint64_t _hits = 0         # views handed out (a test's witness that they are used)


cdef inline bint _within(const PoolRef* ref, uint64_t addr, size_t nbytes) noexcept nogil:
    """Whether [addr, addr + nbytes) lies in the pool ``ref`` (none: base 0)."""
    return ref.base != 0 and addr >= ref.base and nbytes <= ref.nbytes \
        and addr - ref.base <= ref.nbytes - nbytes


cdef int pool_ref(const void* addr, size_t nbytes, PoolRef* out) noexcept nogil:
    if _within(&_mine, <uint64_t>addr, nbytes):
        out[0] = _mine
        return 1
    memset(out, 0, sizeof(PoolRef))
    return 0


cdef char* pool_view(int pid, const PoolRef* ref, uint64_t addr, size_t nbytes) noexcept nogil:
    cdef View* v
    if pid <= 0 or not _within(ref, addr, nbytes):
        return NULL
    v = _find(pid, ref)
    if v == NULL:
        v = _map(pid, ref)
    if v == NULL or v.failed:
        return NULL
    pc_count_u64(&_hits)       # thread ranks view at once: a count that loses none
    return v.local + (addr - ref.base)


cdef View* _find(int pid, const PoolRef* ref) noexcept nogil:
    cdef uint32_t i, n = pc_load_u32(&_nviews)
    for i in range(n):
        if _views[i].pid == pid and _views[i].ino == ref.ino and _views[i].base == ref.base \
                and _views[i].nbytes == ref.nbytes:
            return &_views[i]
    return NULL


cdef View* _map(int pid, const PoolRef* ref) noexcept nogil:
    """Map ``pid``'s pool ``ref`` and add it to the table (a failed entry where it cannot be)."""
    cdef View* v
    cdef char path[64]
    cdef int fd
    cdef struct_stat st
    cdef void* p
    while pc_exchange_u32(&_views_lock, 1):
        pc_pause()
    v = _find(pid, ref)                 # another thread may have mapped it meanwhile
    if v == NULL and _nviews < VIEWS_MAX:
        v = &_views[_nviews]
        v.pid = pid
        v.ino = ref.ino
        v.base = ref.base
        v.nbytes = ref.nbytes
        v.local = NULL
        v.failed = 1
        snprintf(path, sizeof(path), "/proc/%d/fd/%lld", pid, <long long>ref.fd)
        fd = c_open(path, O_RDWR | O_CLOEXEC)
        if fd >= 0:
            if fstat(fd, &st) == 0 and <uint64_t>st.st_ino == ref.ino \
                    and <uint64_t>st.st_size >= ref.nbytes:
                p = mmap(NULL, ref.nbytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_NORESERVE,
                         fd, 0)
                if p != MAP_FAILED:
                    v.local = <char*>p
                    v.failed = 0
            c_close(fd)
        pc_store_u32_sc(&_nviews, _nviews + 1)
    pc_store_u32_sc(&_views_lock, 0)
    return v


def view_stats():
    """(peer pools mapped, views handed out): how often direct algorithms used plain loads."""
    cdef uint32_t i, mapped = 0
    for i in range(pc_load_u32(&_nviews)):
        mapped += not _views[i].failed
    return mapped, _hits


# This process's pool, made by process_pool on first use (and again after a fork).
_made_lock = threading.Lock()
_made = None
_made_pid = 0
_made_error = None      # the OSError of a pool that could not be made, for every later ask


def process_pool():
    """This process's pool (``PYCOLLECT_POOL_BYTES`` of address space), made and made current
    on first use and again in a forked child; OSError where it cannot be made."""
    global _made, _made_pid, _made_error
    with _made_lock:
        if _made is None or _made_pid != getpid():
            if _made_error is not None and _made_pid == getpid():
                raise _made_error
            _made_pid = getpid()
            try:
                pool = Pool(settings.get("PYCOLLECT_POOL_BYTES"), PAGESIZE)
            except OSError as exc:
                _made, _made_error = None, exc
                raise
            pool.current()
            _made, _made_error = pool, None
        return _made


def made_pool():
    """This process's pool if process_pool made it here (not in a parent), else None."""
    with _made_lock:
        return _made if _made is not None and _made_pid == getpid() else None


cdef object pool_block(size_t nbytes):
    try:
        return process_pool().block(nbytes)
    except OSError:
        return None


cdef char* block_address(object block) noexcept:
    return (<Block>block).ptr


cdef class Pool:
    """One memfd file of ``nbytes`` mapped here; ``block(n)`` carves arrays' memory out of it.

    ``current`` makes it the pool whose blocks ``pool_ref`` recognises (one per process).
    """

    cdef int fd
    cdef char* ptr
    cdef readonly size_t nbytes
    cdef readonly size_t page
    cdef size_t top             # bytes below it are handed out or on the free list
    cdef list free_list         # [offset, length] pairs, sorted, never adjacent
    cdef object lock
    cdef uint64_t ino
    cdef int pid                # the owner: a forked child frees nothing of its parent's

    def __cinit__(self):
        self.fd = -1
        self.ptr = NULL

    def __init__(self, size_t nbytes, size_t page):
        cdef struct_stat st
        cdef void* p
        self.page = page
        self.pid = getpid()
        self.nbytes = (nbytes + page - 1) // page * page
        self.top = 0
        self.free_list = []
        self.lock = threading.Lock()
        self.fd = memfd_create(b"pycollect-pool", MFD_CLOEXEC)
        if self.fd < 0:
            raise OSError(errno, "memfd_create: %s" % strerror(errno).decode())
        if ftruncate(self.fd, self.nbytes) < 0 or fstat(self.fd, &st) < 0:
            raise OSError(errno, "ftruncate to %d bytes: %s" % (self.nbytes,
                                                              strerror(errno).decode()))
        self.ino = st.st_ino
        p = mmap(NULL, self.nbytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_NORESERVE,
                 self.fd, 0)
        if p == MAP_FAILED:
            raise OSError(errno, "mmap of %d bytes: %s" % (self.nbytes, strerror(errno).decode()))
        self.ptr = <char*>p

    def current(self):
        """Make this the pool whose blocks direct algorithms offer their peers to map."""
        _mine.base = <uint64_t>self.ptr
        _mine.nbytes = self.nbytes
        _mine.ino = self.ino
        _mine.fd = self.fd

    @property
    def used(self):
        """Bytes handed out as blocks now."""
        with self.lock:
            return self.top - sum(length for _, length in self.free_list)

    def block(self, size_t nbytes):
        """A Block of at least ``nbytes`` (whole pages), or None where the pool has no room."""
        cdef size_t want = nbytes if nbytes > 0 else 1
        cdef Block b
        want = (want + self.page - 1) // self.page * self.page
        with self.lock:
            for i, (off, length) in enumerate(self.free_list):
                if length >= want:
                    if length == want:
                        del self.free_list[i]
                    else:
                        self.free_list[i] = [off + want, length - want]
                    break
            else:
                if self.nbytes - self.top < want:
                    return None
                off = self.top
                self.top += want
        b = Block.__new__(Block)
        b.pool = self
        b.offset = off
        b.length = want
        b.nbytes = nbytes
        b.ptr = self.ptr + <size_t>off
        return b

    cdef void give_back(self, size_t off, size_t length):
        """Return a block: its pages to the kernel, its range to the free list."""
        if getpid() != self.pid:
            return
        fallocate(self.fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, off, length)
        with self.lock:
            fl = self.free_list
            i = 0
            while i < len(fl) and fl[i][0] < off:
                i += 1
            fl.insert(i, [off, length])
            if i + 1 < len(fl) and fl[i][0] + fl[i][1] == fl[i + 1][0]:
                fl[i][1] += fl[i + 1][1]
                del fl[i + 1]
            if i > 0 and fl[i - 1][0] + fl[i - 1][1] == fl[i][0]:
                fl[i - 1][1] += fl[i][1]
                del fl[i]
                i -= 1
            if fl[i][0] + fl[i][1] == self.top:     # the last block: the top comes down
                self.top = fl[i][0]
                del fl[i]

    def __dealloc__(self):
        # Blocks hold their pool, so none is left; peers' views keep the pages they map.
        if self.ptr != NULL:
            if _mine.base == <uint64_t>self.ptr:
                memset(&_mine, 0, sizeof(PoolRef))
            munmap(self.ptr, self.nbytes)
        if self.fd >= 0:
            c_close(self.fd)


cdef class Block:
    """``nbytes`` of a Pool (a buffer object: ``numpy.frombuffer`` takes it); freed with it."""

    cdef Pool pool
    cdef char* ptr
    cdef size_t offset
    cdef size_t length
    cdef readonly size_t nbytes

    def __getbuffer__(self, Py_buffer* view, int flags):
        PyBuffer_FillInfo(view, self, self.ptr, self.nbytes, 0, flags)

    def __dealloc__(self):
        if self.pool is not None:
            self.pool.give_back(self.offset, self.length)
