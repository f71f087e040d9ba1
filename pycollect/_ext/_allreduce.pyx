"""Allreduce: recursive doubling, and the ring family (ring and ring_chunked).

Recursive doubling (latency-bound messages): with P2 the largest power of
two <= size, ranks P2 + i first fold their buffer into rank i.  Then, for
mask = 1, 2, 4, ... < P2, rank r swaps its whole partial result with rank
r ^ mask and combines the two, lower rank's operand first, so both partners
hold the same bits.  Finally rank i hands the result back to rank P2 + i.
log2(P2) exchanges (+2 hops when size is not a power of two), each one
message each way: at 2 ranks a single simultaneous swap.

Both run a reduce-scatter followed by an allgather around the ring
rank -> rank+1.  The buffer of n elements is cut into ``size`` chunks (they
differ by at most one element), and each chunk into segments of at most
``segment_bytes``.

Reduce-scatter, steps s = 0 .. size-2: rank r sends chunk r-s to its right
neighbour and receives chunk r-s-1 from its left one, reducing it into its
own copy.  The chunk it reduced in step s is the chunk it sends in step s+1,
so each reduced segment is posted for sending at once: segments stream
around the ring while later ones are still arriving.  Receives land in a
window of scratch slots (the next segment is already on the wire while this
one is reduced, in cache-sized pieces).  After size-1 steps rank r holds the
fully reduced chunk r+1.

Allgather, steps s = 0 .. size-2: rank r sends chunk r+1-s and receives chunk
r-s straight into the caller's buffer (no copy), forwarding each segment as
it lands.

Every chunk is reduced along one chain and then copied, so all ranks end with
the same bits even for floating-point sums.  ``ring`` sends each chunk as one
message (fewest messages; the choice for small buffers); ``ring_chunked`` cuts
chunks into segments so reduction overlaps the wire (the choice for large
ones).  AVG sums and divides once at the end.
"""

from libc.stdlib cimport free, malloc

from pycollect._ext._algo cimport (chunk_length, chunk_offset, segment_count,
                                   segment_length, wrap)
from pycollect._ext._buffer cimport Buffer, as_buffer
from pycollect._ext._dtypes cimport OP_AVG
from pycollect._ext._reduce cimport check_op, divide_by, reduce_into
from pycollect._ext._transport cimport *

from pycollect.errors import InvalidArgument

ALGORITHMS = {"recursive_doubling": ALGO_RECURSIVE_DOUBLING, "ring": ALGO_RING,
              "ring_chunked": ALGO_RING_CHUNKED}

cdef enum:
    MAX_WINDOW = 8


cdef int _reduce_scatter(Transport t, char* buf, size_t n, size_t es, int dtype, int op,
                         size_t seg, int window) noexcept nogil:
    cdef int P = t.size, r = t.rank
    cdef int right = wrap(r + 1, P), left = wrap(r - 1, P)
    cdef int reqs[MAX_WINDOW]
    cdef int slot_step[MAX_WINDOW]
    cdef size_t slot_seg[MAX_WINDOW]
    cdef char* scratch = t.scratch(window * seg * es)
    cdef int s, c, slot, post_step
    cdef size_t g, post_g, total = 0, k_post = 0, k_done = 0, length, off
    cdef char* dst
    if scratch == NULL:
        return -1
    # Step 0 sends this rank's own chunk r.
    length = chunk_length(n, P, r)
    off = chunk_offset(n, P, r)
    for g in range(segment_count(length, seg)):
        if t.post_send(right, buf + (off + g * seg) * es,
                       segment_length(length, seg, g) * es) < 0:
            return -1
    for s in range(P - 1):
        total += segment_count(chunk_length(n, P, wrap(r - s - 1, P)), seg)
    # Receives, a window at a time, in (step, segment) order.
    post_step = 0
    post_g = 0
    while k_done < total:
        while k_post < total and k_post < k_done + <size_t>window:
            while post_g >= segment_count(chunk_length(n, P, wrap(r - post_step - 1, P)), seg):
                post_step += 1
                post_g = 0
            slot = k_post % window
            slot_step[slot] = post_step
            slot_seg[slot] = post_g
            c = wrap(r - post_step - 1, P)
            reqs[slot] = t.post_recv(left, scratch + slot * seg * es,
                                     segment_length(chunk_length(n, P, c), seg, post_g) * es)
            if reqs[slot] < 0:
                return -1
            post_g += 1
            k_post += 1
        slot = k_done % window
        if t.wait(reqs[slot]) < 0:
            return -1
        s = slot_step[slot]
        c = wrap(r - s - 1, P)
        length = segment_length(chunk_length(n, P, c), seg, slot_seg[slot])
        dst = buf + (chunk_offset(n, P, c) + slot_seg[slot] * seg) * es
        reduce_into(dst, dst, scratch + slot * seg * es, length, dtype, op)
        if s < P - 2 and t.post_send(right, dst, length * es) < 0:
            return -1
        k_done += 1
    # The chunks sent above are overwritten by the allgather: let them leave.
    return t.wait_all()


