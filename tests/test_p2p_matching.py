"""MPI's point-to-point: receives match by (source, tag), with a status; probe and iprobe;
sendrecv; async sends and receives that complete in any order, with wait_all and wait_any.
The wire stays as safe as before: a message nobody receives fails the next collective, and a
receive that does not fit its message is a MismatchError."""

import threading
import time

import numpy as np
import pytest

import pycollect as pc
import pycollect.context
from group import ThreadGroup, run_ranks, without_runner
from jobs import last_json, run_script
from pycollect._ext import _p2p
from pycollect.work import Runner


@pytest.fixture(params=["auto", "tcp"])
def trio(request):
    g = ThreadGroup(3, timeout=20, transport=request.param)
    yield g
    g.close()


def test_tags_received_out_of_send_order(trio):
    """Rank 0 sends tag 1 then tag 2; rank 1 receives tag 2 first: a normal MPI program."""
    def body(ctx):
        out = None
        if ctx.rank == 0:
            ctx.send(np.full(3, 1.0), 1, tag=1)
            ctx.send(np.full(5, 2.0), 1, tag=2)
        elif ctx.rank == 1:
            two, one = np.zeros(5), np.zeros(3)
            st2, st1 = pc.Status(), pc.Status()
            assert ctx.recv(two, 0, tag=2, status=st2) == 0
            ctx.recv(one, 0, tag=1, status=st1)
            out = two.tolist(), one.tolist(), (st2.source, st2.tag, st2.count), \
                (st1.source, st1.tag, st1.count)
        ctx.barrier()       # nothing left unreceived: the collective runs
        return out

    results = trio.run(body)
    assert results[1] == ([2.0] * 5, [1.0] * 3, (0, 2, 5), (0, 1, 3))


def test_a_status_that_cannot_be_filled_is_refused_before_the_receive(trio):
    """A status without ``set`` is refused at the call, in every form, and the message stays
    for a receive that can take it (it raised AttributeError once the message had come)."""
    def body(ctx):
        if ctx.rank == 0:
            ctx.send(np.full(4, 7.0), 1, tag=3)
            return None
        if ctx.rank == 2:
            return None
        refused, buf = [], np.zeros(4)
        for call in (lambda: ctx.recv(buf, 0, tag=3, status=1),
                     lambda: ctx.recv(buf, 0, tag=3, async_op=True, status="s"),
                     lambda: ctx.sendrecv(np.ones(2), 2, buf, 0, recvtag=3, status=[1])):
            with pytest.raises(pc.InvalidArgument, match="status must be a pycollect.Status"):
                call()
            refused.append(buf.tolist())
        st = pc.Status()
        ctx.recv(buf, 0, tag=3, status=st)
        return refused, buf.tolist(), (st.source, st.tag, st.count)

    results = trio.run(body)
    assert results[1] == ([[0.0] * 4] * 3, [7.0] * 4, (0, 3, 4))


def test_any_tag_and_any_source_report_what_they_got(trio):
    def body(ctx):
        if ctx.rank:
            ctx.send(np.full(ctx.rank, float(ctx.rank)), 0, tag=10 + ctx.rank)
            return None
        got = []
        for _ in range(2):
            buf = np.zeros(4)
            st = pc.Status()
            ctx.recv(buf, pc.ANY_SOURCE, pc.ANY_TAG, status=st)
            got.append((st.source, st.tag, st.count))
        return sorted(got)

    assert trio.run(body)[0] == [(1, 11, 1), (2, 12, 2)]


def test_async_receives_complete_in_the_order_their_messages_come(trio):
    gate = threading.Event()

    def body(ctx):
        if ctx.rank == 0:
            ctx.send(np.full(2, 2.0), 1, tag=2)
            gate.wait(10)
            ctx.send(np.full(2, 1.0), 1, tag=1)
            return None
        if ctx.rank == 1:
            one, two = np.zeros(2), np.zeros(2)
            works = [ctx.recv(one, 0, tag=1, async_op=True),
                     ctx.recv(two, 0, tag=2, async_op=True)]
            index, status = pc.wait_any(works, timeout=10)
            first = (index, status.tag, works[0].is_completed(), two.tolist())
            gate.set()
            statuses = pc.wait_all(works, timeout=10)
            return first, [(s.source, s.tag, s.count) for s in statuses], one.tolist()
        return None

    first, statuses, one = trio.run(body)[1]
    assert first == (1, 2, False, [2.0, 2.0])
    assert statuses == [(0, 1, 2), (0, 2, 2)] and one == [1.0, 1.0]


def test_async_receives_begun_past_other_heads_mid_message_and_from_the_mailbox(trio):
    """An async receive begun on the caller's thread finds, at once: its message whole (it
    has ended), another tag's head first (parked; the receive waits for its own), its
    message only partly here (a large one: it goes on reading in the background), or its
    message already parked in the mailbox."""
    go = threading.Event()

    def body(ctx):
        if ctx.rank == 0:
            ctx.send(np.full(2, 1.0), 1, tag=1)
            ctx.send(np.full(2, 2.0), 1, tag=2)
            go.wait(10)
            ctx.send(np.full(1 << 21, 3.0), 1, tag=3)      # 16 MiB: more than a ring
            ctx.barrier()
            return None
        if ctx.rank == 2:
            go.wait(10)
            ctx.barrier()
            return None
        time.sleep(0.2)                 # tags 1 and 2 are here
        two = np.zeros(2)
        w2 = ctx.recv(two, 0, tag=2, async_op=True)     # past tag 1's head, which is parked
        ended_two = not ctx._runner.pending()           # ended at once: nothing parked
        one = np.zeros(2)
        w1 = ctx.recv(one, 0, tag=1, async_op=True)     # from the mailbox
        go.set()
        big = np.zeros(1 << 21)
        w3 = ctx.recv(big, 0, tag=3, async_op=True)
        st3 = w3.wait()
        st2, st1 = w2.wait(), w1.wait()
        ctx.barrier()
        return (ended_two, two.tolist(), one.tolist(), (st1.source, st1.tag, st1.count),
                (st2.source, st2.tag, st2.count), (st3.source, st3.tag, st3.count),
                float(big[0]), float(big[-1]))
    got = trio.run(body)[1]
    assert got[0] is True       # tag 2 was here behind tag 1: read at once
    assert got[1:] == ([2.0, 2.0], [1.0, 1.0], (0, 1, 2), (0, 2, 2), (0, 3, 1 << 21), 3.0, 3.0)


