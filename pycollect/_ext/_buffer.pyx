"""The one gatekeeper between user objects and the compiled layers.

``as_buffer`` turns a NumPy array, bytearray, memoryview or any other
C-contiguous buffer-protocol object into pointer, byte count, element count
and dtype code, or raises ``InvalidArgument`` naming the operation, the
argument and the reason.
"""

cimport cython
from cpython.buffer cimport (PyBUF_FORMAT, PyBUF_RECORDS_RO, PyBuffer_IsContiguous,
                             PyBuffer_Release, PyObject_GetBuffer)
from cpython.pyport cimport PY_SSIZE_T_MAX
from libc.stdlib cimport free, malloc
cimport numpy as cnp

from pycollect._ext._dtypes cimport *

from operator import index as _index

import numpy as np

from pycollect.errors import InvalidArgument
from pycollect.types import DTYPES

cnp.import_array()

cdef enum:
    MAX_TYPENUM = 64

# NumPy type number -> wire code (-1 where unsupported), filled at import.
cdef int _typenum_code[MAX_TYPENUM]

_CODE_BY_KIND = {
    ("b", 1): DT_BOOL,
    ("i", 1): DT_INT8, ("i", 2): DT_INT16, ("i", 4): DT_INT32, ("i", 8): DT_INT64,
    ("u", 1): DT_UINT8, ("u", 2): DT_UINT16, ("u", 4): DT_UINT32, ("u", 8): DT_UINT64,
    ("f", 2): DT_FLOAT16, ("f", 4): DT_FLOAT32, ("f", 8): DT_FLOAT64,
    ("c", 8): DT_COMPLEX64, ("c", 16): DT_COMPLEX128,
}

# PEP 3118 format characters (native size) -> NumPy kind.
_KIND_BY_FORMAT = {
    "?": "b", "b": "i", "h": "i", "i": "i", "l": "i", "q": "i", "n": "i",
    "B": "u", "H": "u", "I": "u", "L": "u", "Q": "u", "N": "u", "c": "u",
    "e": "f", "f": "f", "d": "f", "Zf": "c", "Zd": "c",
}


def _init_tables():
    for i in range(MAX_TYPENUM):
        _typenum_code[i] = -1
    for ch in np.typecodes["AllInteger"] + np.typecodes["Float"] + np.typecodes["Complex"] + "?":
        dt = np.dtype(ch)
        code = _CODE_BY_KIND.get((dt.kind, dt.itemsize), -1)
        if dt.num < MAX_TYPENUM:
            _typenum_code[dt.num] = code


_init_tables()


cdef inline object _reject(str op, str arg, str reason):
    return InvalidArgument("%s: argument '%s' %s" % (op, arg, reason))


@cython.freelist(16)
cdef class Buffer:
    def __dealloc__(self):
        if self.has_view:
            PyBuffer_Release(&self.view)
            self.has_view = False

    def __repr__(self):
        return "<Buffer %s x %d, %d bytes%s>" % (
            DTYPES.get(self.dtype), self.count, self.nbytes, ", read-only" if self.readonly else "")


cdef int _ndarray_code(cnp.ndarray arr, str op, str arg) except -2:
    cdef int num = cnp.PyArray_TYPE(arr)
    if 0 <= num < MAX_TYPENUM and _typenum_code[num] >= 0:
        if not cnp.PyArray_ISNOTSWAPPED(arr):
            raise _reject(op, arg, "has non-native byte order (%s); convert it with "
                          "arr.astype(arr.dtype.newbyteorder('='))" % arr.dtype.str)
        return _typenum_code[num]
    # bfloat16 is a dtype of ml_dtypes (or of a package built on it), known by its name: an
    # array of it exists only once that package is loaded, so this module never imports
    # ml_dtypes (whose import costs about 0.4 s of every rank's start).
    if arr.dtype.name == "bfloat16" and cnp.PyArray_ITEMSIZE(arr) == 2:
        if not cnp.PyArray_ISNOTSWAPPED(arr):
            raise _reject(op, arg, "has non-native byte order (%s); convert it with "
                          "arr.astype(arr.dtype.newbyteorder('='))" % arr.dtype.str)
        return DT_BFLOAT16
    raise _reject(op, arg, "has unsupported dtype %s (supported: %s)"
                  % (arr.dtype, ", ".join(DTYPES.values())))


