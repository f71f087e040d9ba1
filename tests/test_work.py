"""Async handles: result() waits for the final value (or raises), and waits take timedelta."""

import datetime
import random
import threading
import time

import numpy as np
import pytest

import pycollect as pc
from group import ThreadGroup
from pycollect._ext._doorbell import Doorbell
from pycollect.work import Runner


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


def test_a_wait_longer_than_the_limit_is_refused(pair):
    """A wait's timeout past 2,000,000 s is refused (1e10 s raised a bare OverflowError from
    the lock's wait); the handle is still there to wait for."""
    def body(ctx):
        work = ctx.barrier(async_op=True)
        for wait in (lambda: work.wait(timeout=1e10), lambda: work.result(timeout=1e10),
                     lambda: pc.wait_all([work], timeout=1e10),
                     lambda: pc.wait_any([work], timeout=datetime.timedelta(days=30))):
            with pytest.raises(pc.InvalidArgument, match="at most 2000000 seconds"):
                wait()
        return work.wait(timeout=10)

    pair.run(body)


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


# -- a wait runs its queued collective itself; the runner only takes what nobody waits for --


def _ran_on(work):
    """The thread that completed ``work`` (its callbacks run there), once it has ended."""
    seen = []
    work.add_done_callback(lambda w: seen.append(threading.current_thread()))
    return seen


@pytest.mark.parametrize("call", ["allreduce", "broadcast", "barrier", "reduce", "allgather",
                                  "allreduce_python_path"])
def test_a_wait_runs_the_queued_collective_on_the_waiting_thread(pair, call):
    """Without a timeout, wait() takes the collective that the runner has not started and
    runs it on its own thread: no wake-up of the runner, no second thread switch back."""
    def body(ctx):
        here, results = 0, []
        for i in range(20):
            buf = np.full(3, ctx.rank + i, np.float32)
            if call == "allreduce":
                work = ctx.allreduce(buf, async_op=True)
            elif call == "allreduce_python_path":       # recvbuf=: the Python path's call
                work = ctx.allreduce(buf, async_op=True, recvbuf=np.empty_like(buf))
            elif call == "broadcast":
                work = ctx.broadcast(buf, root=1, async_op=True)
            elif call == "barrier":
                work = ctx.barrier(async_op=True)
            elif call == "reduce":
                work = ctx.reduce(buf, root=0, async_op=True)
            else:
                work = ctx.allgather(buf, np.empty(6, np.float32), async_op=True)
            seen = _ran_on(work)
            results.append(work.wait())
            here += seen == [threading.current_thread()]
        return here, results

    (here0, res0), (here1, res1) = pair.run(body)
    # The runner starts a collective only after nobody took it for a look (0.5 ms or more).
    assert here0 >= 10 and here1 >= 10, (here0, here1)
    for i in range(20):
        if call in ("allreduce", "allreduce_python_path"):
            assert np.array_equal(res0[i], np.full(3, 2 * i + 1, np.float32))
        elif call == "broadcast":
            assert np.array_equal(res0[i], np.full(3, 1 + i, np.float32))
        elif call == "reduce":
            assert np.array_equal(res0[i], np.full(3, 2 * i + 1, np.float32))
        elif call == "allgather":
            assert np.array_equal(res1[i], np.repeat(np.float32([i, 1 + i]), 3))


def test_wait_any_runs_the_queued_operations_on_the_waiting_thread(pair):
    """As wait() does: pc.wait_any without a timeout runs the collectives (and drives the
    sends and receives) it waits for on its own thread, up to the first that ends, instead
    of sleeping until the runner's next look."""
    def body(ctx):
        here, got, peer = 0, [], 1 - ctx.rank
        for i in range(20):
            buf = np.full(2, ctx.rank + i, np.float32)
            works = [ctx.allreduce(buf, async_op=True), ctx.barrier(async_op=True)]
            seen = _ran_on(works[0])
            index, value = pc.wait_any(works)
            here += seen == [threading.current_thread()]
            got.append((index, value.tolist()))
            pc.wait_all(works)
        other = np.zeros(1)
        late = ctx.recv(other, peer, tag=9, async_op=True)
        ctx.send(np.full(1, 7.0), peer, tag=9)
        index, status = pc.wait_any([late])
        return here, got, index, status.source, other[0]

    for rank, (here, got, index, source, value) in enumerate(pair.run(body)):
        assert here >= 10, here
        assert got == [(0, [2.0 * i + 1] * 2) for i in range(20)]
        assert (index, source, value) == (0, 1 - rank, 7.0)


