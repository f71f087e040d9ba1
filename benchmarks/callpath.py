"""The call path alone: one-rank collectives of pycollect beside mpi4py and torch, in one run.

    python benchmarks/callpath.py                   # every peer found, 5 rounds
    python benchmarks/callpath.py --peers pycollect,mpi4py --rounds 3 --json out.json
    python benchmarks/callpath.py --ops all         # the other collectives too

On a group of one rank no byte moves, so what a call costs is the library's
own path: argument checks, the plan, the sequence number, the flight
recorder, the call into compiled code and back.  Every peer runs in a process
of its own (mpi4py under ``mpirun -n 1``); the peers take turns, in an order
that rotates from round to round.  A peer times each operation in batches of
``--calls`` back-to-back calls (one clock read per batch, so the clock is not
part of the figure) and reports the median and the fastest batch, per call.
The table gives, per operation and peer, the median over rounds of those
medians, the fastest batch seen, and the ratio of each peer's median to
pycollect's.

Peers: ``pycollect`` (``ctx.allreduce(buf)``, ``ctx.barrier()``,
``ctx.broadcast(buf)`` on a NumPy float32 array of one element),
``mpi4py`` (``Allreduce(IN_PLACE, buf)``, ``Barrier()``, ``Bcast(buf)`` on
Open MPI), ``torch-pycollect`` and ``torch-gloo`` (``dist.all_reduce``,
``dist.barrier``, ``dist.broadcast`` of a one-element float32 tensor with
backend ``"pycollect"`` and ``"gloo"``).  ``--ops all`` adds reduce (in place
on the root), allgather, gather, scatter, reduce_scatter and alltoall of one
element, each peer's own call for it (mpi4py's ``Reduce(IN_PLACE, buf)``,
``Allgather``, ``Gather``, ``Scatter``, ``Reduce_scatter_block``,
``Alltoall``; torch's ``reduce``, ``all_gather_into_tensor``, ``gather``,
``scatter``, ``reduce_scatter_tensor``, ``all_to_all_single``), and
``allreduce-async``: an allreduce started async and waited on at once
(``ctx.allreduce(buf, async_op=True).wait()``, ``Iallreduce(IN_PLACE,
buf).Wait()``, ``dist.all_reduce(t, async_op=True).wait()``); a call a
peer refuses shows as a dash.  A peer that is not installed is left out and
named.
"""

import argparse
import json
import os
import statistics
import sys
import time

from turns import importable, pick_peers, report, summarize, take_turns

OPS = ("allreduce", "barrier", "broadcast")
MORE_OPS = ("reduce", "allgather", "gather", "scatter", "reduce_scatter", "alltoall",
            "allreduce-async")
PEERS = ("pycollect", "mpi4py", "torch-pycollect", "torch-gloo")
BATCHES = 30


def _calls(peer):
    """The three zero-argument calls of ``peer`` on a one-rank group, and a closer."""
    import numpy as np
    if peer == "pycollect":
        import pycollect as pc
        ctx = pc.init(rank=0, size=1, store="hash://callpath", timeout=30)
        buf, out = np.zeros(1, np.float32), np.zeros(1, np.float32)
        return {"allreduce": lambda: ctx.allreduce(buf), "barrier": ctx.barrier,
                "broadcast": lambda: ctx.broadcast(buf), "reduce": lambda: ctx.reduce(buf, 0),
                "allgather": lambda: ctx.allgather(buf, out),
                "gather": lambda: ctx.gather(buf, out, 0),
                "scatter": lambda: ctx.scatter(out, buf, 0),
                "reduce_scatter": lambda: ctx.reduce_scatter(buf, out),
                "alltoall": lambda: ctx.alltoall(buf, out),
                "allreduce-async": lambda: ctx.allreduce(buf, async_op=True).wait()}, ctx.close
    if peer == "mpi4py":
        from mpi4py import MPI
        comm, buf, out = MPI.COMM_WORLD, np.zeros(1, np.float32), np.zeros(1, np.float32)
        in_place = MPI.IN_PLACE
        return {"allreduce": lambda: comm.Allreduce(in_place, buf), "barrier": comm.Barrier,
                "broadcast": lambda: comm.Bcast(buf, 0),
                "reduce": lambda: comm.Reduce(in_place, buf, root=0),
                "allgather": lambda: comm.Allgather(buf, out),
                "gather": lambda: comm.Gather(buf, out, 0),
                "scatter": lambda: comm.Scatter(out, buf, 0),
                "reduce_scatter": lambda: comm.Reduce_scatter_block(buf, out),
                "alltoall": lambda: comm.Alltoall(buf, out),
                "allreduce-async": lambda: comm.Iallreduce(in_place, buf).Wait()}, lambda: None
    import torch
    import torch.distributed as dist
    if peer == "torch-pycollect":
        import pycollect.torch  # noqa: F401  (registers the backend)
    store = dist.HashStore()
    dist.init_process_group(peer.split("-", 1)[1], store=store, rank=0, world_size=1)
    t, o = torch.zeros(1, dtype=torch.float32), torch.zeros(1, dtype=torch.float32)
    return ({"allreduce": lambda: dist.all_reduce(t), "barrier": dist.barrier,
             "broadcast": lambda: dist.broadcast(t, 0), "reduce": lambda: dist.reduce(t, 0),
             "allgather": lambda: dist.all_gather_into_tensor(o, t),
             "gather": lambda: dist.gather(t, [o], 0), "scatter": lambda: dist.scatter(t, [o], 0),
             "reduce_scatter": lambda: dist.reduce_scatter_tensor(o, t),
             "alltoall": lambda: dist.all_to_all_single(o, t),
             "allreduce-async": lambda: dist.all_reduce(t, async_op=True).wait()},
            dist.destroy_process_group)