@pytest.fixture(params=["auto", "tcp"])
def pair(request):
    g = ThreadGroup(2, timeout=30, transport=request.param)
    yield g
    g.close()


@pytest.mark.parametrize("size", [3, 1 << 21], ids=["ended-at-once", "in-flight"])
def test_a_batch_reports_its_sends_without_waiting_for_its_receives_messages(pair, size):
    """A batch whose receive waits for a message that comes late reports a send beside it
    as soon as the send has ended: one the channel took at once, or a large one (16 MiB)
    in flight until the peer reads it a second later.  It used to wait for the receive's
    message for the whole of ``progress``'s time, here 20 s."""
    sent = threading.Event()

    def body(ctx):
        data = np.full(size, 5.0)
        if ctx.rank == 1:
            if size > 3:
                time.sleep(1.0)         # the large send stays in flight meanwhile
            got = np.zeros(size)
            ctx.recv(got, 0, tag=8)
            sent.wait(15)               # only once rank 0 saw its send end
            ctx.send(np.full(3, 7.0), 0, tag=7)
            return float(got[0]), float(got[-1])
        batch = _p2p.Batch(ctx._transport, _p2p.Mailbox(), 30.0)
        late = np.zeros(3)
        r = batch.add_recv(late, 1, 7)
        s = batch.add_send(data, 1, 8)
        start, done = time.monotonic(), []
        while s not in done and time.monotonic() - start < 15:
            done += batch.progress(20.0)
        took = time.monotonic() - start
        first = (s in done, r in done, took < 10)
        sent.set()
        while r not in done and time.monotonic() - start < 30:
            done += batch.progress(1.0)
        return first, r in done, late.tolist(), batch.result(r)

    results = pair.run(body)
    assert results[0] == ((True, False, True), True, [7.0] * 3, (1, 3, 7))
    assert results[1] == (5.0, 5.0)


def _no_python_path(self, *args, **kwargs):
    raise AssertionError("the Python path was taken")


def _joins(monkeypatch):
    """A list that Runner.join fills with (is_recv, wait) for every send or receive that
    joins a batch: the runners made from now on are of a subclass whose join notes the call
    and goes on as before (the compiled call path calls it as the override it is)."""
    joined = []

    class Counted(Runner):
        def join(self, op, description, wait):
            joined.append((op.is_recv, wait))
            return Runner.join(self, op, description, wait)

    monkeypatch.setattr(pycollect.context, "Runner", Counted)
    return joined


def test_blocking_calls_beside_an_async_receive_stay_in_compiled_code(pair, monkeypatch):
    """MPI's Irecv, Send, Recv, Wait: the blocking send and receive made while an async
    receive waits for its message run in compiled code (the Python path, patched to fail
    here, is not taken): the send beside the batch, the receive joining it; each returns
    once it has ended, and the async receive gets its message after them; a buffer the join
    refuses goes to the Python path, which says why, and leaves the waiting receive alone."""
    go = threading.Event()
    no_python_path = _no_python_path

    def body(ctx):
        if ctx.rank == 1:
            got = np.zeros(4)
            ctx.recv(got, 0, tag=8)
            ctx.send(got * 2, 0, tag=9)
            go.wait(15)
            ctx.send(np.full(2, 7.0), 0, tag=7)
            return got.tolist()
        early = np.zeros(2)
        w = ctx.recv(early, 1, tag=7, async_op=True)
        with monkeypatch.context() as m:
            m.setattr(type(ctx), "_send_any", no_python_path)
            m.setattr(type(ctx), "_recv_any", no_python_path)
            ctx.send(np.arange(4.0), 1, tag=8)
            back = np.zeros(4)
            src = ctx.recv(back, 1, tag=9)
        pending = w.is_completed()
        readonly = np.zeros(4)
        readonly.flags.writeable = False
        with pytest.raises(pc.InvalidArgument, match="read-only"):
            ctx.recv(readonly, 1, tag=9)
        go.set()
        st = w.wait(15)
        ctx.barrier()
        return src, back.tolist(), pending, (st.source, st.tag, st.count), early.tolist()

    def other(ctx):
        out = body(ctx)
        if ctx.rank == 1:
            ctx.barrier()
        return out

    results = pair.run(other)
    assert results[0] == (1, [0.0, 2.0, 4.0, 6.0], False, (1, 7, 2), [7.0, 7.0])
    assert results[1] == [0.0, 1.0, 2.0, 3.0]


