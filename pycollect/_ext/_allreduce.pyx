"""Allreduce: recursive doubling, and the ring family (ring and ring_chunked).

Recursive doubling (latency-bound messages): with P2 the largest power of
two <= size, ranks P2 + i first fold their buffer into rank i.  Then, for
mask = 1, 2, 4, ... < P2, rank r swaps its whole partial result with rank
r ^ mask and combines the two, lower rank's operand first, so both partners
hold the same bits.  Finally rank i hands the result back to rank P2 + i.
log2(P2) exchanges (+2 hops when size is not a power of two), each one
message each way: at 2 ranks a single simultaneous swap.

Halving-doubling (Rabenseifner; bandwidth-optimal in log steps): after the
same fold as above, rank r halves its working range log2(P2) times, each time
keeping one half and swapping the other with partner r ^ mask (mask from
P2/2 down to 1) and reducing what it receives: a reduce-scatter in log2(P2)
steps that moves (P2-1)/P2 of the buffer.  Then the ranges double back
(mask from 1 up to P2/2), each rank swapping everything it holds, until all
hold everything; the extra ranks get the result last.  Every element is
reduced along one tree, lower rank's operand first, so all ranks hold the
same bits.

BCube with base b generalises halving-doubling to radix b (a base larger
than the group is cut to its size): with PB the
largest power of b <= size (extra ranks fold in and out as above), rank r
writes its index in base b; in step j the b ranks that differ only in digit
j cut their current range into b parts, each keeps the part of its own digit
and receives it from the b-1 others (reduce-scatter in log_b(PB) steps of
b-1 concurrent messages), then the ranges grow back the same way.  Fewer,
wider steps than halving-doubling: b = 2 is halving-doubling.

``ring`` and ``ring_chunked`` run the ring's reduce-scatter and allgather
(see _ring.pyx).  Every chunk is reduced along one chain and then copied, so
all ranks end with the same bits even for floating-point sums.  ``ring``
sends each chunk as one message (fewest messages); ``ring_chunked`` cuts
chunks into segments so reduction overlaps the wire (the choice for large
buffers).  Its segment is the context's ``segment_bytes``, except at 2 ranks
below PAIR_FINE_BELOW (16 MiB), where it is at most PAIR_SEGMENT_BYTES (128
KiB): with a window of 4 segments each way, what the sockets hold then stays
in cache, and the kernel's copies into and out of them run about twice as
fast (2 ranks over loopback TCP, 1M floats: 626-915 against 1285-1320 us per
call; from 16 MiB 1 MiB segments are ahead again, by 8%: docs/performance.md).
AVG sums and divides once at the end.

``direct`` (every rank on one host, each able to read the others' memory
with cross-memory attach) moves no data through messages at all.  Rank r
owns slice r of the buffer (the same near-equal split as the ring's chunks).
1. Hello: every rank sends every other its buffer's address and whether it
   may read every peer's memory (the transport's ``can_read_remote``).  If any
   rank says no, every rank knows it and all of them run halving-doubling
   instead, in the same operation.
2. Reduce and spread: rank r walks its slice in chunks of at most
   DIRECT_CHUNK_BYTES where every peer's buffer is mapped here, else
   DIRECT_KERNEL_CHUNK_BYTES (each kernel copy has a fixed cost of its own),
   and at most segment_bytes; for each chunk it reads
   the same chunk of every peer's buffer (the transport's ``read_remote``,
   peers r+1, r+2, ... in turn) into one scratch chunk and reduces it into
   its own buffer at once, then writes the reduced chunk, still in cache,
   over the same chunk of every peer's buffer (``write_remote``).  Slice r
   of every buffer is touched by rank r alone (a peer's chunk is read before
   it is written), so every rank ends with the same bits.  A peer whose
   buffer lies in its pool of shared buffers (``pycollect.empty``) and is
   mapped here (``DirectHello.view``) is reduced from in place and written
   with memcpy: no scratch copy, no system call.
3. Finished: every rank tells every peer it reads and writes nobody's buffer
   any more; a rank returns (and its caller may use the buffer) only once
   every peer has said so.
Steps 1 and 3 are the shared ones of _direct.pyx.  Each rank reads (P-1)/P
of the buffer from the peers, reduces it, and writes (P-1)/P of it to them
from cache; two rounds of small messages carry the synchronisation.  A peer
that dies makes a read or write fail (process_vm_readv/writev:
ESRCH/EFAULT): PeerError naming it.

``flags`` (every pair on one host's shared memory, up to _flags.FLAGS_MAX_BYTES):
every rank copies its buffer into its slot of the transport's flag area and
posts its flag; once all have, each reduces every slot in rank order into its
buffer (_flags.pyx).  Where the transport has no flag area, or the buffer does
not fit, ``flags`` runs recursive doubling.
"""

