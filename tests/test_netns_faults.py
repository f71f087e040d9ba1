"""Network faults between two "hosts" (network namespaces): loss, a slow link, a cut link.

Two namespaces joined by one veth pair, one rank in each, transport "tcp",
the rendezvous through a file store in a temporary directory (both
namespaces share the filesystem).  Addresses come from 198.18.0.0/15 only
(the benchmarking range, routed nowhere); the namespaces are built per test
(root and ``ip`` needed, else skipped) and removed whatever happens.

- random packet loss: ``iptables ... -m statistic --probability 0.01 -j DROP``
  on one side (skipped where iptables is missing or refused in the namespace);
- tail-drop loss: a token bucket with a tiny queue, so that real packets are
  dropped and TCP retransmits (the kernel here has no netem; tc alone suffices);
- a shaped link: ``tc ... tbf rate 200mbit``;
- a link cut mid-run: both ranks must raise PeerError or Timeout, quickly.

Every result is checked exactly (small integers in float32).  This file is
also the worker: ``python test_netns_faults.py worker ...`` runs one rank.
"""

import argparse
import contextlib
import itertools
import os
import re
import shutil
import subprocess
import sys
import threading
import time

import pytest

pytestmark = pytest.mark.timeout(60)

HERE = os.path.abspath(__file__)
SUBNET = "198.18.7"          # host i at 198.18.7.i/24
DEV = "eth0"
COMMAND_TIMEOUT_S = 10
# Element counts, mixed from 1 to 1M float32 (4 MiB), some not multiples of anything.
SIZES = [1, 3, 1000, 4099, 65536, 1 << 20, 7, 250_001]
_counter = itertools.count()


# --------------------------------------------------------------------------- worker

def _operand(count, iteration, rank):
    import numpy as np
    return ((np.arange(count, dtype=np.int64) + iteration + 3 * rank) % 7).astype(np.float32)


def worker_main(argv):
    """One rank: ``iterations`` checked allreduces; prints progress, the error or DONE."""
    import numpy as np
    import pycollect as pc

    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--store", required=True)
    parser.add_argument("--interface", required=True)
    parser.add_argument("--timeout", type=float, required=True)
    parser.add_argument("--iterations", type=int, required=True)
    parser.add_argument("--ready-after", type=int, default=0)
    parser.add_argument("--max-size", type=int, default=1 << 20)
    parser.add_argument("--budget", type=float, default=40.0, help="seconds for the loop")
    args = parser.parse_args(argv)
    sizes = [n for n in SIZES if n <= args.max_size]
    rank, size = args.rank, 2
    start = time.monotonic()
    ctx = pc.init(rank=rank, size=size, store=args.store, transport="tcp",
                  timeout=args.timeout, interface=args.interface)
    print("INIT %.3f" % (time.monotonic() - start), flush=True)
    status = 0
    try:
        for i in range(args.iterations):
            if time.monotonic() - start > args.budget:
                print("BUDGET after %d iterations" % i, flush=True)
                status = 5
                break
            count = sizes[i % len(sizes)]
            data = _operand(count, i, rank)
            expected = sum(_operand(count, i, r) for r in range(size))
            began = time.monotonic()
            try:
                ctx.allreduce(data)
            except (pc.PeerError, pc.Timeout) as exc:
                print("RAISED %s after %.3f s at iteration %d: %s"
                      % (type(exc).__name__, time.monotonic() - began, i, exc), flush=True)
                status = 3
                break
            if not np.array_equal(data, expected):
                bad = np.flatnonzero(data != expected)
                print("WRONG iteration %d count %d: %d elements differ, first at %d: %r != %r"
                      % (i, count, bad.size, bad[0], data[bad[0]], expected[bad[0]]),
                      flush=True)
                status = 1
                break
            if args.ready_after and i + 1 == args.ready_after:
                print("READY %d" % (i + 1), flush=True)
        else:
            ctx.barrier()
            print("DONE %d %.3f" % (args.iterations, time.monotonic() - start), flush=True)
    finally:
        closing = time.monotonic()
        ctx.close()
        print("CLOSED %.3f" % (time.monotonic() - closing), flush=True)
    return status


# --------------------------------------------------------------------------- namespaces

def _why_not():
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "needs root to create network namespaces"
    if shutil.which("ip") is None:
        return "needs the ip command"
    return None


def _run(*args, check=True):
    return subprocess.run(list(args), capture_output=True, text=True, check=check,
                          timeout=COMMAND_TIMEOUT_S)


def _ip(*args, check=True):
    return _run("ip", *args, check=check)


