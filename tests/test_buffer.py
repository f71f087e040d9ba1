"""The buffer gatekeeper: what it accepts, how it describes it, what it rejects.

``describe(obj, writable=False)`` returns ``(dtype code, element count, byte
count)`` or raises ``InvalidArgument`` naming the argument and the reason.
"""

import array
import os
import subprocess
import sys

import numpy as np
import pytest

import pycollect
from pycollect import InvalidArgument
from pycollect._ext._buffer import describe
from pycollect.types import DTYPES

try:
    import ml_dtypes
    BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - ml_dtypes is a test dependency
    BFLOAT16 = None

CODE = {name: code for code, name in DTYPES.items()}

NUMPY_DTYPES = [np.dtype(name) for name in (
    "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "bool", "float16", "float32", "float64", "complex64", "complex128")]
if BFLOAT16 is not None:
    NUMPY_DTYPES.append(BFLOAT16)

SHAPES = [(), (0,), (1,), (5,), (2, 3, 4), (2, 0, 3)]


def test_code_table_is_complete():
    assert sorted(DTYPES) == list(range(15))
    assert set(CODE) == {dt.name for dt in NUMPY_DTYPES} | {"bfloat16"}


# --- accepted ----------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)) or "0d")
@pytest.mark.parametrize("dtype", NUMPY_DTYPES, ids=lambda dt: dt.name)
def test_numpy_array_every_dtype_and_shape(dtype, shape):
    arr = np.zeros(shape, dtype=dtype)
    expected = (CODE[dtype.name], arr.size, arr.nbytes)
    assert describe(arr) == expected
    assert describe(arr, writable=True) == expected


@pytest.mark.parametrize("dtype", [dt for dt in NUMPY_DTYPES if dt != BFLOAT16],
                         ids=lambda dt: dt.name)
def test_memoryview_of_numpy_array_matches_the_array(dtype):
    # The PEP 3118 format path must agree with the NumPy type-number path.
    arr = np.zeros((3, 4), dtype=dtype)
    assert describe(memoryview(arr)) == describe(arr) == (CODE[dtype.name], 12, arr.nbytes)


@pytest.mark.parametrize("dtype", ["=i4", "<i8", "|u1", "|b1", "|i1", "=f8"])
def test_explicit_native_or_irrelevant_byte_order(dtype):
    arr = np.zeros(3, dtype=np.dtype(dtype))
    assert np.dtype(dtype).isnative
    assert describe(arr) == (CODE[arr.dtype.name], 3, arr.nbytes)


def test_read_only_array_is_fine_as_input():
    arr = np.arange(6, dtype=np.float32)
    arr.flags.writeable = False
    assert describe(arr) == (CODE["float32"], 6, 24)
    assert describe(np.frombuffer(b"abcdefgh", np.int16)) == (CODE["int16"], 4, 8)


def test_contiguous_views_are_accepted():
    base = np.zeros((4, 5), dtype=np.int64)
    assert describe(base[1:3]) == (CODE["int64"], 10, 80)        # row slice
    assert describe(base[2]) == (CODE["int64"], 5, 40)           # one row
    assert describe(np.zeros((1, 6)).T) == (CODE["float64"], 6, 48)  # size-1 axes
    assert describe(np.zeros(10)[3:7], writable=True) == (CODE["float64"], 4, 32)


def test_bytearray_is_uint8():
    assert describe(bytearray(b"hello")) == (CODE["uint8"], 5, 5)
    assert describe(bytearray(7), writable=True) == (CODE["uint8"], 7, 7)
    assert describe(bytearray()) == (CODE["uint8"], 0, 0)


def test_bytes_are_a_read_only_input():
    assert describe(b"abcdef") == (CODE["uint8"], 6, 6)
    assert describe(b"") == (CODE["uint8"], 0, 0)


@pytest.mark.parametrize("typecode, name", [
    ("d", "float64"), ("f", "float32"), ("b", "int8"), ("B", "uint8"),
    ("h", "int16"), ("H", "uint16"), ("i", "int32"), ("I", "uint32"),
    ("q", "int64"), ("Q", "uint64"),
])
def test_array_module(typecode, name):
    arr = array.array(typecode, range(5))
    expected = (CODE[name], 5, 5 * arr.itemsize)
    assert describe(memoryview(arr)) == expected
    assert describe(arr, writable=True) == expected


def test_memoryview_of_double_array():
    view = memoryview(array.array("d", [1.0, 2.0, 3.0]))
    assert describe(view) == (CODE["float64"], 3, 24)
    assert describe(view, writable=True) == (CODE["float64"], 3, 24)


@pytest.mark.parametrize("make, expected", [
    (lambda: memoryview(bytearray(24)).cast("d"), ("float64", 3, 24)),
    (lambda: memoryview(bytearray(24)).cast("i", (2, 3)), ("int32", 6, 24)),
    (lambda: memoryview(bytearray(8)).cast("?"), ("bool", 8, 8)),
    (lambda: memoryview(bytearray(16)).cast("Q"), ("uint64", 2, 16)),
    (lambda: memoryview(b"ab").cast("c"), ("uint8", 2, 2)),
    (lambda: memoryview(array.array("d", [1.0, 2.0])).cast("B"), ("uint8", 16, 16)),
    (lambda: memoryview(np.zeros(4, np.float32)).cast("B"), ("uint8", 16, 16)),
], ids=["d", "i-2x3", "bool", "Q", "c", "array-d-as-B", "numpy-f4-as-B"])
def test_memoryview_casts(make, expected):
    name, count, nbytes = expected
    assert describe(make()) == (CODE[name], count, nbytes)


# --- rejected ----------------------------------------------------------------


class FakeCupyArray:
    """Just enough of a GPU array: the CUDA array interface, no host buffer."""

    @property
    def __cuda_array_interface__(self):
        return {"shape": (4,), "typestr": "<f4", "data": (0xDEADBEEF, False), "version": 3}


def _read_only(arr):
    arr.flags.writeable = False
    return arr


REJECTED = [
    # id, factory, writable, substrings the message must contain
    ("every-2nd", lambda: np.arange(10.0)[::2], False, ["C-contiguous"]),
    ("reversed", lambda: np.arange(10.0)[::-1], False, ["C-contiguous"]),
    ("transpose-2d", lambda: np.zeros((3, 4)).T, False, ["C-contiguous"]),
    ("column-slice", lambda: np.zeros((4, 4))[:, :2], False, ["C-contiguous"]),
    ("fortran-order", lambda: np.zeros((3, 4), order="F"), False, ["C-contiguous"]),
    ("memoryview-strided", lambda: memoryview(bytearray(10))[::2], False, ["C-contiguous"]),
    ("memoryview-transpose", lambda: memoryview(np.zeros((2, 3)).T), False, ["C-contiguous"]),
    ("big-endian-i4", lambda: np.arange(4, dtype=">i4"), False, ["byte order"]),
    ("big-endian-f8", lambda: np.arange(4, dtype=">f8"), False, ["byte order"]),
    ("big-endian-f2", lambda: np.arange(4, dtype=">f2"), False, ["byte order"]),
    ("big-endian-c16", lambda: np.arange(4, dtype=">c16"), False, ["byte order"]),
    ("memoryview-big-endian", lambda: memoryview(np.arange(4, dtype=">i4")), False,
     ["byte order"]),
    ("object", lambda: np.array([1, "a", None], dtype=object), False, ["unsupported"]),
    ("datetime64", lambda: np.zeros(3, dtype="datetime64[s]"), False, ["unsupported"]),
    ("timedelta64", lambda: np.zeros(3, dtype="timedelta64[ms]"), False, ["unsupported"]),
    ("structured", lambda: np.zeros(3, dtype="i4,f8"), False, ["unsupported"]),
    ("unicode", lambda: np.array(["ab", "cd"]), False, ["unsupported"]),
    ("bytes-S3", lambda: np.zeros(3, dtype="S3"), False, ["unsupported"]),
    ("void", lambda: np.zeros(3, dtype="V4"), False, ["unsupported"]),
    ("memoryview-structured", lambda: memoryview(np.zeros(3, dtype="i4,f8")), False,
     ["unsupported"]),
    ("read-only-array", lambda: _read_only(np.zeros(4)), True, ["read-only"]),
    ("read-only-frombuffer", lambda: np.frombuffer(b"abcd", np.uint8), True, ["read-only"]),
    ("bytes", lambda: b"abcd", True, ["read-only", "bytes"]),
    ("read-only-memoryview", lambda: memoryview(bytearray(4)).toreadonly(), True,
     ["read-only"]),
    ("none", lambda: None, False, ["None"]),
    ("int", lambda: 42, False, ["buffer protocol", "int"]),
    ("str", lambda: "abc", False, ["buffer protocol", "str"]),
    ("list", lambda: [1.0, 2.0], False, ["buffer protocol", "list"]),
    ("cuda-array-interface", FakeCupyArray, False, ["GPU"]),
    ("cuda-array-interface-output", FakeCupyArray, True, ["GPU"]),
]

if np.dtype(np.longdouble).itemsize > np.dtype(np.float64).itemsize:
    REJECTED += [
        ("longdouble", lambda: np.zeros(3, dtype=np.longdouble), False, ["unsupported"]),
        ("clongdouble", lambda: np.zeros(3, dtype=np.clongdouble), False, ["unsupported"]),
        ("memoryview-longdouble", lambda: memoryview(np.zeros(3, dtype=np.longdouble)), False,
         ["unsupported"]),
    ]


@pytest.mark.parametrize("make, writable, substrings", [r[1:] for r in REJECTED],
                         ids=[r[0] for r in REJECTED])
def test_rejected(make, writable, substrings):
    obj = make()
    with pytest.raises(InvalidArgument) as info:
        describe(obj, writable=writable)
    err = info.value
    assert isinstance(err, ValueError)
    assert isinstance(err, pycollect.Error)
    message = str(err)
    assert "'obj'" in message, message          # names the argument
    for text in substrings:
        assert text in message, message


def test_non_contiguous_message_gives_shape_and_strides():
    with pytest.raises(InvalidArgument) as info:
        describe(np.zeros((3, 4), dtype=np.float32).T)
    assert "(4, 3)" in str(info.value) and "(4, 16)" in str(info.value)


def test_unsupported_message_lists_supported_dtypes():
    with pytest.raises(InvalidArgument) as info:
        describe(np.zeros(2, dtype=object))
    for name in DTYPES.values():
        assert name in str(info.value)


def test_writable_only_matters_for_read_only_objects():
    arr = np.zeros(4)
    assert describe(arr, writable=False) == describe(arr, writable=True)
    assert describe(b"ab", writable=False) == (CODE["uint8"], 2, 2)


@pytest.mark.skipif(BFLOAT16 is None, reason="needs ml_dtypes")
def test_big_endian_bfloat16_rejected():
    swapped = np.array([1.0, 2.0], BFLOAT16).astype(BFLOAT16.newbyteorder(">"))
    assert not swapped.dtype.isnative
    with pytest.raises(InvalidArgument, match="byte order"):
        describe(swapped)


def test_importing_pycollect_leaves_ml_dtypes_unloaded():
    """bfloat16 is told by its dtype, so pycollect never imports ml_dtypes itself (its import
    costs every rank about 0.4 s of start-up); a bfloat16 array made after pycollect's import
    is still taken."""
    code = ("import sys, pycollect\n"
            "from pycollect._ext._buffer import describe\n"
            "assert 'ml_dtypes' not in sys.modules, 'pycollect imported ml_dtypes'\n"
            "try:\n"
            "    import ml_dtypes\n"
            "except ImportError:\n"
            "    sys.exit(0)\n"
            "import numpy as np\n"
            "print(describe(np.ones(3, ml_dtypes.bfloat16)))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, cwd=os.path.dirname(os.path.dirname(pycollect.__file__)))
    assert done.returncode == 0, done.stderr
    if BFLOAT16 is not None:
        assert done.stdout.strip() == str((CODE["bfloat16"], 3, 6))