@pytest.mark.parametrize("how", ["wait", "wait_all", "wait_any"])
def test_a_wait_with_a_timeout_has_the_runner_run_the_queue_now(fresh_pair, how):
    """A wait with a timeout does not run the collective itself (it could outlast the
    wait), but wakes the runner for it (Runner.hurry) instead of sleeping until the
    runner's next look."""
    def body(ctx):
        buf = np.full(2, ctx.rank + 1.0)
        ctx.barrier(async_op=True).wait()       # the runner exists
        log = []
        runner = ctx._runner
        real, runner._bell = runner._bell, _Watched(runner._bell, log)
        try:
            # Not through the flags nor a 2-rank exchange: an async call there is begun on
            # this thread.
            work = ctx.allreduce(buf, algorithm="ring", async_op=True)
            seen = _ran_on(work)
            if how == "wait":
                value = work.wait(timeout=20)
            elif how == "wait_all":
                value = pc.wait_all([work], timeout=20)[0]
            else:
                value = pc.wait_any([work], timeout=20)[1]
        finally:
            runner._bell = real
        return "hurry" in log, seen == [runner._thread], value.tolist()

    for hurried, by_runner, value in fresh_pair.run(body):
        assert hurried and by_runner and value == [3.0, 3.0]


def test_the_first_poll_of_a_pending_operation_wakes_the_runner_once(fresh_pair):
    """is_completed() on a queued operation has the runner start it now (as MPI's Test
    progresses a request), once per handle; the waits' own looks do not.  (A poll that
    finds the peer in the call already runs it on its own thread instead:
    tests/test_poll_entered.py.)"""
    def body(ctx):
        ctx.barrier(async_op=True).wait()       # the runner exists
        log = []
        runner = ctx._runner
        real, runner._bell = runner._bell, _Watched(runner._bell, log)
        try:
            # Queued (not through the flags, where the call itself posts and a poll ends
            # it: test_flags.py, nor a 2-rank exchange, which the call begins).
            work = ctx.allreduce(np.full(2, ctx.rank + 1.0), algorithm="ring", async_op=True)
            seen = _ran_on(work)
            polls = 0
            deadline = time.monotonic() + 20
            while not work.is_completed() and time.monotonic() < deadline:
                polls += 1
            hurried = log.count("hurry")
            again = ctx.allreduce(np.ones(1), async_op=True)
            pc.wait_all([again])                # its checks do not hurry
        finally:
            runner._bell = real
        here = seen == [threading.current_thread()]
        return (hurried, log.count("hurry"), seen == [runner._thread], here,
                work.wait().tolist())

    for hurried, total, by_runner, here, value in fresh_pair.run(body):
        # Run by the runner, which the first poll woke; or on this thread, by a poll that
        # found the peer in it (the first, which then woke nobody, or a later one).
        assert hurried == total and (hurried == 1 if by_runner else here and hurried <= 1)
        assert value == [3.0, 3.0]


def test_a_collective_nobody_waits_for_still_runs(pair):
    """The runner takes what no wait takes: async calls complete while the caller only polls."""
    def body(ctx):
        bufs = [np.full(2, ctx.rank + k, np.float64) for k in range(5)]
        works = [ctx.allreduce(b, async_op=True) for b in bufs]
        deadline = time.monotonic() + 10
        while not all(w.is_completed() for w in works) and time.monotonic() < deadline:
            time.sleep(0.001)
        done = [w.is_completed() for w in works]
        return done, [w.wait() for w in works]

    for done, results in pair.run(body):
        assert all(done), done
        assert [r[0] for r in results] == [1.0, 3.0, 5.0, 7.0, 9.0]


