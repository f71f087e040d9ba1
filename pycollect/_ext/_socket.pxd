# A TCP socket as a channel (_socket.pyx); TLS (_tls.pyx) derives from it.
from pycollect._ext._channel cimport Channel, ChannelBase, ChannelOps, MsgHeader

cdef enum:
    STAGE_BYTES = 8192      # a socket channel's receive staging area
    STAGE_DIRECT = 4096     # a read that still wants this many bytes skips the staging area

# What the stream delivered ahead of the reads: buf[head:tail].
ctypedef struct SocketStage:
    size_t head
    size_t tail
    size_t sndbuf       # the socket's send buffer (SO_SNDBUF) when the channel was made
    size_t room_seen    # _room's last look, less what was written since
    char buf[STAGE_BYTES]

cdef class SocketChannel(Channel):
    cdef ChannelBase sock
    cdef SocketStage* stage     # NULL in a subclass that reads its own way (TLS)

cdef void socket_shut(ChannelBase* c) noexcept nogil
cdef void socket_setup(ChannelBase* c, int fd, const ChannelOps* ops) except *
