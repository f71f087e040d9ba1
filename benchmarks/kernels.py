"""The reduction kernels alone, beside NumPy's ufuncs on the same arrays, in one process.

    python benchmarks/kernels.py                          # every dtype, SUM and MAX, 64K
    python benchmarks/kernels.py --elements 4096,1048576 --dtypes float16,bfloat16 --ops SUM

For every dtype, op and size the script times ``reduce(out, a, b, op)`` (the
kernel every reducing collective calls, pycollect/_ext/_reduce.pyx and
_loops.h) and the NumPy ufunc that defines the result (``np.add``,
``np.multiply``, ``np.minimum``, ``np.maximum``, ``np.bitwise_*``) into the
same output, taking turns, and ``divide`` (AVG's tail) beside ``np.divide``.
float16 runs twice: with the CPU's F16C loops and with the one-value loop
(``float16_simd``), where the CPU has F16C.  Each figure is the fastest of
``--repeats`` batches of calls, in ns per element, the Python call's cost
included (about 1 µs: read sizes below 64K with that in mind).
"""

import argparse
import time

import numpy as np

from pycollect import ReduceOp
from pycollect.errors import Error
from pycollect.types import DTYPES
from pycollect._ext._reduce import divide, float16_simd, reduce
from pycollect.bench import numpy_dtype
from turns import int_list

UFUNC = {"SUM": np.add, "PRODUCT": np.multiply, "MIN": np.minimum, "MAX": np.maximum,
         "BAND": np.bitwise_and, "BOR": np.bitwise_or, "BXOR": np.bitwise_xor}


def _best(call, n, repeats, budget=0.05):
    """The fastest batch of back-to-back calls of ``call``, in ns per element."""
    call()
    t0 = time.perf_counter()
    call()
    per = max(time.perf_counter() - t0, 1e-7)
    calls = max(1, min(100000, int(budget / per)))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            call()
        best = min(best, (time.perf_counter() - t0) / calls)
    return best / n * 1e9


def rows(dtypes, ops, sizes, repeats):
    """(dtype label, op, elements, pycollect ns/element, NumPy ns/element) per case."""
    rng = np.random.default_rng(0)
    out = []
    for name in dtypes:
        dt = numpy_dtype(name)
        paths = [("", None)]
        if name == "float16" and float16_simd():
            paths = [(" (F16C)", True), (" (one value at a time)", False)]
        for n in sizes:
            if dt.kind in "iu":
                a = rng.integers(0, 100, n).astype(dt)
                b = rng.integers(1, 100, n).astype(dt)
            else:
                a = (rng.random(n) * 4 + 1).astype(dt)
                b = (rng.random(n) * 4 + 1).astype(dt)
            res = np.empty_like(a)
            for suffix, simd in paths:
                before = float16_simd()
                if simd is not None:
                    float16_simd(simd)
                try:
                    for op in ops:
                        if op in ("BAND", "BOR", "BXOR") and dt.kind not in "iu":
                            continue
                        if op in ("MIN", "MAX") and dt.kind == "c":
                            continue        # complex numbers have no order
                        code = ReduceOp[op]
                        ours = _best(lambda: reduce(res, a, b, code), n, repeats)
                        theirs = _best(lambda: UFUNC[op](a, b, out=res), n, repeats)
                        out.append((name + suffix, op, n, ours, theirs))
                    if dt.kind == "f" or name == "bfloat16":
                        work = a.copy()
                        ours = _best(lambda: divide(work, 1.0), n, repeats)
                        theirs = _best(lambda: np.divide(work, 1.0, out=work), n, repeats)
                        out.append((name + suffix, "divide", n, ours, theirs))
                finally:
                    float16_simd(before)
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", default="int8,int32,int64,float16,bfloat16,float32,float64")
    parser.add_argument("--ops", default="SUM,MAX", help="of " + ",".join(UFUNC))
    parser.add_argument("--elements", default="65536")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    ops = args.ops.split(",")
    for op in ops:
        if op not in UFUNC:
            parser.error("unknown op %r (choose from %s)" % (op, ", ".join(UFUNC)))
    dtypes = args.dtypes.split(",")
    for name in dtypes:
        try:
            known = numpy_dtype(name).name in DTYPES.values()
        except Error as exc:            # bfloat16 without ml_dtypes
            parser.error("--dtypes: %s" % exc)
        except TypeError:
            known = False
        if not known:
            parser.error("--dtypes: unknown dtype %r (choose from %s)"
                         % (name, ", ".join(DTYPES.values())))
    sizes = int_list(parser, "--elements", args.elements, 1)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1, got %d" % args.repeats)
    print("| dtype | op | elements | pycollect ns/element | NumPy ns/element "
          "| NumPy ÷ pycollect |")
    print("|---|---|---:|---:|---:|---:|")
    for name, op, n, ours, theirs in rows(dtypes, ops, sizes, args.repeats):
        print("| %s | %s | %d | %.3f | %.3f | %.2f× |" % (name, op, n, ours, theirs,
                                                        theirs / ours))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
