"""Two builds of pycollect side by side in one run, taking turns: is the new one slower?

    python benchmarks/before_after.py --build before=/path/to/old/venv/bin/python \\
        --build after=/path/to/new/venv/bin/python --ranks 2,4 --transports shm,tcp

Each build is a Python interpreter with its own pycollect installed (two
virtual environments).  For every round, world size and transport, the
builds run ``python -P -m pycollect.bench allreduce --local N`` in turn (the
order rotates from round to round), from a neutral working directory so that
each imports its own installed package, over the same sizes.  Per build and
size the table gives the median over rounds of each run's p50 latency, the
run's own noise (the largest spread between two rounds of one build, relative
to its median), after / before, and the same ratio of the runs' fastest call
(less sensitive to a machine shared with other work).  A ratio above 1 that is larger than the
noise is a slowdown.
"""

import argparse
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile

from turns import int_list

ELEMENTS = (1, 16, 256, 4096, 65536, 262144, 1 << 20, 4 << 20, 16 << 20)


def _run(python, ranks, transport, elements, iteration_time, workdir):
    out = os.path.join(workdir, "bench.json")
    cmd = [python, "-P", "-m", "pycollect.bench", "allreduce", "--local", str(ranks),
           "-t", transport, "--elements", ",".join(map(str, elements)),
           "--iteration-time", iteration_time, "--json=" + out, "--quiet"]
    subprocess.run(cmd, cwd=workdir, check=True, stdout=subprocess.DEVNULL, timeout=1800)
    with open(out) as f:
        return {row["elements"]: row for row in json.load(f)["results"]}


def _noise(values):
    middle = statistics.median(values)
    return (max(values) - min(values)) / middle if middle and len(values) > 1 else 0.0


def _duration(text):
    """``--iteration-time`` as pycollect.bench takes it (``2s``, ``500ms`` or a bare number
    of seconds, above 0), checked here and passed on as given."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*(ms|s)?\s*", text)
    if not match or not 0 < float(match.group(1)) < math.inf:
        raise argparse.ArgumentTypeError("%r is not a duration above 0 such as 2s, 500ms or "
                                         "0.3 (seconds)" % text)
    return text


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build", action="append", required=True, metavar="NAME=PYTHON",
                        help="a build: its name and interpreter (give exactly two)")
    parser.add_argument("--ranks", default="2,4")
    parser.add_argument("--transports", default="shm,tcp")
    parser.add_argument("--elements", default=",".join(map(str, ELEMENTS)))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iteration-time", type=_duration, default="300ms")
    parser.add_argument("--json", help="write every sample here")
    args = parser.parse_args(argv)
    builds = [tuple(b.split("=", 1)) for b in args.build]
    if len(builds) != 2:
        parser.error("give exactly two --build NAME=PYTHON")
    for build in builds:
        if len(build) != 2 or not build[0] or not build[1]:
            parser.error("--build takes NAME=PYTHON (a name, '=', an interpreter), got %r"
                         % "=".join(build))
        if shutil.which(build[1]) is None:
            parser.error("--build %s: %r is not an interpreter that can run here"
                         % ("=".join(build), build[1]))
    if builds[0][0] == builds[1][0]:
        parser.error("the two --build names must differ, got %r twice" % builds[0][0])
    int_list(parser, "--ranks", args.ranks, 1)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1, got %d" % args.rounds)
    elements = int_list(parser, "--elements", args.elements, 0)
    samples = {}    # (ranks, transport, build, elements) -> [p50 per round]
    lows = {}       # ... -> [min per round]
    with tempfile.TemporaryDirectory() as workdir:
        for ranks in [int(r) for r in args.ranks.split(",")]:
            for transport in args.transports.split(","):
                for rnd in range(args.rounds):
                    order = builds if rnd % 2 == 0 else builds[::-1]
                    for name, python in order:
                        rows = _run(python, ranks, transport, elements, args.iteration_time,
                                    workdir)
                        for n, row in rows.items():
                            samples.setdefault((ranks, transport, name, n), []).append(
                                row["p50_us"])
                            lows.setdefault((ranks, transport, name, n), []).append(
                                row["min_us"])
                        print("round %d %s %d ranks %s done" % (rnd + 1, name, ranks,
                                                                transport), file=sys.stderr)
    (old, _), (new, _) = builds
    print("| ranks | transport | elements | %s p50 (us) | %s p50 (us) | %s / %s | noise "
          "| min: %s / %s |" % (old, new, new, old, new, old))
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    for ranks in [int(r) for r in args.ranks.split(",")]:
        for transport in args.transports.split(","):
            for n in elements:
                a = samples[ranks, transport, old, n]
                b = samples[ranks, transport, new, n]
                ma, mb = statistics.median(a), statistics.median(b)
                low = (statistics.median(lows[ranks, transport, new, n])
                       / statistics.median(lows[ranks, transport, old, n]))
                print("| %d | %s | %d | %.1f | %.1f | %.2f | %.2f | %.2f |" % (
                    ranks, transport, n, ma, mb, mb / ma, max(_noise(a), _noise(b)), low))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{"ranks": k[0], "transport": k[1], "build": k[2], "elements": k[3],
                        "p50_us": v} for k, v in samples.items()], f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
