"""Async handles: result() waits for the final value (or raises), and waits take timedelta."""

import datetime
import threading

import numpy as np
import pytest

import pycollect as pc
from group import ThreadGroup


@pytest.fixture(scope="module")
def pair():
    g = ThreadGroup(2, timeout=30)
    yield g
    g.close()


def test_result_before_completion_waits_for_the_reduced_value(pair):
    """Rank 1 joins late: rank 0's result() must wait for the sum, never hand back its input."""
    gate = threading.Event()

    def body(ctx):
        if ctx.rank == 1:
            gate.wait(10)
        buf = np.full(4, ctx.rank + 1.0)
        work = ctx.allreduce(buf, async_op=True)
        if ctx.rank == 0:
            early = work.is_completed()
            gate.set()
            return early, work.result()
        return None, work.result()

    (early, r0), (_, r1) = pair.run(body)
    assert early is False
    assert np.array_equal(r0, np.full(4, 3.0)) and np.array_equal(r1, np.full(4, 3.0))


def test_result_of_a_receive_waits_for_its_source_and_count(pair):
    gate = threading.Event()

    def body(ctx):
        if ctx.rank == 0:
            work = ctx.recv(np.zeros(3), 1, async_op=True)
            gate.set()
            return work.result(timeout=10)
        gate.wait(10)
        ctx.send(np.ones(3), 0)
        return None

    assert pair.run(body)[0] == (1, 3)


def test_result_with_a_timeout_raises_timeout_while_pending(pair):
    gate = threading.Event()

    def body(ctx):
        if ctx.rank == 1:
            gate.wait(10)
            return ctx.barrier()
        work = ctx.barrier(async_op=True)
        try:
            with pytest.raises(pc.Timeout, match="did not complete within 0.05 s"):
                work.result(timeout=0.05)
        finally:
            gate.set()
        return work.result(timeout=datetime.timedelta(seconds=10))

    pair.run(body)


def test_result_raises_the_operations_error():
    g = ThreadGroup(2, timeout=20)
    try:
        works = g.run(lambda ctx: ctx.allreduce(np.ones(3 + ctx.rank), async_op=True))
        for work in works:
            with pytest.raises(pc.MismatchError):
                work.result(timeout=20)
    finally:
        g.close()


def test_wait_accepts_a_timedelta_and_refuses_nonsense(pair):
    def body(ctx):
        work = ctx.allreduce(np.ones(2), async_op=True)
        with pytest.raises(pc.InvalidArgument, match="timedelta"):
            work.wait(timeout="soon")
        return work.wait(timeout=datetime.timedelta(seconds=20))

    assert all(np.array_equal(r, [2.0, 2.0]) for r in pair.run(body))
