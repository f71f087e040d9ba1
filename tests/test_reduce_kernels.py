"""The compiled reduction kernels against NumPy, computed independently.

``reduce(out, a, b, op)`` must give exactly what NumPy gives: the same wrapped
integers, the same float bits (float16 and bfloat16 included), NaN where NumPy
has NaN.  ``divide`` is the tail of AVG.  float16 has two loops (the CPU's
F16C conversions, and one value at a time): every float16 result here is
computed by both, which must give the same bits.
"""

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from pycollect import InvalidArgument, ReduceOp
from pycollect._ext import _reduce
from pycollect._ext._reduce import float16_simd, reduce

try:
    import ml_dtypes
    BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - ml_dtypes is a test dependency
    BFLOAT16 = None

SUM, PRODUCT, MIN, MAX, AVG = (ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN,
                               ReduceOp.MAX, ReduceOp.AVG)
BAND, BOR, BXOR = ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR

INT_DTYPES = [np.dtype(t) for t in ("int8", "int16", "int32", "int64",
                                     "uint8", "uint16", "uint32", "uint64")]
BOOL = np.dtype(bool)
HALF_DTYPES = [np.dtype(np.float16)] + ([BFLOAT16] if BFLOAT16 is not None else [])
FLOAT_DTYPES = HALF_DTYPES + [np.dtype(np.float32), np.dtype(np.float64)]
COMPLEX_DTYPES = [np.dtype(np.complex64), np.dtype(np.complex128)]
ALL_DTYPES = INT_DTYPES + [BOOL] + FLOAT_DTYPES + COMPLEX_DTYPES

ORDERED_OPS = (SUM, PRODUCT, MIN, MAX)
BITWISE_OPS = (BAND, BOR, BXOR)
SIZES = [0, 1, 7, 1000, 100003]

UINT_OF_SIZE = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}

# The NumPy reference for each op.  On bool arrays NumPy's add is OR, multiply
# is AND, minimum is AND and maximum is OR, which is what the kernel promises.
NUMPY_OP = {
    SUM: np.add,
    AVG: np.add,  # AVG reduces like SUM; the division is divide()'s job
    PRODUCT: np.multiply,
    MIN: np.minimum,
    MAX: np.maximum,
    BAND: np.bitwise_and,
    BOR: np.bitwise_or,
    BXOR: np.bitwise_xor,
}


def valid_ops(dtype):
    """The ops the kernel defines on ``dtype``."""
    if dtype in INT_DTYPES or dtype == BOOL:
        return ORDERED_OPS + BITWISE_OPS
    if dtype in FLOAT_DTYPES:
        return ORDERED_OPS + (AVG,)
    return (SUM, PRODUCT, AVG)


def invalid_ops(dtype):
    return tuple(op for op in ReduceOp if op not in valid_ops(dtype))


def reference(a, b, op):
    with np.errstate(all="ignore"):
        return NUMPY_OP[op](a, b)


def _both_float16_loops(run, dtype):
    """``run()``'s result; for float16 run by both loops, which must agree bit for bit."""
    if dtype != np.float16:
        return run()
    simd = float16_simd()
    try:
        float16_simd(False)
        portable = run()
        float16_simd(True)
        vector = run()
    finally:
        float16_simd(simd)
    np.testing.assert_array_equal(vector.view(np.uint16), portable.view(np.uint16))
    return vector


def kernel(a, b, op):
    def run():
        out = np.empty_like(a)
        result = reduce(out, a, b, op)
        assert result is out
        return out
    return _both_float16_loops(run, a.dtype)


def divide(x, d):
    """_reduce.divide in place on ``x`` (for float16 by both loops, from the same input)."""
    before = x.copy()

    def run():
        y = before.copy()
        return _reduce.divide(y, d)
    out = _both_float16_loops(run, x.dtype)
    assert _reduce.divide(x, d) is x
    np.testing.assert_array_equal(x.view(np.uint8), out.view(np.uint8))
    return x


def widen(x):
    """float64 copy of a float array (exact for every float dtype here)."""
    with np.errstate(invalid="ignore"):  # ml_dtypes warns when it widens a NaN
        return x.astype(np.float64)