@pytest.mark.parametrize("async_send", [False, True], ids=["send", "isend"])
def test_a_send_beside_receives_that_wait_goes_out_without_the_runner(pair, monkeypatch,
                                                                      async_send):
    """MPI's Irecv, Send (or Isend), Wait: where the batch in flight holds only receives
    waiting for their messages, a send goes out beside it on the caller's thread, neither
    joining the batch (no send reaches Runner.join) nor taking the Python path (patched to
    fail); an async one's handle has ended when the call returns.  The waiting receives get
    their messages afterwards, each its own."""
    joined = _joins(monkeypatch)
    no_python_path = _no_python_path

    def body(ctx):
        if ctx.rank == 1:
            got = np.zeros(4)
            ctx.recv(got, 0, tag=8)
            ctx.send(np.full(2, 7.0), 0, tag=7)
            ctx.send(np.full(3, 5.0), 0, tag=5)
            ctx.barrier()
            return got.tolist()
        seven, five = np.zeros(2), np.zeros(3)
        w7 = ctx.recv(seven, 1, tag=7, async_op=True)
        w5 = ctx.recv(five, 1, tag=5, async_op=True)
        batch = ctx._runner.batch_alone()
        alone = batch is not None and not batch.on_wire()
        with monkeypatch.context() as m:
            m.setattr(type(ctx), "_send_any", no_python_path)
            sent = ctx.send(np.arange(4.0), 1, tag=8, async_op=async_send)
        ended = sent is None or sent._end.done      # read before anything could end it
        st7, st5 = pc.wait_all([w7, w5], timeout=15)
        if sent is not None:
            sent.wait(5)
        ctx.barrier()
        return (alone, ended, seven.tolist(), five.tolist(), (st7.tag, st7.count),
                (st5.tag, st5.count))

    results = pair.run(body)
    assert results[0] == (True, True, [7.0, 7.0], [5.0] * 3, (7, 2), (5, 3))
    assert results[1] == [0.0, 1.0, 2.0, 3.0]
    assert not [j for j in joined if not j[0]], joined       # no send joined the batch


def test_an_async_send_beside_waiting_receives_that_fails_returns_a_failed_handle(
        pair, monkeypatch):
    """MPI's Irecv, then Isend on a rank that abort() has hit meanwhile: the send goes out
    beside the batch (neither joining it nor taking the Python path), fails on the wire, and
    returns a handle that has ended with the error (its wait raises Aborted naming the
    send, as Isend's Wait would), rather than raising from the call; the context has failed,
    so the waiting receive's wait says so."""
    joined = _joins(monkeypatch)
    peer_done = threading.Event()

    def body(ctx):
        if ctx.rank == 1:
            peer_done.wait(20)
            return None
        try:
            got = np.zeros(4)
            w = ctx.recv(got, 1, tag=7, async_op=True)
            batch = ctx._runner.batch_alone()
            alone = batch is not None and not batch.on_wire()
            ctx.abort()
            with monkeypatch.context() as m:
                m.setattr(type(ctx), "_send_any", _no_python_path)
                sent = ctx.send(np.arange(4.0), 1, tag=8, async_op=True)
            ended = sent._end.done
            with pytest.raises(pc.Aborted, match="tag 8"):
                sent.wait(5)
            with pytest.raises(pc.Aborted, match="failed earlier"):
                w.wait(5)
            return alone, ended
        finally:
            peer_done.set()

    assert pair.run(body)[0] == (True, True)
    assert not [j for j in joined if not j[0]], joined       # the send joined no batch


def test_polls_of_an_async_receive_move_it_themselves(pair, monkeypatch):
    """MPI's Irecv, then Test in a loop: each poll of a receive parked in the runner moves
    its batch one pass on the polling thread, so the receive ends in a poll.  The runners
    here never run (their thread returns at once): with polls that only woke the runner the
    loop below would never end.  Several rounds, messages of two sizes, both ranks."""
    without_runner(monkeypatch)

    def body(ctx):
        peer, out = 1 - ctx.rank, []
        for i, n in enumerate((3, 3, 5000, 5000)):
            got = np.zeros(n)
            w = ctx.recv(got, peer, tag=i, async_op=True)
            ended_in = []
            w.add_done_callback(lambda _: ended_in.append(threading.current_thread()))
            ctx.send(np.full(n, 10.0 * ctx.rank + i), peer, tag=i)
            deadline, polls = time.monotonic() + 10, 0
            while not w.is_completed() and time.monotonic() < deadline:
                polls += 1
            out.append((w.is_completed(), ended_in == [threading.current_thread()],
                        bool(np.all(got == 10.0 * peer + i))))
        return out

    assert pair.run(body) == [[(True, True, True)] * 4] * 2


def test_a_receive_whose_status_refuses_its_result_fails_alone(pair):
    """An async receive whose ``status`` (any object with ``set``) raises when its message
    comes: that handle raises the error; the receive beside it in the same batch, and the
    context, go on.  Both wait in the runner's batch when their messages come."""
    class Refusing:
        def set(self, source, count, tag):
            raise ValueError("status refused (%d, %d, %d)" % (source, count, tag))

    def body(ctx):
        if ctx.rank == 0:
            ctx.recv(np.zeros(1), 1, tag=9)       # rank 1's receives are posted
            ctx.send(np.full(3, 1.0), 1, tag=1)
            ctx.send(np.full(3, 2.0), 1, tag=2)
            return ctx.allreduce(np.ones(2)).tolist()
        bad, good = np.zeros(3), np.zeros(3)
        works = [ctx.recv(bad, 0, tag=1, async_op=True, status=Refusing()),
                 ctx.recv(good, 0, tag=2, async_op=True)]
        ctx.send(np.zeros(1), 0, tag=9)
        with pytest.raises(ValueError, match=r"status refused \(0, 3, 1\)"):
            works[0].wait(timeout=10)
        status = works[1].wait(timeout=10)
        return (bad.tolist(), good.tolist(), (status.source, status.tag, status.count),
                ctx.allreduce(np.ones(2)).tolist())

    assert pair.run(body) == [[2.0, 2.0], ([1.0] * 3, [2.0] * 3, (0, 2, 3), [2.0, 2.0])]


