"""Shrink latency: from a rank's death to a usable new context of the survivors.

    python benchmarks/shrink_latency.py [--ranks 4,16] [--rounds 3] [--transport auto]

Each round starts ``N`` local processes over a file store.  They run 1-float allreduces
in a loop; the last rank notes the time and kills itself (SIGKILL) in the middle of the
loop.  Every survivor catches the PeerError, calls ``shrink()``, and runs one barrier on
the new context.  Printed per N (median over rounds, the slowest survivor of each round):
detection (the kill to the survivor's error), shrink (the error to shrink()'s return),
and total (the kill to the end of the first barrier of the new context).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

import pycollect as pc
from pycollect.plugins.registry import get_transport
from turns import int_list


def rank_main(rank, size, store, transport, stamp):
    ctx = pc.init(rank=rank, size=size, store=store, transport=transport, timeout=60)
    x = np.ones(1, np.float32)
    for _ in range(50):
        ctx.allreduce(x)
    if rank == size - 1:
        with open(stamp, "w") as f:
            f.write(repr(time.time()))
        os.kill(os.getpid(), 9)
    try:
        while True:
            ctx.allreduce(x)
    except pc.PeerError:
        t_err = time.time()
    new = ctx.shrink()
    t_shrunk = time.time()
    new.barrier()
    t_ok = time.time()
    print(json.dumps({"err": t_err, "shrunk": t_shrunk, "ok": t_ok, "size": new.size}))
    new.close()
    ctx.close()


def one_round(size, transport):
    with tempfile.TemporaryDirectory() as tmp:
        stamp = os.path.join(tmp, "killed")
        cmd = [sys.executable, os.path.abspath(__file__), "--rank-of", str(size),
               "--store", "file://%s/store" % tmp, "--transport", transport, "--stamp", stamp]
        procs = [subprocess.Popen(cmd + ["--rank", str(r)], stdout=subprocess.PIPE, text=True)
                 for r in range(size)]
        outs = [p.communicate(timeout=300)[0] for p in procs[:-1]]
        procs[-1].wait(60)
        with open(stamp) as f:
            t_kill = float(f.read())
    rows = [json.loads(o.strip().splitlines()[-1]) for o in outs]
    assert all(r["size"] == size - 1 for r in rows), rows
    return (max(r["err"] for r in rows) - t_kill, max(r["shrunk"] - r["err"] for r in rows),
            max(r["ok"] for r in rows) - t_kill)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="4,16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--transport", default="auto")
    ap.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--rank-of", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--store", help=argparse.SUPPRESS)
    ap.add_argument("--stamp", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank is not None:
        return rank_main(args.rank, args.rank_of, args.store, args.transport, args.stamp)
    sizes = int_list(ap, "--ranks", args.ranks, 2)      # one rank dies, the others shrink
    if args.rounds < 1:
        ap.error("--rounds must be at least 1, got %d" % args.rounds)
    try:
        get_transport(args.transport)
    except pc.Error as exc:
        ap.error("--transport %s: %s" % (args.transport, exc))
    print("ranks  transport  detection_ms  shrink_ms  total_ms   (median of %d rounds, "
          "slowest survivor)" % args.rounds)
    for size in sizes:
        runs = [one_round(size, args.transport) for _ in range(args.rounds)]
        det, shr, tot = (statistics.median(r[i] for r in runs) * 1e3 for i in range(3))
        print("%5d  %9s  %12.2f  %9.2f  %8.2f" % (size, args.transport, det, shr, tot))


if __name__ == "__main__":
    main()
