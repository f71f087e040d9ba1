"""Async calls waited on: pycollect's handles beside mpi4py's requests, 2 ranks.

    python benchmarks/async_wait.py                      # every peer found, 3 rounds
    python benchmarks/async_wait.py --peers pycollect-shm,mpi-shm --counts 1,4096 --json out.json
    python benchmarks/async_wait.py --pattern alltoall      # one collective's ways only

Per element count, four ways of making one float32 allreduce (SUM, in place) at
2 ranks: ``blocking`` (pycollect's ``ctx.allreduce(buf)``, mpi4py's
``Allreduce(IN_PLACE, buf)``), ``async+wait`` (``ctx.allreduce(buf,
async_op=True).wait()``; ``Iallreduce(IN_PLACE, buf).Wait()``), ``async+poll`` (the
handle polled until it has ended: ``is_completed()``; ``Test()``) and ``4 async+wait_all``
(four started, then all waited for: ``pc.wait_all``; ``Request.Waitall``; the
figure is per allreduce); besides them, ``isend+irecv+wait_all``, an exchange of the
buffer with the peer by async send and receive (``pc.wait_all([ctx.send(buf, peer, 3,
async_op=True), ctx.recv(other, peer, 3, async_op=True)])``; ``Request.Waitall([Isend,
Irecv])``), the same exchange with the receive posted first and a blocking send
(``irecv+send+wait``: ``w = ctx.recv(other, peer, 3, async_op=True); ctx.send(buf, peer,
3); w.wait()``; ``Irecv``, ``Send``, ``Wait``) and with an async send
(``irecv+isend+wait_all``; ``Irecv``, ``Isend``, ``Waitall``), the receive posted first
with a blocking allreduce of the buffer before the send (``irecv+allreduce+send+wait``:
``Irecv``, ``Allreduce``, ``Send``, ``Wait``, the allreduce running while the receive
waits), the same exchange blocking, ``sendrecv``
(``ctx.sendrecv(buf, peer, other, peer, 3, 3)``; ``comm.Sendrecv(buf, peer, 3, other,
peer, 3)``), a halo exchange as each rank of a ring makes it with its two neighbours (here
the one peer, twice, by tag: ``halo``: two receives posted, two async sends, all waited for;
``Irecv``, ``Irecv``, ``Isend``, ``Isend``, ``Waitall``), and an async broadcast
from rank 0 waited on (``ctx.broadcast(buf, 0, async_op=True).wait()``;
``Ibcast(buf, 0).Wait()``), and an allgather of the buffer, blocking
(``ctx.allgather(buf, out)``; ``Allgather(buf, out)``) and async, waited on and polled
(``ctx.allgather(buf, out, async_op=True)``; ``Iallgather(buf, out)``), and the same three
of a reduce_scatter of two such buffers into one (``ctx.reduce_scatter(two, buf)``;
``Reduce_scatter_block(two, buf)``, ``Ireduce_scatter_block``) and an alltoall of two
(``ctx.alltoall(two, out)``; ``Alltoall(two, out)``, ``Ialltoall``).  The figure is the median
over batches of 100 calls
(one clock read per batch), per call.  Peers: ``pycollect-shm`` and
``pycollect-tcp`` (ranks started by ``pycollect-run``), ``mpi-shm`` and ``mpi-tcp``
(mpi4py on Open MPI under ``mpirun``; TCP forced with ``--mca pml ob1 --mca btl
tcp,self``).  The peers take turns, in an order that rotates from round to round;
the table has each peer's median over rounds and its ratio to MPI on the same
transport.  A peer that is not installed is left out and named.
"""

import statistics
import sys
import time

from turns import save_figures, two_ranks_main, two_ranks_table

PEERS = ("pycollect-shm", "mpi-shm", "pycollect-tcp", "mpi-tcp")
WAYS = ("blocking", "async+wait", "async+poll", "4 async+wait_all", "isend+irecv+wait_all",
        "irecv+send+wait", "irecv+isend+wait_all", "irecv+allreduce+send+wait", "sendrecv",
        "halo", "broadcast async+wait", "allgather blocking", "allgather async+wait",
        "allgather async+poll", "reduce_scatter blocking", "reduce_scatter async+wait",
        "reduce_scatter async+poll", "alltoall blocking", "alltoall async+wait",
        "alltoall async+poll")
