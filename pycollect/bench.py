"""``pycollect-bench``: Gloo's benchmark tool for pycollect, with algbw, busbw and checked results.

    pycollect-bench --local 4 allreduce                    # 4 local ranks, Gloo's 15-size sweep
    pycollect-bench --local 2 --elements 1048576 allreduce_ring --json
    pycollect-run -n 2 pycollect-bench broadcast           # ranks started by the launcher
    pycollect-bench --size 2 --rank R --store tcp://HOST:29500 allgather   # one command per rank

Every rank runs the same calls back to back and records each call's time; at
the end rank 0 gathers them, and an iteration's latency is the slowest rank's.
Each size's first call is checked against a NumPy reference before any timing
(``--no-verify`` skips the check).  Exit status: 0, 1 when a rank failed or a
check failed, 2 for a usage error.
"""

import argparse
import csv
import functools
import io
import json
import math
import os
import re
import stat
import sys
import time

import numpy as np

__all__ = ["main", "BENCHMARKS", "SWEEP", "busbw_factor", "latency_stats", "numpy_dtype",
           "time_calls"]

# Gloo's --elements -1 sweep: 15 sizes from 100 to 5,000,000 elements.
SWEEP = (100, 200, 500, 1_000, 2_000, 5_000, 10_000, 20_000, 50_000, 100_000, 200_000,
         500_000, 1_000_000, 2_000_000, 5_000_000)
# Timed iterations per size at most, whatever --iteration-time allows.
MAX_ITERATIONS = 1_000_000
ROOT_TAG_ARRIVE, ROOT_TAG_RELEASE, PAIR_TAG = 11, 12, 13

# Benchmark name -> (collective, fixed algorithm or None).  "auto" lets the context pick.
BENCHMARKS = {
    "allreduce": ("allreduce", "auto"),
    "allreduce_ring": ("allreduce", "ring"),
    "allreduce_ring_chunked": ("allreduce", "ring_chunked"),
    "allreduce_halving_doubling": ("allreduce", "halving_doubling"),
    "allreduce_recursive_doubling": ("allreduce", "recursive_doubling"),
    "allreduce_bcube": ("allreduce", "bcube"),
    "allgather": ("allgather", None),
    "allgatherv": ("allgatherv", None),
    "allgather_v": ("allgatherv", None),
    "alltoall": ("alltoall", None),
    "alltoallv": ("alltoallv", None),
    "alltoall_v": ("alltoallv", None),
    "barrier": ("barrier", None),
    "barrier_all_to_all": ("barrier", None),
    "barrier_all_to_one": ("barrier_all_to_one", None),
    "broadcast": ("broadcast", "auto"),
    "broadcast_binomial": ("broadcast", "binomial"),
    "broadcast_pipelined": ("broadcast", "pipelined"),
    "broadcast_one_to_all": ("broadcast_one_to_all", None),
    "gather": ("gather", None),
    "reduce": ("reduce", "auto"),
    "reduce_binomial": ("reduce", "binomial"),
    "reduce_ring": ("reduce", "ring"),
    "reduce_scatter": ("reduce_scatter", None),
    "scatter": ("scatter", None),
    "sendrecv_roundtrip": ("sendrecv_roundtrip", None),
    "pairwise_exchange": ("pairwise_exchange", None),
}
REDUCING = ("allreduce", "reduce", "reduce_scatter")
# Built from send/recv: they run on a sub-group of the same ranks (see run()).
POINT_TO_POINT = ("barrier_all_to_one", "broadcast_one_to_all", "sendrecv_roundtrip",
                  "pairwise_exchange")
ROOTED = ("broadcast", "broadcast_one_to_all", "reduce", "gather", "scatter",
          "barrier_all_to_one")
# Collectives whose "size" column covers all ranks' blocks, as NCCL-tests count it.
WHOLE_BUFFER = ("allgather", "allgatherv", "gather", "scatter", "reduce_scatter", "alltoall",
                "alltoallv")
BYTE_DEFAULT = ("pairwise_exchange",)   # Gloo runs it on chars


def busbw_factor(collective, size):
    """NCCL-tests' bus-bandwidth factor of a collective on ``size`` ranks (None: no data moves)."""
    if collective in ("barrier", "barrier_all_to_one"):
        return None
    if collective == "allreduce":
        return 2 * (size - 1) / size
    if collective in WHOLE_BUFFER:
        return (size - 1) / size
    return 1.0   # broadcast, reduce, point to point


def latency_stats(seconds, nbytes, factor):
    """Summarize per-call latencies (slowest rank's, seconds) as Gloo's row plus algbw/busbw."""
    seconds = np.asarray(seconds, dtype=np.float64)
    lo, p50, p99, hi = np.percentile(seconds, [0, 50, 99, 100])
    mean = float(seconds.mean())
    algbw = nbytes / p50 / 1e9 if nbytes and p50 > 0 else None
    return {
        "bytes": int(nbytes), "iterations": int(seconds.size),
        "min_us": lo * 1e6, "p50_us": p50 * 1e6, "p99_us": p99 * 1e6, "max_us": hi * 1e6,
        "avg_GBps": nbytes / mean / 1e9 if nbytes and mean > 0 else None,
        "algbw_GBps": algbw,
        "busbw_GBps": algbw * factor if algbw is not None and factor is not None else None,
    }


# -- command line -------------------------------------------------------------


