"""Async handles, receive statuses, and the per-context thread that runs queued operations."""

import collections
import datetime
import itertools
import numbers
import threading

from .errors import Error, InvalidArgument, Timeout

__all__ = ["Work", "Later", "P2P", "Status", "wait_seconds", "wait_all", "wait_any"]

# How long a batch of sends and receives progresses before the runner looks
# for more of them in its queue.
BATCH_SLICE_S = 0.002


def wait_seconds(timeout, what):
    """A wait's ``timeout`` (None, seconds, or a ``datetime.timedelta``) in seconds, or None."""
    if timeout is None:
        return None
    if isinstance(timeout, datetime.timedelta):
        timeout = timeout.total_seconds()
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or timeout != timeout:
        raise InvalidArgument("%s: timeout must be seconds or a datetime.timedelta, got %r"
                              % (what, timeout))
    return max(float(timeout), 0.0)


class P2P:
    """A queued send or receive: consecutive ones run together as one batch."""

    __slots__ = ("is_recv", "buf", "peer", "tag", "new_batch", "result", "timeout", "staged")

    def __init__(self, is_recv, buf, peer, tag, new_batch, result=None, timeout=None,
                 staged=()):
        self.is_recv = is_recv
        self.buf = buf
        self.peer = peer
        self.tag = tag
        self.new_batch = new_batch      # () -> a _p2p.Batch of the context
        self.result = result            # a receive's Later
        self.timeout = timeout          # this call's deadline (None: the batch's)
        self.staged = staged            # tensors staged for a receive, copied back at the end

    def post(self, batch):
        if self.is_recv:
            return batch.add_recv(self.buf, self.peer, self.tag, self.timeout)
        return batch.add_send(self.buf, self.peer, self.tag, self.timeout)

    def finish(self):
        for host in self.staged:
            host.finish()


class Status:
    """What a receive got, as MPI's status: ``source``, ``tag`` and ``count`` (elements).

    Pass one to ``recv(..., status=st)`` to have it filled; an async receive's
    result is one.  It also unpacks and compares as ``(source, count)``.
    """

    __slots__ = ("source", "count", "tag")

    def __init__(self, source=-1, count=0, tag=-1):
        self.source, self.count, self.tag = source, count, tag

    def _fill(self, source, count, tag):
        self.source, self.count, self.tag = source, count, tag
        return self

    def __iter__(self):
        return iter((self.source, self.count))

    def __getitem__(self, i):
        return (self.source, self.count)[i]

    def __len__(self):
        return 2

    def __eq__(self, other):
        if isinstance(other, Status):
            return (self.source, self.count, self.tag) == (other.source, other.count, other.tag)
        return (self.source, self.count) == other

    __hash__ = None

    def __repr__(self):
        return "Status(source=%d, count=%d, tag=%d)" % (self.source, self.count, self.tag)


def wait_all(works, timeout=None):
    """Wait for every handle of ``works``; return their results in order (the first error
    raises).  ``timeout`` bounds the whole wait."""
    from time import monotonic
    seconds = wait_seconds(timeout, "wait_all")
    end = None if seconds is None else monotonic() + seconds
    return [w.wait(None if end is None else max(end - monotonic(), 0.0)) for w in works]


def wait_any(works, timeout=None):
    """Wait until one handle of ``works`` has ended; return (its index, its result), or
    raise its error.  ``timeout`` (seconds or a timedelta) raises ``Timeout`` on expiry."""
    works = list(works)
    if not works:
        raise InvalidArgument("wait_any: no handles to wait for")
    seconds = wait_seconds(timeout, "wait_any")
    ended = threading.Event()
    for w in works:
        if w.is_completed():
            break
        w.add_done_callback(lambda _w: ended.set())
    else:
        if not ended.wait(seconds):
            raise Timeout("wait_any: none of %d operations completed within %g s"
                          % (len(works), seconds))
    for i, w in enumerate(works):
        if w.is_completed():
            return i, w.wait()
    raise Error("wait_any: woken with no operation completed")     # not reached


class Later:
    """A result that the operation itself produces (a receive's Status)."""

    __slots__ = ("value", "status")

    def __init__(self, status=None):
        self.value = None
        self.status = status or Status()      # filled with (source, count, tag)


