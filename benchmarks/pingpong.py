"""Point-to-point latency: a ping-pong of tagged send/recv between 2 ranks, beside mpi4py.

    python benchmarks/pingpong.py                          # every peer found, 3 rounds
    python benchmarks/pingpong.py --peers pycollect-shm,mpi-shm --counts 1,4096 --json out.json

Rank 0 sends a float32 buffer of ``count`` elements to rank 1 and receives it
back, ``--iters`` times after a warmup; the figure is half a round trip (the
one-way latency osu_latency reports), the median over batches of 100 round
trips (one clock read per batch).  Peers: ``pycollect-shm`` and
``pycollect-tcp`` (``ctx.send``/``ctx.recv`` on the transport named, ranks
started by ``pycollect-run``), ``mpi-shm`` and ``mpi-tcp`` (mpi4py's
``Send``/``Recv`` on Open MPI under ``mpirun``; TCP forced with
``--mca pml ob1 --mca btl tcp,self``).  The peers take turns, in an order that
rotates from round to round; the table has each peer's median over rounds and
its ratio to MPI on the same transport.  A peer that is not installed is left
out and named.
"""

import argparse
import json
import os
import statistics
import sys
import time

from turns import importable, pick_peers, report, summarize, take_turns

PEERS = ("pycollect-shm", "mpi-shm", "pycollect-tcp", "mpi-tcp")
MPI_TCP = ["--mca", "pml", "ob1", "--mca", "btl", "tcp,self", "--mca", "btl_tcp_if_include", "lo"]
BATCH = 100


def _endpoint(peer):
    """(rank, send(buf), recv(buf), close) of this worker process."""
    if peer.startswith("pycollect-"):
        import pycollect as pc
        ctx = pc.init(transport=peer.split("-", 1)[1], timeout=60)
        other = 1 - ctx.rank
        return (ctx.rank, lambda b: ctx.send(b, other, 5), lambda b: ctx.recv(b, other, 5),
                ctx.close)
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    other = 1 - comm.rank
    return (comm.rank, lambda b: comm.Send(b, other, 5), lambda b: comm.Recv(b, other, 5),
            lambda: None)


def worker(peer, counts, iters, out):
    import numpy as np
    rank, send, recv, close = _endpoint(peer)
    clock = time.perf_counter_ns
    result = {}
    for count in counts:
        buf = np.zeros(count, np.float32)
        batches = []
        for b in range(max(1, iters // BATCH) + 5):     # the first 5 batches warm up
            start = clock()
            for _ in range(BATCH):
                if rank == 0:
                    send(buf)
                    recv(buf)
                else:
                    recv(buf)
                    send(buf)
            if b >= 5:
                batches.append((clock() - start) / BATCH / 2 / 1e9)
        result[str(count)] = {"median": statistics.median(batches), "best": min(batches)}
    close()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)


def available(peer):
    """Whether ``peer`` can run here (its package imports, mpirun exists)."""
    mpi = peer.startswith("mpi-")
    return importable("mpi4py" if mpi else "pycollect", mpirun=mpi)


def _command(peer, counts, iters, out):
    me = [sys.executable, os.path.abspath(__file__), "--worker", peer, "--counts",
          ",".join(map(str, counts)), "--iters", str(iters), "--out", out]
    if peer.startswith("mpi-"):
        return (["mpirun", "--allow-run-as-root", "-n", "2"]
                + (MPI_TCP if peer == "mpi-tcp" else []) + me)
    from pycollect.launch import module_command
    return module_command("pycollect.launch") + ["-n", "2", "--timeout", "300"] + me


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peers", default=",".join(PEERS))
    ap.add_argument("--counts", default="1,4096", help="float32 elements per message")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=5000, help="timed round trips per count")
    ap.add_argument("--json", help="also write the figures here")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    try:
        counts = [int(c) for c in args.counts.split(",") if c]
    except ValueError:
        ap.error("--counts takes integers, comma-separated: %r" % args.counts)
    if not counts or min(counts) < 1 or args.iters < 1 or args.rounds < 1:
        ap.error("--counts, --iters and --rounds must be positive")
    if args.worker:
        return worker(args.worker, counts, args.iters, args.out)

    peers, missing = pick_peers(ap, args.peers, PEERS, available)
    runs = take_turns(peers, args.rounds, lambda peer, out: _command(peer, counts, args.iters, out))
    report("2 ranks, ping-pong, µs one way (median over %d rounds of each run's median batch; "
           "fastest batch in brackets)" % args.rounds, "elements", "---:", counts,
           summarize(runs, counts),
           lambda p: ("mpi-" + p.split("-", 1)[1], "MPI") if p.startswith("pycollect-")
           else None, missing, args.json, {"rounds": args.rounds, "iters": args.iters})
    return 0


if __name__ == "__main__":
    sys.exit(main())
