# The alltoall's async steps (begun in the call: through the flags, or the exchange of 2
# ranks), for the compiled call path (_call.pyx).
from pycollect._ext._transport cimport Transport

cpdef int alltoall(Transport t, object sendbuf, object sendcounts, object recvbuf,
                   object recvcounts, unsigned int seq, double timeout) except? -1

cpdef int alltoall_begin(Transport t, object sendbuf, object recvbuf, unsigned int seq,
                         double timeout) except? -1
cpdef int alltoall_end(Transport t, object sendbuf, object recvbuf, int algo,
                       unsigned int seq, double timeout) except? -1