def test_blocking_sends_after_receives_the_runner_took_up_reach_the_peer(pair):
    """MPI's Irecv, compute, Send, Wait on both ranks: while a rank computes, its runner
    takes up the waiting receive's batch and drives it, holding the context's lock until
    the message comes; the blocking send made then must not wait for that lock (the
    peer's message comes only after the peer's own send) but reach the batch's driver,
    which posts it.  Three rounds, each well within the deadline."""
    def body(ctx):
        peer, took = 1 - ctx.rank, []
        for i in range(3):
            got = np.zeros(4)
            w = ctx.recv(got, peer, tag=7, async_op=True)
            time.sleep(0.3)
            start = time.monotonic()
            ctx.send(np.full(4, float(ctx.rank + i)), peer, tag=7)
            w.wait(20)
            # a lock held until the message came would last until the deadline (30 s)
            took.append(time.monotonic() - start < 10.0 and got[0] == peer + i)
        return took

    assert pair.run(body) == [[True] * 3, [True] * 3]


@pytest.mark.parametrize("count", [1 << 16, 1 << 20], ids=["512KiB", "8MiB"])
def test_large_blocking_sends_beside_waiting_receives_on_both_ranks_at_once(pair, count):
    """MPI's Irecv, Send, Wait on both ranks at the same moment, with messages the channel
    does not take whole at once (over shared memory the peer copies them from the sender's
    memory; over TCP they outgrow the socket's buffers): each send waits for the peer to
    read, which the peer's waiting receive does only when something moves it.  A send
    beside the batch moves nothing, so these sends must join the batch (they timed out at
    the deadline when both went beside).  Three rounds, each checked."""
    together = threading.Barrier(2)

    def body(ctx):
        peer, ok = 1 - ctx.rank, []
        for i in range(3):
            got = np.zeros(count)
            w = ctx.recv(got, peer, tag=4, async_op=True)
            together.wait(10)
            ctx.send(np.full(count, float(10 * ctx.rank + i)), peer, tag=4)
            st = w.wait(20)
            ok.append(st.count == count and got[0] == got[-1] == 10 * peer + i)
        return ok

    assert pair.run(body) == [[True] * 3, [True] * 3]


@pytest.mark.parametrize("compute", [0.0, 0.03], ids=["at-once", "after-computing"])
@pytest.mark.parametrize("probe", ["probe", "iprobe"])
def test_a_probe_after_a_large_async_send_finds_the_peers_message(pair, probe, compute):
    """MPI's Isend, then Probe (or an Iprobe loop), then Recv of the size probed, on both
    ranks at once, with messages the channel does not take whole (8 MiB: over shared
    memory the peer copies them from the sender's memory; over TCP they outgrow the
    sockets' buffers).  A probe queued behind the send's batch waited for the send to end,
    so for the peer's receive, while the peer's own probe waited the same way: Timeout.
    The probe now looks beside the batch, the send staying in flight: at once, beside the
    parked batch; after 30 ms of computing, when the runner has taken the batch up and
    drives it holding the context's lock, after the drive hands the lock over between two
    of its slices."""
    together = threading.Barrier(2)
    count = 1 << 20

    def body(ctx):
        peer, ok = 1 - ctx.rank, []
        for i in range(2):
            together.wait(10)
            sent = ctx.send(np.full(count, float(10 * ctx.rank + i)), peer, tag=3,
                            async_op=True)
            time.sleep(compute)
            if probe == "probe":
                st = ctx.probe(peer, 3, timeout=20)
            else:
                st, end = None, time.monotonic() + 20
                while st is None and time.monotonic() < end:
                    st = ctx.iprobe(peer, 3)
            got = np.zeros(st.count)
            ctx.recv(got, peer, tag=3)
            sent.wait(20)
            ok.append((st.source, st.tag, st.count, got[0] == got[-1] == 10 * peer + i))
        return ok

    assert pair.run(body) == [[(1, 3, count, True)] * 2, [(0, 3, count, True)] * 2]


@pytest.mark.parametrize("count", [4, 1 << 20], ids=["small", "large"])
def test_a_batchs_receive_of_a_small_message_ends_in_the_progress_that_matches_it(pair, count):
    """A batch's receive whose message comes while ``progress`` waits for its head has ended
    when that call returns where the body is small (read as soon as the head is matched,
    Batch._match), with the data in place; a large one, by that call or those that follow."""
    def body(ctx):
        data = np.arange(count, dtype=np.float32)
        if ctx.rank == 1:
            time.sleep(0.2)                 # rank 0's progress waits for the head
            ctx.send(data, 0, tag=6)
            return None
        batch = _p2p.Batch(ctx._transport, _p2p.Mailbox(), 30.0)
        got = np.zeros(count, np.float32)
        r = batch.add_recv(got, 1, 6)
        first = batch.progress(10.0)
        done, start = list(first), time.monotonic()
        while r not in done and time.monotonic() - start < 20:
            done += batch.progress(1.0)
        return first == [r], r in done, bool((got == data).all()), batch.result(r)

    mine = pair.run(body)[0]
    assert mine[1:] == (True, True, (1, count, 6))
    assert mine[0] or count > 4


