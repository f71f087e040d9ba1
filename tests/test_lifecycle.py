"""Contexts opened and closed in a loop leak nothing; a stopped rank is named at the deadline."""

import os
import threading
import time

import numpy as np

from group import ThreadGroup
from jobs import run_victims


def _fds():
    return len(os.listdir("/proc/self/fd"))


def test_contexts_in_a_loop_leak_no_descriptors_or_threads():
    def cycle():
        g = ThreadGroup(3, timeout=20)
        res = g.run(lambda ctx: ctx.allreduce(np.ones(1000), async_op=True).wait(10))
        assert all(np.all(r == 3) for r in res)
        g.close()

    cycle()     # warm up: imports, lazily created objects
    fds, threads = _fds(), threading.active_count()
    for _ in range(15):
        cycle()
    deadline = time.monotonic() + 5
    while threading.active_count() > threads and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _fds() <= fds, (fds, _fds())
    assert threading.active_count() <= threads


_STOPPED = r"""
import os, signal, sys, time
import numpy as np
import pycollect as pc
rank, store = int(sys.argv[1]), sys.argv[2]
ctx = pc.init(rank=rank, size=3, store=store, timeout=3)
ctx.barrier()
if rank == 2:
    os.kill(os.getpid(), signal.SIGSTOP)
t0 = time.monotonic()
try:
    ctx.barrier()       # every survivor waits on rank 2 itself
except (pc.Timeout, pc.PeerError) as exc:
    print("%s after %.2f s: %s" % (type(exc).__name__, time.monotonic() - t0, exc))
    sys.exit(0)
sys.exit("no error")
"""


def test_a_stopped_rank_is_named_at_the_deadline(tmp_path):
    """SIGSTOP: no end of stream, no abort frame; the waiters time out naming it.

    (A rank that waits on a live rank that itself waits on the stopped one
    names the rank it waited for, unless the other's failure reaches it first.)
    """
    run_victims(tmp_path, _STOPPED, stopped=True, bound_s=10, min_s=2.5)
