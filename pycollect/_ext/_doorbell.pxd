# The runner thread's doorbell (_doorbell.pyx), as the runner (_work.pyx) rings it without
# Python's call.
from pycollect._ext._lock cimport sem_t

cdef class Doorbell:
    cdef sem_t wake
    cdef long long queued
    cdef long long taken
    cdef int asleep         # sleeping until posted: queue() posts
    cdef int urgent         # the runner must look now: hurry() was called
    cdef int stopped

    cpdef void queue(self) noexcept
    cpdef void hurry(self) noexcept
    cpdef void take(self) noexcept
    cpdef void stop(self) noexcept