def test_a_batch_names_an_operation_it_does_not_hold(pair):
    """``Batch.result`` of an index the batch never handed out raises IndexError naming the
    index and the batch's size, instead of reading past its operations."""
    def body(ctx):
        batch = _p2p.Batch(ctx._transport, _p2p.Mailbox(), 30.0)
        messages = []
        for i in (0, -1):
            with pytest.raises(IndexError) as err:
                batch.result(i)
            messages.append(str(err.value))
        ctx.barrier()
        return messages

    assert pair.run(body)[0] == ["batch operation 0 of 0", "batch operation -1 of 0"]


def test_a_kick_ends_a_batchs_wait_for_heads_at_once(pair):
    """A batch waiting for its receive's head for a slice of 5 s returns as soon as another
    thread kicks the transport (what the runner does when an operation is queued while the
    batch is driven), and the receive still gets its message afterwards; a kick made while
    nothing waits ends the next bounded wait, not a blocking receive's."""
    kicked_twice = threading.Event()

    def body(ctx):
        if ctx.rank == 1:
            kicked_twice.wait(20)
            ctx.send(np.full(2, 3.0), 0, tag=4)
            ctx.barrier()
            return None
        batch = _p2p.Batch(ctx._transport, _p2p.Mailbox(), 30.0)
        got = np.zeros(2)
        r = batch.add_recv(got, 1, 4)
        threading.Timer(0.2, ctx._transport.kick).start()
        start = time.monotonic()
        first = batch.progress(5.0)
        kicked = time.monotonic() - start
        ctx._transport.kick()               # nothing waits: kept for the next bounded wait
        start = time.monotonic()
        second = batch.progress(5.0)
        again = time.monotonic() - start
        kicked_twice.set()
        done = []
        while r not in done and time.monotonic() - start < 20:
            done += batch.progress(1.0)
        ctx.barrier()
        return (first, kicked < 2.5, second, again < 2.5, r in done, got.tolist())

    assert pair.run(body)[0] == ([], True, [], True, True, [3.0, 3.0])


def test_an_operation_queued_while_a_batch_is_driven_kicks_the_transport():
    """Runner.submit calls the kick it was given when it queues an operation while a batch
    is in flight and being driven (its drive then takes the operation at once), and not
    otherwise."""
    kicks = []
    runner = Runner(lambda op: None, "test-runner", kick=lambda: kicks.append(1))
    try:
        runner.submit("A", pc.Work("A", None))
        assert kicks == []                  # nothing is driven
        with runner._mutex:
            runner._batch, runner.busy = object(), True
        runner.submit("B", pc.Work("B", None))
        assert kicks == [1]
        with runner._mutex:
            runner.busy = False
        runner.submit("C", pc.Work("C", None))
        assert kicks == [1]                 # a parked batch: its next driver takes it
    finally:
        with runner._mutex:
            runner._batch, runner.busy = None, False
            runner._queue.clear()
            runner.backlog = 0
        runner.stop(5)


@pytest.mark.parametrize("in_group", [False, True])
def test_a_send_beside_waiting_receives_leaves_them_their_own_deadline(pair, in_group):
    """The send beside a batch runs under its own timeout (0.5 s here) and gives the batch
    back the deadline its receives had (the context's 30 s): a message that comes 1.5 s
    later is received, not timed out at the send's deadline.  In a sub-group too, whose
    operations wait on the parent's deadline."""
    def body(top):
        ctx = top.new_group([0, 1]) if in_group else top
        if ctx.rank == 1:
            got = np.zeros(2)
            ctx.recv(got, 0, tag=8)
            time.sleep(1.5)
            ctx.send(np.full(3, 4.0), 0, tag=7)
            ctx.barrier()
            return got.tolist()
        late = np.zeros(3)
        w = ctx.recv(late, 1, tag=7, async_op=True)
        ctx.send(np.ones(2), 1, tag=8, timeout=0.5)
        st = w.wait(20)
        ctx.barrier()
        return late.tolist(), (st.source, st.tag, st.count)

    assert pair.run(body) == [([4.0] * 3, (1, 7, 3)), [1.0, 1.0]]


def test_a_blocking_send_joins_a_batch_that_has_a_send_on_the_wire(pair, monkeypatch):
    """Where the batch in flight has a send of its own not yet done (16 MiB the peer reads
    a second later), a blocking send to the same peer joins the batch instead of going
    beside it (``Batch.on_wire``), and the peer receives the two in the order they were
    sent."""
    joined = _joins(monkeypatch)
    big = np.arange(1 << 21, dtype=np.float64)

    def body(ctx):
        if ctx.rank == 1:
            time.sleep(1.0)
            first, second, st = np.zeros(big.size), np.zeros(3), pc.Status()
            ctx.recv(first, 0, tag=pc.ANY_TAG, status=st)
            order = [st.tag]
            ctx.recv(second, 0, tag=pc.ANY_TAG, status=st)
            order.append(st.tag)
            ctx.send(np.ones(1), 0, tag=9)
            ctx.barrier()
            return order, bool(np.array_equal(first, big)), second.tolist()
        waiting = ctx.recv(np.zeros(1), 1, tag=9, async_op=True)
        sent = ctx.send(big, 1, tag=1, async_op=True)
        batch = ctx._runner.batch_alone()
        on_wire = batch is not None and batch.on_wire()
        ctx.send(np.full(3, 2.0), 1, tag=2)
        pc.wait_all([sent, waiting], timeout=20)
        ctx.barrier()
        return on_wire

    results = pair.run(body)
    assert results[1] == ([1, 2], True, [2.0] * 3)
    assert results[0] is True
    assert (False, True) in joined      # the blocking send joined (wait=True)


