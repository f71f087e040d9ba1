"""Hierarchical against flat collectives on a multi-host topology made on this machine.

    sudo python benchmarks/hierarchy.py                 # 2 hosts x 2 ranks, network namespaces
    python benchmarks/hierarchy.py --host-id            # same shape, PYCOLLECT_HOST_ID, loopback
    python benchmarks/hierarchy.py --hosts 3 --ranks-per-host 2 --elements 16384 1048576
    sudo python benchmarks/hierarchy.py --rate 2gbit    # each host's link shaped (tc tbf)

The launcher makes the hosts (network namespaces joined by a bridge, at
198.18.0.0/15 addresses, removed at the end; or, with ``--host-id``, host
identities on loopback), then runs one rank program per rank.  Each size runs
every algorithm back to back, interleaved round by round so drift hits all of
them alike; a call's latency is the slowest rank's.  Rank 0 prints p50 in
microseconds per algorithm and each one's ratio to hierarchical.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np

SIZES = [1024, 16384, 65536, 262144, 1048576, 4194304]        # float32 elements
ALLREDUCE = ["hierarchical", "halving_doubling", "ring", "ring_chunked", "recursive_doubling",
             "auto"]
BROADCAST = ["hierarchical", "binomial", "pipelined", "auto"]
SUBNET = "198.18.30"


def measure(ctx, call, iters):
    """Per-call latencies (seconds) of ``iters`` back-to-back calls, slowest rank's."""
    import pycollect as pc
    times = np.empty(iters)
    for i in range(iters):
        t0 = time.perf_counter()
        call()
        times[i] = time.perf_counter() - t0
    ctx.allreduce(times, op=pc.MAX)
    return times


def rank_main(args):
    """One rank: every algorithm at every size, interleaved; rank 0 prints the table."""
    import pycollect as pc
    rows = []
    with pc.init(timeout=120) as ctx:
        for n in args.elements:
            buf = np.ones(n, np.float32)
            calls = {("allreduce", a): (lambda a=a: ctx.allreduce(buf, algorithm=a))
                     for a in ALLREDUCE}
            calls.update({("broadcast", a): (lambda a=a: ctx.broadcast(buf, algorithm=a))
                          for a in BROADCAST})
            for call in calls.values():
                measure(ctx, call, 2)                        # warm up
            probe = np.median(measure(ctx, calls[("allreduce", "ring")], 3))
            per_round = int(max(3, min(500, args.budget / args.rounds / max(probe, 1e-6))))
            per_round = int(ctx.allreduce(np.array([per_round]), op=pc.MIN)[0])
            samples = {key: [] for key in calls}
            for _ in range(args.rounds):
                for key, call in calls.items():
                    samples[key].append(measure(ctx, call, per_round))
            p50 = {"%s/%s" % key: float(np.median(np.concatenate(s))) * 1e6
                   for key, s in samples.items()}
            work = ctx.allreduce(buf, async_op=True)
            work.wait()
            bwork = ctx.broadcast(buf, async_op=True)
            bwork.wait()
            rows.append({"elements": n, "bytes": 4 * n, "p50_us": p50,
                         "auto_allreduce": work.algorithm, "auto_broadcast": bwork.algorithm})
            if ctx.rank == 0:
                h, b = p50["allreduce/hierarchical"], p50["broadcast/hierarchical"]
                print("%9d B  allreduce: %s  | broadcast: %s  | auto: %s, %s" % (
                    4 * n,
                    "  ".join("%s %.0f (%.2f)" % (a[:6], p50["allreduce/" + a],
                                                  p50["allreduce/" + a] / h) for a in ALLREDUCE),
                    "  ".join("%s %.0f (%.2f)" % (a[:6], p50["broadcast/" + a],
                                                  p50["broadcast/" + a] / b) for a in BROADCAST),
                    work.algorithm, bwork.algorithm), flush=True)
        if ctx.rank == 0:
            print("JSON " + json.dumps({"ranks": ctx.size, "hosts": ctx._topology.hosts,
                                        "kinds": ctx._transport.pair_kinds(), "rows": rows}),
                  flush=True)


