# The rooted collectives' entry points (_rooted.pyx), for the compiled call path (_call.pyx)
# to call as C.
from pycollect._ext._transport cimport Transport

cpdef int reduce(Transport t, object buf, int root, int op, int algo, unsigned int seq,
                 double timeout, size_t segment_bytes) except? -1
cpdef int gather(Transport t, object sendbuf, object recvbuf, object counts, int root,
                 unsigned int seq, double timeout) except? -1
cpdef int scatter(Transport t, object sendbuf, object recvbuf, object counts, int root,
                  unsigned int seq, double timeout) except? -1
