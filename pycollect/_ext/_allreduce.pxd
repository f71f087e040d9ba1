# allreduce's compiled entry point, for the compiled call path (_call.pyx).
from pycollect._ext._transport cimport Transport

cpdef int allreduce(Transport t, object buf, int op, int algo, unsigned int seq, double timeout,
                    size_t segment_bytes, int base=*) except? -1
cpdef int allreduce_begin(Transport t, object buf, int op, int algo, unsigned int seq,
                          double timeout) except? -1
cpdef int allreduce_step(Transport t, object buf, int op, unsigned int seq, double timeout,
                         size_t segment_bytes, bint staged) except? -1
cpdef int allreduce_end(Transport t, object buf, int op, int algo, unsigned int seq,
                        double timeout, size_t segment_bytes=*, bint staged=*,
                        bint stepped=*) except? -1
