# The reduce_scatter's async steps (equal blocks, begun in the call: through the flags, or
# the ring's exchange of 2 ranks), for the compiled call path (_call.pyx).
from pycollect._ext._transport cimport Transport

cpdef int reduce_scatter(Transport t, object sendbuf, object recvbuf, object counts, int op,
                         unsigned int seq, double timeout, size_t segment_bytes) except? -1

cpdef int reduce_scatter_begin(Transport t, object sendbuf, object recvbuf, int op,
                               unsigned int seq, double timeout,
                               size_t segment_bytes) except? -1
cpdef int reduce_scatter_end(Transport t, object sendbuf, object recvbuf, int op, int algo,
                             unsigned int seq, double timeout) except? -1
