"""The flight recorder's cost per call: the same collectives with PYCOLLECT_TRACE_SIZE=0 and
with the default ring, interleaved, as a difference in microseconds.

    python benchmarks/recorder_cost.py [--ranks 2] [--calls 20000] [--rounds 5]

Ranks are threads of this process over the in-process store (pycollect/hash_store), so a
1-element allreduce is nearly all per-call overhead: the place where the recorder's work
(one Entry, the caller's frame, three time stamps) would show.  Each round times a loop of
``--calls`` blocking allreduces on both kinds of context, alternating which goes first;
printed: the median per-call time of each and the difference, and the bare cost of one
record/started/ended cycle measured alone.
"""

import argparse
import os
import statistics
import threading
import time

import numpy as np

import pycollect as pc
from pycollect.recorder import Recorder


def _contexts(ranks, trace_size, name):
    os.environ["PYCOLLECT_TRACE_SIZE"] = str(trace_size)
    out = [None] * ranks
    threads = [threading.Thread(target=lambda r=r: out.__setitem__(
        r, pc.init(rank=r, size=ranks, store="hash://%s" % name))) for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def _per_call_us(ctxs, calls):
    elapsed = [0.0] * len(ctxs)

    def body(r):
        x = np.ones(1, np.float32)
        ctx = ctxs[r]
        ctx.allreduce(x)
        t0 = time.perf_counter()
        for _ in range(calls):
            ctx.allreduce(x)
        elapsed[r] = time.perf_counter() - t0

    threads = [threading.Thread(target=body, args=(r,)) for r in range(len(ctxs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return max(elapsed) / calls * 1e6


def main():
    # The first paragraph of the docstring: one sentence over two lines.
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    for option, value in (("--ranks", args.ranks), ("--calls", args.calls),
                          ("--rounds", args.rounds)):
        if value < 1:
            ap.error("%s must be at least 1, got %d" % (option, value))
    off = _contexts(args.ranks, 0, "recorder-off")
    on = _contexts(args.ranks, 2000, "recorder-on")
    times = {"off": [], "on": []}
    for i in range(args.rounds):
        order = (("off", off), ("on", on)) if i % 2 == 0 else (("on", on), ("off", off))
        for label, ctxs in order:
            times[label].append(_per_call_us(ctxs, args.calls))
    rec = Recorder(0, 1, 2000)
    result = np.ones(1, np.float32)
    n = 200000
    t0 = time.perf_counter()
    for _ in range(n):
        e = rec.record("allreduce", result, None, None)
        rec.started(e, 1)
        rec.ended(e, "ring")
    bare = (time.perf_counter() - t0) / n * 1e6
    med_off, med_on = statistics.median(times["off"]), statistics.median(times["on"])
    print("ranks %d, %d calls x %d rounds, 1-float allreduce" % (args.ranks, args.calls,
                                                              args.rounds))
    print("recorder off: %.2f us/call   on (2000 entries): %.2f us/call   difference: %+.2f us"
          " (%+.1f %%)" % (med_off, med_on, med_on - med_off, 100 * (med_on / med_off - 1)))
    print("one record/started/ended cycle alone: %.2f us" % bare)
    for c in off + on:
        c.close()


if __name__ == "__main__":
    main()
