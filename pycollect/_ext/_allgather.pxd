# The allgather's async steps (equal blocks, begun in the call), for the compiled call
# path (_call.pyx).
from pycollect._ext._transport cimport Transport

cpdef int allgather(Transport t, object sendbuf, object recvbuf, object counts, unsigned int seq,
                    double timeout, size_t segment_bytes, int algo=*) except? -1

cpdef int allgather_begin(Transport t, object sendbuf, object recvbuf, int algo,
                          unsigned int seq, double timeout, size_t segment_bytes) except? -1
cpdef int allgather_step(Transport t, object sendbuf, object recvbuf, unsigned int seq,
                         double timeout, size_t segment_bytes) except? -1
cpdef int allgather_end(Transport t, object sendbuf, object recvbuf, int algo,
                        unsigned int seq, double timeout, size_t segment_bytes,
                        bint stepped) except? -1
