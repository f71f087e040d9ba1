"""Reduction operations and the dtype table shared by every layer."""

import enum

__all__ = ["ReduceOp", "DTYPES", "dtype_name"]


class ReduceOp(enum.IntEnum):
    """Element-wise reduction applied by reduce, allreduce and reduce_scatter."""

    SUM = 0
    PRODUCT = 1
    MIN = 2
    MAX = 3
    AVG = 4
    BAND = 5
    BOR = 6
    BXOR = 7


# Wire codes of the element types.  They travel in every message header, so a
# code, once given, never changes meaning.  The compiled side mirrors this
# table in pycollect/_ext/_dtypes.pxd.
DTYPES = {
    0: "uint8",   # also raw bytes (bytearray, memoryview of 'B')
    1: "int8",
    2: "int16",
    3: "uint16",
    4: "int32",
    5: "uint32",
    6: "int64",
    7: "uint64",
    8: "bool",
    9: "float16",
    10: "bfloat16",
    11: "float32",
    12: "float64",
    13: "complex64",
    14: "complex128",
}


def dtype_name(code):
    """Return the NumPy name of a dtype wire code."""
    return DTYPES.get(code, "dtype#%d" % code)
