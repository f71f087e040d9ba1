# broadcast's compiled entry point, for the compiled call path (_call.pyx).
from pycollect._ext._transport cimport Transport

cpdef int broadcast(Transport t, object buf, int root, int algo, unsigned int seq, double timeout,
                    size_t segment_bytes) except? -1
cpdef int broadcast_begin(Transport t, object buf, int root, int algo, unsigned int seq,
                          double timeout) except? -1
cpdef int broadcast_end(Transport t, object buf, int root, int algo, unsigned int seq,
                        double timeout) except? -1
