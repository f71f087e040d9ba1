"""One rank of the mixed-topology tests: every collective, checked against NumPy.

Usage: python tests/hierarchy_worker.py matrix|loop|leave [--timeout S]

Rank, size and store come from the environment (PYCOLLECT_RANK, _SIZE,
_STORE).  Every rank builds every rank's seeded input, so it checks each
result on its own.

``matrix`` prints one JSON line: this rank's pair kinds, the hosts pycollect
saw, the number of checks and the algorithm "auto" ran for a large allreduce
and broadcast; it exits 1 with the reason on stderr at the first wrong result.
``loop`` prints "READY" after its first hierarchical allreduce, then runs them
until one fails and prints "FAILED <error class> <seconds> <message>".
``leave`` (2 ranks): rank 0 sends rank 1 a large message, which rank 1 never
receives: it exits half a second later; rank 0 prints its FAILED line.
"""

import argparse
import json
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]     # the reference helpers; this tree's pycollect

import pycollect as pc                                                   # noqa: E402
from pycollect.context import (ALLREDUCE_ALGORITHMS, BROADCAST_ALGORITHMS,  # noqa: E402
                               REDUCE_ALGORITHMS)
from reference import (BFLOAT16, assert_matches, make_input, ops_for,   # noqa: E402
                       reduce_reference)

DTYPES = ["float32", "float64", "int32", "uint8", "float16", "complex64"] + \
    (["bfloat16"] if BFLOAT16 is not None else [])
LARGE = 40000           # elements: 160 KB of float32, above the hierarchical threshold


def counts_for(size):
    """Element counts: none, one, not divisible by the size, large."""
    return [0, 1, 7 * size + 3, LARGE]