def _seconds(text):
    """Parse Gloo's --iteration-time: ``2s``, ``500ms`` or a bare number of seconds."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*(ms|s)?\s*", text)
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration such as 2s or 500ms")
    value = float(match.group(1)) / (1000.0 if match.group(2) == "ms" else 1.0)
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive duration")
    return value


def _int_at_least(low):
    """Return an argparse type for an int >= ``low``."""
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value
    return parse


def _elements(text):
    """Parse --elements: -1 (Gloo's sweep) or a comma-separated list of counts >= 0."""
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not -1 or a list of counts") from None
    if counts == [-1]:
        return list(SWEEP)
    if not counts or min(counts) < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: counts must be >= 0 (or -1 alone)")
    return counts


def _parser():
    """Build the command-line parser (Gloo's flags first, then pycollect's)."""
    parser = argparse.ArgumentParser(
        prog="pycollect-bench", allow_abbrev=False,
        description="Time one collective over a sweep of sizes, the way Gloo's benchmark does.",
        epilog="benchmarks: " + ", ".join(sorted(BENCHMARKS)) + ". --elements counts each "
               "rank's block for allgather(v), gather, scatter, reduce_scatter and alltoall(v); "
               "their size column is the whole buffer (all blocks), as NCCL-tests count it. "
               "busbw = algbw x 2(n-1)/n for allreduce, x (n-1)/n for the gathers, scatters and "
               "alltoalls, x 1 otherwise.")
    gloo = parser.add_argument_group("Gloo's options")
    gloo.add_argument("-s", "--size", type=_int_at_least(1), help="number of ranks")
    gloo.add_argument("-r", "--rank", type=_int_at_least(0), help="this process's rank")
    gloo.add_argument("-t", "--transport",
                      help="transport plugin: tcp, shm, auto... (default: pycollect.init's, auto)")
    gloo.add_argument("--elements", type=_elements, default=list(SWEEP), metavar="N[,N...]",
                      help="elements per buffer; -1 (default) sweeps 15 sizes 100..5,000,000")
    gloo.add_argument("--iteration-time", type=_seconds, default=2.0, metavar="T",
                      help="time per size, e.g. 2s or 500ms (default 2s)")
    gloo.add_argument("--iteration-count", type=_int_at_least(1), metavar="N",
                      help="run exactly N timed iterations per size (overrides --iteration-time)")
    gloo.add_argument("--warmup-iters", type=_int_at_least(0), default=5, metavar="N",
                      help="untimed iterations per size (default 5)")
    gloo.add_argument("--no-verify", dest="verify", action="store_false",
                      help="do not check the results")
    gloo.add_argument("--inputs", type=_int_at_least(1), default=1, metavar="N",
                      help="input buffers per rank, combined first (allreduce only; default 1)")
    gloo.add_argument("--redis-host", metavar="HOST", help="rendezvous on redis://HOST:PORT")
    gloo.add_argument("-p", "--redis-port", type=_int_at_least(1), default=6379, metavar="PORT",
                      help="Redis port (default 6379)")
    gloo.add_argument("-x", "--prefix", metavar="NAME", help="store key prefix for this run")
    gloo.add_argument("--shared-path", metavar="DIR", help="rendezvous on file://DIR")
    own = parser.add_argument_group("pycollect's options")
    own.add_argument("--store", metavar="URL",
                     help="rendezvous store URL (default: PYCOLLECT_STORE)")
    own.add_argument("--local", type=_int_at_least(1), metavar="N",
                     help="start N ranks on this machine, wired through an embedded TCP store")
    own.add_argument("--bind", choices=("none", "core"), default="none",
                     help="with --local: core binds rank r to physical core r %% cores "
                          "(pycollect-run --bind core); none (default): the kernel places them")
    own.add_argument("--dtype", help="element type (default float32; uint8 for pairwise_exchange)")
    own.add_argument("--op",
                     help="reduction: sum (default), product, min, max, avg, band, bor, bxor")
    own.add_argument("--algorithm", help="allreduce, broadcast or reduce algorithm (default auto)")
    gloo.add_argument("--base", type=_int_at_least(2), metavar="B",
                      help="allreduce_bcube's base (default: pycollect's, 4)")
    own.add_argument("--root", type=_int_at_least(0), default=0, help="root rank (default 0)")
    own.add_argument("--timeout", type=_seconds, metavar="T",
                     help="deadline of the rendezvous and of every call (default 120s)")
    own.add_argument("--json", nargs="?", const="-", metavar="FILE",
                     help="write the results as JSON to FILE (--json=FILE), or alone: to stdout "
                          "instead of the table")
    own.add_argument("--csv", nargs="?", const="-", metavar="FILE",
                     help="write the results as CSV to FILE (--csv=FILE), or alone: to stdout")
    own.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    own.add_argument("--shared", action="store_true",
                     help="buffers from pycollect.empty (shared memory that the host's ranks "
                          "map: direct algorithms reduce and copy them with plain loads)")
    own.add_argument("--inject-fault", action="store_true",
                     help="corrupt one result element on the last rank before each check "
                          "(shows that the check catches it)")
    parser.add_argument("benchmark", nargs="?", help="benchmark name (see below)")
    return parser


class Config:
    """The validated settings of one run."""

    def __init__(self, args, parser):
        # `--json allreduce` hands the benchmark to --json's optional FILE: take it back.
        for flag in ("json", "csv"):
            if args.benchmark is None and getattr(args, flag) in BENCHMARKS:
                args.benchmark = getattr(args, flag)
                setattr(args, flag, "-")
        if args.benchmark is None:
            parser.error("name a benchmark, e.g. pycollect-bench --local 2 allreduce")
        self.args = args
        try:
            self._validate(args)
        except Exception as exc:
            from .errors import Error
            if not isinstance(exc, Error):
                raise
            parser.error(str(exc))

    def _validate(self, args):
        """Check every setting that needs no peer; raise InvalidArgument or PluginError."""
        from .context import (ALLREDUCE_ALGORITHMS, BROADCAST_ALGORITHMS, REDUCE_ALGORITHMS,
                              allreduce_algorithm)
        from .errors import InvalidArgument
        from .types import DTYPES, ReduceOp
        name = args.benchmark
        if name not in BENCHMARKS:
            close = [b for b in sorted(BENCHMARKS) if b.startswith(name.split("_")[0])]
            raise InvalidArgument(f"unknown benchmark {name!r}" + (
                f"; did you mean one of {', '.join(close)}?" if close else
                f"; choose from {', '.join(sorted(BENCHMARKS))}"))
        self.name = name
        self.collective, fixed = BENCHMARKS[name]
        tables = {"allreduce": ALLREDUCE_ALGORITHMS, "broadcast": BROADCAST_ALGORITHMS,
                  "reduce": REDUCE_ALGORITHMS}
        self.algorithm = fixed
        if args.algorithm is not None:
            if fixed is None:
                raise InvalidArgument(f"--algorithm: {name} has no algorithm to choose")
            if fixed != "auto" and args.algorithm.split(":")[0] != fixed:
                raise InvalidArgument(f"--algorithm {args.algorithm} contradicts {name}; use "
                                      f"{self.collective} --algorithm {args.algorithm}")
            self.algorithm = args.algorithm
        if args.base is not None:
            if self.algorithm != "bcube":
                raise InvalidArgument("--base applies to allreduce_bcube only")
            self.algorithm = f"bcube:{args.base}"
        named = self.algorithm
        if named is not None and self.collective == "allreduce":
            named = allreduce_algorithm(named)[0]       # bcube:B: B checked here
        if named is not None and named not in tables[self.collective]:
            what = "this build of pycollect has no" if name == "allreduce_bcube" else "unknown"
            raise InvalidArgument(f"{what} {self.collective} algorithm {self.algorithm!r} "
                                  f"(available: {', '.join(tables[self.collective])})")
        dtype_name = args.dtype or ("uint8" if name in BYTE_DEFAULT else "float32")
        if dtype_name not in DTYPES.values():
            raise InvalidArgument(f"--dtype {dtype_name!r} is not one of "
                                  f"{', '.join(DTYPES.values())}")
        self.dtype = numpy_dtype(dtype_name)
        if args.op is not None and self.collective not in REDUCING:
            raise InvalidArgument(f"--op: {name} does not reduce")
        op_name = (args.op or "sum").upper()
        if op_name not in ReduceOp.__members__:
            raise InvalidArgument(f"--op {args.op!r} is not one of "
                                  f"{', '.join(m.lower() for m in ReduceOp.__members__)}")
        self.op = ReduceOp[op_name]
        if self.collective in REDUCING:
            from ._ext import _reduce
            one = np.zeros(1, self.dtype)
            try:
                _reduce.reduce(one, one, one, self.op)   # the kernels' own dtype/op check
            except InvalidArgument as exc:
                raise InvalidArgument(f"--op {self.op.name.lower()} --dtype {dtype_name}: "
                                      + str(exc).split(": ", 2)[-1]) from None
        if args.inputs > 1 and (self.collective != "allreduce" or self.op == ReduceOp.AVG):
            raise InvalidArgument("--inputs > 1 applies to the allreduce benchmarks with an op "
                                  "other than avg")
        size = args.local or args.size
        if size is not None:
            self.check_size(size)
        if args.local is not None and (args.size is not None or args.rank is not None):
            raise InvalidArgument("--local N starts ranks 0..N-1 itself: drop --size/--rank")
        if args.bind != "none" and args.local is None:
            raise InvalidArgument("--bind places the ranks that --local starts; ranks started "
                                  "by pycollect-run take its own --bind")
        if args.json == "-" and args.csv == "-":
            raise InvalidArgument("--json and --csv cannot both go to stdout; give one a FILE")
        for flag, path in (("--json", args.json), ("--csv", args.csv)):
            # Checked now, not after the sweep: the file is written once every size has run.
            problem = _output_problem(path) if path and path != "-" else None
            if problem:
                raise InvalidArgument(f"{flag} {path}: {problem}")
        stores = [flag for flag, value in (("--store", args.store), ("--redis-host",
                  args.redis_host), ("--shared-path", args.shared_path)) if value]
        if len(stores) > 1:
            raise InvalidArgument(f"{' and '.join(stores)} name two stores; give one")
        self.store = args.store
        if args.redis_host:
            self.store = f"redis://{args.redis_host}:{args.redis_port}"
        elif args.shared_path:
            from urllib.parse import quote
            self.store = "file://" + quote(os.path.abspath(args.shared_path))
        if args.prefix:
            from . import settings
            if self.store is None:
                self.store = settings.get("PYCOLLECT_STORE")    # pycollect-run's, say
            if self.store is None:
                raise InvalidArgument("--prefix needs a store (--store, --redis-host, "
                                      "--shared-path or PYCOLLECT_STORE)")
            from .plugins.registry import with_prefix
            self.store = with_prefix(self.store, args.prefix)
        from .plugins.registry import get_transport
        if args.transport is not None:
            get_transport(args.transport)   # an unknown one fails here, with the registry's list
        self.transport = args.transport or _default_transport()
        if self.store is not None:
            from .plugins.registry import check_store_url
            # e.g. no scheme, no redis plugin yet, or hash:// for the processes --local starts
            check_store_url(self.store, across_processes=args.local is not None)
        self.elements = [0] if self.collective.startswith("barrier") else args.elements

    def check_size(self, size):
        """Refuse a benchmark that cannot run on ``size`` ranks."""
        from .errors import InvalidArgument
        if self.collective == "sendrecv_roundtrip" and size != 2:
            raise InvalidArgument(f"sendrecv_roundtrip runs on exactly 2 ranks, not {size}")
        if self.collective == "pairwise_exchange" and size < 2:
            raise InvalidArgument("pairwise_exchange needs at least 2 ranks")
        if self.collective in ROOTED and self.args.root >= size:
            raise InvalidArgument(f"--root {self.args.root} is not a rank of {size}")


def _output_problem(path):
    """Why the results cannot be written to ``path`` (None: they can).  It must be a writable
    regular file, character device (``/dev/stdout``) or pipe, or a new file in a writable
    directory; a symbolic link counts as its target."""
    if path.endswith(os.sep) or os.path.isdir(path):
        return "is a directory; name a file"
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        mode = None
    except OSError as exc:
        return f"cannot be written ({exc.strerror})"
    if mode is None:
        where = os.path.dirname(os.path.realpath(path))     # a dangling link: its target's
        if not (os.path.isdir(where) and os.access(where, os.W_OK)):
            return f"cannot write into {where} (no such directory, or not writable)"
        return None
    if not (stat.S_ISREG(mode) or stat.S_ISCHR(mode) or stat.S_ISFIFO(mode)):
        return "is not a regular file, a character device or a pipe"
    if not os.access(path, os.W_OK):
        return "is not writable"
    return None


def _default_transport():
    """The transport pycollect.init uses when none is named: PYCOLLECT_TRANSPORT's."""
    from . import settings
    return settings.get("PYCOLLECT_TRANSPORT")


def numpy_dtype(name):
    """Return the NumPy dtype of a pycollect dtype name (bfloat16 through ml_dtypes)."""
    if name == "bfloat16":
        from .errors import InvalidArgument
        try:
            import ml_dtypes
        except ImportError:
            raise InvalidArgument("--dtype bfloat16 needs ml_dtypes, a dependency of pycollect "
                                  "that is missing here: pip install ml_dtypes") from None
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


# -- inputs and references ------------------------------------------------------


def _is_float(dtype):
    """Say whether ``dtype`` is a floating or complex type (bfloat16 included)."""
    return dtype.kind in "fc" or dtype.name == "bfloat16"


def pattern(source, count, dtype, op=None):
    """Rank ``source``'s deterministic input of ``count`` elements; PRODUCT gets values near 1."""
    from .types import ReduceOp
    k = (np.arange(count, dtype=np.int64) * 7 + source * 13 + 3) % 97
    if dtype.kind == "b":
        return (k % 3 == 0)
    if _is_float(dtype):
        if op == ReduceOp.PRODUCT:
            values = 1.0 + (k % 17 - 8) / 64.0
        else:
            values = (k - 48) / 16.0 + 0.1 * (source + 1)
        if dtype.kind == "c":
            values = values + 1j * values[::-1]
        return values.astype(dtype)
    if op == ReduceOp.PRODUCT:
        return (k % 3 + 1).astype(dtype)
    return (k - 48 if dtype.kind == "i" else k).astype(dtype)


def neutral(count, dtype, op):
    """Values whose repeated reduction neither grows nor changes speed (timing fill)."""
    from .types import ReduceOp
    if op == ReduceOp.PRODUCT:
        return np.ones(count, dtype)
    if op in (ReduceOp.SUM, ReduceOp.AVG):
        return np.zeros(count, dtype)
    return None   # idempotent or bounded ops keep the check pattern


def reference(arrays, dtype, op):
    """Return (expected, tolerance) of reducing ``arrays`` with ``op``; tolerance 0 = exact."""
    from .types import ReduceOp
    ufuncs = {ReduceOp.SUM: np.add, ReduceOp.AVG: np.add, ReduceOp.PRODUCT: np.multiply,
              ReduceOp.MIN: np.minimum, ReduceOp.MAX: np.maximum,
              ReduceOp.BAND: np.bitwise_and, ReduceOp.BOR: np.bitwise_or,
              ReduceOp.BXOR: np.bitwise_xor}
    ufunc = ufuncs[op]
    if not _is_float(dtype):
        return functools.reduce(ufunc, arrays), 0
    wide = np.complex128 if dtype.kind == "c" else np.float64
    terms = [a.astype(wide) for a in arrays]
    expected = functools.reduce(ufunc, terms)
    if op in (ReduceOp.MIN, ReduceOp.MAX):
        return expected, 0   # the result is one of the inputs
    eps = float(_finfo(dtype).eps)
    # Each of the n-1 roundings (and the last one) may err by eps times the running magnitude.
    if op == ReduceOp.PRODUCT:
        scale = functools.reduce(np.multiply, [np.abs(t) for t in terms])
    else:
        scale = functools.reduce(np.add, [np.abs(t) for t in terms])
    tolerance = (len(terms) + 1) * eps * scale
    if op == ReduceOp.AVG:
        expected = expected / len(arrays)
        tolerance = tolerance / len(arrays) + eps * np.abs(expected)
    return expected, tolerance


def _finfo(dtype):
    """np.finfo that also knows bfloat16."""
    if dtype.name == "bfloat16":
        import ml_dtypes
        return ml_dtypes.finfo(dtype)
    return np.finfo(dtype)


def mismatch(got, expected, tolerance, what):
    """Describe the first element of ``got`` outside ``tolerance`` of ``expected``, or None."""
    got = np.asarray(got).reshape(-1)
    expected = np.asarray(expected).reshape(-1)
    if got.size != expected.size:
        return f"{what}: {got.size} elements, expected {expected.size}"
    if np.isscalar(tolerance) and tolerance == 0:
        bad = got != expected
    else:
        wide = np.complex128 if got.dtype.kind == "c" else np.float64
        bad = ~(np.abs(got.astype(wide) - expected) <= tolerance)
    if not bad.any():
        return None
    i = int(np.argmax(bad))
    limit = "" if np.isscalar(tolerance) else f" (tolerance {float(tolerance[i]):.3g})"
    return (f"{what}: element {i} is {got[i]}, expected {expected[i]}{limit}; "
            f"{int(bad.sum())} of {got.size} elements wrong")


# -- one benchmark at one size ------------------------------------------------------


def _numpy_empty(count, dtype):
    """``np.empty(count, dtype)``; an array that cannot be had raises InvalidArgument, as
    pycollect.empty's does (--shared), instead of NumPy's MemoryError or ValueError."""
    from .errors import InvalidArgument
    try:
        return np.empty(count, dtype)
    except MemoryError:
        raise InvalidArgument(f"numpy.empty: {count * dtype.itemsize} bytes ({count} elements "
                              f"of {dtype.name}) do not fit in this machine's memory") from None
    except (ValueError, OverflowError):
        raise InvalidArgument(f"numpy.empty: {count} elements of {dtype.name} are more than "
                              f"a NumPy array may hold") from None


def _vcounts(count, size):
    """Per-rank counts around ``count`` that differ by rank and add up to size * count."""
    counts = [count * 2 * (r + 1) // (size + 1) for r in range(size)]
    counts[-1] += size * count - sum(counts)
    return counts


def _pair_counts(count, src, dst):
    """Elements rank ``src`` sends rank ``dst`` in alltoallv: varied, never negative."""
    return max(0, count + ((src * 3 + dst) % 3 - 1) * (count // 2))


class Case:
    """One benchmark at one element count on this rank: buffers, the timed call, the check."""

    def __init__(self, ctx, cfg, count, p2p=None):
        self.ctx, self.cfg, self.count, self.p2p = ctx, cfg, count, p2p
        self.rank, self.size = ctx.rank, ctx.size
        self.dtype, self.op, self.root = cfg.dtype, cfg.op, cfg.args.root
        self.inputs = cfg.args.inputs
        if cfg.args.shared:
            from .shared import empty
            self.empty = empty
        else:
            self.empty = _numpy_empty
        coll = cfg.collective
        per_buffer = count * self.dtype.itemsize
        self.nbytes = per_buffer * (self.size if coll in WHOLE_BUFFER else 1)
        self.factor = busbw_factor(coll, self.size)
        getattr(self, "_setup_" + coll)()

    def mine(self, n=None, source=None):
        """The check pattern of ``source`` (default: this rank), ``n`` elements."""
        return pattern(self.rank if source is None else source,
                       self.count if n is None else n, self.dtype, self.op)

    # Each _setup_X sets self.run (the timed call: run(async_op) -> Work or None),
    # self.fill(check: bool) and self.check() -> message or None.

    def _setup_allreduce(self):
        """Allreduce in place; with --inputs N the N inputs are combined locally first."""
        bufs = [self.empty(self.count, self.dtype) for _ in range(self.inputs)]
        ctx, op, algo = self.ctx, self.op, self.cfg.algorithm
        ufunc = {0: np.add, 1: np.multiply, 2: np.minimum, 3: np.maximum, 5: np.bitwise_and,
                 6: np.bitwise_or, 7: np.bitwise_xor}.get(int(op))
        first, rest = bufs[0], bufs[1:]

        def run(async_op=False):
            for b in rest:
                ufunc(first, b, out=first)
            work = ctx.allreduce(first, op=op, algorithm=algo, async_op=async_op)
            if rest:
                if async_op:
                    work.wait()
                for b in rest:
                    np.copyto(b, first)
            return work if async_op else None

        def fill(check):
            for j, b in enumerate(bufs):
                values = neutral(self.count, self.dtype, op) if not check else None
                b[...] = self.mine(source=self.rank * self.inputs + j) if values is None \
                    else values

        def check():
            sources = [pattern(s, self.count, self.dtype, op)
                       for s in range(self.size * self.inputs)]
            expected, tol = reference(sources, self.dtype, op)
            return next(filter(None, (mismatch(b, expected, tol, f"input {j}")
                                      for j, b in enumerate(bufs))), None)

        self.run, self.fill, self.check, self.result = run, fill, check, first

    def _setup_reduce(self):
        """Reduce in place into root's buffer; the others' buffers must stay as they were."""
        buf = self.empty(self.count, self.dtype)
        ctx, op, algo, root = self.ctx, self.op, self.cfg.algorithm, self.root
        self.run = lambda async_op=False: ctx.reduce(buf, root, op, algo, async_op=async_op)

        def fill(check):
            values = None if check else neutral(self.count, self.dtype, op)
            buf[...] = self.mine() if values is None else values

        def check():
            if self.rank != root:
                return mismatch(buf, self.mine(), 0, "non-root buffer")
            expected, tol = reference([pattern(s, self.count, self.dtype, op)
                                       for s in range(self.size)], self.dtype, op)
            return mismatch(buf, expected, tol, "root's result")

        self.fill, self.check, self.result = fill, check, buf

    def _setup_reduce_scatter(self):
        """Reduce size blocks of count elements; rank r keeps block r."""
        n = self.count * self.size
        send, recv = self.empty(n, self.dtype), self.empty(self.count, self.dtype)
        ctx, op = self.ctx, self.op
        self.run = lambda async_op=False: ctx.reduce_scatter(send, recv, op, async_op=async_op)

        def fill(check):
            send[...] = self.mine(n)
            recv[...] = 0

        def check():
            lo = self.rank * self.count
            expected, tol = reference([pattern(s, n, self.dtype, op)[lo:lo + self.count]
                                       for s in range(self.size)], self.dtype, op)
            return mismatch(recv, expected, tol, "block")

        self.fill, self.check, self.result = fill, check, recv

    def _setup_broadcast(self):
        """Broadcast root's buffer in place."""
        buf = self.empty(self.count, self.dtype)
        ctx, algo, root = self.ctx, self.cfg.algorithm, self.root
        self.run = lambda async_op=False: ctx.broadcast(buf, root, algo, async_op=async_op)
        self._copy_from_root(buf)

    def _setup_broadcast_one_to_all(self):
        """Gloo's one-to-all broadcast: root sends to every rank in turn (send/recv)."""
        buf = self.empty(self.count, self.dtype)
        ctx, root, size = self.p2p, self.root, self.size
        others = [p for p in range(size) if p != root]

        def run(async_op=False):
            if ctx.rank == root:
                for p in others:
                    ctx.send(buf, p, ROOT_TAG_RELEASE)
            else:
                ctx.recv(buf, root, ROOT_TAG_RELEASE)

        self.run = run
        self._copy_from_root(buf)

    def _copy_from_root(self, buf):
        """Fill and check of the broadcasts: everyone ends with root's pattern."""
        root = self.root

        def fill(check):
            buf[...] = self.mine() if self.rank == root else self.mine(source=root + 1)

        self.fill, self.result = fill, buf
        self.check = lambda: mismatch(buf, self.mine(source=root), 0, "broadcast buffer")

    def _setup_allgather(self, counts=None):
        """Every rank gathers every rank's block."""
        counts = counts or [self.count] * self.size
        send = self.empty(counts[self.rank], self.dtype)
        recv = self.empty(sum(counts), self.dtype)
        ctx = self.ctx
        if counts == [self.count] * self.size:
            self.run = lambda async_op=False: ctx.allgather(send, recv, async_op=async_op)
        else:
            self.run = lambda async_op=False: ctx.allgatherv(send, recv, counts,
                                                             async_op=async_op)
        self._gathered(send, recv, counts)

    def _setup_allgatherv(self):
        """allgather with a different count on every rank (size * count in all)."""
        self._setup_allgather(_vcounts(self.count, self.size))

    def _setup_gather(self):
        """Root gathers every rank's block."""
        send = self.empty(self.count, self.dtype)
        recv = self.empty(self.count * self.size, self.dtype) if self.rank == self.root else None
        ctx, root = self.ctx, self.root
        self.run = lambda async_op=False: ctx.gather(send, recv, root, async_op=async_op)
        self._gathered(send, recv, [self.count] * self.size)

    def _gathered(self, send, recv, counts):
        """Fill and check of the gathers: block r of the result is rank r's pattern."""
        def fill(check):
            send[...] = self.mine(counts[self.rank])
            if recv is not None:
                recv[...] = 0

        def check():
            if recv is None:
                return None
            expected = np.concatenate([self.mine(c, source=r) for r, c in enumerate(counts)])
            return mismatch(recv, expected, 0, "gathered buffer")

        self.fill, self.check, self.result = fill, check, recv

    def _setup_scatter(self):
        """Rank r receives block r of root's buffer."""
        n = self.count * self.size
        send = self.empty(n, self.dtype) if self.rank == self.root else None
        recv = self.empty(self.count, self.dtype)
        ctx, root = self.ctx, self.root
        self.run = lambda async_op=False: ctx.scatter(send, recv, root, async_op=async_op)

        def fill(check):
            if send is not None:
                send[...] = self.mine(n)
            recv[...] = 0

        lo = self.rank * self.count
        self.check = lambda: mismatch(recv, self.mine(n, source=root)[lo:lo + self.count], 0,
                                      "scattered block")
        self.fill, self.result = fill, recv

    def _setup_alltoall(self, varied=False):
        """Block p of this rank's buffer goes to rank p (alltoallv: sizes vary by pair)."""
        size, rank, count = self.size, self.rank, self.count
        counts = (lambda s, d: _pair_counts(count, s, d)) if varied else (lambda s, d: count)
        sendcounts = [counts(rank, p) for p in range(size)]
        recvcounts = [counts(p, rank) for p in range(size)]
        send = self.empty(sum(sendcounts), self.dtype)
        recv = self.empty(sum(recvcounts), self.dtype)
        ctx = self.ctx
        if varied:
            self.run = lambda async_op=False: ctx.alltoallv(send, sendcounts, recv, recvcounts,
                                                            async_op=async_op)
        else:
            self.run = lambda async_op=False: ctx.alltoall(send, recv, async_op=async_op)

        def fill(check):
            send[...] = self.mine(send.size)
            recv[...] = 0

        def check():
            blocks = []
            for p in range(size):
                theirs = [counts(p, q) for q in range(size)]
                lo = sum(theirs[:rank])
                blocks.append(self.mine(sum(theirs), source=p)[lo:lo + theirs[rank]])
            return mismatch(recv, np.concatenate(blocks), 0, "received blocks")

        self.fill, self.check, self.result = fill, check, recv

    def _setup_alltoallv(self):
        """alltoall with a different count for every pair of ranks."""
        self._setup_alltoall(varied=True)

    def _setup_barrier(self):
        """The context's barrier (Gloo's barrier_all_to_all)."""
        ctx = self.ctx
        self.run = lambda async_op=False: ctx.barrier(async_op=async_op)
        self._nothing_to_check()

    def _setup_barrier_all_to_one(self):
        """Gloo's all-to-one barrier with send/recv: all tell root, root releases all."""
        ctx, root = self.p2p, self.root
        token = np.zeros(1, np.uint8)
        others = [p for p in range(self.size) if p != root]

        def run(async_op=False):
            if ctx.rank == root:
                for p in others:
                    ctx.recv(token, p, ROOT_TAG_ARRIVE)
                for p in others:
                    ctx.send(token, p, ROOT_TAG_RELEASE)
            else:
                ctx.send(token, root, ROOT_TAG_ARRIVE)
                ctx.recv(token, root, ROOT_TAG_RELEASE)

        self.run = run
        self._nothing_to_check()

    def _nothing_to_check(self):
        """Barriers carry no data."""
        self.fill = lambda check: None
        self.check = lambda: None
        self.result = None

    def _setup_sendrecv_roundtrip(self):
        """Rank 0 sends to rank 1, which sends it back; the latency is the round trip."""
        send, recv = self.empty(self.count, self.dtype), self.empty(self.count, self.dtype)
        ctx = self.p2p

        def run(async_op=False):
            if ctx.rank == 0:
                ctx.send(send, 1, PAIR_TAG)
                ctx.recv(recv, 1, PAIR_TAG)
            else:
                ctx.recv(recv, 0, PAIR_TAG)
                ctx.send(recv, 0, PAIR_TAG)

        self.run = run
        self._exchanged(send, recv, 0)

    def _setup_pairwise_exchange(self):
        """Ranks 2k and 2k+1 swap buffers (lower rank sends first); an odd last rank idles."""
        send, recv = self.empty(self.count, self.dtype), self.empty(self.count, self.dtype)
        ctx, partner = self.p2p, self.rank ^ 1

        def run(async_op=False):
            if partner >= ctx.size:
                return
            if ctx.rank < partner:
                ctx.send(send, partner, PAIR_TAG)
                ctx.recv(recv, partner, PAIR_TAG)
            else:
                ctx.recv(recv, partner, PAIR_TAG)
                ctx.send(send, partner, PAIR_TAG)

        self.run = run
        self._exchanged(send, recv, partner if partner < self.size else None)

    def _exchanged(self, send, recv, source):
        """Fill and check of the point-to-point cases: ``recv`` holds ``source``'s pattern."""
        def fill(check):
            send[...] = self.mine()
            recv[...] = 0

        self.fill, self.result = fill, recv
        self.check = lambda: None if source is None else mismatch(
            recv, self.mine(source=source), 0, "received buffer")

    def corrupt(self):
        """Change one element of this rank's result by far more than any tolerance."""
        out = self.result
        if out is None or out.size == 0:
            return
        flat = out.reshape(-1)
        i = flat.size // 2
        if flat.dtype.kind == "b":
            flat[i] = not flat[i]
        elif _is_float(flat.dtype):
            flat[i] = flat[i] * 3 + 7
        else:
            flat[i] = flat[i] ^ 1


# -- running ------------------------------------------------------------------------


def time_calls(call, barrier, agree_max, warmup_iters, iteration_time, iteration_count=None,
               min_iterations=1, max_iterations=MAX_ITERATIONS):
    """Warm up, agree on one iteration count, time back-to-back calls; return this rank's times.

    Without ``iteration_count``, the count is sized so that the timed calls last about
    ``iteration_time``: after the warmup, batches of 1, 2, 4, ... calls run until one lasts a
    tenth of it on the slowest rank (the first calls of a size run slower than the rest, so
    the warmup alone would size the count too small)."""
    clock = time.perf_counter_ns
    barrier()
    for _ in range(warmup_iters):
        call()
    if iteration_count is not None:
        iterations = iteration_count
    else:
        # Every rank must run the same count: each batch's length is the slowest rank's.
        batch = 1
        while True:
            start = clock()
            for _ in range(batch):
                call()
            took = agree_max((clock() - start) / 1e9)
            if took >= iteration_time / 10 or batch >= max_iterations:
                break
            batch *= 2
        per_call = max(took / batch, 1e-9)
        iterations = int(min(max_iterations, max(min_iterations, iteration_time // per_call)))
    times = [0] * iterations
    barrier()
    for i in range(iterations):
        start = clock()
        call()
        times[i] = clock() - start
    return np.array(times, np.float64) / 1e9


class VerificationFailed(Exception):
    """A rank's result differed from the reference."""


def _agree_max(ctx, value):
    """Return the largest ``value`` over all ranks (float64)."""
    from .types import ReduceOp
    buf = np.array([value], np.float64)
    ctx.allreduce(buf, op=ReduceOp.MAX)
    return float(buf[0])


def measure(ctx, cfg, count, p2p=None):
    """Check and time one size; return (slowest rank's seconds per call on rank 0, Case, algo)."""
    case = Case(ctx, cfg, count, p2p)
    case.fill(True)
    work = case.run(async_op=True)
    algorithm = None
    if work is not None:
        work.wait()
        algorithm = work.algorithm
    problem = None
    if cfg.args.verify:
        if cfg.args.inject_fault and ctx.rank == ctx.size - 1:
            case.corrupt()
        problem = case.check()
    if _agree_max(ctx, 1.0 if problem else 0.0):
        reports = ctx.gather_object(problem)
        if ctx.rank == 0:
            lines = [f"rank {r}: {msg}" for r, msg in enumerate(reports) if msg]
            raise VerificationFailed(f"{cfg.name} with {count} elements of {cfg.dtype.name}: "
                                     + "; ".join(lines))
        raise VerificationFailed(None)
    case.fill(False)
    mine = time_calls(case.run, ctx.barrier, lambda v: _agree_max(ctx, v),
                      cfg.args.warmup_iters, cfg.args.iteration_time, cfg.args.iteration_count)
    everyone = ctx.gather(mine, root=0)
    slowest = everyone.max(axis=0) if ctx.rank == 0 else None
    return slowest, case, algorithm


class Report:
    """Rank 0's output: Gloo's table on stdout, optional JSON and CSV, progress on stderr."""

    COLUMNS = ("bytes", "elements", "min_us", "p50_us", "p99_us", "max_us", "avg_GBps",
               "algbw_GBps", "busbw_GBps", "iterations")
    HEADINGS = ("size (B)", "elements", "min (us)", "p50 (us)", "p99 (us)", "max (us)",
                "avg (GB/s)", "algbw (GB/s)", "busbw (GB/s)", "iterations")

    def __init__(self, cfg, ctx):
        self.cfg, self.size = cfg, ctx.size
        self.rows = []
        self.table = cfg.args.json != "-" and cfg.args.csv != "-"
        self.show_algorithm = cfg.algorithm == "auto"

    def header(self):
        """Print Gloo's three header lines and the column headings."""
        if not self.table:
            return
        cfg, args = self.cfg, self.cfg.args
        algo = f" (algorithm {cfg.algorithm})" if cfg.algorithm else ""
        print(f"Transport:   {cfg.transport}, {self.size} ranks")
        print(f"Algorithm:   {cfg.name}{algo}")
        timing = (f"iteration-count={args.iteration_count}" if args.iteration_count
                  else f"iteration-time={args.iteration_time:g}s")
        print(f"Options:     processes={self.size}, inputs={args.inputs}, dtype={cfg.dtype.name}"
              + (f", op={cfg.op.name.lower()}" if cfg.collective in REDUCING else "")
              + f", verify={str(args.verify).lower()}, warmup-iters={args.warmup_iters}, "
              + timing + (", buffers=pycollect.empty" if args.shared else ""))
        print()
        headings = self.HEADINGS + (("algorithm",) if self.show_algorithm else ())
        print(" ".join(h.rjust(12) for h in headings).rstrip(), flush=True)

    def add(self, count, stats, algorithm):
        """Record one size and print its row."""
        row = dict(stats, elements=count, algorithm=algorithm, verified=self.cfg.args.verify)
        self.rows.append(row)
        if not self.table:
            return
        cells = [self._cell(row[c]) for c in self.COLUMNS]
        if self.show_algorithm:
            cells.append(algorithm or "")
        print(" ".join(c.rjust(12) for c in cells).rstrip(), flush=True)

    @staticmethod
    def _cell(value):
        """Format a table cell: ints as they are, floats to 4 significant digits, None as '-'."""
        if value is None:
            return "-"
        if isinstance(value, int):
            return str(value)
        return np.format_float_positional(value, precision=4, unique=False, fractional=False,
                                          trim="-")

    def document(self):
        """The whole run as one JSON-ready dict."""
        from . import __version__
        cfg, args = self.cfg, self.cfg.args
        return {"benchmark": cfg.name, "collective": cfg.collective, "algorithm": cfg.algorithm,
                "ranks": self.size, "transport": cfg.transport, "dtype": cfg.dtype.name,
                "op": cfg.op.name.lower() if cfg.collective in REDUCING else None,
                "inputs": args.inputs, "verify": args.verify, "warmup_iters": args.warmup_iters,
                "iteration_time_s": args.iteration_time,
                "iteration_count": args.iteration_count, "pycollect": __version__,
                "latency": "per iteration, the slowest rank's", "results": self.rows}

    def finish(self):
        """Write the JSON and CSV outputs; a file that cannot be written raises Error."""
        args = self.cfg.args
        if args.json:
            _write("--json", args.json, json.dumps(self.document(), indent=2) + "\n")
        if args.csv:
            out = io.StringIO()
            fields = ("elements",) + self.COLUMNS[:1] + self.COLUMNS[2:] + ("algorithm",
                                                                             "verified")
            writer = csv.DictWriter(out, fields, extrasaction="ignore", lineterminator="\n")
            writer.writeheader()
            writer.writerows({k: _csv_value(v) for k, v in row.items()} for row in self.rows)
            _write("--csv", args.csv, out.getvalue())


def _csv_value(value):
    """A CSV cell: floats to 6 significant digits (147.711, not 147.71099999999998)."""
    return float("%.6g" % value) if isinstance(value, float) else value


def _write(flag, target, text):
    """Write ``text`` to stdout ('-') or to a file (raise Error naming ``flag`` if it fails:
    the file changed since the check before the sweep, or its disk is full)."""
    if target == "-":
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    try:
        with open(target, "w") as out:
            out.write(text)
    except OSError as exc:
        from .errors import Error
        raise Error(f"{flag} {target}: cannot write the results: "
                    f"{exc.strerror or exc}") from None


def run(cfg):
    """Join the group, run every size, and report on rank 0; return the exit status."""
    import pycollect as pc
    args = cfg.args
    kwargs = {"transport": cfg.transport}
    if args.timeout is not None:
        kwargs["timeout"] = args.timeout
    ctx = pc.init(rank=args.rank, size=args.size, store=cfg.store, **kwargs)
    with ctx:
        cfg.check_size(ctx.size)
        # A message sent right after a collective may reach a rank still inside it; the
        # context takes an early point-to-point message of its own group for a mismatch, so
        # the send/recv benchmarks talk on a group of their own.
        p2p = ctx.new_group(list(range(ctx.size))) if cfg.collective in POINT_TO_POINT else None
        report = Report(cfg, ctx) if ctx.rank == 0 else None
        progress = ctx.rank == 0 and not args.quiet and len(cfg.elements) > 1
        if report:
            report.header()
        for i, count in enumerate(cfg.elements):
            slowest, case, algorithm = measure(ctx, cfg, count, p2p)
            if report:
                stats = latency_stats(slowest, case.nbytes, case.factor)
                report.add(count, stats, algorithm)
                if progress:
                    sys.stderr.write(f"pycollect-bench: {i + 1}/{len(cfg.elements)} sizes done "
                                     f"({count} elements, {stats['iterations']} iterations, "
                                     f"p50 {stats['p50_us']:.4g} us)\n")
                    sys.stderr.flush()
            del case
        if report:
            report.finish()
        ctx.barrier()   # nobody closes while rank 0 still gathers
    return 0


def _child_argv(parser, args):
    """Rebuild the command line for the ranks --local starts (store and --local left out)."""
    skip = {"local", "bind", "store", "redis_host", "redis_port", "prefix", "shared_path", "help"}
    argv = []
    raw = parser.parse_args([args.benchmark])   # the defaults, as parsed
    for action in parser._actions:
        dest = action.dest
        if dest in skip or not action.option_strings:
            continue
        value = getattr(args, dest)
        if value == getattr(raw, dest):
            continue
        flag = action.option_strings[-1]
        if isinstance(action, argparse._StoreFalseAction) or isinstance(
                action, argparse._StoreTrueAction):
            argv.append(flag)
        elif dest == "elements":
            argv.append(f"{flag}={','.join(map(str, value))}")
        elif dest in ("iteration_time", "timeout"):
            argv.append(f"{flag}={value!r}s")
        else:
            argv.append(f"{flag}={value}")
    return argv + [args.benchmark]


def _launch_local(parser, cfg):
    """Start cfg.args.local ranks of this tool through pycollect-run; return its exit status."""
    from . import launch
    argv = ["-n", str(cfg.args.local), "--bind", cfg.args.bind, "--no-prefix-output"]
    if cfg.store is not None:
        argv += ["--store", cfg.store]
    argv += launch.module_command("pycollect.bench") + _child_argv(parser, cfg.args)
    return launch.main(argv)


def _rank_label(args):
    """This rank for a message: ``--rank``, else ``PYCOLLECT_RANK``, else "?"."""
    from . import settings
    from .errors import InvalidArgument
    if args.rank is not None:
        return args.rank
    try:
        rank = settings.get("PYCOLLECT_RANK")
    except InvalidArgument:
        return "?"
    return "?" if rank is None else rank


def main(argv=None):
    """Run pycollect-bench; return its exit status.  An exception turned into a status here
    is also written to the exit report that pycollect-run reads (exit_report.report), so
    that the launcher blames the rank whose failure is its own, not a peer's PeerError."""
    from .errors import Error, InvalidArgument, PluginError
    from .exit_report import report
    parser = _parser()
    args = parser.parse_args(argv)
    cfg = Config(args, parser)
    if args.local is not None:
        return _launch_local(parser, cfg)
    rank = _rank_label(args)
    try:
        return run(cfg)
    except VerificationFailed as exc:
        report(exc)
        if exc.args[0]:
            sys.stderr.write(f"pycollect-bench: verification failed: {exc.args[0]}\n")
        return 1
    except (InvalidArgument, PluginError) as exc:
        report(exc)
        sys.stderr.write(f"pycollect-bench: rank {rank}: {exc}\n")
        return 2
    except Error as exc:
        report(exc)
        sys.stderr.write(f"pycollect-bench: rank {rank}: {type(exc).__name__}: {exc}\n")
        return 1
    except MemoryError as exc:
        report(exc)
        sys.stderr.write(f"pycollect-bench: rank {rank}: out of memory"
                         + (f": {exc}" if str(exc) else "") + "\n")
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError as exc:
        report(exc)
        # Whoever read our output (e.g. `| head`) has gone: stop without a traceback.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
