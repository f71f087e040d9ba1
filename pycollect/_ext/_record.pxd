# The flight recorder's ring (_record.pyx): compiled callers fill its slots directly.
from cpython.object cimport PyObject
from libc.stdint cimport int64_t

cdef enum:
    N_OBJECTS = 6       # per slot: name, algorithm, dtype, peers, code, error

cdef struct Slot:
    int64_t id
    int64_t seq
    int64_t count
    int64_t root
    int64_t queued_ns      # in the recorder clock's ticks
    int64_t started_ns
    int64_t ended_ns
    int line               # the frame's position: its line, or from 3.11 its last instruction
    int state

cdef extern from *:
    """
    #define PC_RECORD_NONE (-(1LL << 62))
    """
    int64_t NONE "PC_RECORD_NONE"   # a number field left empty (None in entries())

cdef class Ring:
    cdef readonly Py_ssize_t capacity
    cdef readonly Py_ssize_t recorded       # operations ever recorded: the next id
    cdef Py_ssize_t mask                    # slots - 1: entry id's slot is id & mask
    cdef Slot* slots                        # the next power of two of them >= capacity
    cdef PyObject** objects                 # N_OBJECTS per slot, owned references or NULL
    cdef int64_t tick0                      # the clock's ticks and the wall-clock time
    cdef int64_t wall0                      # ... when the ring was made
    cdef object code_outside                # the last code objects the frame walk found
    cdef object code_inside                 # ... outside and inside the package

    cdef Py_ssize_t add(self, object name, object dtype, int64_t count, int64_t root,
                        object peers, bint started=*, int64_t seq=*) except -1
    cdef bint is_outside(self, PyObject* code) noexcept
    cdef Slot* live(self, Py_ssize_t id) noexcept
    cdef void begin(self, Py_ssize_t id, int64_t seq) noexcept
    cdef int end(self, Py_ssize_t id, object algorithm, object error) except -1
    cdef object wall(self, int64_t ticks, double ns_per_tick)
