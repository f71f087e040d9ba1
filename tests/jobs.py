"""Small jobs: thread ranks through a store (one checked allreduce), and spawned ranks' results."""

import contextlib
import subprocess
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
