"""Inputs and NumPy reference results for the collective matrix.

Floating inputs are small integers, so sums, products, minima and maxima
are exact in every precision whatever order ranks add them in; the results
are compared bit for bit.  AVG involves a division and is compared with a
tolerance that fits the dtype.
"""

import numpy as np

import pycollect as pc

try:
    import ml_dtypes
    BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:       # the bfloat16 cases are skipped without it
    BFLOAT16 = None

INTEGER = ["int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64"]
FLOATING = ["float16", "bfloat16", "float32", "float64"]
COMPLEX = ["complex64", "complex128"]
DTYPES = INTEGER + ["bool"] + FLOATING + COMPLEX

ALL_OPS = list(pc.ReduceOp)


def np_dtype(name):
    if name == "bfloat16":
        return BFLOAT16
    return np.dtype(name)


def ops_for(name):
    """The reduction ops defined on dtype ``name``."""
    ops = [pc.SUM, pc.PRODUCT]
    if name not in COMPLEX:
        ops += [pc.MIN, pc.MAX]
    if name in FLOATING or name in COMPLEX:
        ops.append(pc.AVG)
    if name in INTEGER or name == "bool":
        ops += [pc.BAND, pc.BOR, pc.BXOR]
    return ops


def make_input(name, count, rank, op, seed=0):
    """Rank ``rank``'s input: deterministic, exact under the op in the dtype."""
    rng = np.random.default_rng([seed, rank, count, DTYPES.index(name), int(op)])
    dt = np_dtype(name)
    if name == "bool":
        return rng.integers(0, 2, count).astype(bool)
    if name in INTEGER:
        if op == pc.PRODUCT:
            # Small factors: products wrap in the narrow types, which the
            # reference must reproduce exactly.
            return rng.integers(0, 4, count).astype(dt)
        info = np.iinfo(dt)
        return rng.integers(info.min, info.max, count, dtype=np.int64 if info.min < 0
                            else np.uint64, endpoint=True).astype(dt)
    if op == pc.PRODUCT:
        vals = rng.choice(np.array([-2.0, -1.0, 1.0, 2.0]), count)
    else:
        vals = rng.integers(-8, 9, count).astype(np.float64)
    if name in COMPLEX:
        span = 1 if op == pc.PRODUCT else 8
        imag = rng.integers(-span, span + 1, count).astype(np.float64)
        return (vals + 1j * imag).astype(dt)
    return vals.astype(dt)


def reduce_reference(name, inputs, op):
    """The expected allreduce result, computed with NumPy in float64 where it matters."""
    dt = np_dtype(name)
    if name == "bool":
        stack = np.array(inputs, dtype=bool)
        if op in (pc.SUM, pc.MAX, pc.BOR):
            return np.logical_or.reduce(stack, axis=0)
        if op in (pc.PRODUCT, pc.MIN, pc.BAND):
            return np.logical_and.reduce(stack, axis=0)
        return np.logical_xor.reduce(stack, axis=0)
    ufunc = {pc.SUM: np.add, pc.AVG: np.add, pc.PRODUCT: np.multiply, pc.MIN: np.minimum,
             pc.MAX: np.maximum, pc.BAND: np.bitwise_and, pc.BOR: np.bitwise_or,
             pc.BXOR: np.bitwise_xor}[op]
    if name in INTEGER:
        out = inputs[0].copy()
        for x in inputs[1:]:
            out = ufunc(out, x, dtype=dt)      # wraps like C with -fwrapv
        return out
    wide = np.complex128 if name in COMPLEX else np.float64
    stack = np.array([x.astype(wide) for x in inputs])
    out = ufunc.reduce(stack, axis=0)
    if op == pc.AVG:
        out = out / len(inputs)
    return out.astype(dt)


def tolerance(name, op):
    """rtol for comparing a result with the reference (0: bit-exact)."""
    if op != pc.AVG:
        return 0.0
    return {"float16": 1e-3, "bfloat16": 1e-2, "float32": 1e-6, "complex64": 1e-6}.get(name, 1e-12)


def assert_matches(name, op, got, expected, where=""):
    rtol = tolerance(name, op)
    if rtol == 0.0:
        if name in INTEGER or name == "bool":
            ok = np.array_equal(got, expected)
        else:   # equal values; the sign of a zero imaginary part may differ by order
            wide = np.complex128 if name in COMPLEX else np.float64
            ok = np.array_equal(got.astype(wide), expected.astype(wide), equal_nan=True)
        if not ok:
            bad = np.flatnonzero(got != expected)[:5]
            raise AssertionError("%s %s %s: mismatch at %s: got %s expected %s" % (
                where, name, op.name, bad, got[bad], expected[bad]))
    else:
        wide = np.complex128 if name in COMPLEX else np.float64
        np.testing.assert_allclose(got.astype(wide), expected.astype(wide), rtol=rtol,
                                   atol=rtol, err_msg="%s %s %s" % (where, name, op.name))
