"""A store that outlives a job (a reused file:// directory, a long-lived TCP store server) keeps
that job's run keys; a new, correctly started job must not be failed by them, nor blame itself
for their failures.

Every job here is real processes: an earlier job's rank 0 is killed while it waits, or times
out, and leaves its keys; the new job's ranks then start in the order that used to go wrong
(a rank other than 0 first).  Each scenario is bounded in time.
"""

import subprocess
import sys
import time

import pytest

import pycollect as pc
from jobs import collect

pytestmark = pytest.mark.timeout(120)

JOIN_TIMEOUT = 8.0      # the new job's timeout where it must succeed
RUN_KEY = "pycollect/ctx0/run"

RANK = """
import sys, time
import numpy as np
import pycollect as pc
rank, size, url, timeout = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], float(sys.argv[4])
start = time.monotonic()
try:
    ctx = pc.init(rank=rank, size=size, store=url, timeout=timeout)
except pc.Error as exc:
    print("%s after %.2f s: %s" % (type(exc).__name__, time.monotonic() - start, exc))
    sys.exit(3)
data = np.full(4, rank + 1.0)
ctx.allreduce(data)
ctx.close()
print("ok %g" % data[0])
"""


@pytest.fixture(params=["file", "tcp"])
def store(request, tmp_path):
    """(URL, a client of it) for a store that outlives the jobs: a directory, or a TCP store
    server that the test process hosts."""
    if request.param == "file":
        url = "file://%s" % (tmp_path / "rdv")
        client = pc.FileStore(str(tmp_path / "rdv"), timeout=10)
        yield url, client
        client.close()
    else:
        with pc.TCPStoreServer("127.0.0.1", 0) as server:
            server.start()
            client = pc.TCPStore("127.0.0.1", server.port, timeout=10)
            yield server.url, client
            client.close()


def _start(tmp_path, rank, size, url, timeout):
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    return subprocess.Popen([sys.executable, str(script), str(rank), str(size), url,
                             str(timeout)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _until(client, key, seconds=20):
    """Wait (bounded) until ``key`` is in the store; return its value."""
    return client.get(key, timeout=seconds)


def _results(procs, timeout):
    """Each process's (exit code, last line of its output)."""
    return [(code, out.strip().splitlines()[-1] if out.strip() else out)
            for code, out in collect(procs, time.monotonic() + timeout + 20)]


def _killed_rank0(tmp_path, url, client, size):
    """An earlier job of ``size`` whose rank 0 is killed while it waits: its run key stays."""
    proc = _start(tmp_path, 0, size, url, 60)
    try:
        run = _until(client, RUN_KEY)
    finally:
        proc.kill()
        proc.wait(10)
    assert run.split()[1] == str(size).encode(), run
    return run.split()[0].decode()


def _failed_rank0(tmp_path, url, client, timeout=1.0):
    """An earlier job of size 2 whose rank 0 timed out alone: its run and failure stay."""
    proc = _start(tmp_path, 0, 2, url, timeout)
    [(code, line)] = _results([proc], timeout)
    assert code == 3 and "Timeout" in line and "rank(s) 1 never joined" in line, line
    run = client.get(RUN_KEY, timeout=1).split()[0].decode()
    assert client.check(["pycollect/ctx0/%s/failed" % run])
    return run


def test_a_stale_run_of_another_size_gives_way_to_rank_0s_own(tmp_path, store):
    """Rank 1 of a size-2 job reads a size-3 job's stale run before its rank 0 starts."""
    url, client = store
    stale = _killed_rank0(tmp_path, url, client, 3)
    procs = [_start(tmp_path, 1, 2, url, JOIN_TIMEOUT)]
    _until(client, "pycollect/ctx0/%s/join/1" % stale)     # rank 1 answered the stale run
    procs.append(_start(tmp_path, 0, 2, url, JOIN_TIMEOUT))
    assert _results(procs, JOIN_TIMEOUT) == [(0, "ok 3"), (0, "ok 3")]
    # Rank 1 took back what it wrote under the stale run.
    assert not client.check(["pycollect/ctx0/%s/join/1" % stale])


def test_a_stale_run_of_another_size_is_named_at_the_deadline(tmp_path, store):
    """No rank 0 comes: rank 1 reports both sizes at its deadline, and that the run may be
    a stale one, not a size mismatch of its own job at once."""
    url, client = store
    _killed_rank0(tmp_path, url, client, 3)
    [(code, line)] = _results([_start(tmp_path, 1, 2, url, 3)], 3)
    assert code == 3 and line.startswith("MismatchError after "), line
    seconds = float(line.split(" after ")[1].split(" s: ")[0])
    assert seconds >= 2.9, line
    assert "rank 0 of the run in store %s?prefix=pycollect/ctx0 was started with size 3, this " \
           "rank (pid " % url in line, line
    assert "with size 2, and no rank 0 published a run of size 2 within 3 s" in line, line
    assert "or that run is a stale one an earlier job left" in line, line


def test_an_earlier_jobs_failure_is_not_taken_for_this_ranks_own(tmp_path, store):
    """An earlier rank 0 timed out after 1 s; a new rank 1 (timeout 3 s) with no rank 0
    reports its own timeout, and that rank 0 never published a run."""
    url, client = store
    stale = _failed_rank0(tmp_path, url, client)
    [(code, line)] = _results([_start(tmp_path, 1, 2, url, 3)], 3)
    assert code == 3 and line.startswith("Timeout after "), line
    message = line.split(" s: ", 1)[1]
    assert message.startswith("rank 1: timed out after 3 s joining the run in store %s"
                              "?prefix=pycollect/ctx0: rank 0 never published a run (is rank 0 "
                              "running, with the same store?): the one in the store, %s of size "
                              "2, had failed before this rank joined it" % (url, stale)), message
    seconds = float(line.split(" after ")[1].split(" s: ")[0])
    assert seconds >= 2.9, line


def test_a_failed_stale_run_gives_way_to_rank_0s_own(tmp_path, store):
    url, client = store
    stale = _failed_rank0(tmp_path, url, client)
    procs = [_start(tmp_path, 1, 2, url, JOIN_TIMEOUT)]
    _until(client, "pycollect/ctx0/%s/join/1" % stale)
    time.sleep(0.5)     # rank 1 has read the failure of the run it answered
    procs.append(_start(tmp_path, 0, 2, url, JOIN_TIMEOUT))
    assert _results(procs, JOIN_TIMEOUT) == [(0, "ok 3"), (0, "ok 3")]
