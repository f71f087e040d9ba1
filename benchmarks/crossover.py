"""Algorithm crossovers: every fixed algorithm and "auto" over Gloo's sweep.

Run under the launcher, e.g.

    pycollect-run -n 2 python benchmarks/crossover.py
    pycollect-run -n 4 python benchmarks/crossover.py --json crossover-4.json
    pycollect-run -n 2 python benchmarks/crossover.py --collective broadcast --transport shm

The collective is allreduce (default), broadcast (root 0) or allgather (the
count is each rank's block).
Each size runs every algorithm back to back, interleaved round by round so
drift hits all of them alike; a call's latency is the slowest rank's.  Rank
0 prints, per algorithm, the p50 of its best round (the lowest per-round
median, so that a burst of load from elsewhere spoils one round rather than
the verdict), the best fixed choice, what auto picked, and auto's time and
its pick's time relative to the best (the JSON also has the plain p50s);
``--markdown`` ends with the same as a table.
"""

import argparse
import json
import sys
import time

import numpy as np

import pycollect as pc
from pycollect.context import ALLGATHER_ALGORITHMS, ALLREDUCE_ALGORITHMS, BROADCAST_ALGORITHMS
from pycollect.plugins.registry import get_transport

GLOO_SWEEP = [100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000, 200000,
              500000, 1000000, 2000000, 5000000]


ALGORITHMS = {"allreduce": ALLREDUCE_ALGORITHMS, "broadcast": BROADCAST_ALGORITHMS,
              "allgather": ALLGATHER_ALGORITHMS}


def caller(ctx, collective, buf):
    """A function of the algorithm name that runs one ``collective`` on ``buf``."""
    if collective == "broadcast":
        return lambda a: ctx.broadcast(buf, 0, algorithm=a)
    if collective == "allgather":
        out = np.empty(buf.size * ctx.size, buf.dtype)
        return lambda a: ctx.allgather(buf, out, algorithm=a)
    return lambda a: ctx.allreduce(buf, algorithm=a)


def measure(ctx, call, algorithm, iters):
    """Per-call latencies (seconds) of ``iters`` back-to-back calls, slowest rank's."""
    times = np.empty(iters)
    for i in range(iters):
        t0 = time.perf_counter()
        call(algorithm)
        times[i] = time.perf_counter() - t0
    ctx.allreduce(times, op=pc.MAX)
    return times


def markdown(algorithms, results):
    """The rows as docs/algorithms.md's crossover tables have them."""
    fixed = [a for a in algorithms if a != "auto"]
    lines = ["| elements | " + " | ".join("`%s`" % a for a in fixed)
             + " | auto | auto picks | pick / best | auto / best |",
             "|---:|" + "---:|" * len(fixed) + "---:|---|---:|---:|"]
    for row in results:
        cells = ["**%.1f**" % row["best_round_p50_us"][a] if a == row["best"]
                 else "%.1f" % row["best_round_p50_us"][a] for a in fixed]
        lines.append("| %d | %s | %.1f | %s | %.2f | %.2f |" % (
            row["elements"], " | ".join(cells), row["best_round_p50_us"]["auto"], row["auto"],
            row["pick_vs_best"], row["auto_vs_best"]))
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--elements", type=int, nargs="*", default=GLOO_SWEEP)
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds per size")
    parser.add_argument("--budget", type=float, default=1.0,
                        help="seconds per size and algorithm, at most")
    parser.add_argument("--json", help="write the results here (rank 0)")
    parser.add_argument("--markdown", action="store_true",
                        help="rank 0 ends with the results as a Markdown table (best rounds, "
                             "µs; bold: the fastest fixed choice)")
    parser.add_argument("--transport", default="auto", help="tcp, shm or auto (default)")
    parser.add_argument("--collective", default="allreduce", choices=sorted(ALGORITHMS))
    args = parser.parse_args()
    # Every rank checks the same arguments before it joins: a bad one is each rank's usage
    # error, not a traceback from the rendezvous or the first round.
    if args.rounds < 1:
        parser.error("--rounds must be at least 1, got %d" % args.rounds)
    if any(n < 0 for n in args.elements):
        parser.error("--elements must be 0 or more")
    try:
        get_transport(args.transport)
    except pc.Error as exc:
        parser.error("--transport %s: %s" % (args.transport, exc))
    algorithms = [a for a in ALGORITHMS[args.collective] if a != "auto"] + ["auto"]
    results = []
    with pc.init(transport=args.transport) as ctx:
        for n in args.elements:
            buf = np.ones(n, np.float32)
            call = caller(ctx, args.collective, buf)
            for a in algorithms:                      # warm up, and size the rounds
                measure(ctx, call, a, 3)
            probe = measure(ctx, call, algorithms[0], 3)
            per_round = int(max(3, min(2000, args.budget / args.rounds / max(np.median(probe), 1e-6))))
            per_round = int(ctx.allreduce(np.array([per_round]), op=pc.MIN)[0])
            samples = {a: [] for a in algorithms}
            for _ in range(args.rounds):
                for a in algorithms:
                    samples[a].append(measure(ctx, call, a, per_round))
            p50 = {a: float(np.median(np.concatenate(s))) for a, s in samples.items()}
            # The comparison uses each algorithm's best round (the lowest of its per-round
            # medians): a burst of load from elsewhere spoils a round, not the verdict.
            settled = {a: float(min(np.median(r) for r in s)) for a, s in samples.items()}
            chosen = ctx.plan(args.collective, buf).code
            from pycollect._ext._transport import ALGORITHM_NAMES
            fixed = {a: v for a, v in settled.items() if a != "auto"}
            best = min(fixed, key=fixed.get)
            row = {"elements": n, "bytes": n * 4, "p50_us": {a: v * 1e6 for a, v in p50.items()},
                   "best_round_p50_us": {a: v * 1e6 for a, v in settled.items()},
                   "best": best, "auto": ALGORITHM_NAMES[chosen],
                   "auto_vs_best": settled["auto"] / fixed[best],
                   # the same question through the pick's own samples: auto runs exactly
                   # the algorithm it picks, so this ratio is free of auto's separate noise
                   "pick_vs_best": fixed.get(ALGORITHM_NAMES[chosen], np.nan) / fixed[best]}
            results.append(row)
            if ctx.rank == 0:
                print("%9d  %s  best %-18s auto %-18s auto/best %.2f pick/best %.2f" % (
                    n, "  ".join("%s %8.1f" % (a[:5], row["best_round_p50_us"][a])
                                 for a in algorithms),
                    best, row["auto"], row["auto_vs_best"], row["pick_vs_best"]), flush=True)
        if ctx.rank == 0 and args.markdown:
            print(markdown(algorithms, results))
        if ctx.rank == 0 and args.json:
            with open(args.json, "w") as f:
                json.dump({"ranks": ctx.size, "collective": args.collective,
                           "transport": args.transport, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