def signed_zero_ties(a, b):
    """Where a and b are zeros of opposite sign.

    Which of the two NumPy returns from minimum/maximum on such a tie is an
    implementation detail that differs between its float16 loop (first
    operand) and its float32/float64 loops and ml_dtypes (second operand);
    test_min_max_signed_zero_tie_sign pins it separately.
    """
    wa, wb = widen(a), widen(b)
    return (wa == 0) & (wb == 0) & (np.signbit(wa) != np.signbit(wb))


def assert_bits_equal(out, ref, value_only=None):
    """Same bits as ``ref`` wherever ``ref`` is not NaN; NaN exactly where it is.

    ``value_only`` masks elements compared by value instead of by bits.
    """
    assert out.dtype == ref.dtype and out.shape == ref.shape
    out_nan, ref_nan = np.isnan(widen(out)), np.isnan(widen(ref))
    np.testing.assert_array_equal(out_nan, ref_nan, err_msg="NaN positions differ")
    uint = UINT_OF_SIZE[out.dtype.itemsize]
    mismatch = (out.view(uint) != ref.view(uint)) & ~ref_nan
    if value_only is not None:
        np.testing.assert_array_equal(widen(out)[value_only], widen(ref)[value_only])
        mismatch &= ~value_only
    if mismatch.any():
        idx = np.flatnonzero(mismatch)[:5]
        raise AssertionError(
            "%d of %d elements differ in bits; first at %s: got %s, NumPy %s"
            % (mismatch.sum(), out.size, idx.tolist(),
               [hex(v) for v in out.view(uint)[idx]], [hex(v) for v in ref.view(uint)[idx]]))


def assert_matches_numpy(out, a, b, op):
    """Check a kernel result against NumPy with the right notion of 'equal'."""
    ref = reference(a, b, op)
    assert out.dtype == ref.dtype
    if out.dtype.kind in "biu":
        np.testing.assert_array_equal(out, ref)
    elif out.dtype.kind == "c":
        if op == PRODUCT:
            # Either part of (ac - bd) + (ad + bc)i may cancel, but the error of
            # the whole stays within a few ulps of |a*b| = |ref|, the modulus
            # assert_allclose compares against.  Bit equality would forbid FMA.
            eps = np.finfo(out.real.dtype).eps
            np.testing.assert_allclose(out, ref, rtol=4 * eps, atol=0)
        else:
            np.testing.assert_array_equal(out, ref)
    else:
        ties = signed_zero_ties(a, b) if op in (MIN, MAX) else None
        assert_bits_equal(out, ref, value_only=ties)


def random_operand(dtype, n, rng):
    """n values of ``dtype`` spread over its range.

    Integers cover the full range, so sums and products overflow and wrap.
    Floats are mostly ordinary numbers with every fifth element a random bit
    pattern (subnormals, huge values, infinities, NaNs with payloads).
    """
    if dtype == BOOL:
        return rng.integers(0, 2, n).astype(bool)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, n, dtype=dtype, endpoint=True)
    if dtype.kind == "c":
        part = dtype.itemsize // 2
        real = np.dtype("f%d" % part)
        return (rng.standard_normal(n).astype(real)
                + 1j * rng.standard_normal(n).astype(real)).astype(dtype)
    x = (rng.standard_normal(n) * 8.0).astype(dtype)
    uint = UINT_OF_SIZE[dtype.itemsize]
    bits = rng.integers(0, np.iinfo(uint).max, n, dtype=uint, endpoint=True)
    x[::5] = bits[::5].view(dtype)
    return x


def dtype_id(dtype):
    return np.dtype(dtype).name


VALID_PAIRS = [pytest.param(dt, op, id="%s-%s" % (dtype_id(dt), op.name))
               for dt in ALL_DTYPES for op in valid_ops(dt)]
INVALID_PAIRS = [pytest.param(dt, op, id="%s-%s" % (dtype_id(dt), op.name))
                 for dt in ALL_DTYPES for op in invalid_ops(dt)]


# --- the dtype x op x size matrix --------------------------------------------


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype, op", VALID_PAIRS)
def test_reduce_matches_numpy(dtype, op, n):
    rng = np.random.default_rng([n, int(op), dtype.num])
    a, b = random_operand(dtype, n, rng), random_operand(dtype, n, rng)
    a_before, b_before = a.copy(), b.copy()
    out = kernel(a, b, op)
    assert_matches_numpy(out, a, b, op)
    # The inputs are read, never written.
    np.testing.assert_array_equal(a.view(np.uint8), a_before.view(np.uint8))
    np.testing.assert_array_equal(b.view(np.uint8), b_before.view(np.uint8))


