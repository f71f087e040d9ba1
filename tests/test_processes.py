"""Ranks as real processes over real sockets, rendezvousing through the file and TCP stores."""

import os
import re
import shutil
import socket
import subprocess
import sys
import sysconfig
import time

import pytest

from proc_worker import expected_checks

from pycollect.launch import module_command

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "proc_worker.py")
# Wall-clock bound on one group of worker processes (the battery takes seconds).
GROUP_TIMEOUT_S = 120
# The per-context timeout of the failure tests, and the bound on noticing the death.
FAILURE_TIMEOUT_S = 5
FAILURE_BOUND_S = 15


def clean_env(**extra):
    """Our environment without any PYCOLLECT_* setting, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYCOLLECT_")}
    env.update(extra)
    return env


def free_port():
    """A TCP port on loopback that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launcher():
    """The installed ``pycollect-run`` of this interpreter, else the module behind it."""
    script = os.path.join(sysconfig.get_path("scripts"), "pycollect-run")
    if os.access(script, os.X_OK):
        return [script]
    found = shutil.which("pycollect-run")
    return [found] if found else module_command("pycollect.launch")


def run_group(tmp_path, size, store, *flags, env=None):
    """Run ``size`` workers to completion; return [(returncode, stdout, stderr)] and wall time."""
    env = clean_env(**(env or {}))
    procs, files = [], []
    start = time.monotonic()
    try:
        # Highest rank first: with a TCP store, ranks that do not host it wait for rank 0.
        for rank in reversed(range(size)):
            out = open(tmp_path / ("rank%d.out" % rank), "w+b")
            err = open(tmp_path / ("rank%d.err" % rank), "w+b")
            files.append((rank, out, err))
            procs.append(subprocess.Popen(
                [sys.executable, WORKER, *flags, str(rank), str(size), store],
                stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=env, cwd=tmp_path))
        deadline = start + GROUP_TIMEOUT_S
        for proc in procs:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        elapsed = time.monotonic() - start
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(5)
    results = {}
    for (rank, out, err), proc in zip(files, procs):
        with out, err:
            out.seek(0)
            err.seek(0)
            results[rank] = (proc.returncode, out.read().decode(), err.read().decode())
    return [results[r] for r in range(size)], elapsed


def assert_battery_passed(results, size):
    """Every rank exited 0 after printing its ok line with the full count of checks."""
    for rank, (code, out, err) in enumerate(results):
        assert code == 0, "rank %d exited %d:\n%s%s" % (rank, code, out, err)
        assert out.splitlines() == ["rank %d ok %d checks" % (rank, expected_checks(size))], out


@pytest.mark.parametrize("size", [2, 3, 4])
def test_battery_over_file_store(tmp_path, size):
    results, _ = run_group(tmp_path, size, "file://%s" % (tmp_path / "store"))
    assert_battery_passed(results, size)


def test_battery_with_tiny_segments_over_file_store(tmp_path):
    """256-byte segments: ring_chunked and pipelined send many segments per message."""
    results, _ = run_group(tmp_path, 2, "file://%s" % (tmp_path / "store"),
                           env={"PYCOLLECT_MAX_SEGMENT_BYTES": "256"})
    assert_battery_passed(results, 2)


@pytest.mark.parametrize("size", [2, 3])
def test_battery_over_tcp_store_hosted_by_rank0(tmp_path, size):
    results, _ = run_group(tmp_path, size, "tcp://127.0.0.1:%d" % free_port())
    assert_battery_passed(results, size)


def test_battery_under_the_launcher(tmp_path):
    done = subprocess.run(launcher() + ["-n", "3", WORKER], capture_output=True,
                          env=clean_env(), cwd=tmp_path, timeout=GROUP_TIMEOUT_S)
    out = done.stdout.decode()
    assert done.returncode == 0, out + done.stderr.decode()
    for rank in range(3):
        line = "[rank %d] rank %d ok %d checks" % (rank, rank, expected_checks(3))
        assert line in out.splitlines(), out


@pytest.mark.parametrize("store, dead", [("file", 1), ("tcp", 0)], ids=["file", "tcp-host"])
def test_dead_rank_is_named_by_the_survivors(tmp_path, store, dead):
    """A rank exits before a collective: the others raise PeerError or Timeout naming it, fast."""
    url = ("file://%s" % (tmp_path / "store") if store == "file"
           else "tcp://127.0.0.1:%d" % free_port())
    results, elapsed = run_group(tmp_path, 3, url, "--die", str(dead),
                                 "--timeout", str(FAILURE_TIMEOUT_S))
    assert elapsed < FAILURE_BOUND_S, elapsed
    code, out, err = results[dead]
    assert (code, out) == (1, ""), err
    for rank, (code, out, err) in enumerate(results):
        if rank == dead:
            continue
        assert code == 0, "rank %d exited %d:\n%s%s" % (rank, code, out, err)
        pattern = r"rank %d saw the failure of rank %d: (PeerError|Timeout): .*rank %d\b" % (
            rank, dead, dead)
        assert re.match(pattern, out), out


def test_launcher_names_the_dead_rank(tmp_path):
    start = time.monotonic()
    done = subprocess.run(
        launcher() + ["-n", "3", WORKER, "--die", "1", "--timeout", str(FAILURE_TIMEOUT_S)],
        capture_output=True, env=clean_env(), cwd=tmp_path, timeout=GROUP_TIMEOUT_S)
    assert time.monotonic() - start < FAILURE_BOUND_S
    err = done.stderr.decode()
    assert done.returncode == 1, err
    assert "pycollect-run: rank 1 exited with code 1" in err, err