class TwoHosts:
    """Namespaces ``names[0]``, ``names[1]`` joined by veth ``eth0`` <-> ``eth0``."""

    def __init__(self, names, store_dir):
        self.names = names
        self.addresses = [f"{SUBNET}.{i}" for i in (1, 2)]
        self.store = "file://" + store_dir

    def ns_exec(self, host, *command, check=True):
        return _run("ip", "netns", "exec", self.names[host], *command, check=check)

    def start(self, host, *worker_args):
        """Rank ``host`` as a worker in namespace ``host``; returns a _Proc."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("PYCOLLECT_")}
        command = ["ip", "netns", "exec", self.names[host], sys.executable, HERE, "worker",
                   "--rank", str(host), "--store", self.store,
                   "--interface", self.addresses[host], *map(str, worker_args)]
        return _Proc(subprocess.Popen(command, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))


@pytest.fixture
def two_hosts(tmp_path):
    reason = _why_not()
    if reason:
        pytest.skip(reason)
    tag = "pcf%d_%d" % (os.getpid() % 100000, next(_counter))
    names = [tag + "a", tag + "b"]
    created = []
    try:
        for name in names:
            done = _ip("netns", "add", name, check=False)
            if done.returncode != 0:
                pytest.skip(f"cannot create network namespaces here: {done.stderr.strip()}")
            created.append(name)
        _ip("-n", names[0], "link", "add", DEV, "type", "veth", "peer", "name", DEV,
            "netns", names[1])
        for index, name in enumerate(names, start=1):
            _ip("-n", name, "addr", "add", f"{SUBNET}.{index}/24", "dev", DEV)
            _ip("-n", name, "link", "set", DEV, "up")
            _ip("-n", name, "link", "set", "lo", "up")
        store_dir = tmp_path / "store"
        store_dir.mkdir()
        yield TwoHosts(names, str(store_dir))
    finally:
        for name in reversed(created):
            _ip("netns", "del", name, check=False)


class _Proc:
    """A worker process whose output lines a thread collects as they come."""

    def __init__(self, popen):
        self.popen = popen
        self.lines = []
        self.times = []
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self):
        for raw in self.popen.stdout:
            with self._cond:
                self.lines.append(raw.decode(errors="replace").rstrip("\n"))
                self.times.append(time.monotonic())
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def wait_line(self, prefix, deadline):
        """(line, when) of the first line starting with ``prefix``, or None by ``deadline``."""
        with self._cond:
            while True:
                for line, when in zip(self.lines, self.times):
                    if line.startswith(prefix):
                        return line, when
                left = deadline - time.monotonic()
                if left <= 0 or (self.popen.poll() is not None and not self._thread.is_alive()):
                    return None
                self._cond.wait(min(left, 0.2))

    def finish(self, deadline):
        """Exit code (None if still running at ``deadline``, then killed) and the output."""
        try:
            code = self.popen.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            code = None
        self.kill()
        self._thread.join(5)
        return code, "\n".join(self.lines)

    def kill(self):
        if self.popen.poll() is None:
            self.popen.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(5)


def _run_job(hosts, job_s, *worker_args):
    """Both ranks with the same arguments; [(code, output)], each within ``job_s`` seconds."""
    procs = [hosts.start(h, *worker_args) for h in (0, 1)]
    try:
        deadline = time.monotonic() + job_s
        return [p.finish(deadline) for p in procs]
    finally:
        for p in procs:
            p.kill()


def _assert_all_correct(results, iterations):
    for rank, (code, out) in enumerate(results):
        assert code == 0, f"rank {rank} exit {code}:\n{out}"
        assert f"DONE {iterations} " in out, f"rank {rank}:\n{out}"


def _qdisc_drops(hosts, host):
    """Packets the root qdisc of ``host``'s eth0 has dropped."""
    shown = hosts.ns_exec(host, "tc", "-s", "qdisc", "show", "dev", DEV).stdout
    return sum(int(n) for n in re.findall(r"dropped (\d+)", shown)), shown


# --------------------------------------------------------------------------- tests

def test_random_packet_loss_all_results_exact(two_hosts):
    if shutil.which("iptables") is None:
        pytest.skip("needs the iptables command (Debian's iptables package) for random loss")
    rule = ["INPUT", "-m", "statistic", "--mode", "random", "--probability", "0.01",
            "-j", "DROP"]
    done = two_hosts.ns_exec(1, "iptables", "-A", *rule, check=False)
    if done.returncode != 0:
        pytest.skip(f"iptables refused the statistic rule in the namespace: "
                    f"{(done.stderr or done.stdout).strip()}")
    iterations = 200
    results = _run_job(two_hosts, 45, "--timeout", 20, "--iterations", iterations,
                       "--budget", 40)
    counters = two_hosts.ns_exec(1, "iptables", "-L", "INPUT", "-v", "-n", "-x",
                                 check=False).stdout
    _assert_all_correct(results, iterations)
    dropped = [int(line.split()[0]) for line in counters.splitlines()
               if "statistic" in line and "DROP" in line]
    assert dropped and dropped[0] > 0, f"the rule dropped nothing:\n{counters}"


