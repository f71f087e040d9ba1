"""Ray collective backends in one run: Ray's "gloo" against "pycollect", same actors taking turns.

    python benchmarks/ray_compare.py                    # 2 actors; 1, 1M and 16M floats; ~1 min
    python benchmarks/ray_compare.py --counts 1,65536 --rounds 5 --json out.json

One local Ray (``ray.init(num_cpus=...)``) and two actors (``--actors``).  Each
actor joins two groups, one per backend, and a case is timed in each actor
by back-to-back ``ray.util.collective.allreduce`` calls on a float32 array
that the actor made (pycollect.bench.time_calls: a warmup, one iteration
count agreed on from batches of calls timed on the slowest actor, then timed
calls).  The
backends take turns, in a rotated order, for ``--rounds`` rounds; per call
the slowest actor's time counts, and the rounds' calls are pooled.  A third
peer, "Context", is the same pycollect group called without Ray's layer
(``pycollect.ray.context(name).allreduce``): the difference to "pycollect"
is what ``ray.util.collective`` and the backend class cost per call.

busbw is NCCL-tests' bus bandwidth: bytes / p50 x 2(n-1)/n.  Needs ray and
torch (Ray's gloo backend is torch.distributed's).
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))   # run from a checkout without installing
from pycollect.bench import busbw_factor, latency_stats  # noqa: E402

import ray  # noqa: E402

GROUPS = {"gloo": "bench-gloo", "pycollect": "bench-pycollect"}
PEERS = ("gloo", "pycollect", "Context")


@ray.remote(num_cpus=0)
class Timer:
    """One actor: a member of both groups, timing the calls it is told to make."""

    def join(self, size, rank):
        import ray.util.collective as col
        import pycollect.ray  # noqa: F401  (registers the backend "pycollect" here)
        for backend, name in GROUPS.items():
            col.init_collective_group(size, rank, backend, name)
        return os.getpid()

    def measure(self, peer, count, warmup, iteration_time, max_iterations):
        import ray.util.collective as col
        import pycollect.ray as pcray
        from pycollect.bench import time_calls
        name = GROUPS["pycollect" if peer == "Context" else peer]
        buf = np.ones(count, np.float32)
        if peer == "Context":
            ctx = pcray.context(name)

            def call():
                ctx.allreduce(buf)
        else:
            def call():
                col.allreduce(buf, name)

        def agree_max(value):
            # Through the same backend, so that each one times only itself.
            cell = np.array([value], np.float32)
            col.allreduce(cell, name, col.types.ReduceOp.MAX)
            return float(cell[0])

        times = time_calls(call, lambda: col.barrier(name), agree_max, warmup, iteration_time,
                           max_iterations=max_iterations)
        return times

    def leave(self):
        import ray.util.collective as col
        for name in GROUPS.values():
            col.destroy_collective_group(name)
        return True


def run(args):
    ray.init(num_cpus=args.num_cpus, include_dashboard=False, log_to_driver=False)
    actors = [Timer.remote() for _ in range(args.actors)]
    ray.get([a.join.remote(args.actors, r) for r, a in enumerate(actors)], timeout=300)
    results = {peer: {} for peer in PEERS}
    factor = busbw_factor("allreduce", args.actors)
    load_before = os.getloadavg()
    for count in args.counts:
        pooled = {peer: [] for peer in PEERS}
        for round_number in range(args.rounds):
            order = PEERS[round_number % len(PEERS):] + PEERS[:round_number % len(PEERS)]
            for peer in order:
                times = ray.get([a.measure.remote(peer, count, args.warmup, args.iteration_time,
                                               args.max_iterations) for a in actors],
                                timeout=600)
                pooled[peer].append(np.max(np.stack(times), axis=0))
        for peer in PEERS:
            results[peer][count] = latency_stats(np.concatenate(pooled[peer]), 4 * count,
                                                 factor)
        print("%d floats done" % count, file=sys.stderr)
    ray.get([a.leave.remote() for a in actors], timeout=120)
    ray.shutdown()
    return {"actors": args.actors, "rounds": args.rounds, "load_before": load_before,
            "load_after": os.getloadavg(), "ray": ray.__version__, "results": results}


def _count_name(count):
    for unit, shift in (("M", 20), ("K", 10)):
        if count >= 1 << shift and count % (1 << shift) == 0:
            return "%d%s" % (count >> shift, unit)
    return str(count)


def _bw(row):
    return "-" if row["busbw_GBps"] is None or row["bytes"] < 16 << 10 else \
        "%.2f" % row["busbw_GBps"]


def markdown(doc):
    """The table for docs/performance.md."""
    res = doc["results"]
    lines = ["| floats | gloo p50 | pycollect p50 | gloo / pycollect | gloo busbw | "
             "pycollect busbw | pycollect / gloo busbw | Context p50 | Ray's layer |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for count in res["gloo"]:
        gloo, mine, bare = res["gloo"][count], res["pycollect"][count], res["Context"][count]
        bw_ratio = "-" if _bw(gloo) == "-" else "%.1f×" % (mine["busbw_GBps"] /
                                                          gloo["busbw_GBps"])
        lines.append("| %s | %.1f µs | %.1f µs | %.1f× | %s | %s | %s | %.1f µs | %.1f µs |" % (
            _count_name(count), gloo["p50_us"], mine["p50_us"],
            gloo["p50_us"] / mine["p50_us"], _bw(gloo), _bw(mine), bw_ratio, bare["p50_us"],
            mine["p50_us"] - bare["p50_us"]))
    lines.append("")
    lines.append("%d actors, %d rounds; load average %.1f before, %.1f after; Ray %s."
                 % (doc["actors"], doc["rounds"], doc["load_before"][0], doc["load_after"][0],
                    doc["ray"]))
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--actors", type=int, default=2)
    parser.add_argument("--counts", default="1,1048576,16777216",
                        type=lambda text: [int(c) for c in text.split(",")],
                        help="float32 element counts (default 1,1048576,16777216)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iteration-time", type=float, default=1.0,
                        help="seconds of timed calls per peer, case and round")
    parser.add_argument("--max-iterations", type=int, default=20000)
    parser.add_argument("--num-cpus", type=int, default=2, help="ray.init(num_cpus=...)")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    started = time.monotonic()
    doc = run(args)
    doc["seconds"] = time.monotonic() - started
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1, default=str))
    print(markdown(doc))


if __name__ == "__main__":
    main()
