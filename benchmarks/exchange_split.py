"""An exchange with the receive posted first, timed call by call: pycollect beside mpi4py, 2 ranks.

    python benchmarks/exchange_split.py                      # every peer found, 3 rounds
    python benchmarks/exchange_split.py --peers pycollect-shm,mpi-shm --counts 1,4096

Each rank posts an async receive from the other, makes a blocking send to it, then waits
for the receive (``w = ctx.recv(other, peer, 3, async_op=True); ctx.send(buf, peer, 3);
w.wait()``; mpi4py: ``Irecv``, ``Send``, ``Wait``), and reads the clock between the three
calls: ``async_wait.py``'s ``irecv+send+wait``, split into what posting the receive, the
send and the wait each take on rank 1.  The figure is the median over batches of 100
exchanges of each batch's mean, per call (the fastest batch in brackets); each part
includes one read of the clock (``time.perf_counter_ns``), as it does for every peer.
Peers: ``pycollect-shm`` and ``pycollect-tcp`` (ranks started by ``pycollect-run``),
``mpi-shm`` and ``mpi-tcp`` (mpi4py on Open MPI under ``mpirun``; TCP forced with
``--mca pml ob1 --mca btl tcp,self``).  The peers take turns, in an order that rotates
from round to round; the table has each peer's median over rounds and its ratio to MPI on
the same transport.  A peer that is not installed is left out and named.
"""

import statistics
import sys
import time

from turns import save_figures, two_ranks_main, two_ranks_table

PEERS = ("pycollect-shm", "mpi-shm", "pycollect-tcp", "mpi-tcp")
PARTS = ("receive posted", "send", "wait")
BATCH = 100
TITLE = ("2 ranks, an exchange of float32 by a receive posted first, a blocking send and the "
         "wait, each call timed on rank 1, µs a call (median over %d rounds of each run's median "
         "batch; fastest batch in brackets)")
WARMUP_BATCHES = 5


def _endpoint(peer):
    """(exchange(buf, other): the three calls of one exchange of ``buf`` into ``other`` as
    three callables, this process's rank, a closer)."""
    if peer.startswith("pycollect-"):
        import pycollect as pc
        ctx = pc.init(transport=peer.split("-", 1)[1], timeout=60)
        you = 1 - ctx.rank

        def exchange(buf, other):
            return (lambda: ctx.recv(other, you, 3, async_op=True),
                    lambda: ctx.send(buf, you, 3),
                    lambda handle: handle.wait())
        return exchange, ctx.rank, ctx.close
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    you = 1 - comm.rank

    def exchange(buf, other):
        return (lambda: comm.Irecv(other, you, 3),
                lambda: comm.Send(buf, you, 3),
                lambda request: request.Wait())
    return exchange, comm.rank, lambda: None


def _keys(counts):
    return ["%s, %s" % (c, part) for c in counts for part in PARTS]


def _split(post, send, wait, iters):
    """{part: {"median", "best"}}: each part's mean per call over batches of BATCH
    exchanges, after WARMUP_BATCHES."""
    clock = time.perf_counter_ns
    means = {part: [] for part in PARTS}
    for b in range(max(1, iters // BATCH) + WARMUP_BATCHES):
        posting = sending = waiting = 0
        for _ in range(BATCH):
            t0 = clock()
            handle = post()
            t1 = clock()
            send()
            t2 = clock()
            wait(handle)
            t3 = clock()
            posting += t1 - t0
            sending += t2 - t1
            waiting += t3 - t2
        if b >= WARMUP_BATCHES:
            for part, total in zip(PARTS, (posting, sending, waiting)):
                means[part].append(total / BATCH / 1e9)
    return {part: {"median": statistics.median(m), "best": min(m)}
            for part, m in means.items()}


def worker(peer, counts, iters, out):
    import numpy as np
    exchange, rank, close = _endpoint(peer)
    result = {}
    try:
        for count in counts:
            calls = exchange(np.ones(count, np.float32), np.empty(count, np.float32))
            for part, figure in _split(*calls, iters).items():
                result["%s, %s" % (count, part)] = figure
    finally:
        close()
    if rank == 1:       # the rank whose calls are timed in the table
        save_figures(out, result)


def main(argv=None):
    return two_ranks_main(argv, __doc__, __file__, PEERS, 20000, "timed exchanges per count",
                          worker, two_ranks_table(TITLE, "elements, call", _keys))


if __name__ == "__main__":
    sys.exit(main())
