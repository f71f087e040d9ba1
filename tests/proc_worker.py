"""One rank of a process test: a deterministic battery of collectives, every result checked."""

# Usage:
#     python tests/proc_worker.py [--timeout S] [--die D] [RANK SIZE STORE]
#     pycollect-run -n 3 tests/proc_worker.py [--timeout S] [--die D]
#
# Without RANK SIZE STORE, pycollect.init() reads PYCOLLECT_RANK, PYCOLLECT_SIZE
# and PYCOLLECT_STORE.  Every rank builds every rank's seeded input, so each one
# checks its results against a NumPy reference on its own.  Success prints
# "rank R ok N checks" and exits 0; a wrong result or an unexpected error prints
# "rank R FAILED: ..." to stderr and exits 1.
#
# --die D makes rank D call os._exit(1) after the first barrier; the other ranks
# then expect their next collective to raise PeerError or Timeout naming rank D,
# print "rank R saw the failure of rank D: ..." and exit 0.

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import pycollect as pc                                                   # noqa: E402
from reference import (BFLOAT16, assert_matches, make_input, ops_for,   # noqa: E402
                       reduce_reference)

DTYPES = ["float32", "float64", "int64", "uint8", "float16", "bfloat16", "complex64"]
ALLREDUCE_ALGORITHMS = ["ring", "ring_chunked", "direct", "auto"]
BROADCAST_ALGORITHMS = ["binomial", "pipelined", "direct"]
BROADCAST_DTYPES = ["float64", "uint8"]
# Exit status of a rank whose check failed or that hit an unexpected error.
FAILED = 1
# A seed for broadcast inputs, apart from the allreduce inputs' seed 0.
BROADCAST_SEED = 1


def counts_for(size):
    """The element counts of the battery, one of them not divisible by ``size``."""
    return [0, 1, 100, 10000, 7 * size + 3, 300000]


def expected_checks(size):
    """How many results the battery checks in a world of ``size`` ranks."""
    dtypes = [d for d in DTYPES if d != "bfloat16" or BFLOAT16 is not None]
    counts = len(counts_for(size))
    allreduces = sum(len(ops_for(d)) for d in dtypes) * counts * len(ALLREDUCE_ALGORITHMS)
    broadcasts = len(BROADCAST_DTYPES) * counts * size * len(BROADCAST_ALGORITHMS)
    return 2 + allreduces + broadcasts      # two barriers


def parse_args(argv):
    """Read the command line."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("rank", nargs="?", type=int, help="this rank (default: PYCOLLECT_RANK)")
    parser.add_argument("size", nargs="?", type=int, help="world size (default: PYCOLLECT_SIZE)")
    parser.add_argument("store", nargs="?", help="store URL (default: PYCOLLECT_STORE)")
    parser.add_argument("--timeout", type=float, default=30.0,
                        help="per-context timeout in seconds (default 30)")
    parser.add_argument("--die", type=int, metavar="D",
                        help="rank D exits abruptly after the first barrier")
    args = parser.parse_args(argv)
    if args.store is None and args.rank is not None:
        parser.error("give all three of RANK SIZE STORE, or none")
    return args


class Battery:
    """The collectives of one rank and a count of the results checked."""

    def __init__(self, ctx):
        self.ctx = ctx
        self.checks = 0

    def where(self, *parts):
        """Describe a case for a failure message."""
        return "rank %d of %d: %s" % (self.ctx.rank, self.ctx.size, " ".join(map(str, parts)))

    def allreduce(self):
        """Every dtype x op x algorithm x count, against the NumPy reference."""
        size = self.ctx.size
        for dtype in DTYPES:
            if dtype == "bfloat16" and BFLOAT16 is None:
                continue
            for op in ops_for(dtype):
                for n in counts_for(size):
                    inputs = [make_input(dtype, n, r, op) for r in range(size)]
                    expected = reduce_reference(dtype, inputs, op)
                    for algorithm in ALLREDUCE_ALGORITHMS:
                        buf = inputs[self.ctx.rank].copy()
                        out = self.ctx.allreduce(buf, op=op, algorithm=algorithm)
                        where = self.where("allreduce", algorithm, "count", n)
                        if out is not buf:
                            raise AssertionError(where + ": allreduce did not return its buffer")
                        assert_matches(dtype, op, buf, expected, where)
                        self.checks += 1

    def broadcast(self):
        """Every root x algorithm x count, for a wide and a narrow dtype."""
        size = self.ctx.size
        for dtype in BROADCAST_DTYPES:
            for n in counts_for(size):
                for root in range(size):
                    expected = make_input(dtype, n, root, pc.SUM, seed=BROADCAST_SEED)
                    for algorithm in BROADCAST_ALGORITHMS:
                        if self.ctx.rank == root:
                            buf = expected.copy()
                        else:
                            buf = np.zeros(n, dtype=expected.dtype)
                        self.ctx.broadcast(buf, root=root, algorithm=algorithm)
                        if not np.array_equal(buf, expected):
                            bad = np.flatnonzero(buf != expected)[:5]
                            raise AssertionError("%s: mismatch at %s" % (self.where(
                                "broadcast", dtype, algorithm, "root", root, "count", n), bad))
                        self.checks += 1

    def barrier(self):
        """A barrier, counted as a check once it returns."""
        self.ctx.barrier()
        self.checks += 1


def expect_failure_of(ctx, dead):
    """Run a collective that must fail because rank ``dead`` is gone; return the message."""
    started = time.monotonic()
    try:
        ctx.allreduce(np.ones(1000, dtype=np.float32))
    except (pc.PeerError, pc.Timeout) as exc:
        text = "%s: %s" % (type(exc).__name__, exc)
        if "rank %d" % dead not in str(exc):
            raise AssertionError("the error does not name rank %d: %s" % (dead, text)) from None
        return "%s (after %.1f s)" % (text, time.monotonic() - started)
    raise AssertionError("rank %d: allreduce succeeded although rank %d exited"
                         % (ctx.rank, dead))


def run(args):
    """Join the group and run the battery (or the failure scenario); return a report line."""
    ctx = pc.init(rank=args.rank, size=args.size, store=args.store, timeout=args.timeout)
    with ctx:
        battery = Battery(ctx)
        battery.barrier()
        if args.die is not None:
            if ctx.rank == args.die:
                sys.stdout.flush()
                os._exit(FAILED)
            return "rank %d saw the failure of rank %d: %s" % (
                ctx.rank, args.die, expect_failure_of(ctx, args.die))
        battery.allreduce()
        battery.broadcast()
        # Nobody closes (and rank 0 stops hosting a TCP store) before all are done.
        battery.barrier()
        if battery.checks != expected_checks(ctx.size):
            raise AssertionError("rank %d: %d checks ran, %d expected" % (
                ctx.rank, battery.checks, expected_checks(ctx.size)))
        return "rank %d ok %d checks" % (ctx.rank, battery.checks)


def main(argv=None):
    """Run one rank; return its exit status."""
    args = parse_args(argv)
    rank = args.rank if args.rank is not None else os.environ.get("PYCOLLECT_RANK", "?")
    try:
        print(run(args), flush=True)
    except (AssertionError, pc.Error) as exc:
        sys.stderr.write("rank %s FAILED: %s: %s\n" % (rank, type(exc).__name__, exc))
        sys.stderr.flush()
        return FAILED
    return 0


if __name__ == "__main__":
    sys.exit(main())
