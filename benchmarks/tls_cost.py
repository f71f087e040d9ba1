"""The cost of TLS: allreduce over "tcp" and "tcp+tls" on local ranks, interleaved, as ratios.

    python benchmarks/tls_cost.py [--ranks 2] [--rounds 3] [--elements 1,1024,1048576,16777216]

Each round runs ``pycollect-bench --local N allreduce`` once per size and
transport, alternating which transport goes first, so both see the same load
on a shared machine.  A throwaway CA and certificate (for 127.0.0.1) are made
in a temporary folder and passed through ``PYCOLLECT_TLS_*``.  Printed: the
median over rounds of each run's p50 latency, and tcp+tls / tcp.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

from tls_certs import Authority     # noqa: E402

from pycollect.launch import module_command
from turns import int_list

TRANSPORTS = ("tcp", "tcp+tls")


def _iterations(elements):
    """Enough timed calls for a stable median, few enough for a 2-core machine."""
    return 2000 if elements <= 4096 else 50 if elements <= 1 << 20 else 5


def bench(transport, elements, ranks, env):
    out = subprocess.run(
        [*module_command("pycollect.bench"), "--local", str(ranks), "--transport",
         transport, "--elements", str(elements), "--iteration-count",
         str(_iterations(elements)), "--json", "--quiet", "allreduce"],
        env=env, capture_output=True, text=True, timeout=600)
    if out.returncode:
        raise SystemExit("pycollect-bench failed:\n" + out.stderr)
    (result,) = json.loads(out.stdout)["results"]
    return result["p50_us"], result["algorithm"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--elements", default="1,1024,1048576,16777216")
    args = parser.parse_args()
    for option, value in (("--ranks", args.ranks), ("--rounds", args.rounds)):
        if value < 1:
            parser.error("%s must be at least 1, got %d" % (option, value))
    sizes = int_list(parser, "--elements", args.elements, 0)
    with tempfile.TemporaryDirectory() as pki:
        ca = Authority(pki)
        cert, key = ca.issue("bench")
        env = dict(os.environ, PYCOLLECT_TLS_CERT=cert, PYCOLLECT_TLS_KEY=key,
                   PYCOLLECT_TLS_CA=ca.ca_file)
        times = {(t, n): [] for t in TRANSPORTS for n in sizes}
        algos = {}
        for rnd in range(args.rounds):
            for n in sizes:
                order = TRANSPORTS if rnd % 2 == 0 else TRANSPORTS[::-1]
                for transport in order:
                    p50, algos[n] = bench(transport, n, args.ranks, env)
                    times[transport, n].append(p50)
                    print("round %d: %-8s %9d elements  p50 %10.1f us" % (
                        rnd + 1, transport, n, p50), file=sys.stderr)
    print("| float32 elements | bytes | algorithm | tcp p50 (us) | tcp+tls p50 (us) | "
          "tcp+tls / tcp |")
    print("| ---: | ---: | --- | ---: | ---: | ---: |")
    for n in sizes:
        plain = statistics.median(times["tcp", n])
        tls = statistics.median(times["tcp+tls", n])
        print("| %d | %d | %s | %.1f | %.1f | %.2f |" % (n, 4 * n, algos[n], plain, tls,
                                                       tls / plain))


if __name__ == "__main__":
    main()