from pycollect._ext._algo cimport (chunk_length, chunk_offset, exchange_finish, exchange_fits,
                                   exchange_post)
from pycollect._ext._ring cimport (Layout, layout_even, layout_free, ring_allgather,
                                   ring_reduce_scatter)
from pycollect._ext._buffer cimport View, pin
from pycollect._ext._direct cimport (BEGUN_DIRECT, BEGUN_DIRECT_STAGED, DIRECT_BEGIN_BYTES,
                                     DIRECT_CHUNK_BYTES, DIRECT_KERNEL_CHUNK_BYTES,
                                     DirectHello, direct_hello, direct_hello_send,
                                     direct_hello_take, direct_may_begin, direct_release,
                                     direct_release_send, direct_release_take, direct_stage,
                                     direct_staged, direct_write)
from pycollect._ext._dtypes cimport OP_AVG
from pycollect._ext._flags cimport (Flags, flags_allreduce, flags_allreduce_end,
                                    flags_ends_at_once, flags_fit, flags_post,
                                    flags_slot_free)
from pycollect._ext._reduce cimport check_op, divide_by, reduce_into
from pycollect._ext._transport cimport *
from libc.stdint cimport uint64_t
from libc.stdlib cimport free, malloc
from libc.string cimport memcpy

from pycollect.errors import InvalidArgument

ALGORITHMS = {"recursive_doubling": ALGO_RECURSIVE_DOUBLING,
              "halving_doubling": ALGO_HALVING_DOUBLING, "bcube": ALGO_BCUBE,
              "ring": ALGO_RING, "ring_chunked": ALGO_RING_CHUNKED, "direct": ALGO_DIRECT,
              "flags": ALGO_FLAGS}
DEFAULT_BCUBE_BASE = 4

# The chunk of the direct allreduce where every peer's buffer is mapped here.
cdef size_t _mapped_chunk = DIRECT_CHUNK_BYTES


def set_mapped_chunk_bytes(size_t nbytes):
    """The direct allreduce's chunk where every peer's buffer is mapped here (at least one
    element); returns the previous one.  For benchmarks that compare chunk sizes."""
    global _mapped_chunk
    old = _mapped_chunk
    _mapped_chunk = nbytes
    return old

cdef enum:
    MAX_BCUBE_BASE = 16
    MAX_BCUBE_STEPS = 64
    PAIR_SEGMENT_BYTES = 128 << 10      # ring_chunked's segment at 2 ranks ...
    PAIR_FINE_BELOW = 16 << 20          # ... for buffers below this

BCUBE_BASES = range(2, MAX_BCUBE_BASE + 1)     # the bases bcube takes


cdef inline size_t _ring_segment(size_t segment_bytes, size_t nbytes, int P) noexcept nogil:
    """ring_chunked's segment in bytes: ``segment_bytes``, or at 2 ranks and below
    PAIR_FINE_BELOW at most PAIR_SEGMENT_BYTES (see the module notes)."""
    if P == 2 and nbytes < PAIR_FINE_BELOW and segment_bytes > PAIR_SEGMENT_BYTES:
        return PAIR_SEGMENT_BYTES
    return segment_bytes


def ring_segment_bytes(size_t segment_bytes, size_t nbytes, int size):
    """The segment in bytes that ring_chunked cuts a buffer of ``nbytes`` into at world
    size ``size`` where the context's is ``segment_bytes`` (for tests and benchmarks)."""
    return _ring_segment(segment_bytes, nbytes, size)