def test_tail_drop_loss_all_results_exact(two_hosts):
    """Real loss without netem or iptables: a token bucket whose queue holds ~10 packets."""
    if shutil.which("tc") is None:
        pytest.skip("needs the tc command")
    done = two_hosts.ns_exec(0, "tc", "qdisc", "add", "dev", DEV, "root", "tbf", "rate",
                             "400mbit", "burst", "32kbit", "limit", "15000", check=False)
    if done.returncode != 0:
        pytest.skip(f"tc tbf refused in the namespace: {done.stderr.strip()}")
    iterations = 60
    results = _run_job(two_hosts, 45, "--timeout", 20, "--iterations", iterations,
                       "--budget", 40)
    drops, shown = _qdisc_drops(two_hosts, 0)
    _assert_all_correct(results, iterations)
    assert drops > 0, f"the queue dropped nothing, so nothing was retransmitted:\n{shown}"


def test_shaped_link_all_results_exact(two_hosts):
    if shutil.which("tc") is None:
        pytest.skip("needs the tc command")
    for host in (0, 1):
        done = two_hosts.ns_exec(host, "tc", "qdisc", "add", "dev", DEV, "root", "tbf",
                                 "rate", "200mbit", "burst", "32kbit", "latency", "50ms",
                                 check=False)
        if done.returncode != 0:
            pytest.skip(f"tc tbf refused in the namespace: {done.stderr.strip()}")
    iterations = 24     # three rounds of SIZES, ~40 MB each way at 25 MB/s
    began = time.monotonic()
    results = _run_job(two_hosts, 45, "--timeout", 20, "--iterations", iterations,
                       "--budget", 40)
    elapsed = time.monotonic() - began
    _assert_all_correct(results, iterations)
    shown = two_hosts.ns_exec(0, "tc", "-s", "qdisc", "show", "dev", DEV).stdout
    sent = int(re.search(r"Sent (\d+) bytes", shown).group(1))
    # The shaper really carried the traffic, so the job took about bytes / rate.
    assert sent > 10 * 2**20, shown
    assert elapsed > 0.8 * sent * 8 / 200e6, (elapsed, shown)


@pytest.mark.parametrize("side", [0, 1], ids=["cut-at-rank0", "cut-at-rank1"])
def test_link_cut_mid_run_both_ranks_fail_fast(two_hosts, side):
    timeout_s = 5.0
    ready_after = 10
    procs = [two_hosts.start(h, "--timeout", timeout_s, "--iterations", 100_000,
                             "--ready-after", ready_after, "--max-size", 65536,
                             "--budget", 40) for h in (0, 1)]
    try:
        deadline = time.monotonic() + 20
        for rank, p in enumerate(procs):
            got = p.wait_line("READY", deadline)
            assert got, f"rank {rank} never got {ready_after} iterations done:\n" + \
                "\n".join(p.lines)
        _ip("-n", two_hosts.names[side], "link", "set", DEV, "down")
        cut = time.monotonic()
        results = [p.finish(cut + 30) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for rank, ((code, out), p) in enumerate(zip(results, procs)):
        assert code is not None, f"rank {rank} still running 30 s after the cut:\n{out}"
        assert "WRONG" not in out, f"rank {rank}:\n{out}"
        raised = p.wait_line("RAISED", time.monotonic())
        assert raised, f"rank {rank} ended (exit {code}) without PeerError/Timeout:\n{out}"
        line, when = raised
        match = re.match(r"RAISED (PeerError|Timeout) after ([\d.]+) s at iteration (\d+): (.+)",
                         line)
        assert match, f"rank {rank}: {line}"
        kind, message = match.group(1), match.group(4)
        assert int(match.group(3)) >= ready_after, line
        assert when - cut < 30, f"rank {rank} raised {when - cut:.1f} s after the cut: {line}"
        if kind == "Timeout":
            # The per-context timeout bounds the call that hung.
            assert float(match.group(2)) < timeout_s + 5, line
            assert "timed out after %g s" % timeout_s in message, line
        # The message names the peer that went missing.
        assert f"rank {1 - rank}" in message, line
        assert code == 3, f"rank {rank} exit {code}:\n{out}"
        closed = re.search(r"CLOSED ([\d.]+)", out)
        assert closed and float(closed.group(1)) < 10, f"rank {rank} close:\n{out}"


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        sys.exit(worker_main(sys.argv[2:]))
    sys.exit("usage: python test_netns_faults.py worker --rank R --store URL ...")
