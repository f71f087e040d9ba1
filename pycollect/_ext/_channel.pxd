# The channel interface: how the engine (_engine.pyx) moves one pair's bytes.
#
# A channel is one peer's byte path: write a gather list, read into a buffer,
# peek at the next message header without consuming it, the fd poll() waits
# on, and arm/disarm around a sleep.  The engine owns everything else (request
# queues, header checks and matching, the spin and poll loop, deadlines, abort
# spreading) and reaches a channel only through its table of operations, one
# indirect call each, without the GIL.
#
# Channels: _socket.pyx (a TCP socket), _tls.pyx (TLS over that socket, which
# derives from it and overrides the byte path), _shm.pyx (a shared-memory ring
# with the socket as its doorbell).  A new kind is one new file: the functions
# of a ChannelOps table (the defaults below where nothing is special), a C
# struct of the kind's own state, and a subclass of Channel that owns a
# ChannelBase and that struct, points ``base`` at the one and ``base.state``
# at the other; Engine.set_channel takes it.
#
# Return conventions, as the syscalls they stand for on a non-blocking socket:
# writev/readv give a byte count, readv 0 at the end of the stream, -1 with
# errno set (EAGAIN: nothing now; EINTR: try again; anything else: the pair is
# broken).  peek gives the header bytes there are (0: end of stream; -1 with
# errno EAGAIN when none are there yet).
from libc.stdint cimport int32_t, uint8_t, uint32_t, uint64_t
from posix.uio cimport iovec

cdef enum:
    MAGIC_DATA = 0x314d4350     # "PCM1" little-endian
    MAGIC_ABORT = 0x414d4350    # "PCMA"
    MAGIC_BY_ADDRESS = 0x434d4350   # "PCMC": a data message whose payload the receiver
                                    # reads from the sender's memory (the stream carries
                                    # its address)
    MAGIC_RESET = 0x524d4350    # "PCMR": recover()'s frame: the stream starts afresh after it
    MAGIC_REFUSED = 0x584d4350  # "PCMX": the sender refused its arguments to collective seq;
                                # the payload (nbytes, at most REASON_BYTES of
                                # _transport.pxd) says why
    HDR_BYTES = 40
    CHANNEL_ABI = 4             # the version of ChannelOps below (2: send_frame says if it sent;
                                # 3: write_remote; 4: room)

cdef union HeaderWord:
    uint32_t group_id   # data and refused frames: the group's id (OpDesc.group_id)
    uint32_t error_kind # abort frames: the kind of the first failure

cdef packed struct MsgHeader:
    uint32_t magic
    uint32_t msgno      # per pair and direction, counts every data message (abort and
                        # refused: the rank it comes from + 1)
    uint32_t seq
    uint8_t coll
    uint8_t dtype
    uint8_t redop
    uint8_t algo
    int32_t root
    HeaderWord word
    uint64_t count
    uint64_t nbytes     # payload bytes (abort: the blamed rank + 1, 0 for none)

ctypedef struct ChannelBase

ctypedef struct ChannelOps:
    int abi                                     # CHANNEL_ABI
    ssize_t (*writev)(ChannelBase* c, iovec* iov, int cnt) noexcept nogil
    ssize_t (*readv)(ChannelBase* c, iovec* iov, int cnt) noexcept nogil
    int (*peek)(ChannelBase* c, MsgHeader* h) noexcept nogil
    # consume the header the last peek returned
    int (*take_peeked)(ChannelBase* c, MsgHeader* h) noexcept nogil
    # bytes ready to read that poll() on fd would not show
    size_t (*held)(ChannelBase* c) noexcept nogil
    # the poll() events on fd that mean progress is possible
    short (*events)(ChannelBase* c, int want_out, int want_in) noexcept nogil
    # about to sleep in poll(): ask to be woken; 1 if work is already there
    int (*arm)(ChannelBase* c, int want_in, int want_out, uint64_t ack_needed) noexcept nogil
    void (*disarm)(ChannelBase* c) noexcept nogil
    # poll() reported fd: consume what only wakes (a doorbell), note the end
    void (*woken)(ChannelBase* c) noexcept nogil
    # best effort, whole or not at all: one header (an abort frame); 1 if it went
    int (*send_frame)(ChannelBase* c, const MsgHeader* h) noexcept nogil
    # this side ends (after an abort frame)
    void (*shut)(ChannelBase* c) noexcept nogil
    # copy n bytes at addr in the peer's memory to dst: a count, or -1 and errno
    ssize_t (*read_remote)(ChannelBase* c, void* dst, uint64_t addr, size_t n) noexcept nogil
    # copy n bytes at src to addr in the peer's memory (where reads_remote: access to the
    # peer's memory goes both ways): a count, or -1 and errno
    ssize_t (*write_remote)(ChannelBase* c, uint64_t addr, const void* src, size_t n) noexcept nogil
    # how many by-address messages the peer has copied out so far
    uint64_t (*acked)(ChannelBase* c) noexcept nogil
    # one more of the peer's by-address messages has been copied out
    void (*ack)(ChannelBase* c) noexcept nogil
    # bytes that a writev takes whole now, without the peer reading anything first (0 where
    # the kind cannot tell): a send that fits needs nobody to end (Engine.sends_now)
    size_t (*room)(ChannelBase* c) noexcept nogil

ctypedef struct ChannelBase:
    const ChannelOps* ops
    void* state                 # the kind's own state
    int fd                      # what poll() waits on for this pair (-1: nothing)
    int eof                     # the peer ended its side of the stream
    int split_header            # read a header alone before its payload
    size_t by_address_min       # sends from this many bytes go by address (0: never)
    size_t eager_max            # ... but an async send up to this many bytes goes through
                                # the stream, which takes it now: it ends at once
    int reads_remote            # this rank may read the peer's memory (read_remote)
    const char* send_call       # the syscall a failed write names
    const char* recv_call       # ... a failed read
    const char* remote_call     # ... a failed read of the peer's memory
    const char* write_call      # ... and a failed write to it

cdef class Channel:
    cdef ChannelBase* base      # what the engine reads and calls (ops, fd, eof, ...)

# A table of defaults (a plain byte stream with nothing else), that a kind then
# fills with its own byte path (writev, readv, peek) and whatever else it has.
cdef void default_ops(ChannelOps* ops) noexcept
# The defaults, one by one.
cdef int take_peeked_by_reading(ChannelBase* c, MsgHeader* h) noexcept nogil
cdef size_t held_nothing(ChannelBase* c) noexcept nogil
cdef short events_as_asked(ChannelBase* c, int want_out, int want_in) noexcept nogil
cdef int arm_nothing(ChannelBase* c, int want_in, int want_out, uint64_t ack_needed) noexcept nogil
cdef void disarm_nothing(ChannelBase* c) noexcept nogil
cdef void woken_nothing(ChannelBase* c) noexcept nogil
cdef int send_frame_by_writing(ChannelBase* c, const MsgHeader* h) noexcept nogil
cdef void shut_nothing(ChannelBase* c) noexcept nogil
cdef ssize_t write_remote_unsupported(ChannelBase* c, uint64_t addr, const void* src,
                                      size_t n) noexcept nogil
cdef ssize_t read_remote_unsupported(ChannelBase* c, void* dst, uint64_t addr,
                                     size_t n) noexcept nogil
cdef uint64_t acked_none(ChannelBase* c) noexcept nogil
cdef void ack_nothing(ChannelBase* c) noexcept nogil
cdef size_t room_unknown(ChannelBase* c) noexcept nogil
