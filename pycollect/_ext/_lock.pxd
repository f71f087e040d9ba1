# The lock of a context and its sub-groups, and the guard of its runner (_lock.pyx).

cdef extern from "<semaphore.h>" nogil:
    ctypedef struct sem_t:
        pass

cdef class CallLock:
    cdef int held
    cdef int waiters
    cdef sem_t wake

    cdef bint take(self) noexcept
    cdef bint try_take(self) noexcept
    cdef void wait(self) noexcept
    cdef void give(self) noexcept
    cdef bint is_wanted(self) noexcept