@pytest.mark.parametrize("seed", [1, 2])
def test_a_seeded_mix_of_async_and_blocking_sends_and_receives(pair, seed, monkeypatch):
    """400 messages between two ranks (a few of 256 KiB, the rest up to 64 floats), in one
    order both ranks walk: the sender sends each async or blocking; the receiver receives it blocking, or posts an async receive that it
    waits for, polls or finds ended some steps later (so blocking calls meet batches in
    flight and join them, waits leave batches parked, receives begin with their message
    here or not).  Every message arrives whole, with its status, and nothing is left."""
    n = 400
    plan = np.random.default_rng(seed)
    senders = plan.integers(0, 2, n)
    sizes = plan.integers(0, 65, n)
    # One message in twenty is large: over shared memory the peer copies it from the
    # sender's memory and acknowledges it, so its send waits for the receiver.
    sizes[plan.random(n) < 0.05] = 1 << 16
    blocking = plan.random(n) < 0.5
    waits_after = plan.integers(0, 12, n)
    joined = _joins(monkeypatch)

    def body(ctx):
        me, other = ctx.rank, 1 - ctx.rank
        pending, bad = {}, []          # message index -> (handle, buffer)
        sends = []

        def finish(i):
            work, buf = pending.pop(i)
            st = work.wait(20)
            if (st.source, st.tag, st.count) != (other, i, sizes[i]) or \
                    not np.array_equal(buf, np.full(sizes[i], float(i), np.float32)):
                bad.append(i)

        for i in range(n):
            runner = ctx._runner
            if runner is not None and runner.backlog != len(runner._queue) + runner._in_batch:
                bad.append(("backlog", i))
            for j in [j for j in pending if j + waits_after[j] <= i]:
                finish(j)
            if senders[i] == me:
                data = np.full(sizes[i], float(i), np.float32)
                if blocking[i]:
                    ctx.send(data, other, tag=i)
                else:
                    sends.append(ctx.send(data, other, tag=i, async_op=True))
            elif blocking[i]:
                buf = np.zeros(sizes[i], np.float32)
                st = pc.Status()
                ctx.recv(buf, other, tag=i, status=st) if i % 3 == 0 else ctx.recv(buf, other, i)
                if not np.array_equal(buf, np.full(sizes[i], float(i), np.float32)) or \
                        (i % 3 == 0 and (st.source, st.tag, st.count) != (other, i, sizes[i])):
                    bad.append(i)
            else:
                buf = np.zeros(sizes[i], np.float32)
                pending[i] = (ctx.recv(buf, other, tag=i, async_op=True), buf)
                if i % 5 == 0:
                    pending[i][0].is_completed()
        for j in list(pending):
            finish(j)
        pc.wait_all(sends, timeout=20)
        ctx.barrier()
        return bad, all(w.is_completed() for w in sends), ctx._runner.pending()

    assert pair.run(body) == [([], True, 0), ([], True, 0)]
    # Blocking and async calls met batches in flight and joined them.
    waits = [wait for _, wait in joined]
    assert sum(waits) >= 10 and len(waits) - sum(waits) >= 10


_ISEND_AFTER_IRECV = r"""
import json, sys, time
import numpy as np
import pycollect as pc
import pycollect.context
rank, store, transport = int(sys.argv[1]), sys.argv[2], sys.argv[3]
ctx = pc.init(rank=rank, size=2, store=store, timeout=60, transport=transport)
ctx.barrier()
if rank == 0:
    late, data = np.zeros(3), np.full(5, 8.0)
    received = ctx.recv(late, 1, tag=7, async_op=True)     # rank 1 sends it after tag 8
    # This rank's runner thread cannot take the GIL while the main thread computes in
    # Python: the send must leave in the call itself.
    sys.setswitchinterval(30)
    sent = ctx.send(data, 1, tag=8, async_op=True)
    end = time.monotonic() + 3.0
    while time.monotonic() < end:
        pass
    sys.setswitchinterval(0.005)
    st = received.wait()
    sent.wait()
    out = {"late": late.tolist(), "status": [st.source, st.tag, st.count]}
else:
    got = np.zeros(5)
    t0 = time.monotonic()
    ctx.recv(got, 0, tag=8)
    out = {"waited": time.monotonic() - t0, "got": got.tolist()}
    ctx.send(np.full(3, 7.0), 0, tag=7)
ctx.barrier()
ctx.close()
print(json.dumps(out))
"""


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_an_async_send_after_a_waiting_async_receive_leaves_in_the_call(tmp_path, transport):
    """MPI's Irecv, then Isend: rank 0 posts a receive whose message rank 1 sends only after
    it has what rank 0 sends next, async, before computing 3 s in Python with its runner
    kept off the GIL.  The send joins the receive's batch and goes out in the call, so that
    rank 1 has it long before rank 0 computes to the end (it waited for rank 0's next
    call into the library, or its runner, before)."""
    procs = run_script(tmp_path, _ISEND_AFTER_IRECV.replace(
        "sys.argv[3]", repr(transport)), size=2)
    results = last_json(procs, (0, 1), timeout=60)
    assert results[1]["waited"] < 1.5, results
    assert results[1]["got"] == [8.0] * 5, results
    assert results[0] == {"late": [7.0] * 3, "status": [1, 7, 3]}, results