@pytest.mark.parametrize("n", [7, 100003])
@pytest.mark.parametrize("dtype, op", VALID_PAIRS)
def test_reduce_in_place(dtype, op, n):
    rng = np.random.default_rng([n, int(op), dtype.num, 1])
    a, b = random_operand(dtype, n, rng), random_operand(dtype, n, rng)
    a0, b0 = a.copy(), b.copy()

    # out is a
    assert reduce(a, a, b, op) is a
    assert_matches_numpy(a, a0, b0, op)

    # out is b
    b_out = b0.copy()
    assert reduce(b_out, a0, b_out, op) is b_out
    assert_matches_numpy(b_out, a0, b0, op)

    # out, a and b all the same array
    same = a0.copy()
    reduce(same, same, same, op)
    assert_matches_numpy(same, a0, a0, op)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dtype_id)
def test_reduce_multidimensional_arrays(dtype):
    # The kernel sees the flat buffer; the shape must not matter.
    rng = np.random.default_rng(dtype.num)
    a = random_operand(dtype, 60, rng).reshape(3, 4, 5)
    b = random_operand(dtype, 60, rng).reshape(3, 4, 5)
    out = kernel(a, b, SUM)
    assert out.shape == (3, 4, 5)
    assert_matches_numpy(out, a, b, SUM)


# --- integers: wrap-around like NumPy ----------------------------------------

WRAP_CASES = [
    # dtype, op, a, b, expected
    ("int8", SUM, 127, 1, -128),
    ("int8", SUM, -128, -1, 127),
    ("int8", PRODUCT, -128, -1, -128),
    ("int8", PRODUCT, 16, 16, 0),
    ("uint8", SUM, 255, 1, 0),
    ("uint8", PRODUCT, 16, 17, 16),
    ("int16", SUM, 32767, 1, -32768),
    ("int16", PRODUCT, -32768, -1, -32768),
    # uint16 * uint16 promotes to C int, where 65535 * 65535 overflows.
    ("uint16", PRODUCT, 65535, 65535, 1),
    ("uint16", SUM, 65535, 65535, 65534),
    ("int32", SUM, 2**31 - 1, 1, -2**31),
    ("int32", PRODUCT, 65536, 65536, 0),
    ("int32", PRODUCT, 46341, 46341, 46341 * 46341 - 2**32),
    ("int32", PRODUCT, -2**31, -1, -2**31),
    ("uint32", SUM, 2**32 - 1, 2, 1),
    ("uint32", PRODUCT, 2**16 + 1, 2**16 + 1, 2**17 + 1),
    ("int64", SUM, 2**63 - 1, 1, -2**63),
    ("int64", PRODUCT, -2**63, -1, -2**63),
    ("int64", PRODUCT, 2**32 + 1, 2**32 + 1, 2**33 + 1),
    ("uint64", SUM, 2**64 - 1, 1, 0),
    ("uint64", SUM, 2**64 - 1, 2**64 - 1, 2**64 - 2),
    ("uint64", PRODUCT, 2**32, 2**32, 0),
    ("uint64", PRODUCT, 2**64 - 1, 2**64 - 1, 1),
    ("int8", MIN, -128, 127, -128),
    ("uint64", MAX, 2**64 - 1, 2**63, 2**64 - 1),
    ("int64", MIN, -2**63, 2**63 - 1, -2**63),
    ("int8", BXOR, -1, 0x55, ~0x55),
    ("uint32", BAND, 0xF0F0F0F0, 0xFF00FF00, 0xF000F000),
    ("int16", BOR, -32768, 1, -32767),
]


@pytest.mark.parametrize("dtype, op, x, y, expected", WRAP_CASES,
                         ids=["%s-%s-%d" % (c[0], c[1].name, i) for i, c in enumerate(WRAP_CASES)])
def test_integer_wraparound(dtype, op, x, y, expected):
    # Repeat the pair so both the vectorised body and the scalar tail see it.
    n = 37
    a = np.full(n, x, dtype=dtype)
    b = np.full(n, y, dtype=dtype)
    out = kernel(a, b, op)
    np.testing.assert_array_equal(out, np.full(n, expected, dtype=dtype))
    np.testing.assert_array_equal(out, reference(a, b, op))


