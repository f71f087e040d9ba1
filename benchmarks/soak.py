"""Soak: many mixed collectives, resident memory and descriptors measured before and after.

    pycollect-run -n 4 python benchmarks/soak.py --iterations 20000
    pycollect-run -n 64 python benchmarks/soak.py --iterations 20     # oversubscribed

Every rank runs the same deterministic mix (allreduce of several sizes and
algorithms, broadcast, allgather, reduce_scatter, alltoall, barrier, send/recv
in a ring) and checks a sample of the results.  Rank 0 prints the time, the
resident set size (max over ranks) after a warmup and at the end, and the
open descriptors; the run fails if memory grew by more than --max-growth-mib.
Over shared memory the resident set also counts the ring pages a rank has
touched so far (at most 2 × (ranks − 1) rings of up to 1 MiB): with small
messages the rings fill slowly, so expect a few MiB of growth that stops
there; over TCP (SOAK_TRANSPORT=tcp) the growth is 0.
"""

import argparse
import os
import resource
import sys
import time

import numpy as np

import pycollect as pc


def rss_kib():
    """Current resident set size in KiB (from /proc, not the peak)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * (os.sysconf("SC_PAGE_SIZE") // 1024)


def one_round(ctx, i, bufs):
    """One pass of the mix; returns a value every rank can check."""
    r, n = ctx.rank, ctx.size
    kind = i % 8
    if kind == 0:
        return float(ctx.allreduce(bufs["small"].copy())[0])
    if kind == 1:
        return float(ctx.allreduce(bufs["mid"].copy(), algorithm="ring_chunked")[-1])
    if kind == 2:
        b = bufs["mid"].copy() if r == i % n else np.zeros_like(bufs["mid"])
        return float(ctx.broadcast(b, root=i % n)[1])
    if kind == 3:
        return float(ctx.allgather(np.array([r], np.float64)).sum())
    if kind == 4:
        return float(ctx.reduce_scatter(np.ones(4 * n, np.float32)).sum())
    if kind == 5:
        return float(ctx.alltoall(np.full(2 * n, r, np.int32)).sum())
    if kind == 6:
        ctx.barrier()
        return 0.0
    peer_to, peer_from = (r + 1) % n, (r - 1) % n
    if n > 1:
        ctx.send(np.full(3, r, np.int64), peer_to, tag=i % 1000)
        got = np.zeros(3, np.int64)
        ctx.recv(got, src=peer_from, tag=i % 1000)
        return float(got[0])
    return 0.0


def expected(ctx, i):
    n = ctx.size
    kind = i % 8
    return {0: float(n), 1: float(n), 2: 1.0, 3: float(n * (n - 1) / 2), 4: 4.0 * n,
            5: float(2 * n * (n - 1) / 2) * 1.0, 6: 0.0,
            7: float((ctx.rank - 1) % n) if n > 1 else 0.0}[kind]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=20000)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--max-growth-mib", type=float, default=8.0)
    args = parser.parse_args()
    t_init = time.perf_counter()
    with pc.init(transport=os.environ.get("SOAK_TRANSPORT", "auto")) as ctx:
        init_s = time.perf_counter() - t_init
        bufs = {"small": np.ones(16, np.float32), "mid": np.ones(50000, np.float32)}
        for i in range(args.warmup):
            one_round(ctx, i, bufs)
        ctx.barrier()
        rss0, fds0 = rss_kib(), len(os.listdir("/proc/self/fd"))
        t0 = time.perf_counter()
        bad = 0
        for i in range(args.iterations):
            got = one_round(ctx, i, bufs)
            if i % 97 == 0 and got != expected(ctx, i):
                bad += 1
        elapsed = time.perf_counter() - t0
        ctx.barrier()
        rss1, fds1 = rss_kib(), len(os.listdir("/proc/self/fd"))
        stats = ctx.allreduce(np.array([rss0, rss1, rss1 - rss0, fds1 - fds0, bad], np.float64),
                              op=pc.MAX)
        if ctx.rank == 0:
            print("%d ranks: init %.2f s; %d mixed operations in %.2f s (%.1f us each); "
                  "RSS after warmup %.1f MiB, at the end %.1f MiB, growth %.2f MiB (max over "
                  "ranks); descriptors +%d; wrong results %d; max RSS %.1f MiB"
                  % (ctx.size, init_s, args.iterations, elapsed, elapsed / max(args.iterations, 1)
                     * 1e6, stats[0] / 1024, stats[1] / 1024, stats[2] / 1024, stats[3],
                     stats[4], resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024))
        ok = stats[2] / 1024 <= args.max_growth_mib and stats[3] <= 0 and stats[4] == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
