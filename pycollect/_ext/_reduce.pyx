"""Reduction kernels, written once with fused types.

``reduce_into(out, a, b, n, dtype, op)`` computes ``out[i] = a[i] op b[i]``;
``out`` may alias ``a`` or ``b``.  The loops are plain pointer loops over one
C type each, which GCC vectorises at -O3: those of the integers and the floating
types in C (_loops.h: built for AVX2 and the baseline, float16 through the CPU's
F16C conversions where it has them), bool's and complex's here.  Integer arithmetic wraps like
NumPy's (the extension is built with -fwrapv).  MIN and MAX propagate NaN like
``np.minimum``/``np.maximum``.  float16 and bfloat16 are computed in float32
and rounded to nearest even, as NumPy does.  AVG reduces like SUM; the
division by the number of ranks happens once, at the end, in ``divide_by``.
"""

from libc.stdint cimport (int8_t, int16_t, int32_t, int64_t, uint8_t, uint16_t,
                          uint32_t, uint64_t)

from pycollect._ext._dtypes cimport *
from pycollect._ext._buffer cimport Buffer, as_buffer

from pycollect.errors import InvalidArgument
from pycollect.types import DTYPES, ReduceOp

cdef extern from "_loops.h":
    int PC_K_SUM, PC_K_PRODUCT, PC_K_MIN, PC_K_MAX, PC_K_BAND, PC_K_BOR, PC_K_BXOR
    void pc_int8_loop(int8_t* out, const int8_t* a, const int8_t* b, size_t n,
                      int kind) noexcept nogil
    void pc_uint8_loop(uint8_t* out, const uint8_t* a, const uint8_t* b, size_t n,
                       int kind) noexcept nogil
    void pc_int16_loop(int16_t* out, const int16_t* a, const int16_t* b, size_t n,
                       int kind) noexcept nogil
    void pc_uint16_loop(uint16_t* out, const uint16_t* a, const uint16_t* b, size_t n,
                        int kind) noexcept nogil
    void pc_int32_loop(int32_t* out, const int32_t* a, const int32_t* b, size_t n,
                       int kind) noexcept nogil
    void pc_uint32_loop(uint32_t* out, const uint32_t* a, const uint32_t* b, size_t n,
                        int kind) noexcept nogil
    void pc_int64_loop(int64_t* out, const int64_t* a, const int64_t* b, size_t n,
                       int kind) noexcept nogil
    void pc_uint64_loop(uint64_t* out, const uint64_t* a, const uint64_t* b, size_t n,
                        int kind) noexcept nogil
    void pc_float32_loop(float* out, const float* a, const float* b, size_t n,
                         int kind) noexcept nogil
    void pc_float64_loop(double* out, const double* a, const double* b, size_t n,
                         int kind) noexcept nogil
    void pc_float32_divide(float* buf, size_t n, float d) noexcept nogil
    void pc_float64_divide(double* buf, size_t n, double d) noexcept nogil
    void pc_float16_loop(uint16_t* out, const uint16_t* a, const uint16_t* b, size_t n,
                         int kind) noexcept nogil
    void pc_bfloat16_loop(uint16_t* out, const uint16_t* a, const uint16_t* b, size_t n,
                          int kind) noexcept nogil
    void pc_float16_divide(uint16_t* buf, size_t n, float d) noexcept nogil
    void pc_bfloat16_divide(uint16_t* buf, size_t n, float d) noexcept nogil
    int pc_f16c_set(int on) noexcept nogil
    int pc_f16c_on() noexcept nogil

ctypedef fused cplx_t:
    float complex
    double complex


cdef int _ITEMSIZE[DT_COUNT]
_ITEMSIZE[:] = [1, 1, 2, 2, 4, 4, 8, 8, 1, 2, 2, 4, 8, 8, 16]


cdef int dtype_itemsize(int dtype) noexcept nogil:
    return _ITEMSIZE[dtype] if 0 <= dtype < DT_COUNT else 0


cdef void _cplx_kernel(cplx_t* out, const cplx_t* a, const cplx_t* b, size_t n,
                       int op) noexcept nogil:
    cdef size_t i
    if op == OP_SUM or op == OP_AVG:
        for i in range(n):
            out[i] = a[i] + b[i]
    elif op == OP_PRODUCT:
        for i in range(n):
            out[i] = a[i] * b[i]


