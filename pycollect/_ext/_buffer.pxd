from cpython.buffer cimport Py_buffer

cdef class Buffer:
    """A user array pinned for the length of one operation."""
    cdef Py_buffer view
    cdef bint has_view
    cdef readonly object obj
    cdef char* ptr
    cdef readonly Py_ssize_t nbytes
    cdef readonly Py_ssize_t count
    cdef readonly int dtype
    cdef readonly int itemsize
    cdef readonly bint readonly

cdef Buffer as_buffer(object obj, str op, str arg, bint writable)
