"""benchmarks/compare.py end to end on a tiny case: real worker processes, the report."""

import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

COMPARE = Path(__file__).resolve().parents[1] / "benchmarks" / "compare.py"


@pytest.mark.parametrize("bind", ["core", "none"])
def test_a_tiny_run_reports_p50_average_and_placement(tmp_path, bind):
    out = tmp_path / "run.json"
    done = subprocess.run(
        [sys.executable, "-P", str(COMPARE), "--peers", "pycollect-shm,ceiling-shm",
         "--transports", "shm", "--ranks", "2", "--counts", "1,65536",
         "--collectives", "barrier", "--budget", "0.1", "--rounds", "2", "--bind", bind,
         "--no-write", "--json", str(out)],
        capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert doc["bind"] == bind and not doc["missing"].get("pycollect-shm (2 ranks)")
    cases = {(r["peer"], r["collective"], r["count"]) for r in doc["results"]}
    assert cases == {(p, c, n) for p in ("pycollect-shm", "ceiling-shm")
                     for c, n in (("allreduce", 1), ("allreduce", 65536), ("barrier", 0))}
    for r in doc["results"]:
        # A rank's own calls never take longer than the slowest rank's of the same call.
        assert 0 < r["avg_us"] <= r["max_us"], r
    report = done.stdout
    assert "2 ranks, small messages: p50 / average" in report
    placement = ("every peer's rank r bound to core r mod cores" if bind == "core"
                 else "no peer's ranks bound to cores")
    assert placement in report
    small = report.split("2 ranks, small messages")[1].split("\n\n")[1].splitlines()
    assert [row.split(" | ")[0] for row in small[2:]] == ["| allreduce 1", "| barrier"]


def test_a_page_without_plots_says_why(tmp_path):
    """Where matplotlib is missing the page says there is no plot, instead of dropping
    the images silently; with plots it links them."""
    out = tmp_path / "run.json"
    done = subprocess.run(
        [sys.executable, "-P", str(COMPARE), "--peers", "pycollect-shm", "--transports", "shm",
         "--ranks", "2", "--counts", "1", "--collectives", "none", "--budget", "0.05",
         "--rounds", "1", "--no-write", "--json", str(out)],
        capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    compare = _compare_module()
    doc = json.loads(out.read_text())
    without = compare.markdown(doc, None)
    assert "No plot in this run: matplotlib is not installed" in without
    assert "![allreduce" not in without
    linked = compare.markdown(doc, {2: "img/allreduce-2ranks.png"})
    assert "(img/allreduce-2ranks.png)" in linked and "No plot" not in linked


def _compare_module():
    import importlib.util
    spec = importlib.util.spec_from_file_location("compare_under_test", COMPARE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _FakeGroup:
    """What connect_groups reads of a Group: its peer, size, processes and log tail."""

    def __init__(self, peer, proc):
        self.peer, self.size, self.procs = peer, 1, [proc]
        self.conns, self.error = {}, None

    def tail(self):
        return "(its log)"


def test_a_worker_that_never_says_hello_fails_its_group_not_the_run(monkeypatch):
    # A worker connects, then starts its peer, then says hello.  One that connected and
    # is still starting when the deadline comes marks its own group; the others' hellos,
    # coming after it connected, are read all the same (the driver once blocked on the
    # first connection's hello and ended the whole run with a TimeoutError).
    compare = _compare_module()
    monkeypatch.setattr(compare, "SETUP_S", 3.0)
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    silent = ("import socket, time; s = socket.create_connection(('127.0.0.1', %d)); "
              "time.sleep(30)" % port)
    talker = ("import json, socket, time; s = socket.create_connection(('127.0.0.1', %d)); "
              "time.sleep(1); s.sendall(json.dumps({'hello': 'talker', 'rank': 0}).encode() "
              "+ b'\\n'); time.sleep(30)" % port)
    procs = [subprocess.Popen([sys.executable, "-c", silent])]
    try:
        # The silent worker's connection is the first one waiting to be accepted.
        assert select.select([listener], [], [], 20)[0], "the silent worker did not connect"
        procs.append(subprocess.Popen([sys.executable, "-c", talker]))
        groups = [_FakeGroup("silent", procs[0]), _FakeGroup("talker", procs[1])]
        compare.connect_groups(listener, groups)
        assert groups[1].error is None and list(groups[1].conns) == [0]
        assert groups[0].error.startswith("only 0 of 1 ranks said hello within 3 s")
        assert "(its log)" in groups[0].error and not groups[0].conns
        groups[1].conns[0].close()
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
        listener.close()


def _vm_flags(address):
    """The VmFlags of the mapping of this process that holds ``address``."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    inside = False
    for line in lines:
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    raise AssertionError("no mapping holds %#x" % address)


@pytest.mark.parametrize("count", [3, 1 << 20], ids=["small", "4MiB"])
def test_every_peer_gets_buffers_of_a_fresh_mapping(count):
    """compare.py's buffers do not depend on what a worker freed before: each lies in a
    mapping of its own, zeroed; a large one starts on a huge page's boundary and is advised
    for huge pages, as NumPy's large arrays in a fresh process are."""
    sys.path.insert(0, str(COMPARE.parent))
    try:
        import compare
    finally:
        sys.path.remove(str(COMPARE.parent))
    a, b = compare.fresh_zeros(count, np.float32), compare.fresh_zeros(count, np.float32)
    assert a.shape == (count,) and a.dtype == np.float32 and not a.any()
    assert not np.shares_memory(a, b)
    a[:] = 1
    assert not b.any() and a.sum() == count
    flags = _vm_flags(a.ctypes.data)
    if count * 4 >= compare.HUGE_BYTES:
        assert a.ctypes.data % compare.HUGE_BYTES == 0
        assert "hg" in flags, flags
    else:
        assert "hg" not in flags, flags


def test_the_barrier_floor_is_measured_and_set_beside_the_peers():
    """BarrierFloor builds benchmarks/barrier_floor.c and reads the row of pycollect's way
    of waiting; the report sets the peers' 4-rank barrier p50 against the lower of its
    runs.  A floor that cannot be measured says why in the report instead."""
    compare = _compare_module()
    doc = {"barrier_floor": {"ranks": 4, "cpus": 2, "runs": [], "note": None},
           "results": [{"ranks": 4, "collective": "barrier", "count": 0,
                        "peer": "pycollect-shm", "p50_us": 6.5}]}
    floor = compare.BarrierFloor(4)
    try:
        floor.measure(doc)
    finally:
        floor.close()
    assert floor.note is None and len(doc["barrier_floor"]["runs"]) == 1
    run = doc["barrier_floor"]["runs"][0]
    assert 0 < run["period_us"] < 1000 and 0 < run["p50_us"] < 1000, run
    line = compare.barrier_floor(doc)[0]
    assert line.startswith("Barrier floor, 4 ranks on 2 CPUs")
    assert f"pycollect shm 6.50 µs ({compare.num(6.5 / run['p50_us'])}× the lower floor)" \
        in line, line

    missing = compare.CFloor("no_such_floor")
    try:
        assert missing.run([], int) is None and "did not build" in missing.note
    finally:
        missing.close()
    doc["barrier_floor"] = {"ranks": 4, "cpus": 2, "runs": [], "note": missing.note}
    assert compare.barrier_floor(doc) == [f"Barrier floor, 4 ranks on 2 CPUs: {missing.note}."]


@pytest.mark.parametrize("argv, message", [
    (["--peers", "mpi-shmm"], "--peers: unknown 'mpi-shmm' (choose from ceiling-shm, "
                              "pycollect-tcp, pycollect-shm, pycollect-shm-pooled, gloo, "
                              "torch-pycollect, mpi-shm, mpi-tcp;"),
    (["--peers", "pycollect-tcp", "--transports", "shm"], "unknown 'pycollect-tcp'"),
    (["--collectives", "barier"], "--collectives: unknown 'barier' (choose from broadcast, "
                                  "allgather, barrier, or none;"),
    (["--from-json", "/nonexistent.json"], "--from-json /nonexistent.json: No such file"),
    (["--from-json", "EMPTY"], "not a compare.py result"),
], ids=["peer", "peer-of-no-transport", "collective", "no-file", "not-a-result"])
def test_what_the_run_cannot_honour_is_a_usage_error(tmp_path, capsys, argv, message):
    """A misspelt peer or collective is refused, not dropped; a --from-json file that is
    missing or no result of this script is a usage error, not a traceback."""
    (tmp_path / "empty.json").write_text("{}")
    argv = [str(tmp_path / "empty.json") if a == "EMPTY" else a for a in argv]
    with pytest.raises(SystemExit) as exit_:
        _compare_module().parse_args(argv + ["--no-write"])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_a_known_peer_is_taken_whether_or_not_it_is_installed():
    # Whether it can run here is drive's to say (in "missing"), not the parser's.
    args = _compare_module().parse_args(["--peers", "mpi-shm,gloo,pycollect-shm",
                                         "--collectives", "none", "--no-write"])
    assert args.peers == "mpi-shm,gloo,pycollect-shm" and args.collectives == ["none"]


def test_the_barrier_floor_ends_when_a_rank_dies_in_the_run():
    """A rank killed in the middle of barrier_floor's run calls the run off: the program
    exits 1 at once, naming it (its other ranks once waited for the dead one for ever)."""
    floor = _compare_module().CFloor("barrier_floor")
    try:
        assert floor.note is None, floor.note
        run = subprocess.Popen([floor.exe, "4", "2", "20"], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
        try:
            children, until = [], time.monotonic() + 10
            while len(children) < 3 and time.monotonic() < until:    # ranks 1-3, forked
                with open(f"/proc/{run.pid}/task/{run.pid}/children") as f:
                    children = f.read().split()
                time.sleep(0.05)
            assert len(children) == 3, children
            time.sleep(0.5)         # in the run (every rank joined in ms): 4 s a way at 20 us
            os.kill(int(children[1]), signal.SIGKILL)
            out, err = run.communicate(timeout=30)
        finally:
            run.kill()
            run.wait()
        assert run.returncode == 1, (out, err)
        assert f"barrier_floor: a rank died in the run (pid {children[1]})" in err, err
    finally:
        floor.close()


def test_the_barrier_floor_refuses_more_cores_than_cpus():
    """barrier_floor.c refuses CPUs it may not use (it once bound a rank there, failed, and
    left the others spinning), and words for numbers."""
    floor = _compare_module().CFloor("barrier_floor")
    try:
        assert floor.note is None, floor.note
        cpus = len(os.sched_getaffinity(0))
        for args in (["4", str(cpus + 1)], ["4", "x"], ["4", "2", "1", "5"]):
            done = subprocess.run([floor.exe, *args], capture_output=True, text=True,
                                  timeout=30)
            assert done.returncode == 2 and not done.stdout, (args, done)
            assert done.stderr.startswith("usage: ") and f"cores 1..{cpus}" in done.stderr
    finally:
        floor.close()