cdef inline int _loop_kind(int op) noexcept nogil:
    """The operation of _loops.h's loops for ``op`` (AVG reduces like SUM)."""
    if op == OP_PRODUCT:
        return PC_K_PRODUCT
    if op == OP_MIN:
        return PC_K_MIN
    if op == OP_MAX:
        return PC_K_MAX
    if op == OP_BAND:
        return PC_K_BAND
    if op == OP_BOR:
        return PC_K_BOR
    if op == OP_BXOR:
        return PC_K_BXOR
    return PC_K_SUM


cdef void _bool_kernel(uint8_t* out, const uint8_t* a, const uint8_t* b, size_t n,
                       int op) noexcept nogil:
    # NumPy's bool arithmetic: + is OR, * is AND, min is AND, max is OR.  Any
    # non-zero byte is True (views can hold other bytes); results are 0 or 1.
    cdef size_t i
    if op == OP_SUM or op == OP_MAX or op == OP_BOR:
        for i in range(n):
            out[i] = (a[i] != 0) | (b[i] != 0)
    elif op == OP_PRODUCT or op == OP_MIN or op == OP_BAND:
        for i in range(n):
            out[i] = (a[i] != 0) & (b[i] != 0)
    elif op == OP_BXOR:
        for i in range(n):
            out[i] = (a[i] != 0) ^ (b[i] != 0)


cdef int reduce_into(void* out, const void* a, const void* b, size_t n,
                     int dtype, int op) noexcept nogil:
    """out = a op b over n elements of ``dtype``; -1 for a pair check_op rejects."""
    cdef int kind = _loop_kind(op)      # for the loops of _loops.h
    if dtype == DT_INT8:
        pc_int8_loop(<int8_t*>out, <const int8_t*>a, <const int8_t*>b, n, kind)
    elif dtype == DT_UINT8:
        pc_uint8_loop(<uint8_t*>out, <const uint8_t*>a, <const uint8_t*>b, n, kind)
    elif dtype == DT_INT16:
        pc_int16_loop(<int16_t*>out, <const int16_t*>a, <const int16_t*>b, n, kind)
    elif dtype == DT_UINT16:
        pc_uint16_loop(<uint16_t*>out, <const uint16_t*>a, <const uint16_t*>b, n, kind)
    elif dtype == DT_INT32:
        pc_int32_loop(<int32_t*>out, <const int32_t*>a, <const int32_t*>b, n, kind)
    elif dtype == DT_UINT32:
        pc_uint32_loop(<uint32_t*>out, <const uint32_t*>a, <const uint32_t*>b, n, kind)
    elif dtype == DT_INT64:
        pc_int64_loop(<int64_t*>out, <const int64_t*>a, <const int64_t*>b, n, kind)
    elif dtype == DT_UINT64:
        pc_uint64_loop(<uint64_t*>out, <const uint64_t*>a, <const uint64_t*>b, n, kind)
    elif dtype == DT_BOOL:
        _bool_kernel(<uint8_t*>out, <const uint8_t*>a, <const uint8_t*>b, n, op)
    elif dtype == DT_FLOAT32:
        pc_float32_loop(<float*>out, <const float*>a, <const float*>b, n, kind)
    elif dtype == DT_FLOAT64:
        pc_float64_loop(<double*>out, <const double*>a, <const double*>b, n, kind)
    elif dtype == DT_FLOAT16:
        pc_float16_loop(<uint16_t*>out, <const uint16_t*>a, <const uint16_t*>b, n, kind)
    elif dtype == DT_BFLOAT16:
        pc_bfloat16_loop(<uint16_t*>out, <const uint16_t*>a, <const uint16_t*>b, n, kind)
    elif dtype == DT_COMPLEX64:
        _cplx_kernel(<float complex*>out, <const float complex*>a,
                     <const float complex*>b, n, op)
    elif dtype == DT_COMPLEX128:
        _cplx_kernel(<double complex*>out, <const double complex*>a,
                     <const double complex*>b, n, op)
    else:
        return -1
    return 0