@pytest.mark.parametrize("op", ORDERED_OPS + BITWISE_OPS, ids=lambda op: op.name)
def test_bool_truth_table(op):
    a = np.array([False, False, True, True] * 5)
    b = np.array([False, True, False, True] * 5)
    expected = {
        SUM: a | b, MAX: a | b, BOR: a | b,
        PRODUCT: a & b, MIN: a & b, BAND: a & b,
        BXOR: a ^ b,
    }[op]
    out = kernel(a, b, op)
    assert out.dtype == BOOL
    np.testing.assert_array_equal(out, expected)
    np.testing.assert_array_equal(out, reference(a, b, op))
    # Stored bytes stay canonical 0/1.
    assert set(np.unique(out.view(np.uint8)).tolist()) <= {0, 1}


# --- floats: bits, specials, rounding ----------------------------------------

def float_specials(dtype):
    """Values at the edges of ``dtype``: zeros, subnormals, limits, inf, NaN."""
    fi = ml_dtypes.finfo(dtype) if dtype == BFLOAT16 else np.finfo(dtype)
    tiny_sub = fi.smallest_subnormal
    values = [0.0, -0.0, 1.0, -1.0, 1.5, 3.0, float(tiny_sub), -float(tiny_sub),
              float(tiny_sub) * 3, float(fi.smallest_normal), -float(fi.smallest_normal),
              float(fi.smallest_normal) / 2, float(fi.max), -float(fi.max),
              float(fi.max) / 2, float(fi.eps), 1.0 + float(fi.eps),
              np.inf, -np.inf, np.nan, -np.nan]
    return np.array(values, dtype=np.float64).astype(dtype)


@pytest.mark.parametrize("op", ORDERED_OPS, ids=lambda op: op.name)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_float_specials_all_pairs(dtype, op):
    values = float_specials(dtype)
    pairs = np.array(list(itertools.product(range(len(values)), repeat=2)))
    a, b = values[pairs[:, 0]], values[pairs[:, 1]]
    out = kernel(a, b, op)
    assert_matches_numpy(out, a, b, op)


@pytest.mark.parametrize("op", ORDERED_OPS, ids=lambda op: op.name)
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=dtype_id)
def test_half_every_bit_pattern(dtype, op):
    """Every one of the 65536 half values against a spread of second operands.

    This walks the whole float32 -> half rounding path: subnormal results,
    overflow to inf, ties to even, NaN in, NaN out.
    """
    rng = np.random.default_rng(int(op))
    every = np.arange(65536, dtype=np.uint16)
    partners = np.concatenate([
        np.array([0x0000, 0x8000, 0x0001, 0x8001, 0x3C00, 0xBC00], dtype=np.uint16),
        rng.integers(0, 65536, 10, dtype=np.uint16),
    ])
    a = np.tile(every, len(partners)).view(dtype)
    b = np.repeat(partners, len(every)).view(dtype)
    out = kernel(a, b, op)
    assert_matches_numpy(out, a, b, op)


FLOAT16_ROUNDING = [
    # op, a, b, expected (all as float16 bit patterns)
    # 65504 + 16 = 65520 is the tie between 65504 (odd) and 65536: rounds to inf.
    (SUM, 0x7BFF, 0x4C00, 0x7C00),
    # 65504 + 15 rounds down to 65504.
    (SUM, 0x7BFF, 0x4B80, 0x7BFF),
    (PRODUCT, 0x7BFF, 0x4000, 0x7C00),         # 65504 * 2 overflows to inf
    (PRODUCT, 0xFBFF, 0x4000, 0xFC00),         # to -inf
    (SUM, 0x0001, 0x0001, 0x0002),             # subnormal + subnormal
    (SUM, 0x03FF, 0x0001, 0x0400),             # largest subnormal + 1 ulp = smallest normal
    (PRODUCT, 0x0001, 0x3800, 0x0000),         # 2^-24 * 0.5: tie, rounds to even 0
    (PRODUCT, 0x0003, 0x3800, 0x0002),         # 3 * 2^-25: tie, rounds to even 2 * 2^-24
    (PRODUCT, 0x0001, 0x3E00, 0x0002),         # 2^-24 * 1.5 rounds up to 2^-23
    (PRODUCT, 0x8001, 0x3800, 0x8000),         # -2^-24 * 0.5 -> -0
    (SUM, 0x3C00, 0x1000, 0x3C00),             # 1 + 2^-11: tie, rounds to even 1
    (SUM, 0x3C01, 0x1000, 0x3C02),             # (1 + 2^-10) + 2^-11: tie, rounds up to even
    (SUM, 0x7C00, 0xFC00, None),               # inf - inf = NaN
    (PRODUCT, 0x7C00, 0x0000, None),           # inf * 0 = NaN
    (SUM, 0x8000, 0x8000, 0x8000),             # -0 + -0 = -0
    (SUM, 0x8000, 0x0000, 0x0000),             # -0 + 0 = +0
    (PRODUCT, 0x8000, 0x3C00, 0x8000),         # -0 * 1 = -0
]

