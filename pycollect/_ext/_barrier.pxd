# barrier's compiled entry point, for the compiled call path (_call.pyx).
from pycollect._ext._transport cimport Transport

cpdef int barrier(Transport t, unsigned int seq, double timeout) except? -1
cpdef int barrier_begin(Transport t, unsigned int seq, double timeout) except? -1
cpdef int barrier_end(Transport t, unsigned int seq, double timeout) except? -1