def _time(call, calls):
    """Per-call seconds of each of BATCHES batches of ``calls`` calls, after a warmup."""
    clock = time.perf_counter_ns
    for _ in range(calls):
        call()
    out = []
    for _ in range(BATCHES):
        start = clock()
        for _ in range(calls):
            call()
        out.append((clock() - start) / calls / 1e9)
    return out


def worker(peer, ops, calls, out):
    table, close = _calls(peer)
    result = {}
    for op in ops:
        try:
            table[op]()
        except Exception:       # the peer does not have this call (its backend refuses it)
            result[op] = None
            continue
        per_call = _time(table[op], calls)
        result[op] = {"median": statistics.median(per_call), "best": min(per_call)}
    close()
    with open(out, "w") as f:
        json.dump(result, f)


def available(peer):
    """Whether ``peer`` can run here (its packages import, mpirun exists)."""
    return importable({"pycollect": "pycollect", "mpi4py": "mpi4py",
                       "torch-pycollect": "torch, pycollect.torch", "torch-gloo": "torch"}[peer],
                      mpirun=peer == "mpi4py")


def _command(peer, ops, calls, out):
    me = [sys.executable, os.path.abspath(__file__), "--worker", peer, "--calls", str(calls),
          "--ops", ",".join(ops), "--out", out]
    if peer == "mpi4py":
        return ["mpirun", "--allow-run-as-root", "-n", "1"] + me
    return me


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peers", default=",".join(PEERS))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=2000, help="calls per timed batch")
    ap.add_argument("--ops", default=",".join(OPS),
                    help="operations to time, comma-separated, or 'all' (default: %(default)s)")
    ap.add_argument("--json", help="also write the figures here")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    ops = list(OPS + MORE_OPS) if args.ops == "all" else [o for o in args.ops.split(",") if o]
    bad = sorted(set(ops) - set(OPS + MORE_OPS))
    if bad:
        ap.error("unknown operation(s) %s (choose from %s, or all)"
                 % (", ".join(bad), ", ".join(OPS + MORE_OPS)))
    for option, value in (("--rounds", args.rounds), ("--calls", args.calls)):
        if value < 1:
            ap.error("%s must be at least 1, got %d" % (option, value))
    if args.worker:
        return worker(args.worker, ops, args.calls, args.out)

    peers, missing = pick_peers(ap, args.peers, PEERS, available)
    runs = take_turns(peers, args.rounds, lambda peer, out: _command(peer, ops, args.calls, out))
    report("one-rank call path, µs per call (median over %d rounds of each run's median "
           "batch; fastest batch in brackets)" % args.rounds, "operation", "---", ops,
           summarize(runs, ops), lambda p: ("pycollect", "pycollect") if p != "pycollect"
           else None, missing, args.json, {"rounds": args.rounds, "calls": args.calls})
    return 0


if __name__ == "__main__":
    sys.exit(main())
