"""A poll of a queued async collective that every peer has entered runs it on the polling
thread (``Runner._run_entered``: each peer's next message is of it, ``Transport.head_of``),
as a wait would, instead of waking the runner; where some peer has not entered it, the poll
returns at once as before."""

import threading
import time

import numpy as np
import pytest

from group import ThreadGroup, without_runner


def _poll(work, seconds):
    """Poll ``work`` until it ends (at most ``seconds``): the thread its callbacks ran on,
    and the longest single look in seconds."""
    ended, longest = [], 0.0
    work.add_done_callback(lambda w: ended.append(threading.current_thread()))
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        t0 = time.monotonic()
        done = work.is_completed()
        longest = max(longest, time.monotonic() - t0)
        if done:
            break
    return ended, longest


@pytest.mark.parametrize("size, kind", [(2, "allgather"), (3, "allgather"), (2, "broadcast"),
                                        (3, "alltoall"), (4, "alltoall")])
def test_the_late_rank_runs_it_in_its_poll(size, kind, monkeypatch):
    """No runner thread runs anything; the early ranks wait (running the call themselves,
    so their first messages go out), the late rank only polls: its poll finds every peer
    in the call and runs it, every value right.  Its polls before the peers enter return
    at once.  (The direct allgather starts with a hello to every peer, an alltoall with
    every rank's block to every peer; a broadcast of more than 2 ranks does not, and is
    left to the runner.)"""
    without_runner(monkeypatch)
    g = ThreadGroup(size, timeout=30)
    try:
        def body(ctx):
            out = []
            for late in range(size):
                n = 4096
                buf = np.full(n, ctx.rank + 1.0, np.float32)
                recv = np.zeros(n * size, np.float32)
                if ctx.rank != late:
                    time.sleep(0.2)     # the late rank polls before its peers enter
                if kind == "allgather":
                    work = ctx.allgather(buf, recv, algorithm="direct", async_op=True)
                elif kind == "alltoall":      # block p of every rank's send goes to rank p
                    work = ctx.alltoall(np.tile(buf, size), recv, async_op=True)
                else:
                    work = ctx.broadcast(buf, root=(late + 1) % size, algorithm="direct",
                                         async_op=True)
                if ctx.rank == late:
                    ended, longest = _poll(work, 10)
                    polled = (ended == [threading.current_thread()], longest < 0.5)
                else:
                    work.wait()         # runs it here (a wait with a timeout would not)
                    polled = None
                got = buf if kind == "broadcast" else recv
                want = (np.full(n, (late + 1) % size + 1.0) if kind == "broadcast"
                        else np.repeat(np.arange(1.0, size + 1), n))
                out.append((polled, bool(np.array_equal(got, want))))
            return out

        res = g.run(body)
        for rank, rows in enumerate(res):
            for late, row in enumerate(rows):
                assert row == ((True, True) if rank == late else None, True), res
    finally:
        g.close()


def test_a_sub_group_runs_it_in_its_poll(monkeypatch):
    """The same in a sub-group of a shared-memory job (its messages carry the group's id
    on the parent's streams): the late member's poll runs the group's allgather."""
    without_runner(monkeypatch)
    g = ThreadGroup(3, timeout=30)
    try:
        def body(ctx):
            sub = ctx.split(0 if ctx.rank != 1 else 1)
            if ctx.rank == 1:
                return None
            buf = np.full(8, sub.rank + 1.0)
            recv = np.zeros(16)
            if sub.rank == 0:
                time.sleep(0.2)
                work = sub.allgather(buf, recv, async_op=True)
                ended, _ = _poll(work, 10)
                polled = ended == [threading.current_thread()]
            else:
                sub.allgather(buf, recv, async_op=True).wait()
                polled = None
            return polled, recv.tolist()

        res = g.run(body)
        assert res == [(True, [1.0] * 8 + [2.0] * 8), None, (None, [1.0] * 8 + [2.0] * 8)]
    finally:
        g.close()