BFLOAT16_ROUNDING = [
    (SUM, 0x3F80, 0x3B80, 0x3F80),             # 1 + 2^-8: tie, rounds to even 1
    (SUM, 0x3F81, 0x3B80, 0x3F82),             # (1 + 2^-7) + 2^-8: tie, rounds up to even
    (SUM, 0x3F80, 0x3B81, 0x3F81),             # just above the tie rounds up
    (SUM, 0x7F7F, 0x7F7F, 0x7F80),             # max + max overflows to inf
    (PRODUCT, 0x7F7F, 0xC000, 0xFF80),         # max * -2 -> -inf
    (SUM, 0x0001, 0x0001, 0x0002),             # subnormal + subnormal
    (SUM, 0x007F, 0x0001, 0x0080),             # largest subnormal + 1 ulp = smallest normal
    (PRODUCT, 0x0001, 0x3F00, 0x0000),         # smallest subnormal * 0.5: tie to even 0
    (PRODUCT, 0x0003, 0x3F00, 0x0002),         # 3 units * 0.5: tie to even 2 units
    (SUM, 0x7F80, 0xFF80, None),               # inf - inf = NaN
    (SUM, 0x8000, 0x8000, 0x8000),             # -0 + -0 = -0
    (PRODUCT, 0x8000, 0x3F80, 0x8000),         # -0 * 1 = -0
]


def _rounding_params():
    params = []
    for i, case in enumerate(FLOAT16_ROUNDING):
        params.append(pytest.param(np.dtype(np.float16), *case, id="float16-%d" % i))
    for i, case in enumerate(BFLOAT16_ROUNDING):
        params.append(pytest.param(BFLOAT16, *case, id="bfloat16-%d" % i,
                                   marks=pytest.mark.skipif(BFLOAT16 is None,
                                                            reason="needs ml_dtypes")))
    return params


@pytest.mark.parametrize("dtype, op, x, y, expected", _rounding_params())
def test_half_rounding_edges(dtype, op, x, y, expected):
    n = 19  # body and tail
    a = np.full(n, x, dtype=np.uint16).view(dtype)
    b = np.full(n, y, dtype=np.uint16).view(dtype)
    out = kernel(a, b, op)
    if expected is None:
        assert np.isnan(widen(out)).all()
    else:
        np.testing.assert_array_equal(out.view(np.uint16), np.full(n, expected, np.uint16))
    assert_matches_numpy(out, a, b, op)


@pytest.mark.parametrize("op", [MIN, MAX], ids=lambda op: op.name)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_min_max_nan_propagation(dtype, op):
    nan, inf = np.nan, np.inf
    a = np.array([nan, 1.0, nan, -inf, inf, nan, -0.0, 2.0, nan, -inf], dtype=dtype)
    b = np.array([1.0, nan, nan, nan, nan, -inf, nan, -2.0, inf, inf], dtype=dtype)
    out = kernel(a, b, op)
    ref = reference(a, b, op)
    np.testing.assert_array_equal(np.isnan(widen(out)), np.isnan(widen(ref)))
    assert np.isnan(widen(out)[[0, 1, 2, 3, 4, 5, 6, 8]]).all()
    np.testing.assert_array_equal(widen(out), widen(ref))  # equal_nan by default
    assert_matches_numpy(out, a, b, op)


