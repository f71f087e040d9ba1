"""Sub-groups: a transport that is a subset of another transport's ranks.

A GroupTransport renumbers its members 0..n-1 and sends over its parent's
connections (no new sockets).  Every message it sends carries the group's
context id, so traffic of different groups, or of a group and its parent,
can never be taken for one another: a receive that meets another group's
message fails with MismatchError instead of corrupting data.  Operations on
a group and its parent share one lock and run one at a time.
"""

from libc.stdlib cimport calloc, free

from pycollect._ext._transport cimport *
from pycollect._ext._pool cimport PoolRef


cdef class GroupTransport(Transport):
    """The members ``members`` (parent ranks, in group-rank order) of ``parent``."""

    cdef Transport parent
    cdef int* members
    cdef int* index
    cdef uint8_t* within        # Probe.within for the parent: the members among its ranks
    cdef uint32_t group_id

    def __cinit__(self):
        self.members = NULL
        self.index = NULL
        self.within = NULL

    def __init__(self, Transport parent, members, unsigned int group_id):
        cdef int i, p
        if parent.rank not in members:
            raise ValueError("GroupTransport: this rank is not a member")
        self.parent = parent
        self.group_id = group_id
        self.size = len(members)
        self.rank = list(members).index(parent.rank)
        self.members = <int*>calloc(self.size, sizeof(int))
        self.index = <int*>calloc(parent.size, sizeof(int))
        self.within = <uint8_t*>calloc(parent.size, sizeof(uint8_t))
        if self.members == NULL or self.index == NULL or self.within == NULL:
            raise MemoryError()
        for p in range(parent.size):
            self.index[p] = -1
        for i, p in enumerate(members):
            self.members[i] = p
            self.index[p] = i
        # The parent's host identity of each member, in group-rank order.
        self.host_ids = None if parent.host_ids is None else [parent.host_ids[p]
                                                              for p in members]

    def __dealloc__(self):
        free(self.members)
        free(self.index)
        free(self.within)

    cdef int _mirror(self, int rc) noexcept nogil:
        """Adopt the parent's error after a failed call, peers renumbered into the group."""
        if rc < 0:
            self.copy_error(self.parent)
            if 0 <= self.err.peer < self.parent.size:
                self.err.peer = self.index[self.err.peer]
        return rc

    cdef int begin(self, const OpDesc* op, double timeout_s) noexcept nogil:
        self.op = op[0]
        if self.op.group_id == 0:
            self.op.group_id = self.group_id      # a group nested in this one keeps its own id
        self.timeout_s = timeout_s
        if self.failed:
            return -1
        return self._mirror(self.parent.begin(&self.op, timeout_s))

    cdef int post_send(self, int peer, const void* buf, size_t nbytes) noexcept nogil:
        return self._mirror(self.parent.post_send(self.members[peer], buf, nbytes))

    cdef int post_send_async(self, int peer, const void* buf, size_t nbytes) noexcept nogil:
        return self._mirror(self.parent.post_send_async(self.members[peer], buf, nbytes))

    cdef int post_recv(self, int peer, void* buf, size_t nbytes) noexcept nogil:
        return self._mirror(self.parent.post_recv(self.members[peer], buf, nbytes))

    cdef int wait(self, int req) noexcept nogil:
        return self._mirror(self.parent.wait(req))

    cdef int wait_all(self) noexcept nogil:
        return self._mirror(self.parent.wait_all())

    cdef const uint8_t* _narrow(self, int peer, Probe* out) noexcept nogil:
        """For a probe of any member (``peer`` -1): point ``out.within`` at the members among
        the parent's ranks (of those ``out.within`` names, for a group of this group), so
        that a non-member's ended stream does not fail it.  Returns what it was."""
        cdef const uint8_t* outer = out.within
        cdef int p
        if peer < 0:
            for p in range(self.parent.size):
                self.within[p] = self.index[p] >= 0 and (outer == NULL or
                                                         outer[self.index[p]])
            out.within = self.within
        return outer

    cdef int probe(self, int peer, Probe* out) noexcept nogil:
        cdef const uint8_t* outer = self._narrow(peer, out)
        cdef int rc = self._mirror(self.parent.probe(
            self.members[peer] if peer >= 0 else -1, out))
        out.within = outer
        if rc >= 0:
            out.peer = self.index[rc]
            rc = out.peer
        return rc

    cdef int probe_until(self, int peer, Probe* out, int64_t until_ns) noexcept nogil:
        cdef const uint8_t* outer = self._narrow(peer, out)
        cdef int rc = self.parent.probe_until(self.members[peer] if peer >= 0 else -1, out,
                                              until_ns)
        out.within = outer
        if rc >= 0:
            out.peer = self.index[rc]
            return out.peer
        return rc if rc == -2 else self._mirror(rc)

    def kick(self):
        self.parent.kick()      # the group's waits are the parent's

    cdef void save_op(self, OpState* saved) noexcept nogil:
        # The group's operations wait on the parent's descriptor and deadline.
        self.parent.save_op(saved)

    cdef void restore_op(self, const OpState* saved) noexcept nogil:
        self.parent.restore_op(saved)

    cdef bint sends_now(self, int peer, size_t nbytes) noexcept nogil:
        return self.parent.sends_now(self.members[peer], nbytes)

    cdef bint head_here(self, int peer) noexcept nogil:
        # The parent's stream from that member: a frame of the parent's or of another group
        # at its head fails this group's receive at once (MismatchError), as it would later.
        if self.failed:
            return 1
        return 0 <= peer < self.size and self.parent.head_here(self.members[peer])

    cdef bint head_of(self, int peer, uint32_t group_id, uint32_t seq) noexcept nogil:
        if self.failed:
            return 1
        # The innermost group's id, as set_op keeps it.
        return 0 <= peer < self.size and self.parent.head_of(
            self.members[peer], group_id if group_id else self.group_id, seq)

    cdef int set_op(self, const OpDesc* op) noexcept nogil:
        self.op = op[0]
        if self.op.group_id == 0:
            self.op.group_id = self.group_id
        if self.failed:
            return -1
        return self._mirror(self.parent.set_op(&self.op))

    cdef int post_recv_upto(self, int peer, void* buf, size_t capacity) noexcept nogil:
        return self._mirror(self.parent.post_recv_upto(self.members[peer], buf, capacity))

    cdef int done(self, int req) noexcept nogil:
        return self.parent.done(req)

    cdef int64_t received(self, int req) noexcept nogil:
        return self.parent.received(req)

    cdef int progress_until(self, int64_t until_ns) noexcept nogil:
        return self._mirror(self.parent.progress_until(until_ns))

    cdef void extend_deadline(self, double timeout_s) noexcept nogil:
        self.timeout_s = timeout_s
        self.parent.extend_deadline(timeout_s)

    cdef int refuse(self, const OpDesc* op, double timeout_s, const char* reason, size_t n,
                    const int* peers, int npeers) noexcept nogil:
        """Tell the members (of ``peers``, group ranks, when not NULL) over the parent."""
        cdef OpDesc mine = op[0]
        cdef int i, k = 0, rc
        if mine.group_id == 0:
            mine.group_id = self.group_id
        if self.failed:
            return -1
        cdef int* to = <int*>calloc(self.size, sizeof(int))
        if to == NULL:
            return self.set_error(ERR_INTERNAL, -1, "calloc", 0, "out of memory")
        for i in range(npeers if peers != NULL else self.size):
            if (peers[i] if peers != NULL else i) != self.rank:
                to[k] = self.members[peers[i] if peers != NULL else i]
                k += 1
        rc = self._mirror(self.parent.refuse(&mine, timeout_s, reason, n, to, k))
        free(to)
        return rc

    cdef int can_read_remote(self, int peer) noexcept nogil:
        return 0 <= peer < self.size and self.parent.can_read_remote(self.members[peer])

    cdef int read_remote(self, int peer, void* dst, uint64_t remote_addr,
                         size_t nbytes) noexcept nogil:
        return self._mirror(self.parent.read_remote(self.members[peer], dst, remote_addr,
                                                    nbytes))

    cdef int write_remote(self, int peer, uint64_t remote_addr, const void* src,
                          size_t nbytes) noexcept nogil:
        return self._mirror(self.parent.write_remote(self.members[peer], remote_addr, src,
                                                     nbytes))

    cdef char* view_remote(self, int peer, const PoolRef* ref, uint64_t remote_addr,
                           size_t nbytes) noexcept nogil:
        if not 0 <= peer < self.size:
            return NULL
        return self.parent.view_remote(self.members[peer], ref, remote_addr, nbytes)

    cdef int set_error(self, int kind, int peer, const char* syscall, int errnum,
                       const char* detail) noexcept nogil:
        if not self.parent.failed:
            self.parent.err.theirs = self.err.theirs
            self.parent.err.has_theirs = self.err.has_theirs
        self.parent.set_error(kind, self.members[peer] if 0 <= peer < self.size else -1,
                              syscall, errnum, detail)
        return self._mirror(-1)

    def peer_address(self, int peer):
        if 0 <= peer < self.size:
            return "global rank %d, %s" % (self.members[peer],
                                           self.parent.peer_address(self.members[peer]))
        return "?"

    @property
    def is_failed(self):
        return bool(self.failed or self.parent.failed)

    @property
    def members_in_parent(self):
        """The parent ranks of the members, in group-rank order."""
        return [self.members[i] for i in range(self.size)]

    @property
    def members_in_world(self):
        """The top-level ranks of the members, in group-rank order."""
        above = self.parent.members_in_world
        mine = self.members_in_parent
        return mine if above is None else [above[p] for p in mine]

    def pair_kinds(self):
        """The parent's pair kind of each member, in group-rank order."""
        kinds = self.parent.pair_kinds()
        return [kinds[self.members[i]] for i in range(self.size)]

    def unreachable(self):
        """The members whose pair to this rank has ended."""
        return [self.index[p] for p in self.parent.unreachable() if self.index[p] >= 0]

    def recover(self, peers, double timeout_s, within=None):
        """The parent's recover() for the members ``peers``, within the members (``within``:
        those of a group of this group), so that the parent's pairs to other ranks stay as
        they are; clears this group's failure.  Returns the members that could not be
        brought back."""
        lost = self.parent.recover(
            [self.members[p] for p in peers], timeout_s,
            [self.members[p] for p in (range(self.size) if within is None else within)])
        self.failed = 0
        self.err.kind = 0
        self.err.peer = self.err.blamed = self.err.origin = -1
        self.err.has_theirs = 0
        return [self.index[p] for p in lost]

    def take_abort(self):
        """The parent's take_abort(): an abort() of the shared connections not yet raised."""
        return self.parent.take_abort()

    def abort(self, closing=False):
        """Abort the shared connections (the parent and every group on them); ``closing``:
        as the engine's."""
        self.parent.abort(closing)

    def close(self):
        """A group owns no sockets: closing it only ends its own use."""
        with nogil:
            Transport.set_error(self, ERR_INTERNAL, -1, "", 0, "the group is closed")
