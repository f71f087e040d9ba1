"""Allreduce (or broadcast, allgather) algorithms call by call: each iteration runs one call
of every algorithm.

    python benchmarks/allreduce_paired.py --ranks 4 --count 1048576 \
        --algorithms direct,halving_doubling,ring --iterations 40
    python benchmarks/allreduce_paired.py --collective broadcast --algorithms direct,binomial
    python benchmarks/allreduce_paired.py --algorithms direct,direct-cma --count 262144
    python benchmarks/allreduce_paired.py --algorithms direct,direct@262144

"direct-cma" is "direct" with plain buffers never staged in the pool of shared
buffers (their peers copy them with cross-memory attach, as before staging).
"direct@N" is the allreduce "direct" with N-byte chunks where every peer's
buffer is mapped (set_mapped_chunk_bytes).

On a machine other jobs share, a burst of load lands on whichever call runs
then.  Here every iteration calls each algorithm once, back to back, in an
order that rotates, and each call's time is the slowest rank's; the report
gives each algorithm's median and minimum and the median, over iterations, of
its time over the first algorithm's in the same iteration.  Ranks are local
processes over the default transport (shared memory on one host).
"""

import argparse
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

from pycollect.bench import numpy_dtype
from pycollect.plugins.hosts import rank_cpus, started_on

MAX_BCUBE_BASE = 16     # pycollect/_ext/_allreduce.pyx: a bcube base is 2..16


def rank_main(args):
    import pycollect as pc
    ctx = pc.init(rank=args.rank, size=args.ranks, store=args.store, timeout=args.timeout,
                  transport=args.transport)
    from pycollect.bench import busbw_factor
    from pycollect._ext._allreduce import set_mapped_chunk_bytes
    from pycollect._ext._direct import set_stage_bytes
    names = args.algorithms.split(",")
    if args.pooled:
        buf = pc.empty(args.count, numpy_dtype(args.dtype))
        buf[:] = 1
    else:
        buf = np.ones(args.count, numpy_dtype(args.dtype))
    out = np.empty(args.count * args.ranks, buf.dtype)
    run = {"allreduce": lambda a: ctx.allreduce(buf, algorithm=a),
           "broadcast": lambda a: ctx.broadcast(buf, 0, algorithm=a),
           "allgather": lambda a: ctx.allgather(buf, out, algorithm=a)}[args.collective]

    def direct_with(setter, value):
        """"direct" with ``setter``'s value set for this call alone."""
        before = setter(value)
        try:
            run("direct")
        finally:
            setter(before)

    def call(name):
        if name.startswith("direct@"):
            direct_with(set_mapped_chunk_bytes, int(name[len("direct@"):]))
        elif name == "direct-cma":
            direct_with(set_stage_bytes, 0)
        else:
            run(name)
    for name in names:
        for _ in range(args.warmup):
            call(name)
    times = np.zeros((args.iterations, len(names)))
    for i in range(args.iterations):
        k = i % len(names)
        for j in list(range(k, len(names))) + list(range(k)):
            ctx.barrier()
            t0 = time.perf_counter()
            call(names[j])
            times[i, j] = time.perf_counter() - t0
    ctx.allreduce(times, op=pc.MAX)
    if args.rank == 0:
        nbytes = buf.nbytes * (args.ranks if args.collective == "allgather" else 1)
        factor = busbw_factor(args.collective, args.ranks)
        print("%s, %d ranks, %d x %s, %d iterations, load %s" % (
            args.collective, args.ranks, args.count, args.dtype, args.iterations,
            " ".join(open("/proc/loadavg").read().split()[:3])))
        print("%-20s %12s %12s %12s %12s" % ("algorithm", "median (us)", "busbw (GB/s)",
                                              "min (us)", "÷ " + names[0]))
        for j, name in enumerate(names):
            med = np.median(times[:, j])
            print("%-20s %12.1f %12.3f %12.1f %12.2f" % (
                name, med * 1e6, factor * nbytes / med / 1e9, times[:, j].min() * 1e6,
                np.median(times[:, j] / times[:, 0])))
    ctx.close()


def check_args(parser, args):
    """Refuse, with ``parser``'s usage error, what the ranks could not run."""
    from pycollect.errors import Error
    from pycollect.selection import named
    from pycollect.types import DTYPES
    if args.ranks < 1:
        parser.error("--ranks must be at least 1, got %d" % args.ranks)
    if args.iterations < 1:
        parser.error("--iterations must be at least 1, got %d" % args.iterations)
    if args.count < 0:
        parser.error("--count must be 0 or more, got %d" % args.count)
    try:
        dtype = numpy_dtype(args.dtype).name
    except Error as exc:            # bfloat16 without ml_dtypes
        parser.error(str(exc))
    except TypeError:
        dtype = None
    if dtype not in DTYPES.values():
        parser.error("--dtype %r is not a dtype pycollect has (choose from %s)"
                     % (args.dtype, ", ".join(DTYPES.values())))
    names = args.algorithms.split(",")
    for name in names:
        if name.startswith("direct@"):
            chunk = name[len("direct@"):]
            if not (chunk.isdigit() and int(chunk) >= 1):
                parser.error("--algorithms: %r: direct@N takes a chunk of N >= 1 bytes" % name)
        elif name.startswith("bcube:") and args.collective == "allreduce":
            base = name[len("bcube:"):]
            if not (base.isdigit() and 2 <= int(base) <= MAX_BCUBE_BASE):
                parser.error("--algorithms: %r: bcube:B takes a base B of 2..%d"
                             % (name, MAX_BCUBE_BASE))
        elif name not in ("auto", "direct-cma"):
            try:
                named(args.collective, name)
            except Error as exc:
                parser.error("--algorithms: %s; or direct-cma, direct@N" % exc)


def main(argv=None):
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--collective", default="allreduce",
                        choices=("allreduce", "broadcast", "allgather"))
    parser.add_argument("--count", type=int, default=1 << 20, help="elements per rank")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--algorithms", default="direct,halving_doubling,ring_chunked")
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--transport", default="auto")
    parser.add_argument("--pooled", action="store_true",
                        help="the buffer from pycollect.empty (shared memory the peers map)")
    parser.add_argument("--bind", choices=("core", "none"), default="core",
                        help="core (default): rank r bound to core r %% cores from its start "
                        "(pycollect-run --bind core); none: the kernel places the ranks")
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--store", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    check_args(parser, args)
    if args.rank is not None:
        return rank_main(args)
    with tempfile.TemporaryDirectory() as tmp:
        store = "file://" + os.path.join(tmp, "store")
        given = sys.argv[1:] if argv is None else list(argv)
        cpus = rank_cpus(args.ranks) if args.bind == "core" else [None] * args.ranks
        procs = []
        for r in range(args.ranks):
            with started_on(cpus[r]):
                procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__),
                                               *given, "--rank", str(r), "--store", store]))
        deadline = time.monotonic() + args.timeout * 4
        codes = []
        for p in procs:
            try:
                codes.append(p.wait(timeout=max(1.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                p.kill()
                codes.append(p.wait())
    return max(codes)


if __name__ == "__main__":
    sys.exit(main())
