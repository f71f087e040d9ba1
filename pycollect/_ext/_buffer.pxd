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

cdef struct View:
    # What a blocking operation needs of a buffer: ``pin`` fills it.
    char* ptr
    Py_ssize_t nbytes
    Py_ssize_t count
    int dtype
    int itemsize
    bint readonly

cdef Buffer as_buffer(object obj, str op, str arg, bint writable)
cdef object pin(object obj, View* v, str op, str arg, bint writable)
cdef void view_of(Buffer b, View* v) noexcept

cdef size_t* counts_array(object counts, int size, str op, str arg) except NULL
cdef size_t* filled_array(int size, size_t value) except NULL
cdef int check_pair(View send, View recv, str op) except -1
cdef int check_apart(View send, View recv, str op, str in_place, char* send_at=*,
                     char* recv_at=*) except -1
cdef int check_count(View b, Py_ssize_t expected, str op, str arg, str why,
                     Py_ssize_t index=*) except -1