def _ip(*args):
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


def launch(args):
    """Make the hosts, run the ranks, print rank 0's output, remove the hosts."""
    here = os.path.abspath(__file__)
    root = os.path.dirname(os.path.dirname(here))
    size = args.hosts * args.ranks_per_host
    names, switch, procs = [], None, []
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYCOLLECT_")}
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    forwarded = ["--rounds", str(args.rounds), "--budget", str(args.budget),
                 "--elements"] + [str(n) for n in args.elements]
    try:
        if args.host_id:
            store = "tcp://127.0.0.1:%d" % (20000 + os.getpid() % 20000)
        else:
            if os.geteuid() != 0 or shutil.which("ip") is None:
                sys.exit("network namespaces need root and the ip command; try --host-id")
            tag = "pcb%d" % (os.getpid() % 100000)
            switch = tag + "sw"
            _ip("netns", "add", switch)
            _ip("-n", switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", switch, "link", "set", "br0", "up")
            for h in range(1, args.hosts + 1):
                name = "%sh%d" % (tag, h)
                _ip("netns", "add", name)
                names.append(name)
                _ip("-n", switch, "link", "add", "port%d" % h, "type", "veth", "peer", "name",
                    "eth0", "netns", name)
                _ip("-n", switch, "link", "set", "port%d" % h, "master", "br0", "up")
                _ip("-n", name, "addr", "add", "%s.%d/24" % (SUBNET, h), "dev", "eth0")
                _ip("-n", name, "link", "set", "eth0", "up")
                _ip("-n", name, "link", "set", "lo", "up")
                if args.rate:
                    subprocess.run(["ip", "netns", "exec", name, "tc", "qdisc", "add", "dev",
                                    "eth0", "root", "tbf", "rate", args.rate, "burst", "4mb",
                                    "latency", "100ms"], check=True, capture_output=True,
                                   timeout=10)
            store = "tcp://%s.1:29600" % SUBNET
        for rank in range(size):
            host = rank // args.ranks_per_host
            renv = dict(env, PYCOLLECT_RANK=str(rank), PYCOLLECT_SIZE=str(size),
                        PYCOLLECT_STORE=store)
            command = [sys.executable, here, "--rank-program"] + forwarded
            if args.host_id:
                renv["PYCOLLECT_HOST_ID"] = "host%d" % host
            else:
                command = ["ip", "netns", "exec", names[host]] + command
            procs.append(subprocess.Popen(command, env=renv, stdin=subprocess.DEVNULL,
                                          stdout=subprocess.DEVNULL if rank else None))
        codes = [p.wait() for p in procs]
        return max(codes)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for name in names + ([switch] if switch else []):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, default=2)
    parser.add_argument("--ranks-per-host", type=int, default=2)
    parser.add_argument("--elements", type=int, nargs="*", default=SIZES)
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds per size")
    parser.add_argument("--budget", type=float, default=0.5,
                        help="seconds per size and algorithm, about")
    parser.add_argument("--host-id", action="store_true",
                        help="split hosts with PYCOLLECT_HOST_ID on loopback (no root needed)")
    parser.add_argument("--rate", help="shape each namespace host's link to this tc rate "
                        "(e.g. 2gbit): a network slower than memory, as between real hosts")
    parser.add_argument("--rank-program", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    for option, value in (("--hosts", args.hosts), ("--ranks-per-host", args.ranks_per_host),
                          ("--rounds", args.rounds)):
        if value < 1:
            parser.error("%s must be at least 1, got %d" % (option, value))
    if any(n < 0 for n in args.elements):
        parser.error("--elements must be 0 or more")
    if args.rank_program:
        return rank_main(args)
    return launch(args)


if __name__ == "__main__":
    sys.exit(main())
