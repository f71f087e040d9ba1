# Wire codes of the element types; mirrors pycollect/types.py DTYPES.
cdef enum:
    DT_UINT8 = 0
    DT_INT8 = 1
    DT_INT16 = 2
    DT_UINT16 = 3
    DT_INT32 = 4
    DT_UINT32 = 5
    DT_INT64 = 6
    DT_UINT64 = 7
    DT_BOOL = 8
    DT_FLOAT16 = 9
    DT_BFLOAT16 = 10
    DT_FLOAT32 = 11
    DT_FLOAT64 = 12
    DT_COMPLEX64 = 13
    DT_COMPLEX128 = 14
    DT_COUNT = 15

# Reduction op codes; mirror pycollect.types.ReduceOp.
cdef enum:
    OP_SUM = 0
    OP_PRODUCT = 1
    OP_MIN = 2
    OP_MAX = 3
    OP_AVG = 4
    OP_BAND = 5
    OP_BOR = 6
    OP_BXOR = 7
    OP_COUNT = 8