def test_waits_from_many_threads_run_each_queued_collective_once_in_order(pair):
    """Three threads wait for handles out of order while the runner is free to take any:
    every collective runs exactly once, in issue order on both ranks (the sums prove it)."""
    def body(ctx):
        n = 60
        bufs = [np.full(1, 1000.0 * ctx.rank + k) for k in range(n)]
        works = [ctx.allreduce(b, async_op=True) for b in bufs]
        order = list(range(n))
        random.Random(ctx.rank).shuffle(order)
        errors = []

        def waiter(part):
            try:
                for k in part:
                    works[k].wait()
            except BaseException as exc:     # reported below
                errors.append(exc)

        threads = [threading.Thread(target=waiter, args=(order[j::3],)) for j in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors
        return [float(b[0]) for b in bufs]

    r0, r1 = pair.run(body)
    assert r0 == r1 == [1000.0 + 2 * k for k in range(60)]


def test_a_failed_collective_run_by_its_waiter_raises_there_and_the_next_runs(pair):
    """A refusal met by the waiting thread is raised by wait() on every rank, as the
    runner's would be, and the queue goes on with the next collective."""
    def body(ctx):
        bad = ctx.allreduce(np.ones(2, np.int32), op=pc.AVG, async_op=True)
        good = ctx.allreduce(np.ones(2, np.float32), async_op=True)
        with pytest.raises(pc.InvalidArgument, match="AVG"):
            bad.wait()
        return good.wait()

    for r in pair.run(body):
        assert np.array_equal(r, [2.0, 2.0])


def test_a_wait_with_a_timeout_leaves_the_collective_to_the_runner(pair):
    def body(ctx):
        # Queued (through the flags, or as a 2-rank exchange, the call itself begins it).
        work = ctx.allreduce(np.ones(2), algorithm="ring", async_op=True)
        seen = _ran_on(work)
        result = work.wait(timeout=20)
        deadline = time.monotonic() + 5
        while not seen and time.monotonic() < deadline:
            time.sleep(0.001)
        return result, seen, threading.current_thread()

    for result, seen, waiter in pair.run(body):
        assert np.array_equal(result, [2.0, 2.0])
        assert len(seen) == 1 and seen[0] is not waiter     # not the thread that waited
        assert seen[0].name.startswith("pycollect-rank")


def test_the_doorbell_wakes_the_runner_only_for_what_nobody_took():
    from pycollect._ext._doorbell import TICK_US, Doorbell
    bell = Doorbell()
    woke = []

    def sleeper():
        while not bell.sleep():
            woke.append(bell.untaken)

    t = threading.Thread(target=sleeper, daemon=True)
    t.start()
    bell.queue()
    bell.take()                     # taken at once, as a waiting thread takes it
    time.sleep(10 * TICK_US / 1e6)
    assert woke == [] and bell.untaken == 0
    bell.queue()                    # nobody takes this one: the sleeper wakes for it
    deadline = time.monotonic() + 5
    while not woke and time.monotonic() < deadline:
        time.sleep(0.001)
    assert woke and woke[0] == 1
    bell.take()
    woke.clear()
    bell.hurry()                    # a waiter left work behind: at once, whatever the counts
    deadline = time.monotonic() + 5
    while not woke and time.monotonic() < deadline:
        time.sleep(0.001)
    assert woke == [0]
    bell.stop()
    t.join(5)
    assert not t.is_alive()


def _noted(name):
    """A doorbell method of ``_Watched``: noted in the log, then made on the real bell."""
    def method(self, *args):
        self._log.append(name)
        return getattr(self._bell, name)(*args)
    return method


class _Watched(Doorbell):
    """A Runner's doorbell, with the calls made to it noted in ``log``: it rings ``bell``."""

    def __init__(self, bell, log):
        self._bell, self._log = bell, log

    queue, hurry, take, stop, sleep = (_noted(name) for name in (
        "queue", "hurry", "take", "stop", "sleep"))

    @property
    def untaken(self):
        return self._bell.untaken


def test_what_is_queued_behind_a_running_operation_runs_next_without_a_look():
    """A blocking call made while the runner runs an async one (it waits for the runner) is
    run by the runner right after it, not at the runner's next look; and what a waiter
    leaves queued behind the operation it ran still runs (the runner is hurried to it, or
    finds it at a look)."""
    from pycollect.work import Runner, Work
    log, release = [], threading.Event()

    def execute(op):
        log.append("start %s" % op)
        if op == "A":
            release.wait(10)
        log.append("end %s" % op)

    runner = Runner(execute, "test-runner")
    try:
        runner._bell = _Watched(runner._bell, log)
        a, b = Work("A", None), Work("B", None)
        runner.submit("A", a)               # nobody waits: the runner takes it at a look
        deadline = time.monotonic() + 10
        while "start A" not in log and time.monotonic() < deadline:
            time.sleep(0.001)
        runner.submit("B", b)
        waiter = threading.Thread(target=b.wait)    # finds A running: leaves B to the runner
        waiter.start()
        time.sleep(0.05)
        release.set()
        waiter.join(10)
        assert b.is_completed()
        between = log[log.index("end A"):log.index("start B")]
        assert "sleep" not in between, log      # no look of the runner in between

        # A waiter runs C while D waits behind it for a thread that found C running.
        log.clear()
        release.clear()
        c, d = Work("C", None), Work("D", None)

        def execute_c(op):
            log.append("start %s" % op)
            if op == "C":
                release.wait(10)
        runner._execute = execute_c
        runner.submit("C", c)
        runner.submit("D", d)
        first = threading.Thread(target=c.wait)     # takes C and runs it
        first.start()
        deadline = time.monotonic() + 10
        while "start C" not in log and time.monotonic() < deadline:
            time.sleep(0.001)
        second = threading.Thread(target=d.wait)    # finds C running
        second.start()
        time.sleep(0.05)
        release.set()
        first.join(10)
        second.join(10)
        assert d.is_completed(), log
    finally:
        release.set()
        runner.stop(10)


def test_a_runner_that_found_a_thread_busy_waits_for_one_end_not_for_each():
    """A runner woken while another thread runs operations back to back (a rank's loop of
    async sends and receives begun on its own thread) waits for the end of the one it
    found running, then goes back to its doorbell: the thread's later operations do not
    each wake it.  What is queued afterwards and nobody waits for still runs."""
    from pycollect.work import Runner, Work
    ran = []
    runner = Runner(ran.append, "test-runner")
    try:
        assert runner.claim()
        runner._bell.hurry()                # the runner wakes and finds this thread busy
        deadline = time.monotonic() + 10
        while not runner._runner_waits and time.monotonic() < deadline:
            time.sleep(0.001)
        assert runner._runner_waits
        for _ in range(200):                # operations begun and ended on this thread
            runner.unclaim()
            assert runner.claim()
        runner.unclaim()
        # The runner's wait for the busy thread ends once (runner.notified counts the ends
        # of that wait: the posts of its hand-off semaphore).
        assert 1 <= runner.notified <= 2, runner.notified
        work = Work("late", None)
        runner.submit("late", work)
        deadline = time.monotonic() + 10
        while not work.is_completed() and time.monotonic() < deadline:
            time.sleep(0.001)
        assert ran == ["late"]
    finally:
        runner.stop(10)


@pytest.fixture
def fresh_pair():
    """Two ranks whose contexts have never queued anything (no runner yet)."""
    g = ThreadGroup(2, timeout=30)
    yield g
    g.close()


def test_an_async_send_the_channel_takes_at_once_has_ended_when_the_call_returns(fresh_pair):
    """As MPI's Isend of a small message: posted and written on the calling thread, before
    the receiver has posted anything, from the context's first send on."""
    gate = threading.Event()

    def body(ctx):
        if ctx.rank == 0:
            works = [ctx.send(np.full(4, float(k)), 1, tag=k, async_op=True) for k in range(5)]
            ended = [w.is_completed() for w in works]
            gate.set()
            pc.wait_all(works)
            return ended
        gate.wait(10)
        got = []
        for k in reversed(range(5)):
            buf = np.zeros(4)
            ctx.recv(buf, 0, tag=k)
            got.append(buf[0])
        return got

    ended, got = fresh_pair.run(body)
    assert ended == [True] * 5
    assert got == [4.0, 3.0, 2.0, 1.0, 0.0]


def test_an_async_receive_whose_message_is_here_has_ended_when_the_call_returns(fresh_pair):
    def body(ctx):
        if ctx.rank == 1:
            ctx.send(np.arange(3.0), 0, tag=7)
            ctx.barrier()
            return None
        ctx.barrier()           # the message has been sent (it may still be on its way)
        deadline = time.monotonic() + 5
        while ctx.iprobe(1, 7) is None and time.monotonic() < deadline:
            time.sleep(0.001)
        buf = np.zeros(3)
        st = pc.Status()
        work = ctx.recv(buf, 1, tag=7, async_op=True, status=st)
        return work.is_completed(), work.wait(), st, buf.tolist()

    ended, status, st, got = fresh_pair.run(body)[0]
    assert ended is True
    assert status is st and (st.source, st.count, st.tag) == (1, 3, 7)
    assert got == [0.0, 1.0, 2.0]


def test_an_async_receive_left_in_flight_is_driven_by_its_wait_or_else_the_runner(pair):
    """A receive whose message has not come stays posted without waking the runner: the
    wait that follows drives it on the waiting thread; one nobody waits for is taken by
    the runner at its doorbell's next look."""
    def body(ctx):
        here = 0
        peer = 1 - ctx.rank
        for i in range(20):
            buf = np.zeros(2)
            work = ctx.recv(buf, peer, tag=i, async_op=True)
            seen = _ran_on(work)
            ctx.send(np.full(2, float(i + ctx.rank)), peer, tag=i, async_op=True).wait()
            work.wait()
            assert buf.tolist() == [float(i + peer)] * 2
            here += seen == [threading.current_thread()]
        # Nobody waits on rank 0 (which makes no other call): the runner completes it.
        if ctx.rank == 1:
            time.sleep(0.05)
            ctx.send(np.ones(1), peer, tag=99)
            return here, None, None
        late = ctx.recv(np.zeros(1), peer, tag=99, async_op=True)
        seen = _ran_on(late)
        deadline = time.monotonic() + 10
        while not late.is_completed() and time.monotonic() < deadline:
            time.sleep(0.001)
        return here, late.is_completed(), seen

    (here0, late_done, late_thread), (here1, _, _) = pair.run(body)
    assert here0 >= 10 and here1 >= 10, (here0, here1)
    assert late_done
    assert late_thread[0].name.startswith("pycollect-rank")


def test_an_async_send_to_a_rank_that_left_fails_its_wait_and_the_context():
    g = ThreadGroup(2, timeout=30)
    try:
        def body(ctx):
            if ctx.rank == 1:
                ctx.close()
                return None
            deadline = time.monotonic() + 10
            work = None
            while time.monotonic() < deadline:     # until the peer's end is seen
                work = ctx.send(np.ones(1 << 16), 1, tag=0, async_op=True)
                try:
                    work.wait(timeout=10)
                except pc.PeerError as exc:
                    return exc, ctx.send(np.ones(1), 1, async_op=True)
                time.sleep(0.01)
            return None, work

        (exc, after), _ = g.run(body)
        assert isinstance(exc, pc.PeerError) and "rank 1" in str(exc)
        with pytest.raises(pc.Error):
            after.wait(timeout=10)
    finally:
        g.close()


def test_wait_all_runs_what_is_queued_up_to_its_last_handle_without_hurrying_the_runner():
    """wait_all runs the queued operations up to the last of its handles on its own thread,
    in order, and hurries the runner for none of them: a wait for the first alone would
    hand the rest to the runner, and each later wait would sleep until it had run them."""
    ran = []

    def execute(op):
        ran.append((op, threading.current_thread()))
        return None

    runner = Runner(execute, "test-runner")
    log = []
    try:
        runner._bell = _Watched(runner._bell, log)
        for _ in range(20):
            works = [pc.Work("op %d" % k, None) for k in range(4)]
            for k, w in enumerate(works):
                runner.submit((k, 0, None, None), w)
            pc.wait_all(works)
        assert [op[0] for op, _ in ran] == [0, 1, 2, 3] * 20
        assert all(t is threading.current_thread() for _, t in ran)
        assert "hurry" not in log
    finally:
        runner.stop(5)


def _mixed_step(ctx, kind, count, peer):
    """One step of a mixed run: an async or point-to-point form, waited for one of the ways
    a program waits; the result checked (every rank's buffer holds its rank + 1)."""
    mine = np.full(count, ctx.rank + 1.0, np.float32)
    theirs = np.empty_like(mine)
    if kind == 0:
        assert ctx.allreduce(mine, async_op=True).wait(timeout=20)[0] == 3.0
    elif kind == 1:
        works = [ctx.allreduce(mine.copy(), async_op=True) for _ in range(3)]
        assert pc.wait_any(works)[1][0] == 3.0
        assert [w[0] for w in pc.wait_all(works, timeout=20)] == [3.0] * 3
    elif kind == 2:
        work = ctx.barrier(async_op=True)
        deadline = time.monotonic() + 20
        while not work.is_completed() and time.monotonic() < deadline:
            pass
        assert work.is_completed()
    elif kind == 3:
        pc.wait_all([ctx.send(mine, peer, 5, async_op=True),
                     ctx.recv(theirs, peer, 5, async_op=True)])
    elif kind == 4:
        assert ctx.sendrecv(mine, peer, theirs, peer, 6, 6) == peer
    elif kind == 5:
        late = ctx.recv(theirs, peer, 7, async_op=True)
        ctx.send(mine, peer, 7)
        assert pc.wait_any([late], timeout=20)[1].source == peer
    else:
        queued = ctx.allreduce(mine, async_op=True)
        assert ctx.allreduce(np.ones(3))[0] == 2.0       # blocking, behind the queued one
        assert queued.wait()[0] == 3.0
    if kind in (3, 4, 5):
        assert theirs[0] == peer + 1.0 and theirs[-1] == peer + 1.0


def test_a_mixed_run_of_async_forms_and_waits_stays_in_step(fresh_pair):
    """Ended and parked sends and receives, queued collectives, waits with and without a
    timeout, wait_any, polls and sendrecv, in one seeded order on both ranks: every result
    right and nothing left behind."""
    def body(ctx):
        order = random.Random(18)
        for _ in range(300):
            _mixed_step(ctx, order.randrange(7), order.randrange(1, 3000), 1 - ctx.rank)
        ctx.barrier()
        return ctx.iprobe(), ctx._runner.pending()

    assert fresh_pair.run(body) == [(None, 0)] * 2


def test_a_status_unpacks_compares_pickles_and_may_be_subclassed(pair):
    """pc.Status (compiled with the handles): (source, count) when unpacked or compared,
    unhashable, pickled whole; a subclass passed to a receive, blocking or async, is filled."""
    import pickle

    class Tagged(pc.Status):
        def label(self):
            return "%d:%d" % (self.source, self.tag)

    st = pc.Status(1, 4, 9)
    assert tuple(st) == (1, 4) and st == (1, 4) and st[1] == 4 and len(st) == 2
    assert st == pc.Status(1, 4, 9) and st != pc.Status(1, 4, 8)
    assert pickle.loads(pickle.dumps(st)) == st
    with pytest.raises(TypeError):
        hash(st)

    def body(ctx):
        if ctx.rank == 0:
            ctx.send(np.ones(3), 1, tag=5)
            ctx.send(np.ones(2), 1, tag=6)
            return None
        a, b = Tagged(), Tagged()
        ctx.recv(np.zeros(3), 0, tag=5, status=a)
        got = ctx.recv(np.zeros(4), 0, tag=6, status=b, async_op=True).wait(10)
        return a.label(), (a.count, b.count), got is b

    assert pair.run(body)[1] == ("0:5", (3, 2), True)


def test_a_callback_that_raises_is_logged_and_the_runner_goes_on(pair, caplog):
    def body(ctx):
        w = ctx.allreduce(np.ones(4), async_op=True)
        w.add_done_callback(lambda w: 1 / 0)
        w.wait(timeout=10)
        # The thread that ran the callback (the runner, or this one) still runs later calls.
        later = [ctx.allreduce(np.full(4, float(i)), async_op=True) for i in range(3)]
        return [r.tolist() for r in pc.wait_all(later, timeout=10)]
    for got in pair.run(body):
        assert got == [[0.0] * 4, [2.0] * 4, [4.0] * 4]
    assert any("a done callback of" in r.getMessage() and r.exc_info
               and r.exc_info[0] is ZeroDivisionError for r in caplog.records)


def test_handles_and_callbacks_are_checked(pair):
    def body(ctx):
        w = ctx.allreduce(np.ones(2), async_op=True)
        with pytest.raises(pc.InvalidArgument, match="add_done_callback: None is not callable"):
            w.add_done_callback(None)
        done = pc.wait_all(iter([w]))           # an iterator is read once, results kept
        for bad, message in ((None, "expected handles"), ([None], "None is not the handle"),
                             ([[w]], "is not the handle")):
            with pytest.raises(pc.InvalidArgument, match=message):
                pc.wait_all(bad)
            with pytest.raises(pc.InvalidArgument, match=message):
                pc.wait_any(bad)
        return done[0].tolist()
    assert pair.run(body) == [[2.0, 2.0], [2.0, 2.0]]


@pytest.mark.parametrize("transport", ["tcp", "auto"])
def test_a_blocking_call_in_a_done_callback_is_refused_on_every_rank(transport):
    """Whichever thread runs a done callback (the runner, a waiter that ended the handle,
    or the caller of add_done_callback for a handle ended already) a blocking call of the
    context in it is refused: it ran where the handle had ended before the callback was
    added, or where a waiter ended it, and was refused elsewhere, so one rank ran a barrier
    the others never made (a hang, or PeerError)."""
    g = ThreadGroup(2, timeout=10, transport=transport)
    try:
        def body(ctx):
            seen = []

            def callback(w):
                try:
                    ctx.barrier()
                    seen.append("ran")
                except pc.InvalidArgument as exc:
                    seen.append("refused" if "cannot run in a done callback" in str(exc)
                                else str(exc))

            for i in range(20):
                work = ctx.allreduce(np.ones(10), async_op=True)
                if i % 2:
                    work.wait()             # ended before its callback is added
                work.add_done_callback(callback)
                work.wait()
            ctx.barrier()                   # in step
            return seen

        assert g.run(body, timeout=30) == [["refused"] * 20] * 2
    finally:
        g.close()


def test_callbacks_on_two_threads_at_once_leave_no_thread_marked():
    """A callback run on the caller's thread (its handle had ended) adds one whose handle
    the runner ends meanwhile, and returns first: each thread's mark goes with its own
    callbacks (one field, saved and restored by both, stayed on the caller's thread, and
    every later blocking call of it was refused)."""
    g = ThreadGroup(2, timeout=20, transport="tcp")
    try:
        def body(ctx):
            runner_busy, later = threading.Event(), []

            def on_runner(w):
                runner_busy.set()
                time.sleep(0.3)             # the caller's callback returns meanwhile

            def on_caller(w):
                later.append(ctx.allreduce(np.ones(4), async_op=True))
                later[0].add_done_callback(on_runner)
                runner_busy.wait(10)

            first = ctx.allreduce(np.ones(4), async_op=True)
            first.wait()
            first.add_done_callback(on_caller)      # ended: runs here
            later[0].wait(10)
            time.sleep(0.5)
            in_callback = ctx._runner.in_callback()
            ctx.barrier()
            return in_callback
        assert g.run(body, timeout=60) == [False, False]
    finally:
        g.close()


def test_a_blocking_call_in_a_callback_beside_a_parked_receive_is_refused():
    """With a receive parked in the runner's batch, a blocking barrier in a callback on the
    caller's thread took the path beside the batch and ran, where the other rank's was
    refused: every rank refuses it."""
    g = ThreadGroup(2, timeout=6, transport="tcp")
    try:
        def body(ctx):
            seen = []

            def callback(w):
                try:
                    ctx.barrier(timeout=4)
                    seen.append("ran")
                except pc.InvalidArgument:
                    seen.append("refused")

            ctx.recv(np.zeros(4), 1 - ctx.rank, tag=9, async_op=True)     # stays parked
            work = ctx.allreduce(np.ones(4), async_op=True)
            if ctx.rank == 0:
                work.wait()
                time.sleep(0.2)
                work.add_done_callback(callback)    # ended: the caller's thread
            else:
                work.add_done_callback(callback)
                work.wait()
            time.sleep(0.3)
            return seen
        assert g.outcomes(body, timeout=60) == [["refused"]] * 2
    finally:
        g.close()


@pytest.mark.parametrize("transport", ["tcp", "auto"])
def test_a_wait_in_a_done_callback_for_what_is_queued_behind_is_refused(transport):
    """A done callback runs on the thread that runs the context's operations, so a wait in
    it for one queued behind (Work.wait with or without a timeout, wait_all, wait_any), or
    a blocking call, could never end: each waited forever, past every deadline.  Each is
    refused at once; an async call and a wait for an ended handle work there, and the
    context goes on."""
    g = ThreadGroup(2, timeout=10, transport=transport)
    gate = threading.Event()
    try:
        def body(ctx):
            if ctx.rank == 1:
                ctx.allreduce(np.ones(4), async_op=True).wait()      # rank 0's first
                gate.wait(10)       # rank 0's w1 is pending until rank 1 makes it
                w1 = ctx.allreduce(np.ones(50000), async_op=True)
                later = ctx.allreduce(np.ones(50000), async_op=True)
                number = ctx.allreduce(5, async_op=True)
                extra = ctx.allreduce(np.ones(3), async_op=True)
                return [w.wait()[0] for w in (w1, later, extra)] + [number.wait()], None
            seen = {}
            queued = []
            first = ctx.allreduce(np.ones(4), async_op=True)
            first.wait()

            def callback(w):
                seen["thread"] = threading.current_thread()
                later = queued[0]
                for name, wait in (("wait", later.wait),
                                   ("wait timeout", lambda: later.wait(timeout=5)),
                                   ("wait_all", lambda: pc.wait_all([later])),
                                   ("wait_any", lambda: pc.wait_any([later])),
                                   ("blocking call", lambda: ctx.allreduce(np.ones(3)))):
                    try:
                        wait()
                        seen[name] = "returned"
                    except pc.Error as exc:
                        seen[name] = exc
                seen["ended"] = first.wait()[0]                 # an ended handle: its result
                number = ctx.allreduce(5, async_op=True)        # a number's handle
                try:
                    number.wait()
                    seen["number"] = "returned"
                except pc.Error as exc:
                    seen["number"] = exc
                queued.append(ctx.allreduce(np.ones(3), async_op=True))    # async: queued
                queued.append(number)

            w1 = ctx.allreduce(np.ones(50000), async_op=True)
            w1.add_done_callback(callback)
            queued.append(ctx.allreduce(np.ones(50000), async_op=True))
            gate.set()
            results = [w1.wait()[0], queued[0].wait()[0]]
            deadline = time.monotonic() + 10
            while len(queued) < 3 and time.monotonic() < deadline:
                time.sleep(0.01)                                # the callback's own calls
            results.append(queued[1].wait()[0])
            results.append(queued[2].wait())
            return results, seen

        (r0, seen), (r1, _) = g.run(body, timeout=30)
        assert r0 == r1 == [2.0, 2.0, 2.0, 10]
        assert seen["thread"] is not threading.main_thread()
        for name in ("wait", "wait timeout", "wait_all", "wait_any", "number"):
            assert isinstance(seen[name], pc.InvalidArgument), (name, seen[name])
            assert "has not ended, and cannot while this done callback runs" in \
                str(seen[name]), seen[name]
            assert str(seen[name]).startswith(
                "wait_all:" if name == "wait_all" else "wait_any:" if name == "wait_any"
                else "Work.wait:"), seen[name]
        assert isinstance(seen["blocking call"], pc.InvalidArgument), seen["blocking call"]
        assert "allreduce: a blocking call cannot run in a done callback" in \
            str(seen["blocking call"])
        assert seen["ended"] == 2.0
        assert g.run(lambda ctx: ctx.allreduce(np.ones(2))[0], timeout=30) == [2.0, 2.0]
    finally:
        g.close()
