"""The transport base class and the one place transport errors become exceptions."""

from libc.errno cimport errno
from libc.stdlib cimport free
from libc.string cimport memset, strncpy
from posix.stdlib cimport posix_memalign

cdef extern from "_sys.h" nogil:
    int64_t pc_now_ns()

from pycollect.errors import (Aborted, Error, MismatchError, PeerError, Timeout)
from pycollect.types import DTYPES, ReduceOp

COLLECTIVE_NAMES = {
    COLL_BARRIER: "barrier", COLL_BROADCAST: "broadcast", COLL_ALLREDUCE: "allreduce",
    COLL_REDUCE: "reduce", COLL_ALLGATHER: "allgather", COLL_ALLGATHERV: "allgatherv",
    COLL_GATHER: "gather", COLL_GATHERV: "gatherv", COLL_SCATTER: "scatter",
    COLL_SCATTERV: "scatterv", COLL_REDUCE_SCATTER: "reduce_scatter",
    COLL_REDUCE_SCATTERV: "reduce_scatterv", COLL_ALLTOALL: "alltoall",
    COLL_ALLTOALLV: "alltoallv", COLL_P2P: "send/recv"}
ROOTED = (COLL_BROADCAST, COLL_REDUCE, COLL_GATHER, COLL_GATHERV, COLL_SCATTER, COLL_SCATTERV)
REDUCING = (COLL_ALLREDUCE, COLL_REDUCE, COLL_REDUCE_SCATTER, COLL_REDUCE_SCATTERV)
ALGORITHM_NAMES = {ALGO_NONE: "", ALGO_RING: "ring", ALGO_RING_CHUNKED: "ring_chunked",
                   ALGO_BINOMIAL: "binomial", ALGO_PIPELINED: "pipelined",
                   ALGO_DISSEMINATION: "dissemination",
                   ALGO_RECURSIVE_DOUBLING: "recursive_doubling",
                   ALGO_HALVING_DOUBLING: "halving_doubling", ALGO_BCUBE: "bcube",
                   ALGO_BINOMIAL_REDUCE: "binomial", ALGO_LINEAR: "linear",
                   ALGO_PAIRWISE: "pairwise", ALGO_DIRECT: "direct",
                   ALGO_HIERARCHICAL: "hierarchical", ALGO_FLAGS: "flags"}
ERROR_KINDS = {ERR_PEER: "peer", ERR_TIMEOUT: "timeout", ERR_MISMATCH: "mismatch",
               ERR_ABORTED: "aborted", ERR_INTERNAL: "internal", ERR_REFUSED: "refused"}
COLLECTIVE_CODES = {name: code for code, name in COLLECTIVE_NAMES.items()}


def describe_op(int coll, int dtype, int redop, int algo, int root, unsigned long long count):
    """A human description of an operation descriptor, as errors print it."""
    name = COLLECTIVE_NAMES.get(coll, "collective#%d" % coll)
    if coll == COLL_BARRIER:
        return "barrier()"
    parts = [DTYPES.get(dtype, "dtype#%d" % dtype)]
    if coll != COLL_ALLTOALLV:      # its count differs from rank to rank (the header has 0)
        parts[0] += " x %d" % count
    if coll in REDUCING:
        try:
            parts.append(ReduceOp(redop).name)
        except ValueError:
            parts.append("op#%d" % redop)
    if coll in ROOTED:
        parts.append("root %d" % root)
    elif coll == COLL_ALLGATHERV or coll == COLL_REDUCE_SCATTERV:
        parts.append("counts #%08x" % root)     # their digest (counts_digest)
    if algo:
        parts.append(ALGORITHM_NAMES.get(algo, "algorithm#%d" % algo))
    return "%s(%s)" % (name, ", ".join(parts))


cdef str _desc(const OpDesc* d):
    if d.coll == COLL_P2P:
        text = "send/recv(%s x %d, tag %d)" % (DTYPES.get(d.dtype, "?"), d.count, d.root)
    else:
        text = "%s #%d" % (describe_op(d.coll, d.dtype, d.redop, d.algo, d.root, d.count), d.seq)
    if d.group_id:
        text += " in group %08x" % d.group_id
    return text


