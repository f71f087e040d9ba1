"""Ranks as threads in one process: the fast way to run a collective on every rank.

The collectives release the GIL for their whole duration, so threads give
real parallelism over real sockets; the in-process HashStore does the
rendezvous.
"""

import itertools
import threading
import time

import pycollect as pc
import pycollect.context
from pycollect.work import Runner

_names = itertools.count()


def run_ranks(size, fn, timeout=120.0):
    """Call ``fn(rank)`` on ``size`` threads at once; return results, re-raise the first error."""
    results = [None] * size
    errors = [None] * size

    def body(rank):
        try:
            results[rank] = fn(rank)
        except BaseException as exc:      # re-raised in the caller
            errors[rank] = exc

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        if t.is_alive():
            raise AssertionError("a rank did not finish within %g s" % timeout)
    for exc in errors:
        if exc is not None:
            raise exc
    return results


def outcomes(size, fn, timeout=120.0):
    """Like run_ranks, but return each rank's result or exception instead of raising."""
    def wrapped(rank):
        try:
            return fn(rank)
        except pc.Error as exc:
            return exc
    return run_ranks(size, wrapped, timeout)


class IdleRunner(Runner):
    """A context's runner whose thread returns at once: only the calling threads' waits
    and polls end anything (tests of what a call or a look does on its own)."""

    def _loop(self):
        return None


def poll_to_end(work, seconds=20):
    """Poll ``work`` (``is_completed``) until it ends, at most ``seconds``; the threads its
    callbacks ran on (the polling thread alone where a poll ended it)."""
    ended = []
    work.add_done_callback(lambda w: ended.append(threading.current_thread()))
    deadline = time.monotonic() + seconds
    while not work.is_completed() and time.monotonic() < deadline:
        pass
    return ended


def without_runner(monkeypatch):
    """The contexts this test makes from now on get an IdleRunner."""
    monkeypatch.setattr(pycollect.context, "Runner", IdleRunner)


class ThreadGroup:
    """``size`` connected contexts, one per rank, driven from threads."""

    def __init__(self, size, timeout=60.0, **init_kwargs):
        self.size = size
        store = "hash://group-%d" % next(_names)
        self.contexts = run_ranks(size, lambda r: pc.init(
            rank=r, size=size, store=store, timeout=timeout, **init_kwargs))

    def run(self, fn, timeout=120.0):
        """Call ``fn(ctx)`` on every rank at once and return the per-rank results."""
        return run_ranks(self.size, lambda r: fn(self.contexts[r]), timeout)

    def outcomes(self, fn, timeout=120.0):
        """Call ``fn(ctx)`` on every rank; return each rank's result or pycollect error."""
        return outcomes(self.size, lambda r: fn(self.contexts[r]), timeout)

    def close(self):
        for ctx in self.contexts:
            ctx.close()
