"""Allreduce latency and bus bandwidth, pycollect against torch.distributed's Gloo, side by side.

    python benchmarks/allreduce_vs_gloo.py --ranks 2 --counts 1,1024,65536,1048576,16777216

Every worker process opens both a pycollect context and a Gloo process group on
loopback; for each count it times pycollect, then Gloo, with back-to-back float32
SUM allreduces after a warmup.  An iteration's latency is the slowest rank's.
"""

import argparse
import json
import multiprocessing
import os
import secrets
import socket
import sys
import time
from datetime import timedelta

import numpy as np

PEERS = ("pycollect", "gloo")
WARMUP = 5
SETUP_TIMEOUT_S = 120


def free_port():
    """Return a TCP port on loopback that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def agreed_iterations(dist, seconds_per_call, args):
    """Return the timed iteration count every rank agrees on, from the slowest warmup."""
    import torch
    slowest = torch.tensor([seconds_per_call], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return int(max(1, min(args.iters, args.budget / max(slowest.item(), 1e-9))))


def measure(call, barrier, dist, args):
    """Warm up, then time back-to-back calls; return this rank's per-call seconds."""
    barrier()
    start = time.perf_counter()
    for _ in range(WARMUP):
        call()
    iters = agreed_iterations(dist, (time.perf_counter() - start) / WARMUP, args)
    times = np.empty(iters)
    barrier()
    for i in range(iters):
        start = time.perf_counter_ns()
        call()
        times[i] = time.perf_counter_ns() - start
    return times / 1e9


def open_pycollect(rank, size, dist, secret):
    """Open a pycollect context; rank 0 hosts the TCP store and shares its URL over Gloo."""
    import pycollect as pc
    from pycollect.plugins.tcp_store import TCPStoreServer
    server = None
    url = [None]
    if rank == 0:
        server = TCPStoreServer(host="127.0.0.1", port=0, auth=secret).start()
        url[0] = f"{server.url}?prefix=bench-{secrets.token_hex(4)}"
    dist.broadcast_object_list(url, src=0)
    return pc.init(rank=rank, size=size, store=url[0]), server


def worker(rank, size, gloo_port, secret, args):
    """Run every count for both peers on one rank; rank 0 reports."""
    import torch
    import torch.distributed as dist
    os.environ["PYCOLLECT_AUTH"] = secret
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{gloo_port}", rank=rank,
                            world_size=size, timeout=timedelta(seconds=SETUP_TIMEOUT_S))
    ctx = server = None
    if "pycollect" in args.peers:
        import pycollect as pc
        ctx, server = open_pycollect(rank, size, dist, secret)

    samples = {}
    for count in args.counts:
        array = np.ones(count, dtype=np.float32)
        tensor = torch.ones(count, dtype=torch.float32)
        for peer in args.peers:
            if peer == "pycollect":
                call = lambda: ctx.allreduce(array, op=pc.SUM, algorithm=args.algorithm)
                result, barrier = array, ctx.barrier
            else:
                call = lambda: dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
                result, barrier = tensor.numpy(), dist.barrier
            call()
            if not np.all(result == size):
                raise SystemExit(f"rank {rank}: {peer} allreduce of {count} ones gave "
                                 f"{result[result != size][0]}, expected {size}")
            result[:] = 0  # timed calls sum zeros: no overflow, no denormals
            samples[(count, peer)] = measure(call, barrier, dist, args)
            if rank == 0:
                print(f"  {peer} count={count}: {samples[(count, peer)].size} iterations",
                      file=sys.stderr, flush=True)

    gathered = [None] * size if rank == 0 else None
    dist.gather_object(samples, gathered, dst=0)
    if ctx is not None:
        ctx.close()
    dist.barrier()  # every rank is done with the store before rank 0 closes it
    if server is not None:
        server.close()
    dist.destroy_process_group()
    if rank == 0:
        report(gathered, size, args)


def summarize(per_rank, count, size):
    """Reduce per-rank per-iteration times to p50, p99 and bus bandwidth."""
    slowest = np.max(np.stack(per_rank), axis=0)
    p50, p99 = np.percentile(slowest, [50, 99])
    nbytes = count * 4
    return {"count": count, "bytes": nbytes, "iterations": int(slowest.size),
            "p50_us": p50 * 1e6, "p99_us": p99 * 1e6,
            "busbw_GBps": nbytes / p50 * 2 * (size - 1) / size / 1e9}


