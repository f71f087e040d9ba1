"""The channel base class and the default operations of a channel kind (_channel.pxd).

The defaults describe a byte stream with nothing more: no bytes held where
poll() cannot see them, no sleep to arm, no reads of the peer's memory.  A
kind fills its ``ChannelOps`` table with its own byte path and these where it
has nothing special.
"""

from libc.errno cimport ENOSYS, errno
from posix.unistd cimport close as c_close

cdef extern from "_sys.h" nogil:
    void pc_set_errno(int e)

cdef extern from "<poll.h>" nogil:
    enum:
        POLLIN
        POLLOUT


cdef class Channel:
    """One peer's byte path, as the engine reaches it (``base``: the kind's state)."""

    def __cinit__(self):
        self.base = NULL

    @property
    def kind(self):
        """How the peer is reached, as ``Transport.pair_kinds`` reports it."""
        return "channel"

    @property
    def pid(self):
        """The peer's process id where this channel can read its memory, else -1."""
        return -1

    @property
    def encrypted(self):
        """Whether the bytes cross the wire encrypted."""
        return False

    @property
    def fd(self):
        return -1 if self.base == NULL else self.base.fd

    @property
    def room(self):
        """The bytes a write would take whole now, as the engine asks before a send that
        must not wait for the peer (its ``room`` operation; 0: none for sure)."""
        return 0 if self.base == NULL else self.base.ops.room(self.base)

    def release_fd(self):
        """Hand the fd over to another channel (which will close it); return it."""
        cdef int fd = self.base.fd
        self.base.fd = -1
        return fd

    def close(self):
        """Close the fd (the engine does, when it closes)."""
        if self.base != NULL and self.base.fd >= 0:
            c_close(self.base.fd)
            self.base.fd = -1

    def __dealloc__(self):
        if self.base != NULL and self.base.fd >= 0:
            c_close(self.base.fd)
            self.base.fd = -1


cdef ssize_t _unsupported_io(ChannelBase* c, iovec* iov, int cnt) noexcept nogil:
    pc_set_errno(ENOSYS)
    return -1


cdef int _unsupported_peek(ChannelBase* c, MsgHeader* h) noexcept nogil:
    pc_set_errno(ENOSYS)
    return -1


cdef void default_ops(ChannelOps* ops) noexcept:
    ops.abi = CHANNEL_ABI
    ops.writev = _unsupported_io
    ops.readv = _unsupported_io
    ops.peek = _unsupported_peek
    ops.take_peeked = take_peeked_by_reading
    ops.held = held_nothing
    ops.events = events_as_asked
    ops.arm = arm_nothing
    ops.disarm = disarm_nothing
    ops.woken = woken_nothing
    ops.send_frame = send_frame_by_writing
    ops.shut = shut_nothing
    ops.read_remote = read_remote_unsupported
    ops.write_remote = write_remote_unsupported
    ops.acked = acked_none
    ops.ack = ack_nothing
    ops.room = room_unknown


cdef int take_peeked_by_reading(ChannelBase* c, MsgHeader* h) noexcept nogil:
    cdef iovec iov
    iov.iov_base = h
    iov.iov_len = HDR_BYTES
    return <int>c.ops.readv(c, &iov, 1)


cdef size_t held_nothing(ChannelBase* c) noexcept nogil:
    return 0


cdef short events_as_asked(ChannelBase* c, int want_out, int want_in) noexcept nogil:
    cdef short ev = 0
    if want_out:
        ev |= POLLOUT
    if want_in:
        ev |= POLLIN
    return ev


cdef int arm_nothing(ChannelBase* c, int want_in, int want_out, uint64_t ack_needed) noexcept nogil:
    return 0


cdef void disarm_nothing(ChannelBase* c) noexcept nogil:
    pass


cdef void woken_nothing(ChannelBase* c) noexcept nogil:
    pass


cdef int send_frame_by_writing(ChannelBase* c, const MsgHeader* h) noexcept nogil:
    cdef iovec iov
    iov.iov_base = <void*>h
    iov.iov_len = HDR_BYTES
    return c.ops.writev(c, &iov, 1) == HDR_BYTES


cdef void shut_nothing(ChannelBase* c) noexcept nogil:
    pass


cdef ssize_t read_remote_unsupported(ChannelBase* c, void* dst, uint64_t addr,
                                     size_t n) noexcept nogil:
    pc_set_errno(ENOSYS)
    return -1


cdef ssize_t write_remote_unsupported(ChannelBase* c, uint64_t addr, const void* src,
                                      size_t n) noexcept nogil:
    pc_set_errno(ENOSYS)
    return -1


cdef uint64_t acked_none(ChannelBase* c) noexcept nogil:
    return 0


cdef void ack_nothing(ChannelBase* c) noexcept nogil:
    pass


cdef size_t room_unknown(ChannelBase* c) noexcept nogil:
    return 0