cdef class Transport:
    """Base of every transport: request bookkeeping lives in subclasses."""

    def __cinit__(self):
        self.scratch_buf[0] = self.scratch_buf[1] = NULL
        self.scratch_cap[0] = self.scratch_cap[1] = 0
        self.failed = 0
        memset(&self.err, 0, sizeof(TransportError))
        self.err.peer = -1
        self.err.blamed = -1
        self.err.origin = -1

    def __dealloc__(self):
        free(self.scratch_buf[0])
        free(self.scratch_buf[1])
        self.scratch_buf[0] = self.scratch_buf[1] = NULL

    cdef int begin(self, const OpDesc* op, double timeout_s) noexcept nogil:
        return self.set_error(ERR_INTERNAL, -1, "", 0, "transport does not implement begin")

    cdef int post_send(self, int peer, const void* buf, size_t nbytes) noexcept nogil:
        return self.set_error(ERR_INTERNAL, peer, "", 0, "transport does not implement send")

    cdef int post_send_async(self, int peer, const void* buf, size_t nbytes) noexcept nogil:
        return self.post_send(peer, buf, nbytes)

    cdef int post_recv(self, int peer, void* buf, size_t nbytes) noexcept nogil:
        return self.set_error(ERR_INTERNAL, peer, "", 0, "transport does not implement recv")

    cdef int wait(self, int req) noexcept nogil:
        return self.set_error(ERR_INTERNAL, -1, "", 0, "transport does not implement wait")

    cdef int wait_all(self) noexcept nogil:
        return self.set_error(ERR_INTERNAL, -1, "", 0, "transport does not implement wait")

    cdef int probe(self, int peer, Probe* out) noexcept nogil:
        return self.set_error(ERR_INTERNAL, peer, "", 0, "transport does not implement probe")

    cdef int set_op(self, const OpDesc* op) noexcept nogil:
        self.op = op[0]
        return -1 if self.failed else 0

    cdef int post_recv_upto(self, int peer, void* buf, size_t capacity) noexcept nogil:
        return self.set_error(ERR_INTERNAL, peer, "", 0, "transport does not implement recv")

    cdef int done(self, int req) noexcept nogil:
        return 0

    cdef int64_t received(self, int req) noexcept nogil:
        return -1

    cdef int progress_until(self, int64_t until_ns) noexcept nogil:
        return self.set_error(ERR_INTERNAL, -1, "", 0, "transport does not implement progress")

    cdef int probe_until(self, int peer, Probe* out, int64_t until_ns) noexcept nogil:
        return self.set_error(ERR_INTERNAL, peer, "", 0, "transport does not implement probe")

    cdef void extend_deadline(self, double timeout_s) noexcept nogil:
        """Let the operation in progress run until at least ``timeout_s`` from now."""
        cdef int64_t until = pc_now_ns() + <int64_t>(timeout_s * 1e9)
        if until > self.deadline_ns:
            self.deadline_ns = until
        self.timeout_s = timeout_s

    def kick(self):
        """Have a bounded wait for a point-to-point head in progress return at once (from
        any thread), so that its driver looks at what was queued meanwhile; nothing here."""

    cdef void save_op(self, OpState* saved) noexcept nogil:
        saved.op = self.op
        saved.deadline_ns = self.deadline_ns
        saved.timeout_s = self.timeout_s

    cdef void restore_op(self, const OpState* saved) noexcept nogil:
        self.op = saved.op
        self.deadline_ns = saved.deadline_ns
        self.timeout_s = saved.timeout_s

    cdef bint can_stash(self) noexcept nogil:
        return 0

    cdef void stash(self, bint on) noexcept nogil:
        pass

    cdef Stashed* stashed(self) noexcept nogil:
        return NULL

    cdef int finish_aside(self) noexcept nogil:
        return 0

    cdef void past_collectives(self, bint on) noexcept nogil:
        pass

    cdef bint sends_now(self, int peer, size_t nbytes) noexcept nogil:
        return 0

    cdef void copy_error(self, Transport src) noexcept nogil:
        """Adopt ``src``'s recorded error (a sub-group reporting its parent's failure)."""
        if not self.failed and src.failed:
            self.err = src.err
            self.failed = 1

    cdef int set_error(self, int kind, int peer, const char* syscall, int errnum,
                       const char* detail) noexcept nogil:
        """Record the first error (later ones are consequences) and return -1."""
        if self.failed:
            return -1
        self.failed = 1
        self.err.kind = kind
        self.err.peer = peer
        self.err.sys_errno = errnum
        strncpy(self.err.syscall, syscall, sizeof(self.err.syscall) - 1)
        strncpy(self.err.detail, detail, sizeof(self.err.detail) - 1)
        self.err.mine = self.op
        return -1

    cdef char* scratch(self, size_t nbytes) noexcept nogil:
        """A reusable 64-byte aligned area for receives that feed a reduction, or NULL."""
        return self._area(0, nbytes)

    cdef char* work_area(self, size_t nbytes) noexcept nogil:
        """A second reusable area, for a working copy of the caller's data, or NULL."""
        return self._area(1, nbytes)

    cdef char* _area(self, int which, size_t nbytes) noexcept nogil:
        cdef void* p = NULL
        if nbytes <= self.scratch_cap[which]:
            return self.scratch_buf[which]
        if posix_memalign(&p, 64, nbytes) != 0:
            self.set_error(ERR_INTERNAL, -1, "posix_memalign", 0, "out of memory for scratch")
            return NULL
        free(self.scratch_buf[which])
        self.scratch_buf[which] = <char*>p
        self.scratch_cap[which] = nbytes
        return <char*>p

    cdef int watch(self, int64_t until_ns, int waiting_for) noexcept nogil:
        return self.set_error(ERR_INTERNAL, -1, "", 0, "transport does not implement watch")

    cdef int peer_left(self, int peer) noexcept nogil:
        return 0

    cdef bint head_here(self, int peer) noexcept nogil:
        return 0

    cdef bint head_of(self, int peer, uint32_t group_id, uint32_t seq) noexcept nogil:
        return 0

    cdef void ring_bell(self, int peer) noexcept nogil:
        pass

    cdef int refuse(self, const OpDesc* op, double timeout_s, const char* reason, size_t n,
                    const int* peers, int npeers) noexcept nogil:
        # A transport without the frame leaves its peers to find out at their deadline.
        return 0

    cdef int can_read_remote(self, int peer) noexcept nogil:
        return 0

    cdef int read_remote(self, int peer, void* dst, uint64_t remote_addr,
                         size_t nbytes) noexcept nogil:
        return self.set_error(ERR_INTERNAL, peer, "", 0, "this transport offers no reads of "
                              "a peer's memory")

    cdef int write_remote(self, int peer, uint64_t remote_addr, const void* src,
                          size_t nbytes) noexcept nogil:
        return self.set_error(ERR_INTERNAL, peer, "", 0, "this transport offers no writes to "
                              "a peer's memory")

    cdef char* view_remote(self, int peer, const PoolRef* ref, uint64_t remote_addr,
                           size_t nbytes) noexcept nogil:
        return NULL

    def peer_address(self, int peer):
        """The address of ``peer`` as errors print it."""
        return "?"

    @property
    def members_in_parent(self):
        """For a sub-group, the parent ranks of its members in group-rank order; else None."""
        return None

    @property
    def members_in_world(self):
        """For a sub-group, the top-level ranks of its members in group-rank order (through
        every parent: a group of a group); else None."""
        return None

    def pair_kinds(self):
        """How each peer is reached: "self" for this rank, else the pair's kind ("tcp",
        "shm", "shm+cma", or a plugin's own name; ``auto`` takes kinds that start with
        "shm" for shared memory)."""
        return ["self" if p == self.rank else "remote" for p in range(self.size)]

    @property
    def is_failed(self):
        return bool(self.failed)

    def error_kind(self):
        """The name of the recorded error kind, or None."""
        return ERROR_KINDS.get(self.err.kind) if self.failed else None


