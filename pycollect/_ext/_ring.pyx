"""The ring: a reduce-scatter phase and an allgather phase over rank -> rank+1.

A buffer is cut into ``size`` chunks (a Layout: offsets and lengths, equal
or user-given) and each chunk into segments of at most ``seg`` elements.

Reduce-scatter, steps s = 0 .. size-2: rank r sends chunk r-s+shift to its
right neighbour and receives chunk r-s-1+shift from its left one, reducing it
into ``work``.  The chunk reduced in step s is the one sent in step s+1, so
each reduced segment is posted for sending at once and segments stream
around the ring while later ones still arrive.  Receives land in a window of
scratch slots: the next segment is on the wire while this one is reduced in
a cache-sized piece.  After size-1 steps rank r holds the fully reduced chunk
r+1+shift.  Each chunk is reduced along one chain, so every rank that later
receives it gets the same bits.

Allgather, steps s = 0 .. size-2: rank r sends chunk r+1+shift-s and
receives chunk r+shift-s straight into the caller's buffer (no copy),
forwarding each segment the moment it lands.
"""

from libc.stdlib cimport calloc, free, malloc

from pycollect._ext._algo cimport (chunk_length, chunk_offset, segment_count,
                                   segment_length, wrap)
from pycollect._ext._reduce cimport reduce_into
from pycollect._ext._transport cimport *

cdef enum:
    MAX_WINDOW = 8


cdef int _layout_alloc(Layout* lay, int parts, int shift) noexcept nogil:
    lay.shift = shift
    if parts <= LAYOUT_INLINE:
        lay.off, lay.len = lay.inline_off, lay.inline_len
        return 0
    lay.off = <size_t*>calloc(parts, sizeof(size_t))
    lay.len = <size_t*>calloc(parts, sizeof(size_t))
    if lay.off == NULL or lay.len == NULL:
        layout_free(lay)
        return -1
    return 0


cdef int layout_even(Layout* lay, size_t n, int parts, int shift) noexcept nogil:
    cdef int c
    if _layout_alloc(lay, parts, shift) < 0:
        return -1
    for c in range(parts):
        lay.off[c] = chunk_offset(n, parts, c)
        lay.len[c] = chunk_length(n, parts, c)
    return 0


cdef int layout_counts(Layout* lay, const size_t* counts, int parts, int shift) noexcept nogil:
    cdef int c
    cdef size_t off = 0
    if _layout_alloc(lay, parts, shift) < 0:
        return -1
    for c in range(parts):
        lay.off[c] = off
        lay.len[c] = counts[c]
        off += counts[c]
    return 0


cdef void layout_free(Layout* lay) noexcept nogil:
    if lay.off != lay.inline_off:
        free(lay.off)
    if lay.len != lay.inline_len:
        free(lay.len)
    lay.off = NULL
    lay.len = NULL


cdef int ring_reduce_scatter(Transport t, char* work, const Layout* lay, size_t es, int dtype,
                             int op, size_t seg, int window) noexcept nogil:
    cdef int P = t.size, r = t.rank, sh = lay.shift
    cdef int right = wrap(r + 1, P), left = wrap(r - 1, P)
    cdef int reqs[MAX_WINDOW]
    cdef int slot_step[MAX_WINDOW]
    cdef size_t slot_seg[MAX_WINDOW]
    cdef char* scratch
    cdef int s, c, slot, post_step
    cdef size_t g, post_g, total = 0, k_post = 0, k_done = 0, length
    cdef char* dst
    if P == 1:
        return 0
    if window > MAX_WINDOW:
        window = MAX_WINDOW
    scratch = t.scratch(window * seg * es)
    if scratch == NULL:
        return -1
    # Step 0 sends this rank's own chunk.
    c = wrap(r + sh, P)
    for g in range(segment_count(lay.len[c], seg)):
        if t.post_send(right, work + (lay.off[c] + g * seg) * es,
                       segment_length(lay.len[c], seg, g) * es) < 0:
            return -1
    for s in range(P - 1):
        total += segment_count(lay.len[wrap(r - s - 1 + sh, P)], seg)
    # Receives, a window at a time, in (step, segment) order.
    post_step = 0
    post_g = 0
    while k_done < total:
        while k_post < total and k_post < k_done + <size_t>window:
            while post_g >= segment_count(lay.len[wrap(r - post_step - 1 + sh, P)], seg):
                post_step += 1
                post_g = 0
            slot = k_post % window
            slot_step[slot] = post_step
            slot_seg[slot] = post_g
            c = wrap(r - post_step - 1 + sh, P)
            reqs[slot] = t.post_recv(left, scratch + slot * seg * es,
                                     segment_length(lay.len[c], seg, post_g) * es)
            if reqs[slot] < 0:
                return -1
            post_g += 1
            k_post += 1
        slot = k_done % window
        if t.wait(reqs[slot]) < 0:
            return -1
        s = slot_step[slot]
        c = wrap(r - s - 1 + sh, P)
        length = segment_length(lay.len[c], seg, slot_seg[slot])
        dst = work + (lay.off[c] + slot_seg[slot] * seg) * es
        reduce_into(dst, dst, scratch + slot * seg * es, length, dtype, op)
        if s < P - 2 and t.post_send(right, dst, length * es) < 0:
            return -1
        k_done += 1
    # Chunks sent above may be overwritten next (by an allgather): let them leave.
    return t.wait_all()


cdef int ring_allgather(Transport t, char* buf, const Layout* lay, size_t es,
                        size_t seg) noexcept nogil:
    cdef int P = t.size, r = t.rank, sh = lay.shift
    cdef int right = wrap(r + 1, P), left = wrap(r - 1, P)
    cdef int s, c, rc = 0
    cdef size_t g, k = 0, total = 0
    cdef int* reqs
    if P == 1:
        return 0
    c = wrap(r + 1 + sh, P)
    for g in range(segment_count(lay.len[c], seg)):
        if t.post_send(right, buf + (lay.off[c] + g * seg) * es,
                       segment_length(lay.len[c], seg, g) * es) < 0:
            return -1
    for s in range(P - 1):
        total += segment_count(lay.len[wrap(r - s + sh, P)], seg)
    reqs = <int*>malloc((total + 1) * sizeof(int))
    if reqs == NULL:
        return t.set_error(ERR_INTERNAL, -1, "malloc", 0, "out of memory")
    for s in range(P - 1):
        c = wrap(r - s + sh, P)
        for g in range(segment_count(lay.len[c], seg)):
            reqs[k] = t.post_recv(left, buf + (lay.off[c] + g * seg) * es,
                                  segment_length(lay.len[c], seg, g) * es)
            if reqs[k] < 0:
                free(reqs)
                return -1
            k += 1
    k = 0
    for s in range(P - 1):
        c = wrap(r - s + sh, P)
        for g in range(segment_count(lay.len[c], seg)):
            rc = t.wait(reqs[k])
            k += 1
            if rc == 0 and s < P - 2:
                rc = t.post_send(right, buf + (lay.off[c] + g * seg) * es,
                                 segment_length(lay.len[c], seg, g) * es)
            if rc < 0:
                break
        if rc < 0:
            break
    free(reqs)
    if rc < 0:
        return -1
    return t.wait_all()
