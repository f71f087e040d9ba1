"""Async handles, and the per-context thread that runs queued operations in order."""

import collections
import datetime
import itertools
import numbers
import threading

from .errors import Error, InvalidArgument, Timeout

__all__ = ["Work", "Later", "P2P", "wait_seconds"]

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

    __slots__ = ("is_recv", "buf", "peer", "tag", "new_batch", "result")

    def __init__(self, is_recv, buf, peer, tag, new_batch, result=None):
        self.is_recv = is_recv
        self.buf = buf
        self.peer = peer
        self.tag = tag
        self.new_batch = new_batch      # () -> a _p2p.Batch of the context
        self.result = result            # a receive's Later

    def post(self, batch):
        if self.is_recv:
            return batch.add_recv(self.buf, self.peer, self.tag)
        return batch.add_send(self.buf, self.peer, self.tag)


class Later:
    """A result that the operation itself produces (a receive's source and count)."""

    __slots__ = ("value",)

    def __init__(self):
        self.value = None


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
    """A daemon thread that runs a context's queued operations in order.

    Collectives run one at a time.  A run of consecutive sends and receives
    runs as one batch, all in flight together (two ranks may each send
    before they receive), and still completes in issue order; sends and
    receives queued while a batch runs join it.
    """

    def __init__(self, execute, name):
        self._execute = execute
        self._queue = collections.deque()
        self._cond = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def pending(self):
        """The number of operations queued or running."""
        return len(self._queue)

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

    def _run_batch(self, new_batch):
        """Run the sends and receives at the head of the queue, and those queued meanwhile."""
        taken = [0]         # operations of the queue's head handed to the batch

        def drive(seq):
            batch = new_batch()
            while True:
                with self._cond:
                    fresh = list(itertools.islice(self._queue, taken[0], None))
                for op, _ in fresh:
                    if not isinstance(op, P2P):
                        break
                    taken[0] += 1
                    op.post(batch)
                done = batch.progress(BATCH_SLICE_S)
                with self._cond:
                    # The queue's head holds the batch's last taken[0] operations;
                    # the first ``done`` of the batch are complete.
                    ended = []
                    while taken[0] and len(batch) - taken[0] < done:
                        ended.append((len(batch) - taken[0], self._queue.popleft()))
                        taken[0] -= 1
                    idle = not taken[0] and (
                        not self._queue or not isinstance(self._queue[0][0], P2P))
                for i, (op, work) in ended:
                    if op.result is not None:
                        op.result.value = batch.result(i)
                    work._finish(None, None)
                if idle:
                    return None

        try:
            self._execute((drive, 0, None, None))
        except BaseException as exc:      # fails every operation handed to the batch
            with self._cond:
                failed = [self._queue.popleft()[1]
                          for _ in range(min(max(taken[0], 1), len(self._queue)))]
            for work in failed:
                work._finish(None, exc)