cdef int raise_error(Transport t) except -1:
    """Raise the exception that describes the transport's recorded error."""
    cdef TransportError* e = &t.err
    if t.interrupt is not None:
        exc, t.interrupt = t.interrupt, None
        raise exc
    me = "rank %d" % t.rank
    what = _desc(&e.mine)
    peer = "a peer"
    if e.peer >= 0:
        peer = "rank %d (%s)" % (e.peer, t.peer_address(e.peer))
    detail = e.detail.decode("utf-8", "replace")
    sysinfo = ""
    if e.syscall[0] != 0:
        import os
        sysinfo = " [%s: %s]" % (e.syscall.decode(), os.strerror(e.sys_errno)) if e.sys_errno else ""
    if e.kind == ERR_REFUSED:
        call = "%s #%d" % (COLLECTIVE_NAMES.get(e.theirs.coll, "collective"), e.theirs.seq)
        if e.origin < 0 or e.origin == e.peer:
            msg = "%s: %s failed: %s refused its arguments to %s: %s" % (me, what, peer, call,
                                                                       detail)
        else:
            msg = "%s: %s failed: %s relayed that rank %d refused its arguments to %s" % (
                me, what, peer, e.origin, call)
        refused = MismatchError(msg)
        # Another rank's refusal (pycollect-run's blame), unless relayed back to its maker.
        refused.caused_elsewhere = (e.origin if e.origin >= 0 else e.peer) != t.rank
        raise refused
    if e.kind == ERR_MISMATCH:
        third = False
        if e.has_theirs and e.peer >= 0 and e.blamed >= 0 and e.blamed != t.rank \
                and e.blamed != e.peer:
            # A peer found a third rank out of step: this rank's call is not in question.
            msg = "%s: %s failed: %s, which called %s, %s" % (
                me, what, peer, _desc(&e.theirs), detail)
            third = True
        elif e.has_theirs:
            msg = "%s: %s disagrees with %s, which called %s%s" % (
                me, what, peer, _desc(&e.theirs), (": " + detail) if detail else "")
        else:
            msg = "%s: %s: %s" % (me, what, detail)
        mismatch = MismatchError(msg)
        # A third rank out of step, or a peer's refusal of a later collective (the
        # engine's words for it): not this rank's own.
        mismatch.caused_elsewhere = third or "refused its arguments" in detail
        raise mismatch
    if e.kind == ERR_TIMEOUT:
        raise Timeout("%s: %s timed out after %g s %s" % (me, what, t.timeout_s, detail))
    if e.kind == ERR_ABORTED:
        raise Aborted("%s: %s was aborted%s" % (me, what, (": " + detail) if detail else ""))
    if e.kind == ERR_PEER:
        raise PeerError("%s: %s failed: %s %s%s" % (me, what, peer, detail, sysinfo))
    raise Error("%s: %s failed: %s%s" % (me, what, detail, sysinfo))


def fail(Transport t, str detail):
    """Fail ``t`` with ERR_MISMATCH and ``detail``, outside any operation: a transport
    that tells its peers (the engine's abort frames) does so now."""
    cdef bytes b = detail.encode("utf-8", "replace")
    cdef const char* c = b
    with nogil:
        t.set_error(ERR_MISMATCH, -1, "", 0, c)


def refuse(Transport t, unsigned int seq, str collective, str reason, double timeout):
    """Tell every peer of ``t`` that this rank refused its arguments to ``collective`` (a
    name of COLLECTIVE_NAMES) numbered ``seq``, and why; the peers running it fail at once
    (MismatchError naming this rank, the call and ``reason``)."""
    cdef OpDesc d
    fill_desc(&d, seq, COLLECTIVE_CODES[collective], 0, 0, 0, -1, 0)
    cdef bytes text = reason.encode("utf-8", "replace")[:REASON_BYTES]
    cdef const char* ptr = text
    cdef size_t n = len(text)
    cdef int rc
    with nogil:
        rc = t.refuse(&d, timeout, ptr, n, NULL, 0)
    if rc < 0:
        raise_error(t)