cdef int _view_ndarray(cnp.ndarray arr, View* v, str op, str arg, bint writable) except -1:
    v.dtype = _ndarray_code(arr, op, arg)
    if not cnp.PyArray_IS_C_CONTIGUOUS(arr):
        raise _reject(op, arg, "is not C-contiguous (shape %s, strides %s); pass "
                      "np.ascontiguousarray(...) and copy the result back"
                      % ((<object>arr).shape, (<object>arr).strides))
    v.readonly = not cnp.PyArray_ISWRITEABLE(arr)
    if writable and v.readonly:
        raise _reject(op, arg, "is read-only but receives the result")
    v.ptr = <char*>cnp.PyArray_DATA(arr)
    v.itemsize = <int>cnp.PyArray_ITEMSIZE(arr)
    v.count = cnp.PyArray_SIZE(arr)
    v.nbytes = v.count * v.itemsize
    return 0


cdef Buffer _from_ndarray(cnp.ndarray arr, str op, str arg, bint writable):
    cdef Buffer b = Buffer.__new__(Buffer)
    cdef View v
    _view_ndarray(arr, &v, op, arg, writable)
    b.obj = arr
    b.ptr, b.nbytes, b.count, b.itemsize = v.ptr, v.nbytes, v.count, v.itemsize
    b.dtype, b.readonly = v.dtype, v.readonly
    return b


cdef int _format_code(str fmt, Py_ssize_t itemsize, str op, str arg) except -2:
    cdef str f = fmt
    if f and f[0] in "@=<>!":
        order = f[0]
        f = f[1:]
        little = np.little_endian
        if (order == ">" or order == "!") and little or order == "<" and not little:
            raise _reject(op, arg, "has non-native byte order (format %r)" % fmt)
    kind = _KIND_BY_FORMAT.get(f)
    code = _CODE_BY_KIND.get((kind, itemsize), -1) if kind else -1
    if code < 0:
        raise _reject(op, arg, "has unsupported element format %r (itemsize %d)" % (fmt, itemsize))
    return code


cdef Buffer as_buffer(object obj, str op, str arg, bint writable):
    """Pin ``obj`` for one operation and describe it, or raise InvalidArgument."""
    if isinstance(obj, cnp.ndarray):
        return _from_ndarray(<cnp.ndarray>obj, op, arg, writable)
    if obj is None:
        raise _reject(op, arg, "is None; pass a NumPy array or another C-contiguous buffer")
    if hasattr(obj, "__cuda_array_interface__"):
        raise _reject(op, arg, "is a GPU array; pycollect works on host memory only, over "
                      "every transport (copy it to the host first: cupy.asnumpy(x), "
                      "tensor.cpu())")
    cdef Buffer b = Buffer.__new__(Buffer)
    try:
        PyObject_GetBuffer(obj, &b.view, PyBUF_RECORDS_RO | PyBUF_FORMAT)
    except (TypeError, BufferError) as exc:
        raise _reject(op, arg, "does not support the buffer protocol (%s: %s)"
                      % (type(obj).__name__, exc)) from None
    b.has_view = True
    fmt = b.view.format.decode("ascii") if b.view.format != NULL else "B"
    b.dtype = _format_code(fmt, b.view.itemsize, op, arg)
    if not PyBuffer_IsContiguous(&b.view, b'C'):
        raise _reject(op, arg, "is not C-contiguous")
    b.readonly = b.view.readonly
    if writable and b.readonly:
        raise _reject(op, arg, "is read-only (%s) but receives the result" % type(obj).__name__)
    b.obj = obj
    b.ptr = <char*>b.view.buf
    b.itemsize = <int>b.view.itemsize
    b.nbytes = b.view.len
    b.count = b.nbytes // b.itemsize if b.itemsize else 0
    return b


cdef object pin(object obj, View* v, str op, str arg, bint writable):
    """Describe ``obj`` in ``v`` for one blocking operation, as ``as_buffer`` would, or
    raise InvalidArgument; what the caller keeps until the operation ends: None for a
    NumPy array (the caller's own reference keeps it; no object is made), else the
    ``Buffer`` that holds the exported buffer."""
    cdef Buffer b
    if isinstance(obj, cnp.ndarray):
        _view_ndarray(<cnp.ndarray>obj, v, op, arg, writable)
        return None
    b = as_buffer(obj, op, arg, writable)
    view_of(b, v)
    return b


cdef void view_of(Buffer b, View* v) noexcept:
    """``v`` describes what ``b`` pins."""
    v.ptr, v.nbytes, v.count, v.itemsize = b.ptr, b.nbytes, b.count, b.itemsize
    v.dtype, v.readonly = b.dtype, b.readonly


def describe(obj, bint writable=False):
    """Return (dtype code, element count, byte count) as the gatekeeper sees ``obj``."""
    cdef Buffer b = as_buffer(obj, "describe", "obj", writable)
    return b.dtype, b.count, b.nbytes