cdef int fold_in(Transport t, char* buf, char* other, size_t n, size_t es, int dtype, int op,
                 int core) noexcept nogil:
    """Ranks from ``core`` up hand their buffer to rank r mod core, which reduces them in.

    Returns 1 on such an extra rank (it then waits in fold_out), 0 on a core rank, -1 on error.
    """
    cdef int P = t.size, r = t.rank, k
    if r >= core:
        return -1 if t.post_send(r % core, buf, n * es) < 0 else 1
    k = r + core
    while k < P:
        if t.wait(t.post_recv(k, other, n * es)) < 0:
            return -1
        reduce_into(buf, buf, other, n, dtype, op)
        k += core
    return 0


cdef int fold_out(Transport t, char* buf, size_t nbytes, int core, int extra) noexcept nogil:
    """Core ranks hand the result back to the extra ranks that folded into them."""
    cdef int P = t.size, r = t.rank, k
    if extra:
        if t.wait(t.post_recv(r % core, buf, nbytes)) < 0:
            return -1
        return t.wait_all()     # our fold-in send, if it is still being acknowledged
    k = r + core
    while k < P:
        if t.post_send(k, buf, nbytes) < 0:
            return -1
        k += core
    return t.wait_all()


cdef int recursive_doubling_allreduce(Transport t, char* buf, size_t n, size_t es, int dtype,
                                      int op) noexcept nogil:
    """Allreduce in place by pairwise exchanges of the whole buffer."""
    cdef int P = t.size, r = t.rank, p2 = 1, mask, partner, extra
    cdef size_t nbytes = n * es
    cdef char* other
    if P > 1 and n > 0:
        while p2 * 2 <= P:
            p2 *= 2
        other = t.scratch(nbytes)
        if other == NULL:
            return -1
        extra = fold_in(t, buf, other, n, es, dtype, op, p2)
        if extra < 0:
            return -1
        if not extra:
            mask = 1
            while mask < p2:
                partner = r ^ mask
                if t.post_send(partner, buf, nbytes) < 0:
                    return -1
                if t.post_recv(partner, other, nbytes) < 0 or t.wait_all() < 0:
                    return -1
                if r < partner:
                    reduce_into(buf, buf, other, n, dtype, op)
                else:
                    reduce_into(buf, other, buf, n, dtype, op)
                mask <<= 1
        if fold_out(t, buf, nbytes, p2, extra) < 0:
            return -1
    return 0


cdef int halving_doubling_allreduce(Transport t, char* buf, size_t n, size_t es, int dtype,
                                    int op) noexcept nogil:
    """Allreduce in place: recursive-halving reduce-scatter, recursive-doubling allgather."""
    cdef int P = t.size, r = t.rank, p2 = 1, mask, partner, steps = 0, k, extra
    cdef size_t lo = 0, hi = n, mid, keep_lo, keep_hi, give_lo, give_hi
    cdef size_t los[32]
    cdef size_t his[32]
    cdef char* other
    if P > 1 and n > 0:
        while p2 * 2 <= P:
            p2 *= 2
        other = t.scratch(n * es)
        if other == NULL:
            return -1
        extra = fold_in(t, buf, other, n, es, dtype, op, p2)
        if extra < 0:
            return -1
        if not extra:
            # Reduce-scatter: halve the range, keeping the half on our side of mask.
            mask = p2 >> 1
            while mask > 0:
                partner = r ^ mask
                mid = lo + (hi - lo) // 2
                if r < partner:
                    keep_lo, keep_hi, give_lo, give_hi = lo, mid, mid, hi
                else:
                    keep_lo, keep_hi, give_lo, give_hi = mid, hi, lo, mid
                if t.post_send(partner, buf + give_lo * es, (give_hi - give_lo) * es) < 0:
                    return -1
                if t.post_recv(partner, other + keep_lo * es, (keep_hi - keep_lo) * es) < 0:
                    return -1
                if t.wait_all() < 0:
                    return -1
                if r < partner:
                    reduce_into(buf + keep_lo * es, buf + keep_lo * es, other + keep_lo * es,
                                keep_hi - keep_lo, dtype, op)
                else:
                    reduce_into(buf + keep_lo * es, other + keep_lo * es, buf + keep_lo * es,
                                keep_hi - keep_lo, dtype, op)
                los[steps] = lo
                his[steps] = hi
                steps += 1
                lo, hi = keep_lo, keep_hi
                mask >>= 1
            # Allgather: retrace the halvings, swapping what each side holds.
            mask = 1
            k = steps - 1
            while mask < p2:
                partner = r ^ mask
                if t.post_send(partner, buf + lo * es, (hi - lo) * es) < 0:
                    return -1
                if lo == los[k]:
                    give_lo, give_hi = hi, his[k]
                else:
                    give_lo, give_hi = los[k], lo
                if t.post_recv(partner, buf + give_lo * es, (give_hi - give_lo) * es) < 0:
                    return -1
                if t.wait_all() < 0:
                    return -1
                lo, hi = los[k], his[k]
                k -= 1
                mask <<= 1
        if fold_out(t, buf, n * es, p2, extra) < 0:
            return -1
    return 0