cdef void divide_by(void* buf, size_t n, int dtype, double divisor) noexcept nogil:
    """buf[i] /= divisor, for the floating and complex types (the tail of AVG)."""
    cdef size_t i
    cdef float fd = <float>divisor
    if dtype == DT_FLOAT32:
        pc_float32_divide(<float*>buf, n, fd)
    elif dtype == DT_FLOAT64:
        pc_float64_divide(<double*>buf, n, divisor)
    elif dtype == DT_COMPLEX64:
        for i in range(n):
            (<float complex*>buf)[i] = (<float complex*>buf)[i] / fd
    elif dtype == DT_COMPLEX128:
        for i in range(n):
            (<double complex*>buf)[i] = (<double complex*>buf)[i] / divisor
    elif dtype == DT_FLOAT16:
        pc_float16_divide(<uint16_t*>buf, n, fd)
    elif dtype == DT_BFLOAT16:
        pc_bfloat16_divide(<uint16_t*>buf, n, fd)


cdef int check_op(int dtype, int op, str where) except -1:
    """Raise InvalidArgument unless ``op`` is defined on ``dtype``."""
    if not 0 <= op < OP_COUNT:
        raise InvalidArgument("%s: unknown reduction op %r" % (where, op))
    cdef bint is_int = DT_UINT8 <= dtype <= DT_UINT64
    cdef bint is_float = DT_FLOAT16 <= dtype <= DT_FLOAT64
    cdef bint is_complex = dtype == DT_COMPLEX64 or dtype == DT_COMPLEX128
    if op == OP_SUM or op == OP_PRODUCT:
        return 0    # the common case, defined on every dtype
    reason = None
    if op == OP_AVG and not (is_float or is_complex):
        reason = "AVG is defined for floating and complex types only; use SUM and divide"
    elif op in (OP_BAND, OP_BOR, OP_BXOR) and not (is_int or dtype == DT_BOOL):
        reason = "bitwise ops need an integer or bool dtype"
    elif op in (OP_MIN, OP_MAX) and is_complex:
        reason = "complex numbers have no order"
    if reason is not None:
        raise InvalidArgument("%s: op %s is not defined on %s: %s"
                              % (where, ReduceOp(op).name, DTYPES.get(dtype), reason))
    return 0


def check_reduction(int dtype, op, str where):
    """Raise InvalidArgument unless reduction ``op`` is defined on the dtype code ``dtype``."""
    check_op(dtype, int(op), where)


def reduce(out, a, b, op):
    """out = a op b element-wise, in compiled code (a test and debugging aid)."""
    cdef Buffer bo = as_buffer(out, "reduce", "out", True)
    cdef Buffer ba = as_buffer(a, "reduce", "a", False)
    cdef Buffer bb = as_buffer(b, "reduce", "b", False)
    if not (bo.dtype == ba.dtype == bb.dtype and bo.count == ba.count == bb.count):
        raise InvalidArgument("reduce: out, a and b must share dtype and size")
    check_op(bo.dtype, int(op), "reduce")
    cdef int code = int(op)
    with nogil:
        reduce_into(bo.ptr, ba.ptr, bb.ptr, <size_t>bo.count, bo.dtype, code)
    return out


def divide(buf, double divisor):
    """buf /= divisor in place, as AVG finishes (a test aid)."""
    cdef Buffer b = as_buffer(buf, "divide", "buf", True)
    if not (DT_FLOAT16 <= b.dtype <= DT_FLOAT64 or b.dtype == DT_COMPLEX64
            or b.dtype == DT_COMPLEX128):
        raise InvalidArgument("divide: %s is not a floating or complex type" % DTYPES.get(b.dtype))
    with nogil:
        divide_by(b.ptr, <size_t>b.count, b.dtype, divisor)
    return buf


def float16_simd(on=None):
    """Whether float16's loops use the CPU's F16C conversions; ``on`` (a bool) turns them
    on or off first (a test aid: both paths must give the same bits).  They stay off
    where the CPU lacks F16C."""
    if on is not None:
        pc_f16c_set(1 if on else 0)
    return bool(pc_f16c_on())