cdef size_t* counts_array(object counts, int size, str op, str arg) except NULL:
    """A malloc'd array of ``size`` element counts from a Python sequence of integers
    (caller frees; Python's or NumPy's, as ``operator.index`` takes them: a float is
    refused).  A list or tuple is read in place (no copy, no conversion of its ints)."""
    cdef size_t* out
    cdef Py_ssize_t i, v, total = 0
    values = counts
    if type(counts) is not list and type(counts) is not tuple:
        try:
            values = [_index(c) for c in counts]
        except (TypeError, ValueError):
            raise _reject(op, arg, "must be a sequence of %d integer counts, got %r"
                          % (size, counts)) from None
    if len(values) != size:
        raise _reject(op, arg, "has %d entries; the group has %d ranks" % (len(values), size))
    out = <size_t*>malloc((size + 1) * sizeof(size_t))
    if out == NULL:
        raise MemoryError()
    try:
        for i in range(size):
            c = values[i]
            if type(c) is not int:
                try:
                    c = _index(c)       # NumPy's integers; a float is refused
                except (TypeError, ValueError):
                    raise _reject(op, arg, "must be a sequence of %d integer counts, got %r"
                                  % (size, counts)) from None
            try:
                v = c
            except OverflowError:
                raise _reject(op, arg, "has a count too large for rank %d" % i) from None
            if v < 0:
                raise _reject(op, arg, "has a negative count %d for rank %d" % (v, i))
            if v > PY_SSIZE_T_MAX - total:      # offsets and totals are sums of counts
                raise _reject(op, arg, "adds up to more than %d elements" % PY_SSIZE_T_MAX)
            total += v
            out[i] = <size_t>v
    except BaseException:
        free(out)
        raise
    return out


cdef size_t* filled_array(int size, size_t value) except NULL:
    """A malloc'd array of ``size`` + 1 copies of ``value`` (caller frees): counts_array's
    result for equal counts (or zeros for offsets) without a Python list."""
    cdef size_t* out = <size_t*>malloc((size + 1) * sizeof(size_t))
    cdef int i
    if out == NULL:
        raise MemoryError()
    for i in range(size + 1):
        out[i] = value
    return out


cdef int check_pair(View send, View recv, str op) except -1:
    """Refuse a send and a receive buffer of different dtypes."""
    if send.dtype != recv.dtype:
        raise InvalidArgument("%s: 'sendbuf' holds %s but 'recvbuf' holds %s"
                              % (op, DTYPES.get(send.dtype), DTYPES.get(recv.dtype)))
    return 0


cdef int check_apart(View send, View recv, str op, str in_place, char* send_at=NULL,
                     char* recv_at=NULL) except -1:
    """Refuse a send and a receive buffer that share memory.  The algorithms write the one
    while they, and over shared memory the peers, still read the other, so overlapping bytes
    would come out silently wrong.  The one exception is a collective's in-place form:
    ``send`` starting at ``send_at``, or ``recv`` at ``recv_at`` (NULL: no such form), the
    counts, checked after, making it exactly that block; ``in_place`` names the form in the
    message ("" where the collective has none)."""
    if (send.nbytes > 0 and recv.nbytes > 0
            and send.ptr < recv.ptr + recv.nbytes and recv.ptr < send.ptr + send.nbytes
            and not (send_at != NULL and send.ptr == send_at)
            and not (recv_at != NULL and recv.ptr == recv_at)):
        raise InvalidArgument("%s: 'sendbuf' and 'recvbuf' overlap in memory; pass arrays "
                              "that do not%s" % (op, in_place))
    return 0


def apart(sendbuf, recvbuf, str op, str in_place=""):
    """Refuse ``sendbuf`` and ``recvbuf`` where they overlap in memory, as the compiled
    collectives do (``check_apart``; no in-place form)."""
    cdef View send, recv
    held_send = pin(sendbuf, &send, op, "sendbuf", False)
    held_recv = pin(recvbuf, &recv, op, "recvbuf", True)
    check_apart(send, recv, op, in_place)


cdef int check_count(View b, Py_ssize_t expected, str op, str arg, str why,
                     Py_ssize_t index=-1) except -1:
    """Refuse a buffer whose element count is not ``expected`` (``why``: the rule it breaks;
    with ``index``, formatted with it, and only then: "counts[%d]")."""
    if b.count != expected:
        raise _reject(op, arg, "holds %d elements but must hold %d (%s)"
                      % (b.count, expected, why if index < 0 else why % index))
    return 0


def check(obj, str op, str arg, bint writable=False):
    """Validate ``obj`` as the gatekeeper does for ``op``; return (dtype code, element count)."""
    cdef Buffer b = as_buffer(obj, op, arg, writable)
    return b.dtype, b.count