@pytest.mark.parametrize("op", [MIN, MAX], ids=lambda op: op.name)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_min_max_nan_in_long_arrays(dtype, op):
    # NaNs scattered through a long array, in a, in b and in both, so the
    # vectorised loop and its tail are both made to propagate them.
    n = 100003
    rng = np.random.default_rng(n)
    a = rng.standard_normal(n).astype(dtype)
    b = rng.standard_normal(n).astype(dtype)
    a[::97] = np.nan
    b[5::89] = np.nan
    b[::97 * 3] = np.nan
    a[-3:] = np.nan
    out = kernel(a, b, op)
    ref = reference(a, b, op)
    np.testing.assert_array_equal(np.isnan(widen(out)), np.isnan(widen(a)) | np.isnan(widen(b)))
    assert_bits_equal(out, ref)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_min_max_infinities_and_negative_zero(dtype):
    inf = np.inf
    a = np.array([inf, -inf, inf, -0.0, -0.0, -0.0, 5.0], dtype=dtype)
    b = np.array([-inf, 3.0, inf, -0.0, 1.0, -1.0, -inf], dtype=dtype)
    low = kernel(a, b, MIN)
    high = kernel(a, b, MAX)
    np.testing.assert_array_equal(widen(low), [-inf, -inf, inf, -0.0, -0.0, -1.0, -inf])
    np.testing.assert_array_equal(widen(high), [inf, 3.0, inf, -0.0, 1.0, -0.0, 5.0])
    # -0.0 stays -0.0 where it wins outright or meets itself.
    assert np.signbit(widen(low)[[3, 4]]).all()
    assert np.signbit(widen(high)[[3, 5]]).all()
    assert_matches_numpy(low, a, b, MIN)
    assert_matches_numpy(high, a, b, MAX)


@pytest.mark.parametrize("op", [MIN, MAX], ids=lambda op: op.name)
@pytest.mark.parametrize("dtype", [
    pytest.param(np.dtype(np.float16), id="float16"),
    pytest.param(BFLOAT16, id="bfloat16", marks=(
        [pytest.mark.skip(reason="needs ml_dtypes")] if BFLOAT16 is None else [])),
    pytest.param(np.dtype(np.float32), id="float32"),
    pytest.param(np.dtype(np.float64), id="float64"),
])
def test_min_max_signed_zero_tie_sign(dtype, op):
    """The sign of min/max(+0, -0) and (-0, +0) is NumPy's, bit for bit."""
    a = np.array([0.0, -0.0] * 4, dtype=dtype)
    b = np.array([-0.0, 0.0] * 4, dtype=dtype)
    out = kernel(a, b, op)
    uint = UINT_OF_SIZE[dtype.itemsize]
    np.testing.assert_array_equal(out.view(uint), reference(a, b, op).view(uint))


# --- complex -----------------------------------------------------------------


@pytest.mark.parametrize("dtype", COMPLEX_DTYPES, ids=dtype_id)
def test_complex_known_values(dtype):
    a = np.array([1 + 2j, -3 + 0.5j, 0j, 1j], dtype=dtype)
    b = np.array([3 - 1j, 2 + 2j, 5 + 5j, 1j], dtype=dtype)
    np.testing.assert_array_equal(kernel(a, b, SUM), [4 + 1j, -1 + 2.5j, 5 + 5j, 2j])
    np.testing.assert_array_equal(kernel(a, b, AVG), [4 + 1j, -1 + 2.5j, 5 + 5j, 2j])
    np.testing.assert_allclose(kernel(a, b, PRODUCT), [5 + 5j, -7 - 5j, 0j, -1 + 0j],
                               rtol=1e-6 if dtype == np.complex64 else 1e-15)


# --- rejected (dtype, op) pairs and bad arguments ----------------------------


@pytest.mark.parametrize("dtype, op", INVALID_PAIRS)
def test_invalid_pair_raises(dtype, op):
    a = np.ones(5, dtype=dtype)
    b = np.ones(5, dtype=dtype)
    out = np.zeros(5, dtype=dtype)
    with pytest.raises(InvalidArgument) as info:
        reduce(out, a, b, op)
    message = str(info.value)
    assert op.name in message
    assert dtype.name in message
    assert isinstance(info.value, ValueError)
    # Nothing was written.
    np.testing.assert_array_equal(out.view(np.uint8), np.zeros(5, dtype).view(np.uint8))


