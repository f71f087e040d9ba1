# A TCP socket as a channel (_socket.pyx); TLS (_tls.pyx) derives from it.
from pycollect._ext._channel cimport Channel, ChannelBase, ChannelOps, MsgHeader

cdef class SocketChannel(Channel):
    cdef ChannelBase sock

cdef void socket_shut(ChannelBase* c) noexcept nogil
cdef void socket_setup(ChannelBase* c, int fd, const ChannelOps* ops) except *