def report(gathered, size, args):
    """Print the markdown table and write the JSON file."""
    import torch
    rows = []
    for count in args.counts:
        row = {peer: summarize([ranks[(count, peer)] for ranks in gathered], count, size)
               for peer in args.peers}
        rows.append(row)
    header = ["count", "bytes"]
    for peer in args.peers:
        header += [f"{peer} p50 µs", f"{peer} p99 µs", f"{peer} busbw GB/s"]
    both = set(PEERS) <= set(args.peers)
    if both:
        header.append("p50 pycollect/gloo")
    title = f"allreduce float32 SUM, {size} ranks on loopback, torch {torch.__version__} gloo"
    if "pycollect" in args.peers:
        title += f", pycollect algorithm={args.algorithm}"
    print(title + "\n")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        first = row[args.peers[0]]
        cells = [str(first["count"]), str(first["bytes"])]
        for peer in args.peers:
            cells += [f"{row[peer]['p50_us']:.1f}", f"{row[peer]['p99_us']:.1f}",
                      f"{row[peer]['busbw_GBps']:.3g}"]
        if both:
            cells.append(f"{row['pycollect']['p50_us'] / row['gloo']['p50_us']:.2f}")
        print("| " + " | ".join(cells) + " |")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"ranks": size, "torch": torch.__version__, "algorithm": args.algorithm,
                       "results": [dict(r, peer=p) for row in rows for p, r in row.items()]},
                      out, indent=2)


def parse_args():
    """Parse the command line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2, help="worker processes (default 2)")
    parser.add_argument("--counts", default="1,1024,65536,1048576,16777216",
                        help="comma-separated float32 element counts")
    parser.add_argument("--peers", default=",".join(PEERS),
                        help="comma-separated subset of pycollect,gloo, timed in that order")
    parser.add_argument("--iters", type=int, default=1000,
                        help="most timed iterations per count and peer (default 1000)")
    parser.add_argument("--budget", type=float, default=2.0,
                        help="seconds of timed calls per count and peer, at most (default 2)")
    parser.add_argument("--algorithm", default="auto", help="pycollect allreduce algorithm")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    args = parser.parse_args()
    args.counts = [int(c) for c in args.counts.split(",")]
    args.peers = args.peers.split(",")
    if args.ranks < 2:
        parser.error("--ranks must be at least 2")
    if not args.counts or min(args.counts) < 1:
        parser.error("--counts must be positive integers")
    if not args.peers or not set(args.peers) <= set(PEERS):
        parser.error(f"--peers must name some of {', '.join(PEERS)}")
    if args.iters < 1 or args.budget <= 0:
        parser.error("--iters and --budget must be positive")
    return args


def main():
    """Spawn the ranks, wait for them (bounded), and fail if any rank failed."""
    args = parse_args()
    spawn = multiprocessing.get_context("spawn")
    gloo_port, secret = free_port(), secrets.token_hex(16)
    procs = [spawn.Process(target=worker, args=(rank, args.ranks, gloo_port, secret, args))
             for rank in range(args.ranks)]
    for proc in procs:
        proc.start()
    # Each count and peer takes at most WARMUP calls plus the budget; allow setup and slack.
    deadline = time.monotonic() + SETUP_TIMEOUT_S + len(args.counts) * len(args.peers) * (
        3 * args.budget + 30)
    while any(proc.is_alive() for proc in procs) and time.monotonic() < deadline:
        if any(proc.exitcode not in (None, 0) for proc in procs):
            break  # one rank failed: the others would only wait for it
        time.sleep(0.1)
    failed = [f"rank {rank} exited with {proc.exitcode}" for rank, proc in enumerate(procs)
              if proc.exitcode not in (None, 0)]
    if not failed and any(proc.is_alive() for proc in procs):
        failed = ["the run passed its deadline"]
    for proc in procs:
        proc.kill()
        proc.join(10)
    if failed:
        sys.exit("allreduce_vs_gloo: " + "; ".join(failed))

if __name__ == "__main__":
    main()