def test_probe_and_iprobe_describe_without_receiving(trio):
    def body(ctx):
        if ctx.rank == 2:
            ctx.send(np.arange(6, dtype=np.int32), 0, tag=4)
            ctx.send(np.arange(2, dtype=np.int32), 0, tag=5)
            return None
        if ctx.rank == 1:
            return None
        seen = None
        for _ in range(2000):       # bounded: the message is on its way
            seen = ctx.iprobe(2, tag=5)
            if seen is not None:
                break
            time.sleep(0.005)
        first = ctx.probe(pc.ANY_SOURCE, tag=4, timeout=10)
        buf = np.zeros(first.count, np.int32)
        ctx.recv(buf, first.source, first.tag)
        rest = np.zeros(seen.count, np.int32)
        ctx.recv(rest, 2, tag=5)
        return (seen.source, seen.tag, seen.count), (first.source, first.tag, first.count), \
            buf.tolist(), rest.tolist(), ctx.iprobe()

    seen, first, buf, rest, none_left = trio.run(body)[0]
    assert seen == (2, 5, 2) and first == (2, 4, 6)
    assert buf == list(range(6)) and rest == [0, 1] and none_left is None


def test_sendrecv_and_sendrecv_replace_around_a_ring(trio):
    def body(ctx):
        n, r = ctx.size, ctx.rank
        got = np.zeros(3)
        st = pc.Status()
        src = ctx.sendrecv(np.full(3, float(r)), (r + 1) % n, got, (r - 1) % n, sendtag=3,
                           recvtag=3, status=st)
        buf = np.full(100_000, float(r))        # larger than the socket buffers
        ctx.sendrecv_replace(buf, (r + 1) % n, (r - 1) % n)
        return src, got[0], st.tag, buf[0], buf[-1]

    for r, (src, got, tag, first, last) in enumerate(trio.run(body)):
        assert src == (r - 1) % 3 and got == (r - 1) % 3 and tag == 3
        assert first == last == (r - 1) % 3


def test_a_message_nobody_received_fails_the_next_collective_on_every_rank():
    g = ThreadGroup(2, timeout=20)
    try:
        def body(ctx):
            if ctx.rank == 0:
                ctx.send(np.ones(2), 1, tag=1)
                ctx.send(np.ones(2), 1, tag=2)
            else:
                ctx.recv(np.zeros(2), 0, tag=2)     # tag 1 waits in the mailbox
            start = time.monotonic()
            try:
                ctx.barrier()
            except pc.Error as exc:
                return type(exc), str(exc), time.monotonic() - start
            return None

        (kind0, text0, t0), (kind1, text1, t1) = g.run(body)
        assert kind1 is pc.MismatchError
        assert "were never received (from rank 0, tag 1, float64 x 16 bytes)" in text1, text1
        assert issubclass(kind0, pc.Error) and "rank 1" in text0, text0
        assert t0 < 10 and t1 < 10      # at once, not at the 20 s deadline
    finally:
        g.close()


@pytest.mark.parametrize("transport", ["tcp", "auto"])
def test_a_message_sent_after_a_collective_that_comes_early_waits_for_its_receive(transport):
    """MPI's unexpected messages: a leaf of a binomial reduce (rank 1, whose partial goes
    straight to the root, rank 2) finishes its part at once and sends rank 0 a message that
    rank 0 receives after the reduce.  It comes while rank 0 still waits in a receive from
    any rank for another tag, which puts it in the mailbox; rank 0's reduce must not count
    it as one left unreceived (it failed with MismatchError), and the receive after the
    reduce takes it.  The message carries the number of the sender's next collective (2)
    and rank 0's reduce is number 1.  A message sent before the collective and left
    unreceived still fails it (the test above)."""
    g = ThreadGroup(3, timeout=20, transport=transport)
    try:
        def body(ctx):
            buf = np.full(4, float(ctx.rank))
            if ctx.rank == 0:
                first = np.zeros(2)
                ctx.recv(first, pc.ANY_SOURCE, tag=1)   # rank 2's, 0.5 s late
                parked = len(ctx._mailbox)
                ctx.reduce(buf, root=2, algorithm="binomial")
                early = np.zeros(3)
                st = pc.Status()
                ctx.recv(early, 1, tag=2, status=st)
                return parked, first.tolist(), buf.tolist(), early.tolist(), st.source
            if ctx.rank == 1:
                ctx.reduce(buf, root=2, algorithm="binomial")
                ctx.send(np.full(3, 7.0), 0, tag=2)
                return buf.tolist()
            time.sleep(0.5)
            ctx.send(np.full(2, 5.0), 0, tag=1)
            ctx.reduce(buf, root=2, algorithm="binomial")
            return buf.tolist()

        results = g.run(body)
    finally:
        g.close()
    assert results[0] == (1, [5.0, 5.0], [0.0] * 4, [7.0] * 3, 1), results
    assert results[1] == [1.0] * 4 and results[2] == [3.0] * 4, results


def test_a_message_that_does_not_fit_its_receive_is_a_mismatch():
    g = ThreadGroup(2, timeout=20)
    try:
        def body(ctx):
            if ctx.rank == 0:
                ctx.send(np.ones(4), 1, tag=1)
                ctx.send(np.ones(4), 1, tag=2)
                return None
            ctx.recv(np.zeros(4), 0, tag=2)         # tag 1 parked in the mailbox
            with pytest.raises(pc.MismatchError, match="tag 1 .float64, 32 bytes. does not "
                                                      "fit this receive .float32, 16 bytes"):
                ctx.recv(np.zeros(4, np.float32), 0, tag=1)
            return None
        g.run(body)
    finally:
        g.close()


