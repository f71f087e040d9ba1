"""Small jobs: thread ranks through a store (one checked allreduce), spawned ranks' results,
and three spawned ranks of which one dies or stops."""

import contextlib
import json
import signal
import subprocess
import sys
import time

import numpy as np

import pycollect as pc
from group import run_ranks


def allreduce_job(size, store, **init_kwargs):
    """Run ``size`` ranks through ``store``; every rank's allreduce must give the exact sum."""
    contexts = run_ranks(size, lambda r: pc.init(rank=r, size=size, store=store,
                                                 **init_kwargs))
    try:
        results = run_ranks(size, lambda r: contexts[r].allreduce(np.full(5, r + 1.0)))
        expected = np.full(5, size * (size + 1) / 2)
        assert all(np.array_equal(result, expected) for result in results), results
    finally:
        for ctx in contexts:
            ctx.close()


def collect(procs, deadline):
    """Each process's (exit code, output) by ``deadline`` (monotonic); kill those left over."""
    try:
        results = []
        for proc in procs:
            out, _ = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
            results.append((proc.returncode, out.decode(errors="replace")))
        return results
    finally:
        stop(procs)


def stop(procs):
    """Kill the processes that are still running and reap them."""
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)


_SHM_HEAD = r"""
import json, sys
import numpy as np
import pycollect as pc
from pycollect import shared
rank, store = int(sys.argv[1]), sys.argv[2]
ctx = pc.init(rank=rank, size=%d, store=store, timeout=30, transport="shm")
assert all(k in ("self", "shm+cma") for k in ctx._transport.pair_kinds()), \
    "cross-memory attach is needed for this test"
"""


def shm_ranks(size, body):
    """A rank script for run_script: joins ``size`` ranks over shared memory, checks that
    every pair may use cross-memory attach, then runs ``body`` (``ctx``, ``rank``, ``np``,
    ``pc``, ``shared`` and ``json`` defined)."""
    return _SHM_HEAD % size + body


def run_script(tmp_path, text, size=3):
    """Start ``text`` as a script of ``size`` ranks (argv: rank, a file store's URL); return
    the processes, their output piped."""
    script = tmp_path / "ranks.py"
    script.write_text(text)
    store = "file://%s" % (tmp_path / "store")
    return [subprocess.Popen([sys.executable, str(script), str(r), store],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for r in range(size)]


def run_victims(tmp_path, victim, stopped=False, bound_s=10, min_s=0.0):
    """Run ``victim`` (argv: rank, store URL) as ranks 0..2, where rank 2 dies by SIGKILL (or,
    ``stopped``, stops): ranks 0 and 1 must print "<error> after <seconds> s: <message>"
    naming it, after at least ``min_s`` and within ``bound_s`` seconds."""
    procs = run_script(tmp_path, victim)
    try:
        outs = [procs[r].communicate(timeout=60) for r in ((0, 1) if stopped else (0, 1, 2))]
    finally:
        stop(procs)
    if not stopped:
        assert procs[2].returncode == -signal.SIGKILL, outs[2]
    for r in (0, 1):
        assert procs[r].returncode == 0, outs[r]
        line = outs[r][0]
        assert "rank 2" in line, line
        assert "PeerError" in line or (stopped and "Timeout" in line), line
        assert min_s < float(line.split(" after ")[1].split(" s")[0]) < bound_s, line


def last_json(procs, ranks, timeout):
    """The last stdout line, parsed as JSON, of each of ``procs[r]`` for r in ``ranks``
    (each must exit 0 within ``timeout`` seconds); every process is stopped afterwards."""
    try:
        outs = [procs[r].communicate(timeout=timeout) for r in ranks]
    finally:
        stop(procs)
    results = []
    for r, (out, err) in zip(ranks, outs):
        assert procs[r].returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results
