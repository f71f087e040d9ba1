"""Point-to-point latency: a ping-pong of tagged send/recv between 2 ranks, beside mpi4py.

    python benchmarks/pingpong.py                          # every peer found, 3 rounds
    python benchmarks/pingpong.py --peers pycollect-shm,mpi-shm --counts 1,4096 --json out.json
    python benchmarks/pingpong.py --pattern exchange --peers pycollect-shm,pycollect-shm-ring

Rank 0 sends a float32 buffer of ``count`` elements to rank 1 and receives it
back, ``--iters`` times after a warmup; the figure is half a round trip (the
one-way latency osu_latency reports), the median over batches of 100 round
trips (one clock read per batch).  ``--pattern exchange`` times instead both
ranks sending a message to each other at once (a send started async, a receive
into a second buffer, then the send waited on: MPI's ``Isend``, ``Recv``,
``Wait``), the figure being one whole exchange; ``--pattern sendrecv`` the same
exchange as one call (``ctx.sendrecv``, MPI's ``Sendrecv``).  Peers: ``pycollect-shm`` and
``pycollect-tcp`` (``ctx.send``/``ctx.recv`` on the transport named, ranks
started by ``pycollect-run``), ``pycollect-shm-pooled`` (shm on a buffer from
``pycollect.zeros``: messages by address are copied from the sender's mapped
pool), ``pycollect-shm-ring`` (shm with ``PYCOLLECT_CMA_MIN_BYTES`` at 1 TiB:
every message through the rings, two copies, none by address),
``mpi-shm`` and ``mpi-tcp`` (mpi4py's
``Send``/``Recv`` on Open MPI under ``mpirun``; TCP forced with
``--mca pml ob1 --mca btl tcp,self``).  The peers take turns, in an order that
rotates from round to round; the table has each peer's median over rounds and
its ratio to MPI on the same transport.  A peer that is not installed is left
out and named.
"""

import json
import os
import statistics
import sys
import time

from turns import against_mpi, pycollect_transport, report, summarize, two_ranks_main

PEERS = ("pycollect-shm", "pycollect-shm-pooled", "pycollect-shm-ring", "mpi-shm",
         "pycollect-tcp", "mpi-tcp")
PATTERNS = ("pingpong", "exchange", "sendrecv")
# pycollect-shm-ring: no message is large enough to go by address.
RING_ONLY_BYTES = str(1 << 40)
BATCH = 100


def _endpoint(peer):
    """(rank, send(buf), recv(buf), {pattern: exchange(sendbuf, recvbuf)}, close) of this
    worker process."""
    if peer.startswith("pycollect-"):
        if peer.endswith("-ring"):
            os.environ["PYCOLLECT_CMA_MIN_BYTES"] = RING_ONLY_BYTES
        import pycollect as pc
        ctx = pc.init(transport=pycollect_transport(peer), timeout=60)
        other = 1 - ctx.rank

        def exchange(sendbuf, recvbuf):
            work = ctx.send(sendbuf, other, 5, async_op=True)
            ctx.recv(recvbuf, other, 5)
            work.wait()

        def sendrecv(sendbuf, recvbuf):
            ctx.sendrecv(sendbuf, other, recvbuf, other, 5, 5)
        return (ctx.rank, lambda b: ctx.send(b, other, 5), lambda b: ctx.recv(b, other, 5),
                {"exchange": exchange, "sendrecv": sendrecv}, ctx.close)
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    other = 1 - comm.rank

    def exchange(sendbuf, recvbuf):
        req = comm.Isend(sendbuf, other, 5)
        comm.Recv(recvbuf, other, 5)
        req.Wait()

    def sendrecv(sendbuf, recvbuf):
        comm.Sendrecv(sendbuf, other, 5, recvbuf, other, 5)
    return (comm.rank, lambda b: comm.Send(b, other, 5), lambda b: comm.Recv(b, other, 5),
            {"exchange": exchange, "sendrecv": sendrecv}, lambda: None)


def worker(peer, counts, iters, out, pattern="pingpong"):
    import numpy as np
    rank, send, recv, exchanges, close = _endpoint(peer)
    exchange = exchanges.get(pattern)
    clock = time.perf_counter_ns
    result = {}
    if peer.endswith("-pooled"):
        import pycollect
        zeros = pycollect.zeros
    else:
        zeros = np.zeros
    for count in counts:
        buf = zeros(count, np.float32)
        other = zeros(count, np.float32)
        batches = []
        for b in range(max(1, iters // BATCH) + 5):     # the first 5 batches warm up
            start = clock()
            for _ in range(BATCH):
                if exchange is not None:
                    exchange(buf, other)
                elif rank == 0:
                    send(buf)
                    recv(buf)
                else:
                    recv(buf)
                    send(buf)
            if b >= 5:
                batches.append((clock() - start) / BATCH / (2 if exchange is None else 1)
                               / 1e9)
        result[str(count)] = {"median": statistics.median(batches), "best": min(batches)}
    close()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)


def _tabulate(args, counts, runs, missing):
    what = ("µs one way" if args.pattern == "pingpong"
            else "µs per exchange (both ranks send and receive at once)")
    report("2 ranks, %s, %s (median over %d rounds of each run's median batch; fastest batch "
           "in brackets)" % (args.pattern, what, args.rounds), "elements", "---:", counts,
           summarize(runs, counts), against_mpi, missing, args.json,
           {"rounds": args.rounds, "iters": args.iters, "pattern": args.pattern})


def main(argv=None):
    return two_ranks_main(argv, __doc__, __file__, PEERS, 5000, "timed round trips per count",
                          worker, _tabulate, patterns=PATTERNS)


if __name__ == "__main__":
    sys.exit(main())