# --pattern: the ways of one kind of call, or all of them.
GROUPS = {"allreduce": WAYS[:4], "exchange": WAYS[4:10], "broadcast": WAYS[10:11],
          "allgather": WAYS[11:14], "reduce_scatter": WAYS[14:17], "alltoall": WAYS[17:20]}
PATTERNS = ("all",) + tuple(GROUPS)
BATCH = 100
TITLE = ("2 ranks, allreduce of float32 (SUM, in place), an exchange by async send and receive, "
         "and by sendrecv, an async broadcast from rank 0, an allgather, a reduce_scatter "
         "and an alltoall, µs a call "
         "(median over %d rounds "
         "of each run's median batch; fastest batch in brackets)")


def _endpoint(peer):
    """(ways(buf): {way: a call making one allreduce of ``buf`` that way ("4 ...": four of
    them; "isend+irecv+wait_all", "irecv+send+wait", "irecv+isend+wait_all", "sendrecv" and
    "halo": an exchange of ``buf``)},
    this process's rank, a closer)."""
    import numpy as np
    if peer.startswith("pycollect-"):
        import pycollect as pc
        ctx = pc.init(transport=peer.split("-", 1)[1], timeout=60)

        def ways(buf):
            other, peer = np.empty_like(buf), 1 - ctx.rank
            other2 = np.empty_like(buf)
            gathered = np.empty(2 * buf.size, buf.dtype)
            two = np.ones(2 * buf.size, buf.dtype)
            return {"blocking": lambda: ctx.allreduce(buf),
                    "async+wait": lambda: ctx.allreduce(buf, async_op=True).wait(),
                    "async+poll": lambda: _poll(ctx.allreduce(buf, async_op=True).is_completed),
                    "4 async+wait_all": lambda: pc.wait_all(
                        [ctx.allreduce(buf, async_op=True) for _ in range(4)]),
                    "isend+irecv+wait_all": lambda: pc.wait_all(
                        [ctx.send(buf, peer, 3, async_op=True),
                         ctx.recv(other, peer, 3, async_op=True)]),
                    "irecv+send+wait": lambda: _prepost(
                        ctx.recv(other, peer, 3, async_op=True), lambda: ctx.send(buf, peer, 3)),
                    "irecv+isend+wait_all": lambda: _posted_first(
                        ctx.recv(other, peer, 3, async_op=True),
                        lambda: ctx.send(buf, peer, 3, async_op=True), pc.wait_all),
                    "irecv+allreduce+send+wait": lambda: _prepost(
                        ctx.recv(other, peer, 3, async_op=True),
                        lambda: (ctx.allreduce(buf), ctx.send(buf, peer, 3))),
                    "sendrecv": lambda: ctx.sendrecv(buf, peer, other, peer, 3, 3),
                    # From the left neighbour (its send to the right: tag 4) and the right.
                    "halo": lambda: pc.wait_all(
                        [ctx.recv(other, peer, 4, async_op=True),
                         ctx.recv(other2, peer, 3, async_op=True),
                         ctx.send(buf, peer, 4, async_op=True),
                         ctx.send(buf, peer, 3, async_op=True)]),
                    "broadcast async+wait": lambda: ctx.broadcast(buf, 0, async_op=True).wait(),
                    "allgather blocking": lambda: ctx.allgather(buf, gathered),
                    "allgather async+wait": lambda: ctx.allgather(buf, gathered,
                                                                  async_op=True).wait(),
                    "allgather async+poll": lambda: _poll(
                        ctx.allgather(buf, gathered, async_op=True).is_completed),
                    "reduce_scatter blocking": lambda: ctx.reduce_scatter(two, other),
                    "reduce_scatter async+wait": lambda: ctx.reduce_scatter(
                        two, other, async_op=True).wait(),
                    "reduce_scatter async+poll": lambda: _poll(
                        ctx.reduce_scatter(two, other, async_op=True).is_completed),
                    "alltoall blocking": lambda: ctx.alltoall(two, gathered),
                    "alltoall async+wait": lambda: ctx.alltoall(two, gathered,
                                                                async_op=True).wait(),
                    "alltoall async+poll": lambda: _poll(
                        ctx.alltoall(two, gathered, async_op=True).is_completed)}
        return ways, ctx.rank, ctx.close
    from mpi4py import MPI
    comm = MPI.COMM_WORLD

    def ways(buf):
        other, peer = np.empty_like(buf), 1 - comm.rank
        other2 = np.empty_like(buf)
        gathered = np.empty(2 * buf.size, buf.dtype)
        two = np.ones(2 * buf.size, buf.dtype)
        return {"blocking": lambda: comm.Allreduce(MPI.IN_PLACE, buf),
                "async+wait": lambda: comm.Iallreduce(MPI.IN_PLACE, buf).Wait(),
                "async+poll": lambda: _poll(comm.Iallreduce(MPI.IN_PLACE, buf).Test),
                "4 async+wait_all": lambda: MPI.Request.Waitall(
                    [comm.Iallreduce(MPI.IN_PLACE, buf) for _ in range(4)]),
                "isend+irecv+wait_all": lambda: MPI.Request.Waitall(
                    [comm.Isend(buf, peer, 3), comm.Irecv(other, peer, 3)]),
                "irecv+send+wait": lambda: _prepost(comm.Irecv(other, peer, 3),
                                                    lambda: comm.Send(buf, peer, 3), "Wait"),
                "irecv+isend+wait_all": lambda: _posted_first(
                    comm.Irecv(other, peer, 3), lambda: comm.Isend(buf, peer, 3),
                    MPI.Request.Waitall),
                "irecv+allreduce+send+wait": lambda: _prepost(
                    comm.Irecv(other, peer, 3),
                    lambda: (comm.Allreduce(MPI.IN_PLACE, buf), comm.Send(buf, peer, 3)), "Wait"),
                "sendrecv": lambda: comm.Sendrecv(buf, peer, 3, other, peer, 3),
                "halo": lambda: MPI.Request.Waitall(
                    [comm.Irecv(other, peer, 4), comm.Irecv(other2, peer, 3),
                     comm.Isend(buf, peer, 4), comm.Isend(buf, peer, 3)]),
                "broadcast async+wait": lambda: comm.Ibcast(buf, 0).Wait(),
                "allgather blocking": lambda: comm.Allgather(buf, gathered),
                "allgather async+wait": lambda: comm.Iallgather(buf, gathered).Wait(),
                "allgather async+poll": lambda: _poll(comm.Iallgather(buf, gathered).Test),
                "reduce_scatter blocking": lambda: comm.Reduce_scatter_block(two, other),
                "reduce_scatter async+wait": lambda: comm.Ireduce_scatter_block(
                    two, other).Wait(),
                "reduce_scatter async+poll": lambda: _poll(
                    comm.Ireduce_scatter_block(two, other).Test),
                "alltoall blocking": lambda: comm.Alltoall(two, gathered),
                "alltoall async+wait": lambda: comm.Ialltoall(two, gathered).Wait(),
                "alltoall async+poll": lambda: _poll(comm.Ialltoall(two, gathered).Test)}
    return ways, comm.rank, lambda: None


