"""Async collectives that progress while a peer computes: pycollect's handles beside
mpi4py's nonblocking collectives, 2 ranks.

    python benchmarks/overlap.py                      # every peer found, 3 rounds
    python benchmarks/overlap.py --peers pycollect-shm,mpi-shm --counts 1,1024 --json out.json

Per element count and per K in OUTSTANDING: both ranks meet at a barrier, then make K async
float32 allreduces (SUM, in place) each, or K async broadcasts from rank 1; rank 1 then
computes for COMPUTE_US microseconds (a Python loop: it makes no call of the library and
holds the GIL) before it waits for its K, while rank 0 waits for its K at once.  The
figure is rank 0's wait: where rank 1's calls sent everything rank 0 needs when they were
made, it is a few microseconds; where some of rank 1's part waits for rank 1's next call
into the library (or for a thread that the computing one keeps from the GIL), it is about
COMPUTE_US.
Besides them, a blocking send beside an async receive (MPI's ``Irecv``, ``Send``,
``Wait``): rank 0 posts a receive from rank 1 and sends rank 1 one buffer, while rank 1
computes COMPUTE_US before it receives that buffer and sends its own; the figure is rank
0's send, which the channel takes at once, so that it need not wait for rank 1 at all.
The median over iterations, per round; the table has each peer's median over rounds (the
fastest iteration in brackets) and its ratio to MPI on the same transport.  Peers:
``pycollect-shm``, ``pycollect-tcp`` (ranks started by ``pycollect-run``), ``mpi-shm``,
``mpi-tcp`` (mpi4py on Open MPI under ``mpirun``; TCP forced with ``--mca pml ob1 --mca
btl tcp,self``), in turns, in an order that rotates from round to round.
"""

import statistics
import sys
import time

from turns import against_mpi, report, summarize, two_ranks_main

PEERS = ("pycollect-shm", "mpi-shm", "pycollect-tcp", "mpi-tcp")
OUTSTANDING = (1, 4, 8)
COLLECTIVES = ("allreduces", "broadcasts from rank 1")
COMPUTE_US = 500
SEND_WAY = "async receive, then a blocking send: rank 0's send while rank 1 computes"


def _endpoint(peer):
    """(barrier(), {collective: start(buf, k): k async calls on ``buf``}, wait_all(handles),
    (irecv(buf, src), send(buf, dst), recv(buf, src)), this process's rank, a closer)."""
    if peer.startswith("pycollect-"):
        import pycollect as pc
        ctx = pc.init(transport=peer.split("-", 1)[1], timeout=60)
        return (ctx.barrier,
                {"allreduces": lambda buf, k: [ctx.allreduce(buf, async_op=True)
                                               for _ in range(k)],
                 "broadcasts from rank 1": lambda buf, k: [
                     ctx.broadcast(buf, 1, async_op=True) for _ in range(k)]},
                pc.wait_all,
                (lambda buf, src: ctx.recv(buf, src, 4, async_op=True),
                 lambda buf, dst: ctx.send(buf, dst, 4), lambda buf, src: ctx.recv(buf, src, 4)),
                ctx.rank, ctx.close)
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    return (comm.Barrier,
            {"allreduces": lambda buf, k: [comm.Iallreduce(MPI.IN_PLACE, buf)
                                           for _ in range(k)],
             "broadcasts from rank 1": lambda buf, k: [comm.Ibcast(buf, 1) for _ in range(k)]},
            MPI.Request.Waitall,
            (lambda buf, src: comm.Irecv(buf, src, 4), lambda buf, dst: comm.Send(buf, dst, 4),
             lambda buf, src: comm.Recv(buf, src, 4)),
            comm.rank, lambda: None)


def _compute(us):
    """Busy for ``us`` microseconds in Python, calling nothing of the library."""
    end = time.perf_counter() + us * 1e-6
    while time.perf_counter() < end:
        pass


def worker(peer, counts, iters, out):
    import json
    import numpy as np
    barrier, starts, wait_all, (irecv, send, recv), rank, close = _endpoint(peer)
    clock = time.perf_counter_ns
    result = {}
    for count in counts:
        buf = np.ones(count, np.float32)
        for what in COLLECTIVES:
            for k in OUTSTANDING:
                waits = []
                for i in range(iters + 10):             # the first 10 warm up
                    barrier()
                    handles = starts[what](buf, k)
                    if rank == 1:
                        _compute(COMPUTE_US)
                        wait_all(handles)
                        continue
                    t0 = clock()
                    wait_all(handles)
                    if i >= 10:
                        waits.append((clock() - t0) / 1e9)
                result["%s %s" % (count, _way(what, k))] = (
                    None if rank else {"median": statistics.median(waits),
                                       "best": min(waits)})
        sends, other = [], np.empty_like(buf)
        for i in range(iters + 10):
            barrier()
            if rank == 1:
                _compute(COMPUTE_US)
                recv(other, 0)
                send(buf, 0)
                continue
            handle = irecv(other, 1)
            t0 = clock()
            send(buf, 1)
            if i >= 10:
                sends.append((clock() - t0) / 1e9)
            wait_all([handle])
        result["%s %s" % (count, SEND_WAY)] = (
            None if rank else {"median": statistics.median(sends), "best": min(sends)})
    close()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)


def _way(what, k):
    return "%d async %s, rank 0's wait while rank 1 computes" % (k, what)


def _tabulate(args, counts, runs, missing):
    keys = ["%s %s" % (c, way) for c in counts
            for way in [_way(w, k) for w in COLLECTIVES for k in OUTSTANDING] + [SEND_WAY]]
    report("2 ranks, K async allreduces of float32 (SUM, in place), or K async broadcasts from "
           "rank 1, on each; rank 1 computes %d µs in Python before it waits, rank 0 waits at "
           "once: rank 0's wait, µs; and rank 0's blocking send beside an async receive while "
           "rank 1 computes (median over %d rounds of each run's median; fastest in "
           "brackets)" % (COMPUTE_US, args.rounds),
           "elements, way", "---", keys, summarize(runs, keys), against_mpi, missing,
           args.json, {"rounds": args.rounds, "iters": args.iters,
                       "compute_us": COMPUTE_US})


def main(argv=None):
    return two_ranks_main(argv, __doc__, __file__, PEERS, 200, "timed iterations per count "
                          "and K", worker, _tabulate)


if __name__ == "__main__":
    sys.exit(main())