@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_a_message_of_another_dtype_and_the_same_size_is_a_mismatch(transport):
    """float64 x 4 into int64 x 4 (32 bytes each): refused by dtype, from the mailbox (tag
    1, parked behind tag 2) and straight off the wire (tag 3), never reinterpreted."""
    g = ThreadGroup(2, timeout=20, transport=transport)
    try:
        def body(ctx):
            if ctx.rank == 0:
                for tag in (1, 2, 3):
                    ctx.send(np.ones(4), 1, tag=tag)
                return None
            ctx.recv(np.zeros(4), 0, tag=2)
            with pytest.raises(pc.MismatchError, match="tag 1 .float64, 32 bytes. does not "
                                                      "fit this receive .int64, 32 bytes"):
                ctx.recv(np.zeros(4, np.int64), 0, tag=1)
            got = np.zeros(4, np.int64)
            with pytest.raises(pc.MismatchError, match=r"send/recv\(int64 x 4, tag 3\) "
                                                      r"disagrees .*\(float64 x 4, tag 3\)"):
                ctx.recv(got, 0, tag=3)
            assert not got.any()
            return None
        g.run(body)
    finally:
        g.close()


def test_a_receive_that_times_out_names_what_came_instead():
    g = ThreadGroup(2, timeout=20)
    try:
        def body(ctx):
            if ctx.rank == 0:
                ctx.send(np.ones(2), 1, tag=1)
                return None
            with pytest.raises(pc.Timeout, match="a receive from rank 0 with tag 3 timed out "
                                                "after 0.5 s; received meanwhile, and not "
                                                "matched: from rank 0, tag 1"):
                ctx.recv(np.zeros(2), 0, tag=3, timeout=0.5)
            return None
        g.run(body)
    finally:
        g.close()


def _receive_failure(size, leaving, receive, split=False):
    """On a group of ``size``, rank ``leaving`` closes its context after 0.2 s while the
    last rank runs ``receive(ctx)`` (``split``: on a sub-group of every rank, from
    ``ctx.split``): the text of the PeerError it raises, and how long it took."""
    g = ThreadGroup(size, timeout=20)
    try:
        def body(ctx):
            on = ctx.split(0) if split else ctx     # every rank, before one leaves
            if ctx.rank == leaving:
                time.sleep(0.2)
                ctx.close()
            if ctx.rank != size - 1:
                return None
            start = time.monotonic()
            with pytest.raises(pc.PeerError) as info:
                receive(on)
            return str(info.value), time.monotonic() - start

        return g.run(body)[size - 1]
    finally:
        g.close()


@pytest.mark.parametrize("form", ["compiled", "status", "async", "sub-group"])
def test_a_receive_whose_peer_leaves_names_the_receive(form):
    # The wait for a head looks at any tag; the error names the receive that waited (on a
    # sub-group, with the group's id).
    def receive(ctx):
        kwargs = {"status": pc.Status()} if form == "status" else {}
        if form == "async":
            ctx.recv(np.zeros(3, np.float32), 0, tag=7, async_op=True).wait()
        else:
            ctx.recv(np.zeros(3, np.float32), 0, tag=7, **kwargs)

    text, seconds = _receive_failure(2, 0, receive, split=form == "sub-group")
    named = "send/recv(float32 x 3, tag 7) " + ("in group " if form == "sub-group" else "")
    assert named in text and "failed: rank 0" in text, text
    assert "closed its connection" in text, text
    assert seconds < 10             # at once, not at the 20 s deadline


def test_async_receives_name_the_one_from_the_rank_that_left():
    # Of an async batch, the receive from the rank that left.
    def receive(ctx):
        pc.wait_all([ctx.recv(np.zeros(3, np.float32), 0, tag=7, async_op=True),
                     ctx.recv(np.zeros(2), 1, tag=8, async_op=True)])

    text, _ = _receive_failure(3, 1, receive)
    assert "send/recv(float64 x 2, tag 8) failed: rank 1" in text, text


@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_wait_all_over_two_contexts_and_a_batch_of_many(transport):
    """One wait_all, without a timeout, over handles of two contexts (two runners) and an
    ended send among them; the batch of one context holds more sends and receives than its
    first storage (they go on past it, and past its first growth), matched out of order:
    every receive gets its own message and status."""
    n = 9
    groups = [ThreadGroup(2, timeout=20, transport=transport) for _ in range(2)]

    def body(rank):
        ctx, other = groups[0].contexts[rank], groups[1].contexts[rank]
        peer = 1 - rank
        got = [np.zeros(tag + 1, np.float32) for tag in range(n)]
        works = [ctx.recv(got[tag], peer, tag=tag, async_op=True) for tag in range(n)]
        works += [ctx.send(np.full(tag + 1, 10.0 * rank + tag, np.float32), peer, tag=tag,
                           async_op=True) for tag in reversed(range(n))]
        aside = np.zeros(2)
        works.append(other.recv(aside, peer, tag=5, async_op=True))
        works.append(other.send(np.full(2, rank + 0.5), peer, tag=5, async_op=True))
        results = pc.wait_all(works)
        statuses = [(s.source, s.tag, s.count) for s in results[:n]]
        return statuses, results[n:2 * n], [g.tolist() for g in got], aside.tolist(), \
            results[-2].tag, results[-1]

    try:
        for rank, (statuses, sent, got, aside, aside_tag, last) in \
                enumerate(run_ranks(2, body, 60)):
            peer = 1 - rank
            assert statuses == [(peer, tag, tag + 1) for tag in range(n)]
            assert sent == [None] * n and last is None
            assert got == [[10.0 * peer + tag] * (tag + 1) for tag in range(n)]
            assert aside == [peer + 0.5] * 2 and aside_tag == 5
    finally:
        for g in groups:
            g.close()
