"""A rank started twice whose second process joins just after rank 0 last counted the
joins (both started at once; the answers were all in) is still named on every rank: rank 0
counts again once the transport stands, before it confirms the run."""

import threading
import time

import pycollect as pc
from group import outcomes
from pycollect import join
from pycollect.plugins.registry import open_store
from pycollect.plugins.store import Deadline, PrefixStore


def test_a_second_process_that_joins_after_the_last_count_is_named(monkeypatch):
    size, url = 3, "hash://join-twice"
    store = open_store(url)
    go = threading.Event()
    original = join._Join.host

    def host(self):
        """Rank 0 has counted and acked: now the second rank 1 joins (a bounded wait)."""
        run = original(self)
        go.set()
        for _ in range(1000):
            if self.scoped.add("%s/joins" % run, 0) >= size:
                break
            time.sleep(0.01)
        return run

    monkeypatch.setattr(join._Join, "host", host)

    def second():
        assert go.wait(10)
        return join._Join(PrefixStore("pycollect/ctx0", store), 1, size,
                          Deadline(6.0)).try_guest()

    def rank(r):
        if r == size:
            return second()
        return pc.init(rank=r, size=size, store=store, timeout=6)

    results = outcomes(size + 1, rank, timeout=30)
    for result in results:
        if isinstance(result, pc.Context):
            result.close()
    store.close()
    for result in results:
        assert isinstance(result, pc.MismatchError), results
        assert "rank 1 was started twice" in str(result), results