def test_invalid_pairs_cover_the_brief():
    """AVG on integers/bool, bitwise on floats/complex, MIN/MAX on complex."""
    invalid = {(dt.name, op) for dt in ALL_DTYPES for op in invalid_ops(dt)}
    for dt in INT_DTYPES + [BOOL]:
        assert (dt.name, AVG) in invalid
    for dt in FLOAT_DTYPES + COMPLEX_DTYPES:
        assert {(dt.name, op) for op in BITWISE_OPS} <= invalid
    for dt in COMPLEX_DTYPES:
        assert {(dt.name, MIN), (dt.name, MAX)} <= invalid
    assert len(invalid) == 9 + len(FLOAT_DTYPES) * 3 + 2 * 5


def test_unknown_op_raises():
    a = np.ones(3, np.float32)
    with pytest.raises(InvalidArgument, match="unknown reduction op"):
        reduce(a.copy(), a, a, 99)
    with pytest.raises(InvalidArgument, match="unknown reduction op"):
        reduce(a.copy(), a, a, -1)


def test_plain_int_op_is_accepted():
    a = np.arange(5, dtype=np.int32)
    out = np.empty_like(a)
    reduce(out, a, a, int(ReduceOp.SUM))
    np.testing.assert_array_equal(out, 2 * a)


@pytest.mark.parametrize("out, a, b", [
    (np.zeros(4, np.float32), np.ones(4, np.float32), np.ones(4, np.float64)),
    (np.zeros(4, np.float64), np.ones(4, np.float32), np.ones(4, np.float32)),
    (np.zeros(4, np.int32), np.ones(5, np.int32), np.ones(4, np.int32)),
    (np.zeros(3, np.int32), np.ones(4, np.int32), np.ones(4, np.int32)),
], ids=["b-dtype", "out-dtype", "a-size", "out-size"])
def test_mismatched_operands_raise(out, a, b):
    before = out.copy()
    with pytest.raises(InvalidArgument, match="dtype and size"):
        reduce(out, a, b, SUM)
    np.testing.assert_array_equal(out, before)


def test_read_only_out_raises():
    a = np.ones(4, np.float64)
    out = np.zeros(4, np.float64)
    out.flags.writeable = False
    with pytest.raises(InvalidArgument, match=r"'out'.*read-only"):
        reduce(out, a, a, SUM)


def test_read_only_inputs_are_fine():
    a = np.arange(4, dtype=np.int64)
    a.flags.writeable = False
    out = np.empty_like(a)
    reduce(out, a, a, PRODUCT)
    np.testing.assert_array_equal(out, a * a)


def test_non_contiguous_operand_raises():
    a = np.arange(8, dtype=np.int32)
    with pytest.raises(InvalidArgument, match=r"'a'.*C-contiguous"):
        reduce(np.empty(4, np.int32), a[::2], np.ones(4, np.int32), SUM)


# --- hypothesis: random arrays -----------------------------------------------


@settings(max_examples=50, deadline=None)
@given(data=st.data())
def test_hypothesis_integers(data):
    dtype = data.draw(st.sampled_from(INT_DTYPES + [BOOL]), label="dtype")
    op = data.draw(st.sampled_from(ORDERED_OPS + BITWISE_OPS), label="op")
    n = data.draw(st.integers(0, 200), label="n")
    a = data.draw(hnp.arrays(dtype, n), label="a")
    b = data.draw(hnp.arrays(dtype, n), label="b")
    out = kernel(a, b, op)
    np.testing.assert_array_equal(out, reference(a, b, op))


@settings(max_examples=50, deadline=None)
@given(data=st.data())
def test_hypothesis_floats(data):
    dtype = data.draw(st.sampled_from([np.dtype(np.float16), np.dtype(np.float32),
                                       np.dtype(np.float64)]), label="dtype")
    op = data.draw(st.sampled_from(ORDERED_OPS + (AVG,)), label="op")
    n = data.draw(st.integers(0, 200), label="n")
    a = data.draw(hnp.arrays(dtype, n), label="a")
    b = data.draw(hnp.arrays(dtype, n), label="b")
    assert_matches_numpy(kernel(a, b, op), a, b, op)


