# The reduce_scatter's async steps (2 ranks, equal blocks, begun in the call), for the
# compiled call path (_call.pyx).
from pycollect._ext._transport cimport Transport

cpdef int reduce_scatter_begin(Transport t, object sendbuf, object recvbuf, int op,
                               unsigned int seq, double timeout,
                               size_t segment_bytes) except? -1
cpdef int reduce_scatter_end(Transport t, object sendbuf, object recvbuf, int op,
                             unsigned int seq, double timeout) except? -1