cdef int bcube_allreduce(Transport t, char* buf, size_t n, size_t es, int dtype, int op,
                         int base) noexcept nogil:
    """Allreduce in place over base-``base`` digit groups (see the module notes)."""
    cdef int P = t.size, r = t.rank, pb = 1, steps = 0, d, mine, stride, peer, k, extra
    cdef size_t lo = 0, hi = n, span, part_lo, part_len
    cdef size_t los[MAX_BCUBE_STEPS]
    cdef size_t his[MAX_BCUBE_STEPS]
    cdef int strides[MAX_BCUBE_STEPS]
    cdef char* other
    if P > 1 and n > 0:
        if base > P:
            base = P        # one step of all ranks, instead of folding all into rank 0
        while pb * base <= P:
            pb *= base
        other = t.scratch(base * (n // base + 1) * es)
        if other == NULL:
            return -1
        # Extra ranks (several per core rank when base > 2) fold into rank r mod pb.
        extra = fold_in(t, buf, other, n, es, dtype, op, pb)
        if extra < 0:
            return -1
        if not extra:
            # Reduce-scatter: one digit per step, largest stride first.
            stride = pb // base
            while stride > 0:
                mine = (r // stride) % base
                span = hi - lo
                part_lo = lo + chunk_offset(span, base, mine)
                part_len = chunk_length(span, base, mine)
                for d in range(base):
                    if d == mine:
                        continue
                    peer = r + (d - mine) * stride
                    if t.post_send(peer, buf + (lo + chunk_offset(span, base, d)) * es,
                                   chunk_length(span, base, d) * es) < 0:
                        return -1
                    if t.post_recv(peer, other + d * part_len * es, part_len * es) < 0:
                        return -1
                if t.wait_all() < 0:
                    return -1
                for d in range(base):
                    if d != mine:
                        reduce_into(buf + part_lo * es, buf + part_lo * es,
                                    other + d * part_len * es, part_len, dtype, op)
                los[steps] = lo
                his[steps] = hi
                strides[steps] = stride
                steps += 1
                lo, hi = part_lo, part_lo + part_len
                stride //= base
            # Allgather: retrace the steps, each rank sharing the part it holds.
            for k in range(steps - 1, -1, -1):
                stride = strides[k]
                mine = (r // stride) % base
                span = his[k] - los[k]
                for d in range(base):
                    if d == mine:
                        continue
                    peer = r + (d - mine) * stride
                    if t.post_send(peer, buf + lo * es, (hi - lo) * es) < 0:
                        return -1
                    if t.post_recv(peer, buf + (los[k] + chunk_offset(span, base, d)) * es,
                                   chunk_length(span, base, d) * es) < 0:
                        return -1
                if t.wait_all() < 0:
                    return -1
                lo, hi = los[k], his[k]
        if fold_out(t, buf, n * es, pb, extra) < 0:
            return -1
    return 0


cdef int ring_allreduce(Transport t, char* buf, size_t n, size_t es, int dtype, int op,
                        size_t seg, int window) noexcept nogil:
    """Allreduce in place over the ring; seg is the segment length in elements."""
    cdef Layout lay
    cdef int rc = 0
    if t.size > 1 and n > 0:
        if seg < 1:
            seg = 1
        if layout_even(&lay, n, t.size, 0) < 0:
            return t.set_error(ERR_INTERNAL, -1, "calloc", 0, "out of memory")
        rc = ring_reduce_scatter(t, buf, &lay, es, dtype, op, seg, window)
        if rc == 0:
            rc = ring_allgather(t, buf, &lay, es, seg)
        layout_free(&lay)
        if rc < 0:
            return -1
    return 0


cdef inline bint _all_viewed(const DirectHello* hello, int P, int r) noexcept nogil:
    """Every peer's buffer is mapped here (``DirectHello.view``): no copy goes through the
    kernel."""
    cdef int p
    for p in range(P):
        if p != r and not hello[p].view:
            return 0
    return 1


cdef int direct_allreduce(Transport t, char* buf, size_t n, size_t es, int dtype, int op,
                          size_t chunk, char* stage) noexcept nogil:
    """Allreduce in place by reading the peers' buffers directly (see the module notes);
    ``stage`` (or NULL): where the peers read this rank's other slices and write them back.

    Returns 1 when some rank's memory was not readable and halving-doubling ran instead.
    """
    cdef int P = t.size, readable
    cdef DirectHello* hello
    if P == 1 or n == 0:
        return 0
    hello = <DirectHello*>t.work_area(P * sizeof(DirectHello))
    if hello == NULL:
        return -1
    _staged_copy(t, buf, n, es, stage, False)
    # 1. Hello: addresses, and whether direct access works between every pair.
    readable = direct_hello(t, stage if stage != NULL else buf, n * es, hello)
    if readable < 0:
        return -1
    if not readable:
        return -1 if halving_doubling_allreduce(t, buf, n, es, dtype, op) < 0 else 1
    if _direct_reduce(t, buf, n, es, dtype, op, chunk, hello) < 0:
        return -1
    # 3. Nobody returns while a peer may still read or write its buffer.
    if direct_release(t) < 0:
        return -1
    _staged_copy(t, buf, n, es, stage, True)
    return 0


cdef inline void _staged_copy(Transport t, char* buf, size_t n, size_t es, char* stage,
                              bint out) noexcept nogil:
    """Copy the slices the peers reduce (all but this rank's) from ``buf`` into ``stage``,
    or with ``out`` their reduced values back from ``stage`` into ``buf``; nothing where
    ``stage`` is NULL."""
    cdef size_t lo, tail
    cdef char* dst = buf if out else stage
    cdef char* src = stage if out else buf
    if stage != NULL:
        lo = chunk_offset(n, t.size, t.rank)
        tail = (lo + chunk_length(n, t.size, t.rank)) * es
        memcpy(dst, src, lo * es)
        memcpy(dst + tail, src + tail, n * es - tail)


cdef int _direct_reduce(Transport t, char* buf, size_t n, size_t es, int dtype, int op,
                        size_t chunk, DirectHello* hello) noexcept nogil:
    """Step 2 of the direct allreduce, the peers' hellos in ``hello``: reduce this rank's
    slice, a cache-sized chunk at a time, straight from every peer, and write each reduced
    chunk into every peer's buffer while it is in cache; where every peer is mapped here
    the copies are plain loads and stores, and the chunk smaller.  0, or -1 after
    set_error."""
    cdef int P = t.size, r = t.rank, i, p
    cdef size_t lo = chunk_offset(n, P, r), length = chunk_length(n, P, r), off, c, take
    cdef char* other
    if _all_viewed(hello, P, r) and chunk > _mapped_chunk:
        chunk = _mapped_chunk
    chunk = chunk // es if chunk >= es else 1
    other = t.scratch(chunk * es)
    if other == NULL:
        return -1
    c = 0
    while c < length:
        take = length - c if length - c < chunk else chunk
        off = (lo + c) * es
        for i in range(1, P):
            p = (r + i) % P
            if hello[p].view:       # the peer's buffer is mapped here: reduce from it
                reduce_into(buf + off, buf + off, <char*>hello[p].view + off, take, dtype, op)
                continue
            if t.read_remote(p, other, hello[p].addr + off, take * es) < 0:
                return -1
            reduce_into(buf + off, buf + off, other, take, dtype, op)
        for i in range(1, P):
            p = (r + i) % P
            if direct_write(t, p, &hello[p], off, buf + off, take * es, False) < 0:
                return -1
        c += take
    return 0


cpdef int allreduce(Transport t, object buf, int op, int algo, unsigned int seq, double timeout,
                    size_t segment_bytes, int base=DEFAULT_BCUBE_BASE) except? -1:
    """Reduce ``buf`` in place across all ranks of ``t`` (one nogil call); return the algorithm code.

    ``direct`` reads the peers' buffers with ``t.read_remote``; where some rank may not read
    every peer's memory, every rank runs halving-doubling (and that code is returned).
    """
    cdef View b
    held = pin(buf, &b, "allreduce", "buf", True)
    check_op(b.dtype, op, "allreduce")
    cdef OpDesc d
    cdef Flags* fl = NULL
    if algo == ALGO_FLAGS:
        fl = flags_fit(t, b.nbytes)
        if fl == NULL:
            algo = ALGO_RECURSIVE_DOUBLING
    fill_desc(&d, seq, COLL_ALLREDUCE, b.dtype, op, algo, 0, b.count)
    cdef size_t es = b.itemsize
    cdef size_t n = b.count
    cdef size_t seg
    cdef int window, rc
    cdef char* stage = NULL
    if algo == ALGO_BCUBE and not 2 <= base <= MAX_BCUBE_BASE:
        raise InvalidArgument("allreduce: bcube base %d is outside 2..%d" % (base, MAX_BCUBE_BASE))
    if algo == ALGO_RECURSIVE_DOUBLING or algo == ALGO_HALVING_DOUBLING or algo == ALGO_BCUBE \
            or algo == ALGO_FLAGS:
        seg = 0
        window = 0
    elif algo == ALGO_RING:
        seg = n // t.size + 1
        window = 2
    elif algo == ALGO_RING_CHUNKED:
        seg = _ring_segment(segment_bytes, b.nbytes, t.size)
        seg = seg // es if seg >= es else 1
        window = 4
    elif algo == ALGO_DIRECT:
        seg = _direct_chunk(segment_bytes)
        window = 0
        if not t.solo and t.size > 1:
            stage = direct_stage(t, b.ptr, b.nbytes)
    else:
        raise InvalidArgument("allreduce: unknown algorithm code %d" % algo)
    if t.solo:
        rc = t.begin(&d, timeout)       # a world of one: the buffer is the result, GIL kept
    else:
        with nogil:
            rc = t.begin(&d, timeout)
            if rc == 0:
                if algo == ALGO_FLAGS:
                    rc = flags_allreduce(t, fl, b.ptr, n, es, b.dtype, op)
                elif algo == ALGO_RECURSIVE_DOUBLING:
                    rc = recursive_doubling_allreduce(t, b.ptr, n, es, b.dtype, op)
                elif algo == ALGO_HALVING_DOUBLING:
                    rc = halving_doubling_allreduce(t, b.ptr, n, es, b.dtype, op)
                elif algo == ALGO_BCUBE:
                    rc = bcube_allreduce(t, b.ptr, n, es, b.dtype, op, base)
                elif algo == ALGO_DIRECT:
                    rc = direct_allreduce(t, b.ptr, n, es, b.dtype, op, seg, stage)
                    if rc == 1:
                        algo = ALGO_HALVING_DOUBLING
                        rc = 0
                else:
                    rc = ring_allreduce(t, b.ptr, n, es, b.dtype, op, seg, window)
            if rc == 0 and op == OP_AVG and t.size > 1:
                divide_by(b.ptr, n, b.dtype, t.size)   # every algorithm sums; AVG divides once
    if rc < 0:
        raise_error(t)
    return algo


cpdef int allreduce_begin(Transport t, object buf, int op, int algo, unsigned int seq,
                          double timeout) except? -1:
    """Begin an allreduce of ``buf`` in place without waiting (an async call on the caller's
    thread), as ``allreduce`` would run it with ``algo``: through the flag area, posting
    this rank's contribution; or, at 2 ranks, recursive doubling (asked for, or flags where
    no area serves, which runs it), whose one exchange starts with this rank's send of
    ``buf``; or direct, up to DIRECT_BEGIN_BYTES where this rank may read every peer,
    whose hello is sent (the buffer staged first where ``allreduce`` would stage it).
    1 when it has ended; 0 when it is posted to the flag area, 2 when it is begun as an
    exchange, BEGUN_DIRECT or BEGUN_DIRECT_STAGED when its hello is sent, and
    ``allreduce_end`` (with ALGO_FLAGS, ALGO_RECURSIVE_DOUBLING or ALGO_DIRECT; for
    direct, ``allreduce_step`` may run first) must finish it before the next collective;
    -2 when none applies or the post would wait for its slot (nothing was done: run
    ``allreduce``)."""
    cdef View b
    held = pin(buf, &b, "allreduce", "buf", True)
    check_op(b.dtype, op, "allreduce")
    cdef Flags* fl = flags_fit(t, b.nbytes) if algo == ALGO_FLAGS else NULL
    cdef OpDesc d
    cdef int rc
    cdef char* stage
    cdef DirectHello* hello
    if t.solo or t.size < 2:
        return -2
    if fl != NULL:
        if not flags_slot_free(fl):
            return -2
        fill_desc(&d, seq, COLL_ALLREDUCE, b.dtype, op, ALGO_FLAGS, 0, b.count)
        with nogil:
            rc = t.begin(&d, timeout)
            if rc == 0:
                rc = flags_post(t, fl, b.ptr, b.nbytes)
            if rc == 0 and flags_ends_at_once(fl, -1):
                rc = _end_flags(t, fl, b.ptr, b.count, b.itemsize, b.dtype, op)
                if rc == 0:
                    rc = 1
    elif _exchanges(t, algo, b.count) and exchange_fits(t, b.nbytes):
        fill_desc(&d, seq, COLL_ALLREDUCE, b.dtype, op, ALGO_RECURSIVE_DOUBLING, 0, b.count)
        with nogil:
            rc = t.begin(&d, timeout)
            if rc == 0:
                rc = exchange_post(t, b.ptr, b.nbytes)
            if rc == 0:
                rc = 2
    elif algo == ALGO_DIRECT and 0 < b.nbytes <= DIRECT_BEGIN_BYTES and direct_may_begin(t):
        stage = direct_stage(t, b.ptr, b.nbytes)
        fill_desc(&d, seq, COLL_ALLREDUCE, b.dtype, op, ALGO_DIRECT, 0, b.count)
        with nogil:
            rc = t.begin(&d, timeout)
            if rc == 0:
                hello = <DirectHello*>t.work_area(t.size * sizeof(DirectHello))
                rc = -1 if hello == NULL else 0
            if rc == 0:
                _staged_copy(t, b.ptr, b.count, b.itemsize, stage, False)
                rc = direct_hello_send(t, stage if stage != NULL else b.ptr, b.nbytes, hello)
            if rc == 0:
                rc = BEGUN_DIRECT if stage == NULL else BEGUN_DIRECT_STAGED
    else:
        return -2
    if rc < 0:
        raise_error(t)
    return rc


cdef inline bint _exchanges(Transport t, int algo, size_t count):
    """``allreduce`` runs ``algo`` as one exchange of the buffer with the peer: recursive
    doubling (or flags without a flag area) at 2 ranks, on a buffer that is not empty."""
    return (t.size == 2 and count > 0 and (algo == ALGO_RECURSIVE_DOUBLING
                                           or algo == ALGO_FLAGS and t.flag_area is None))


cpdef int allreduce_step(Transport t, object buf, int op, unsigned int seq, double timeout,
                         size_t segment_bytes, bint staged) except? -1:
    """The middle of a direct allreduce that ``allreduce_begin`` began (``staged``: it
    answered BEGUN_DIRECT_STAGED), for a look that found every peer's hello there (so it
    waits for nobody): take the hellos, reduce this rank's slice from every peer and write
    it to them, and tell them so without waiting.  ALGO_DIRECT: ``allreduce_end`` (with
    ``stepped``) finishes it once the peers have said the same; ALGO_HALVING_DOUBLING: some
    rank may not read every peer, and halving-doubling ran instead (it has ended)."""
    cdef View b
    held = pin(buf, &b, "allreduce", "buf", True)
    cdef OpDesc d
    cdef int rc, algo = ALGO_DIRECT
    fill_desc(&d, seq, COLL_ALLREDUCE, b.dtype, op, ALGO_DIRECT, 0, b.count)
    with nogil:
        rc = t.begin(&d, timeout)
        if rc == 0:
            rc = _direct_step(t, b.ptr, b.count, b.itemsize, b.dtype, op, segment_bytes)
            if rc == 1:
                algo = ALGO_HALVING_DOUBLING
                rc = 0
                if op == OP_AVG:
                    divide_by(b.ptr, b.count, b.dtype, t.size)
    if rc < 0:
        raise_error(t)
    return algo


cdef int _direct_step(Transport t, char* buf, size_t n, size_t es, int dtype, int op,
                      size_t segment_bytes) noexcept nogil:
    """Steps 1 (the peers' half) and 2 of a begun direct allreduce, and this rank's half of
    step 3.  0; 1 when some rank may not read every peer and halving-doubling ran; -1."""
    cdef DirectHello* hello = <DirectHello*>t.work_area(t.size * sizeof(DirectHello))
    cdef int readable
    if hello == NULL:
        return -1
    readable = direct_hello_take(t, n * es, hello)
    if readable < 0:
        return -1
    if not readable:
        return -1 if halving_doubling_allreduce(t, buf, n, es, dtype, op) < 0 else 1
    if _direct_reduce(t, buf, n, es, dtype, op, _direct_chunk(segment_bytes), hello) < 0:
        return -1
    return direct_release_send(t)


cdef inline size_t _direct_chunk(size_t segment_bytes) noexcept nogil:
    """The direct allreduce's chunk: the segment, at most DIRECT_KERNEL_CHUNK_BYTES
    (``_direct_reduce`` takes the mapped chunk where every peer is mapped)."""
    return segment_bytes if segment_bytes < DIRECT_KERNEL_CHUNK_BYTES \
        else DIRECT_KERNEL_CHUNK_BYTES


cpdef int allreduce_end(Transport t, object buf, int op, int algo, unsigned int seq,
                        double timeout, size_t segment_bytes=0, bint staged=False,
                        bint stepped=False) except? -1:
    """Finish the allreduce ``allreduce_begin`` began, ``algo`` saying how (ALGO_FLAGS: it
    posted to the flag area; ALGO_DIRECT: it sent a direct allreduce's hello, ``staged``
    as it answered, and ``stepped``: ``allreduce_step`` ran since, with ALGO_DIRECT;
    else it began an exchange), its deadline counting from now: wait for every flag and
    reduce; finish the direct allreduce (``allreduce_step``'s work unless ``stepped``,
    then wait for the peers' release and copy their slices out of the stage); or receive
    the peer's buffer and reduce it with this one, lower rank first.  The algorithm's
    code."""
    cdef View b
    held = pin(buf, &b, "allreduce", "buf", True)
    cdef Flags* fl = flags_fit(t, b.nbytes) if algo == ALGO_FLAGS else NULL
    cdef char* stage = direct_staged(t) if algo == ALGO_DIRECT and staged else NULL
    cdef OpDesc d
    cdef int rc
    cdef char* other
    if fl == NULL and algo != ALGO_DIRECT:
        algo = ALGO_RECURSIVE_DOUBLING
    fill_desc(&d, seq, COLL_ALLREDUCE, b.dtype, op, algo, 0, b.count)
    with nogil:
        rc = t.begin(&d, timeout)
        if rc == 0 and fl != NULL:
            rc = _end_flags(t, fl, b.ptr, b.count, b.itemsize, b.dtype, op)
        elif rc == 0 and algo == ALGO_DIRECT:
            if not stepped:
                rc = _direct_step(t, b.ptr, b.count, b.itemsize, b.dtype, op, segment_bytes)
            if rc == 1:         # halving-doubling ran instead
                algo = ALGO_HALVING_DOUBLING
                rc = 0
            elif rc == 0:
                rc = direct_release_take(t)
                if rc == 0:
                    _staged_copy(t, b.ptr, b.count, b.itemsize, stage, True)
            if rc == 0 and op == OP_AVG:
                divide_by(b.ptr, b.count, b.dtype, t.size)
        elif rc == 0:
            other = t.scratch(b.nbytes)
            rc = -1 if other == NULL else exchange_finish(t, other, b.nbytes)
            if rc == 0:
                if t.rank == 0:
                    reduce_into(b.ptr, b.ptr, other, b.count, b.dtype, op)
                else:
                    reduce_into(b.ptr, other, b.ptr, b.count, b.dtype, op)
                if op == OP_AVG:
                    divide_by(b.ptr, b.count, b.dtype, t.size)
    if rc < 0:
        raise_error(t)
    return algo


cdef int _end_flags(Transport t, Flags* fl, char* buf, size_t n, size_t es, int dtype,
                    int op) noexcept nogil:
    """Wait for every post of the flags allreduce begun on ``buf``, and reduce."""
    if flags_allreduce_end(t, fl, buf, n, es, dtype, op) < 0:
        return -1
    if op == OP_AVG:
        divide_by(buf, n, dtype, t.size)
    return 0