@pytest.mark.skipif(BFLOAT16 is None, reason="needs ml_dtypes")
@settings(max_examples=50, deadline=None)
@given(data=st.data())
def test_hypothesis_bfloat16(data):
    # Hypothesis has no bfloat16 strategy: draw bit patterns.
    op = data.draw(st.sampled_from(ORDERED_OPS + (AVG,)), label="op")
    n = data.draw(st.integers(0, 200), label="n")
    a = data.draw(hnp.arrays(np.uint16, n), label="a bits").view(BFLOAT16)
    b = data.draw(hnp.arrays(np.uint16, n), label="b bits").view(BFLOAT16)
    assert_matches_numpy(kernel(a, b, op), a, b, op)


@settings(max_examples=50, deadline=None)
@given(data=st.data())
def test_hypothesis_complex(data):
    dtype = data.draw(st.sampled_from(COMPLEX_DTYPES), label="dtype")
    op = data.draw(st.sampled_from([SUM, PRODUCT, AVG]), label="op")
    n = data.draw(st.integers(0, 100), label="n")
    elements = hnp.from_dtype(dtype, allow_nan=False, allow_infinity=False, max_magnitude=1e6)
    a = data.draw(hnp.arrays(dtype, n, elements=elements), label="a")
    b = data.draw(hnp.arrays(dtype, n, elements=elements), label="b")
    assert_matches_numpy(kernel(a, b, op), a, b, op)


# --- divide: the tail of AVG -------------------------------------------------

DIVISORS = [1.0, 2.0, 3.0, 5.0, 7.0, 0.1, 1e-3, 1024.0, 12345.678, -4.0]


def divide_reference(x, d):
    """What AVG's tail must produce: float32/float64/complex in their own
    precision; float16/bfloat16 through float32 and rounded back."""
    with np.errstate(all="ignore"):
        if x.dtype in HALF_DTYPES:
            return (x.astype(np.float32) / np.float32(d)).astype(x.dtype)
        return x / d


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("d", DIVISORS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_divide_float(dtype, d, n):
    rng = np.random.default_rng([n, dtype.num, int(abs(d) * 1000)])
    x = random_operand(dtype, n, rng)
    ref = divide_reference(x, d)
    assert divide(x, d) is x
    assert_bits_equal(x, ref)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_divide_specials(dtype):
    x = float_specials(dtype)
    for d in (3.0, 0.5, 0.0, -0.0, np.inf):
        y = x.copy()
        divide(y, d)
        assert_bits_equal(y, divide_reference(x, d))


@pytest.mark.parametrize("n", [0, 7, 100003])
@pytest.mark.parametrize("d", [2.0, 3.0, 7.0, 0.1])
@pytest.mark.parametrize("dtype", COMPLEX_DTYPES, ids=dtype_id)
def test_divide_complex(dtype, d, n):
    rng = np.random.default_rng([n, dtype.num])
    x = random_operand(dtype, n, rng)
    ref = x / d
    divide(x, d)
    assert x.dtype == dtype
    eps = np.finfo(x.real.dtype).eps
    np.testing.assert_allclose(x, ref, rtol=2 * eps, atol=0)


def test_divide_finishes_avg():
    # Four ranks' contributions summed with AVG, then divided by four.
    rng = np.random.default_rng(4)
    parts = [rng.standard_normal(1001) for _ in range(4)]
    acc = parts[0].copy()
    for p in parts[1:]:
        reduce(acc, acc, p, AVG)
    divide(acc, 4)
    np.testing.assert_array_equal(acc, (((parts[0] + parts[1]) + parts[2]) + parts[3]) / 4)


def test_divide_read_only_raises():
    x = np.ones(4, np.float32)
    x.flags.writeable = False
    with pytest.raises(InvalidArgument, match="read-only"):
        divide(x, 2.0)


@settings(max_examples=50, deadline=None)
@given(data=st.data())
def test_hypothesis_divide(data):
    dtype = data.draw(st.sampled_from(FLOAT_DTYPES), label="dtype")
    n = data.draw(st.integers(0, 100), label="n")
    uint = UINT_OF_SIZE[dtype.itemsize]
    x = data.draw(hnp.arrays(uint, n), label="bits").view(dtype)
    d = data.draw(st.floats(allow_nan=False, allow_infinity=False, width=32)
                  .filter(lambda v: v != 0), label="d")
    ref = divide_reference(x, d)
    divide(x, d)
    assert_bits_equal(x, ref)
