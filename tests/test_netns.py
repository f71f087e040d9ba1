"""Three "hosts" as network namespaces on one bridge: every rank must advertise its host's address.

The test builds the namespaces itself (root and ``ip`` needed, else skipped),
on addresses from 198.18.0.0/15 (the benchmarking range, routed nowhere),
and removes them whatever happens.  Each rank runs under ``ip netns exec``
with its own UTS namespace and host name, so pycollect sees three hosts.
The store is the embedded TCP store that rank 0 hosts on host 1.
"""

import json
import os
import subprocess
import sys
import time

import pytest
from jobs import collect, stop
from netns import HOSTS, SUBNET

pytestmark = pytest.mark.timeout(60)

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "rendezvous_worker.py")
STORE_PORT = 29400
JOB_TIMEOUT_S = 40


def _run_job(hosts, placement, extra_env=None):
    """Run ranks ``placement[rank] = host index`` (1-based); return [(code, output)] by rank."""
    size = len(placement)
    base = {k: v for k, v in os.environ.items() if not k.startswith("PYCOLLECT_")}
    procs = []
    deadline = time.monotonic() + JOB_TIMEOUT_S
    try:
        for rank, host in enumerate(placement):
            env = dict(base, PYCOLLECT_RANK=str(rank), PYCOLLECT_SIZE=str(size),
                       PYCOLLECT_STORE=f"tcp://{SUBNET}.1:{STORE_PORT}",
                       **(extra_env or {}).get(rank, {}))
            command = ["ip", "netns", "exec", hosts[host - 1], "unshare", "--uts", "sh", "-c",
                       f'hostname netns-host{host} && exec "$@"', "sh",
                       sys.executable, WORKER, "--timeout", "20"]
            procs.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
        return collect(procs, deadline)
    finally:
        stop(procs)


def test_three_hosts_each_rank_advertises_its_hosts_address(hosts):
    placement = [1, 1, 2, 2, 3]
    # Every way of naming the interface must land on the same address.
    specs = {1: "198.18.0.0/15", 2: "^lo", 3: "=eth0", 4: "eth,lo"}
    results = _run_job(hosts, placement, {rank: {"PYCOLLECT_SOCKET_IFNAME": spec}
                                          for rank, spec in specs.items()})
    for rank, (code, out) in enumerate(results):
        assert code == 0, f"rank {rank}: {out}"
        report = json.loads(out.strip().splitlines()[-1])
        assert report["rank"] == rank and report["size"] == len(placement)
        host, _, port = report["address"].rpartition(":")
        assert host == f"{SUBNET}.{placement[rank]}", report
        if rank in specs:
            assert specs[rank] in report["why"], report
        else:
            assert report["why"] == f"route to store host {SUBNET}.1", report


def test_a_loopback_listener_in_a_multi_host_job_is_refused(hosts):
    (code0, out0), (code1, out1) = _run_job(hosts, [1, 2], {1: {"PYCOLLECT_SOCKET_IFNAME": "lo"}})
    assert code0 != 0 and "spans 2 hosts but rank 1 listens on loopback 127.0.0.1" in out0, out0
    assert "PYCOLLECT_SOCKET_IFNAME" in out0
    # Rank 1 refuses too, unless rank 0's store (closed as rank 0 exits) is gone first.
    assert code1 != 0 and ("listens on loopback" in out1 or "TCP store" in out1), out1
