"""Point-to-point latency: a ping-pong of tagged send/recv between 2 ranks, beside mpi4py.

    python benchmarks/pingpong.py                          # every peer found, 3 rounds
    python benchmarks/pingpong.py --peers pycollect-shm,mpi-shm --counts 1,4096 --json out.json

Rank 0 sends a float32 buffer of ``count`` elements to rank 1 and receives it
back, ``--iters`` times after a warmup; the figure is half a round trip (the
one-way latency osu_latency reports), the median over batches of 100 round
trips (one clock read per batch).  Peers: ``pycollect-shm`` and
``pycollect-tcp`` (``ctx.send``/``ctx.recv`` on the transport named, ranks
started by ``pycollect-run``), ``pycollect-shm-pooled`` (shm on a buffer from
``pycollect.zeros``: messages by address are copied from the sender's mapped
pool), ``mpi-shm`` and ``mpi-tcp`` (mpi4py's
``Send``/``Recv`` on Open MPI under ``mpirun``; TCP forced with
``--mca pml ob1 --mca btl tcp,self``).  The peers take turns, in an order that
rotates from round to round; the table has each peer's median over rounds and
its ratio to MPI on the same transport.  A peer that is not installed is left
out and named.
"""

import json
import statistics
import sys
import time

from turns import against_mpi, pycollect_transport, report, summarize, two_ranks_main

PEERS = ("pycollect-shm", "pycollect-shm-pooled", "mpi-shm", "pycollect-tcp", "mpi-tcp")
BATCH = 100


def _endpoint(peer):
    """(rank, send(buf), recv(buf), close) of this worker process."""
    if peer.startswith("pycollect-"):
        import pycollect as pc
        ctx = pc.init(transport=pycollect_transport(peer), timeout=60)
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
    if peer.endswith("-pooled"):
        import pycollect
        zeros = pycollect.zeros
    else:
        zeros = np.zeros
    for count in counts:
        buf = zeros(count, np.float32)
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


def _tabulate(args, counts, runs, missing):
    report("2 ranks, ping-pong, µs one way (median over %d rounds of each run's median batch; "
           "fastest batch in brackets)" % args.rounds, "elements", "---:", counts,
           summarize(runs, counts), against_mpi, missing, args.json,
           {"rounds": args.rounds, "iters": args.iters})


def main(argv=None):
    return two_ranks_main(argv, __doc__, __file__, PEERS, 5000, "timed round trips per count",
                          worker, _tabulate)


if __name__ == "__main__":
    sys.exit(main())