def _prepost(receive, send, wait="wait"):
    """A receive posted first (its handle ``receive``), then ``send()``, then the wait."""
    send()
    getattr(receive, wait)()


def _posted_first(receive, isend, wait_all):
    """A receive posted first (its handle ``receive``), then an async send, then both
    waited for."""
    wait_all([receive, isend()])


def _poll(ended):
    """Call ``ended`` until it says the operation has ended."""
    while not ended():
        pass


def _ways(pattern):
    return WAYS if pattern == "all" else GROUPS[pattern]


def _tabulate(args, counts, runs, missing):
    two_ranks_table(TITLE, "elements, way", lambda cs: [
        "%s %s" % (c, w) for c in cs for w in _ways(args.pattern)])(args, counts, runs, missing)


def worker(peer, counts, iters, out, pattern="all"):
    import numpy as np
    ways_of, rank, close = _endpoint(peer)
    clock = time.perf_counter_ns
    result = {}
    for count in counts:
        ways = ways_of(np.ones(count, np.float32))
        for way in _ways(pattern):
            call, per = ways[way], 4 if way.startswith("4 ") else 1
            batches = []
            for b in range(max(1, iters // BATCH) + 5):     # the first 5 batches warm up
                start = clock()
                for _ in range(BATCH):
                    call()
                if b >= 5:
                    batches.append((clock() - start) / BATCH / per / 1e9)
            result["%s %s" % (count, way)] = {"median": statistics.median(batches),
                                              "best": min(batches)}
    close()
    if rank == 0:
        save_figures(out, result)


def main(argv=None):
    return two_ranks_main(argv, __doc__, __file__, PEERS, 3000, "timed calls per count and way",
                          worker, _tabulate, patterns=PATTERNS)


if __name__ == "__main__":
    sys.exit(main())
