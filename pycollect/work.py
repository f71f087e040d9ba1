"""Async handles, and the per-context thread that runs queued operations in order."""

import collections
import threading

from .errors import Error, Timeout

__all__ = ["Work", "Later"]


class Later:
    """A result that the operation itself produces (a receive's source and count)."""

    __slots__ = ("value",)

    def __init__(self):
        self.value = None


class Work:
    """The handle of an operation started with ``async_op=True``."""

    __slots__ = ("_done", "_result", "_exception", "algorithm", "description")

    def __init__(self, description, result):
        self._done = threading.Event()
        self._result = result
        self._exception = None
        self.algorithm = None
        self.description = description

    def wait(self, timeout=None):
        """Block until the operation ends; return its result or raise its error.

        ``timeout`` (seconds) bounds this wait only: on expiry ``Timeout`` is
        raised and the operation goes on (its own deadline still applies).
        """
        if not self._done.wait(timeout):
            raise Timeout("%s did not complete within %g s" % (self.description, timeout))
        if self._exception is not None:
            raise self._exception
        return self.result()

    def is_completed(self):
        """True once the operation has ended, successfully or not."""
        return self._done.is_set()

    def exception(self):
        """The error the operation ended with, None if it succeeded or is still running."""
        return self._exception

    def result(self):
        """The operation's output (the same object wait() returns), once completed."""
        r = self._result
        return r.value if isinstance(r, Later) else r

    def __repr__(self):
        state = ("failed" if self._exception else "done") if self._done.is_set() else "pending"
        return "<pycollect.Work %s %s%s>" % (
            self.description, state, " (%s)" % self.algorithm if self.algorithm else "")

    def _finish(self, algorithm, exception):
        self.algorithm = algorithm
        self._exception = exception
        self._done.set()


class Runner:
    """A daemon thread that runs a context's queued operations one at a time, in order."""

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
            algorithm, exception = None, None
            try:
                algorithm = self._execute(op)
            except BaseException as exc:      # handed to the waiter
                exception = exc
            with self._cond:
                self._queue.popleft()
            work._finish(algorithm, exception)