class Matrix:
    """Run collectives on ``ctx`` and check them; counts the checks."""

    def __init__(self, ctx):
        self.ctx = ctx
        self.checks = 0

    def inputs(self, name, count, op, seed):
        return [make_input(name, count, r, op, seed) for r in range(self.ctx.size)]

    def check(self, name, op, got, expected, *where):
        assert_matches(name, op, got, expected, "rank %d: %s" % (self.ctx.rank, where))
        self.checks += 1

    def exact(self, got, expected, *where):
        if not np.array_equal(got, expected):
            raise AssertionError("rank %d: %s: got %r, expected %r"
                                 % (self.ctx.rank, where, got[:8], expected[:8]))
        self.checks += 1

    def allreduce(self):
        ctx = self.ctx
        for name in DTYPES:
            for op in ops_for(name):
                for count in counts_for(ctx.size):
                    inputs = self.inputs(name, count, op, 0)
                    expected = reduce_reference(name, inputs, op)
                    for algo in ALLREDUCE_ALGORITHMS:
                        buf = inputs[ctx.rank].copy()
                        ctx.allreduce(buf, op=op, algorithm=algo)
                        self.check(name, op, buf, expected, "allreduce", algo, count)

    def rooted(self):
        ctx, size, rank = self.ctx, self.ctx.size, self.ctx.rank
        case = 0
        for name in ("float32", "int32"):
            for count in counts_for(size):
                data = self.inputs(name, count, pc.SUM, 2)
                for algo in BROADCAST_ALGORITHMS:
                    root = case % size
                    case += 1
                    buf = data[root].copy() if rank == root else np.zeros_like(data[root])
                    ctx.broadcast(buf, root=root, algorithm=algo)
                    self.exact(buf, data[root], "broadcast", algo, count, "root", root)
                for algo in REDUCE_ALGORITHMS:
                    root = case % size
                    case += 1
                    buf = data[rank].copy()
                    ctx.reduce(buf, root=root, op=pc.MAX, algorithm=algo)
                    want = reduce_reference(name, data, pc.MAX) if rank == root else data[rank]
                    self.exact(buf, want, "reduce", algo, count, "root", root)
                root = case % size
                case += 1
                got = ctx.gather(data[rank], root=root)
                if rank == root:
                    self.exact(got, np.array(data), "gather", count, "root", root)
                send = np.concatenate(data) if rank == root else None
                mine = np.empty(count, data[0].dtype)
                ctx.scatter(send, mine, root=root)
                self.exact(mine, data[rank], "scatter", count, "root", root)

    def vectors(self):
        ctx, size, rank = self.ctx, self.ctx.size, self.ctx.rank
        for name in ("float64", "uint8"):
            for count in counts_for(size):
                data = self.inputs(name, count, pc.SUM, 3)
                self.exact(ctx.allgather(data[rank]), np.array(data), "allgather", count)
                counts = [(count + r) % 5 + r for r in range(size)]
                parts = [self.inputs(name, c, pc.SUM, 4)[r] for r, c in enumerate(counts)]
                out = np.empty(sum(counts), data[0].dtype)
                ctx.allgatherv(parts[rank], out, counts)
                self.exact(out, np.concatenate(parts), "allgatherv", counts)
                block = count // size * size
                full = [d[:block] for d in data]
                got = ctx.reduce_scatter(full[rank].copy())
                want = reduce_reference(name, full, pc.SUM)
                self.exact(got, np.split(want, size)[rank], "reduce_scatter", count)
                rs_counts = [count // size + (1 if r < count % size else 0) for r in range(size)]
                mine = np.empty(rs_counts[rank], data[0].dtype)
                ctx.reduce_scatterv(data[rank].copy(), mine, rs_counts)
                edges = np.cumsum([0] + rs_counts)
                want = reduce_reference(name, data, pc.SUM)
                self.exact(mine, want[edges[rank]:edges[rank + 1]], "reduce_scatterv", count)
                got = ctx.alltoall(full[rank].reshape(size, -1))
                want = np.array([np.split(full[r], size)[rank] for r in range(size)])
                self.exact(got, want, "alltoall", count)
                sendcounts = [(rank + p + count) % 4 for p in range(size)]
                recvcounts = [(p + rank + count) % 4 for p in range(size)]
                send = np.arange(sum(sendcounts), dtype=data[0].dtype) + rank
                recv = np.empty(sum(recvcounts), data[0].dtype)
                ctx.alltoallv(send, sendcounts, recv, recvcounts)
                offsets = [sum((p + q + count) % 4 for q in range(rank)) for p in range(size)]
                want = np.concatenate([np.arange(offsets[p], offsets[p] + recvcounts[p])
                                       .astype(data[0].dtype) + p for p in range(size)])
                self.exact(recv, want, "alltoallv", count)

    def point_to_point(self):
        ctx, size, rank = self.ctx, self.ctx.size, self.ctx.rank
        for count in (0, 5, LARGE):
            # A ring: rank r sends to r+1 (across hosts and within one).
            dst, src = (rank + 1) % size, (rank - 1) % size
            mine = self.inputs("float32", count, pc.SUM, 5)
            work = ctx.send(mine[rank], dst, tag=count, async_op=True)
            got = np.empty(count, np.float32)
            ctx.recv(got, src, tag=count)
            work.wait()
            self.exact(got, mine[src], "send/recv", count)

    def coalesced_and_barrier(self):
        ctx, rank = self.ctx, self.ctx.rank
        a = [self.inputs("float32", n, pc.SUM, 6) for n in (3, LARGE)]
        bufs = [x[rank].copy() for x in a]
        ctx.allreduce_coalesced(bufs)
        for got, x in zip(bufs, a):
            self.check("float32", pc.SUM, got, reduce_reference("float32", x, pc.SUM),
                       "allreduce_coalesced", len(got))
        ctx.barrier()
        self.checks += 1


def run_matrix(ctx):
    m = Matrix(ctx)
    m.allreduce()
    m.rooted()
    m.vectors()
    m.point_to_point()
    m.coalesced_and_barrier()
    large = make_input("float32", LARGE, ctx.rank, pc.SUM)
    auto_allreduce = ctx.allreduce(large, async_op=True)
    auto_allreduce.wait()
    auto_broadcast = ctx.broadcast(large, root=ctx.size - 1, async_op=True)
    auto_broadcast.wait()
    small = ctx.allreduce(np.ones(4, np.float32), async_op=True)
    small.wait()
    ctx.barrier()       # nobody closes (rank 0 hosts the store) before all are done
    topology = ctx._topology
    return {"rank": ctx.rank, "kinds": ctx._transport.pair_kinds(), "hosts": topology.hosts,
            "checks": m.checks, "auto_allreduce": auto_allreduce.algorithm,
            "auto_broadcast": auto_broadcast.algorithm, "auto_small": small.algorithm}


def run_loop(ctx):
    buf = np.ones(LARGE, np.float32)
    ctx.allreduce(buf, algorithm="hierarchical")
    print("READY", flush=True)
    start = time.monotonic()
    try:
        while True:
            ctx.allreduce(buf, algorithm="hierarchical")
            buf[:] = 1
    except pc.Error as exc:
        print("FAILED %s %.3f %s" % (type(exc).__name__, time.monotonic() - start,
                                     str(exc).replace("\n", " ")), flush=True)


def run_leave(ctx):
    ctx.barrier()
    if ctx.rank == 1:
        time.sleep(0.5)
        os._exit(0)
    start = time.monotonic()
    try:
        ctx.send(np.ones(1 << 20, np.float32), 1)
        print("SENT", flush=True)
    except pc.Error as exc:
        print("FAILED %s %.3f %s" % (type(exc).__name__, time.monotonic() - start, exc),
              flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("mode", choices=("matrix", "loop", "leave"))
    parser.add_argument("--timeout", type=float, default=20.0)
    args = parser.parse_args()
    ctx = pc.init(timeout=args.timeout)
    try:
        if args.mode == "matrix":
            print(json.dumps(run_matrix(ctx)), flush=True)
        elif args.mode == "loop":
            run_loop(ctx)
        else:
            run_leave(ctx)
    except (AssertionError, pc.Error) as exc:
        sys.exit("rank %d FAILED: %s: %s" % (ctx.rank, type(exc).__name__, exc))
    finally:
        ctx.close()


if __name__ == "__main__":
    main()