cdef int _allgather_ring(Transport t, char* buf, size_t n, size_t es, size_t seg) noexcept nogil:
    """Circulate chunk r+1 (fully reduced here) until every rank has every chunk."""
    cdef int P = t.size, r = t.rank
    cdef int right = wrap(r + 1, P), left = wrap(r - 1, P)
    cdef int s, c, rc = 0
    cdef size_t g, k = 0, total = 0, length, off
    cdef int* reqs
    length = chunk_length(n, P, r + 1 if r + 1 < P else 0)
    off = chunk_offset(n, P, wrap(r + 1, P))
    for g in range(segment_count(length, seg)):
        if t.post_send(right, buf + (off + g * seg) * es,
                       segment_length(length, seg, g) * es) < 0:
            return -1
    for s in range(P - 1):
        total += segment_count(chunk_length(n, P, wrap(r - s, P)), seg)
    reqs = <int*>malloc((total + 1) * sizeof(int))
    if reqs == NULL:
        return t.set_error(ERR_INTERNAL, -1, "malloc", 0, "out of memory")
    for s in range(P - 1):
        c = wrap(r - s, P)
        length = chunk_length(n, P, c)
        off = chunk_offset(n, P, c)
        for g in range(segment_count(length, seg)):
            reqs[k] = t.post_recv(left, buf + (off + g * seg) * es,
                                  segment_length(length, seg, g) * es)
            if reqs[k] < 0:
                free(reqs)
                return -1
            k += 1
    k = 0
    for s in range(P - 1):
        c = wrap(r - s, P)
        length = chunk_length(n, P, c)
        off = chunk_offset(n, P, c)
        for g in range(segment_count(length, seg)):
            rc = t.wait(reqs[k])
            k += 1
            if rc < 0:
                break
            if s < P - 2:
                rc = t.post_send(right, buf + (off + g * seg) * es,
                                 segment_length(length, seg, g) * es)
                if rc < 0:
                    break
        if rc < 0:
            break
    free(reqs)
    if rc < 0:
        return -1
    return t.wait_all()


cdef int recursive_doubling_allreduce(Transport t, char* buf, size_t n, size_t es, int dtype,
                                      int op) noexcept nogil:
    """Allreduce in place by pairwise exchanges of the whole buffer."""
    cdef int P = t.size, r = t.rank, p2 = 1, mask, partner
    cdef size_t nbytes = n * es
    cdef char* other
    if P > 1 and n > 0:
        while p2 * 2 <= P:
            p2 *= 2
        other = t.scratch(nbytes)
        if other == NULL:
            return -1
        if r >= p2:
            # Fold in, then wait for the result.
            if t.post_send(r - p2, buf, nbytes) < 0:
                return -1
            if t.wait(t.post_recv(r - p2, buf, nbytes)) < 0:
                return -1
        else:
            if r + p2 < P:
                if t.wait(t.post_recv(r + p2, other, nbytes)) < 0:
                    return -1
                reduce_into(buf, buf, other, n, dtype, op)
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
            if r + p2 < P and t.post_send(r + p2, buf, nbytes) < 0:
                return -1
            if t.wait_all() < 0:
                return -1
    if op == OP_AVG and P > 1:
        divide_by(buf, n, dtype, P)
    return 0


cdef int ring_allreduce(Transport t, char* buf, size_t n, size_t es, int dtype, int op,
                        size_t seg, int window) noexcept nogil:
    """Allreduce in place over the ring; seg is the segment length in elements."""
    if t.size > 1 and n > 0:
        if seg < 1:
            seg = 1
        if _reduce_scatter(t, buf, n, es, dtype, op, seg, window) < 0:
            return -1
        if _allgather_ring(t, buf, n, es, seg) < 0:
            return -1
    if op == OP_AVG and t.size > 1:
        divide_by(buf, n, dtype, t.size)
    return 0


def allreduce(Transport t, object buf, int op, int algo, unsigned int seq, double timeout,
              size_t segment_bytes):
    """Reduce ``buf`` in place across all ranks of ``t`` (one nogil call); return the algorithm code."""
    cdef Buffer b = as_buffer(buf, "allreduce", "buf", True)
    check_op(b.dtype, op, "allreduce")
    cdef OpDesc d
    d.seq = seq
    d.coll = COLL_ALLREDUCE
    d.dtype = b.dtype
    d.redop = op
    d.algo = algo
    d.root = 0
    d.count = b.count
    cdef size_t es = b.itemsize
    cdef size_t n = b.count
    cdef size_t seg
    cdef int window, rc
    if algo == ALGO_RECURSIVE_DOUBLING:
        seg = 0
        window = 0
    elif algo == ALGO_RING:
        seg = n // t.size + 1
        window = 2
    elif algo == ALGO_RING_CHUNKED:
        seg = segment_bytes // es if segment_bytes >= es else 1
        window = 4
    else:
        raise InvalidArgument("allreduce: unknown algorithm code %d" % algo)
    with nogil:
        rc = t.begin(&d, timeout)
        if rc == 0:
            if algo == ALGO_RECURSIVE_DOUBLING:
                rc = recursive_doubling_allreduce(t, b.ptr, n, es, b.dtype, op)
            else:
                rc = ring_allreduce(t, b.ptr, n, es, b.dtype, op, seg, window)
    if rc < 0:
        raise_error(t)
    return algo