class Work:
    """The handle of an operation started with ``async_op=True``."""

    __slots__ = ("_done", "_result", "_exception", "_callbacks", "algorithm", "description")

    def __init__(self, description, result):
        self._done = threading.Event()
        self._result = result
        self._exception = None
        self._callbacks = None
        self.algorithm = None
        self.description = description

    def wait(self, timeout=None):
        """Block until the operation ends; return its result or raise its error.

        ``timeout`` (seconds or a ``datetime.timedelta``) bounds this wait only:
        on expiry ``Timeout`` is raised and the operation goes on (its own
        deadline still applies).
        """
        seconds = wait_seconds(timeout, "Work.wait")
        if not self._done.wait(seconds):
            raise Timeout("%s did not complete within %g s" % (self.description, seconds))
        if self._exception is not None:
            raise self._exception
        r = self._result
        return r.value if isinstance(r, Later) else r

    def is_completed(self):
        """True once the operation has ended, successfully or not."""
        return self._done.is_set()

    def exception(self):
        """The error the operation ended with, None if it succeeded or is still running."""
        return self._exception

    def result(self, timeout=None):
        """The operation's output, as ``concurrent.futures.Future.result``: waits for the
        end (at most ``timeout``), then returns the output or raises the operation's error.
        Never hands out an output before it is final."""
        return self.wait(timeout)

    def add_done_callback(self, fn):
        """Call ``fn(work)`` once the operation has ended (at once if it already has).

        ``fn`` runs on the context's runner thread, or on the caller's when the
        operation had already ended; it must not raise.
        """
        if self._callbacks is None:
            self._callbacks = collections.deque()
        self._callbacks.append(fn)
        if self._done.is_set():
            self._run_callbacks()

    def _run_callbacks(self):
        # Each callback is popped, so runs, exactly once, whichever thread gets it.
        callbacks = self._callbacks
        while callbacks:
            try:
                fn = callbacks.popleft()
            except IndexError:
                return
            fn(self)

    def __repr__(self):
        state = ("failed" if self._exception else "done") if self._done.is_set() else "pending"
        return "<pycollect.Work %s %s%s>" % (
            self.description, state, " (%s)" % self.algorithm if self.algorithm else "")

    def _finish(self, algorithm, exception):
        self.algorithm = algorithm
        self._exception = exception
        self._done.set()
        if self._callbacks is not None:
            self._run_callbacks()


class Runner:
    """A daemon thread that runs a context's queued operations.

    Collectives run one at a time, in issue order.  A run of consecutive sends
    and receives runs as one batch, all in flight together (two ranks may each
    send before they receive); sends and receives queued while a batch runs
    join it, and each completes as soon as it is done, in any order (a receive
    when its message, matched by source and tag, has arrived).  A collective
    queued after them starts once they have all completed.
    """

    def __init__(self, execute, name):
        self._execute = execute
        self._queue = collections.deque()
        self._in_batch = 0      # operations taken off the queue by the running batch
        self._cond = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def pending(self):
        """The number of operations queued or running."""
        return len(self._queue) + self._in_batch

    def submit(self, op, work):
        with self._cond:
            if self._stopping:
                raise Error("the context is closed")
            self._queue.append((op, work))
            self._cond.notify()

    def stop(self, timeout):
        """Let queued operations finish (they fail fast once the context is aborted)."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout)

    def _loop(self):
        while True:
            with self._cond:
                while not self._queue and not self._stopping:
                    self._cond.wait()
                if not self._queue:
                    return
                op, work = self._queue[0]
            if isinstance(op, P2P):
                self._run_batch(op.new_batch)
                continue
            algorithm, exception = None, None
            try:
                algorithm = self._execute(op)
            except BaseException as exc:      # handed to the waiter
                exception = exc
            with self._cond:
                self._queue.popleft()
            work._finish(algorithm, exception)

    def _take_p2p(self):
        """The sends and receives at the queue's head, taken off it."""
        with self._cond:
            taken = []
            while self._queue and isinstance(self._queue[0][0], P2P):
                taken.append(self._queue.popleft())
            self._in_batch += len(taken)
            return taken

    def _run_batch(self, new_batch):
        """Run the sends and receives at the head of the queue, and those queued meanwhile."""
        running = {}        # batch index -> (op, work)
        posting = []        # taken, not yet handed to the batch

        def drive(seq):
            batch = new_batch()
            while True:
                posting.extend(self._take_p2p())
                while posting:
                    op, work = posting[0]
                    running[op.post(batch)] = posting.pop(0)
                ended = []
                for i in batch.progress(BATCH_SLICE_S):
                    op, work = running.pop(i)
                    if op.result is not None:
                        op.result.value = op.result.status._fill(*batch.result(i))
                    op.finish()
                    ended.append(work)
                with self._cond:
                    self._in_batch -= len(ended)
                    idle = not running and (
                        not self._queue or not isinstance(self._queue[0][0], P2P))
                for work in ended:
                    work._finish(None, None)
                if idle:
                    return None

        try:
            self._execute((drive, 0, None, None))
        except BaseException as exc:      # fails every operation handed to the batch
            failed = [work for _, work in list(running.values()) + posting]
            with self._cond:
                self._in_batch -= len(failed)
                if not failed and self._queue:
                    # The batch could not start: its first operation gets the error.
                    failed.append(self._queue.popleft()[1])
            for work in failed:
                work._finish(None, exc)
