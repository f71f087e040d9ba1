"""Async handles, receive statuses, and the per-context thread that runs queued operations.

Compiled, as the call path that begins the operations is (``_call.pyx`` calls the
runner's ``claim``, ``begun``, ``join``... and reads its ``busy`` and ``backlog`` as C):
an MPI exchange of one float (Irecv, Send, Wait) goes through a dozen of these steps,
which as Python functions cost more than the exchange.  ``pycollect/work.py`` is the
module's Python face.  The runner's guard is a ``CallLock`` (``_lock.pyx``): a word the
GIL guards, a semaphore for a thread that finds it held.
"""

cimport cython

from pycollect._ext._doorbell cimport Doorbell
from pycollect._ext._lock cimport CallLock
from pycollect._ext._p2p cimport Batch
from pycollect._ext._record cimport Ring
from cpython.pythread cimport PyThread_get_thread_ident

cdef extern from "<semaphore.h>" nogil:
    int sem_init(sem_t* s, int pshared, unsigned int value)
    int sem_destroy(sem_t* s)
    int sem_wait(sem_t* s)
    int sem_post(sem_t* s)

cdef extern from "<sched.h>" nogil:
    int sched_yield()

import collections
import datetime
import logging
import numbers
import threading
import time

from pycollect.errors import Error, InvalidArgument, Timeout
from pycollect.settings import MAX_TIMEOUT_S

_log = logging.getLogger("pycollect")

__all__ = ["BATCH_SLICE_S", "Completion", "Work", "Later", "P2P", "Runner", "Status",
           "wait_seconds", "wait_all", "wait_any"]

# How long a batch of sends and receives progresses before the runner looks
# for more of them in its queue.
BATCH_SLICE_S = 0.002
cdef double _SLICE_S = BATCH_SLICE_S
cdef double _POST_ONLY = -1.0      # a drive's slice that posts what it takes, and stops


def wait_seconds(timeout, what):
    """A wait's ``timeout`` (None, seconds, or a ``datetime.timedelta``) in seconds, or None."""
    if timeout is None:
        return None
    if isinstance(timeout, datetime.timedelta):
        timeout = timeout.total_seconds()
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or timeout != timeout:
        raise InvalidArgument("%s: timeout must be seconds or a datetime.timedelta, got %r"
                              % (what, timeout))
    if timeout > MAX_TIMEOUT_S:
        raise InvalidArgument("%s: timeout must be at most %d seconds (about 23 days), got %r"
                              % (what, MAX_TIMEOUT_S, timeout))
    return max(float(timeout), 0.0)


@cython.freelist(8)
cdef class Status:
    """What a receive got, as MPI's status: ``source``, ``tag`` and ``count`` (elements).

    Pass one to ``recv(..., status=st)`` to have it filled; an async receive's
    result is one.  It also unpacks and compares as ``(source, count)``.
    """

    def __init__(self, source=-1, count=0, tag=-1):
        self.source, self.count, self.tag = source, count, tag

    cdef Status fill(self, tuple got):
        self.source, self.count, self.tag = got
        return self

    def set(self, source, count, tag):
        """Fill in what a receive got; returns the Status."""
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

    def __hash__(self):
        raise TypeError("unhashable type: 'Status'")

    def __reduce__(self):
        return Status, (self.source, self.count, self.tag)

    def __repr__(self):
        return "Status(source=%d, count=%d, tag=%d)" % (self.source, self.count, self.tag)


cdef object filled(object status, tuple got):
    """``status`` (a ``Status``, or what has its ``set``; None: a new Status) filled with a
    receive's (source, count, tag)."""
    if status is None:
        status = Status.__new__(Status)
    if type(status) is Status:
        return (<Status>status).fill(got)
    return status.set(*got)


@cython.final
@cython.freelist(8)
cdef class Later:
    """A result that the operation itself produces (a receive's Status)."""

    def __init__(self, status=None):
        self.value = None
        self.status = status or Status()      # filled with (source, count, tag)

    @staticmethod
    cdef Later of(object status):
        """``Later(status)`` without Python's call (a receive begun by the call path); its
        ``status`` stays None where none was given, until ``P2P.finish`` fills a new one
        (``filled``)."""
        cdef Later later = Later.__new__(Later)
        later.status = status
        return later


@cython.final
@cython.freelist(8)
cdef class P2P:
    """A queued send or receive: consecutive ones run together as one batch."""

    def __init__(self, is_recv, buf, peer, tag, owner, result=None, timeout=None,
                 staged=()):
        self.is_recv = is_recv
        self.buf = buf
        self.peer = peer
        self.tag = tag
        # The context it belongs to: its batch is ``owner.p2p_batch()`` (a _p2p.Batch on the
        # context's transport and mailbox), driven under ``owner.run_drive``; a runner shared
        # by a context and its sub-groups batches only one context's operations together.
        self.owner = owner
        self.result = result            # a receive's Later
        self.timeout = timeout          # this call's deadline (None: the batch's)
        self.staged = staged            # tensors staged for a receive, copied back at the end

    @staticmethod
    cdef P2P of(bint is_recv, object buf, int peer, int tag, object owner, object result,
                object timeout):
        """``P2P(...)`` without Python's call (the call path's sends and receives)."""
        cdef P2P op = P2P.__new__(P2P)
        op.is_recv, op.buf, op.peer, op.tag = is_recv, buf, peer, tag
        op.owner, op.result, op.timeout, op.staged = owner, result, timeout, ()
        return op

    cpdef Py_ssize_t post(self, Batch batch) except -1:
        if self.is_recv:
            return batch.add_recv(self.buf, self.peer, self.tag, self.timeout)
        return batch.add_send(self.buf, self.peer, self.tag, self.timeout)

    cpdef finish(self, Batch batch, Py_ssize_t index):
        """It ended as operation ``index`` of ``batch``: a receive's result is filled, and
        tensors staged for it are copied back."""
        cdef Later later
        if self.result is not None:
            later = <Later?>self.result
            later.value = filled(later.status, batch.result(index))
        for host in self.staged:
            host.finish()


# Guards the making of a Completion's event.
_EVENT_MADE = threading.Lock()

# What a new Runner's doorbell is made with: a Doorbell, or a subclass of it (tests put one
# here that notes or holds the runner's looks).
doorbell_type = Doorbell


@cython.final
@cython.freelist(8)
cdef class Completion:
    """Whether something has ended (``done``), and a wait for it that makes a
    ``threading.Event`` (microseconds to make) only when it has to block: most ends
    are seen without one.  The handles of this module and of pycollect.torch use it."""

    def __init__(self, done=False):
        self.done = done
        self._event = None

    cdef void set_done(self) except *:
        self.done = True
        event = self._event
        if event is not None:
            event.set()

    def set(self):
        """It has ended: wake every wait."""
        self.set_done()

    def wait(self, seconds=None):
        """Whether it ended within ``seconds`` (None: waits for the end)."""
        if self.done:
            return True
        with _EVENT_MADE:
            event = self._event
            if event is None:
                event = self._event = threading.Event()
        # set() sets done before it looks for the event: either it sees this event, or
        # this look sees done.
        return self.done or event.wait(seconds)


# The Completion of every handle made already ended (Work.ended): done, so no wait makes
# its event and nothing sets it again.
cdef Completion _ENDED = Completion(True)


cdef class BatchOwner:
    """What a batch of sends and receives belongs to: the compiled call path of a context
    (``_call.CallPath``), whose ``run_drive`` the runner calls as C, not through Python's
    call (a wait for an async receive goes through it once)."""

    cpdef object run_drive(self, Runner runner):
        """Drive ``runner``'s batch (``Runner.drive``) under the owner's lock."""
        raise NotImplementedError


@cython.freelist(8)
cdef class Work:
    """The handle of an operation started with ``async_op=True``."""

    def __cinit__(self):
        self._entry = -1

    def __init__(self, description, result):
        self._end = Completion.__new__(Completion)
        self._result = result
        self._exception = None
        self._callbacks = None
        self._runner = None     # the Runner whose queue holds it, once submitted
        self._polled = False    # is_completed() has woken the runner for it
        self.algorithm = None
        self.description = description

    cdef int record_in(self, Ring rec, Py_ssize_t entry) except -1:
        """Its end ends entry ``entry`` of the flight recorder's ``rec`` (with its error),
        before the callbacks run; at once where it has ended already."""
        if self._end.done:
            return rec.end(entry, None, self._exception)
        self._rec = rec
        self._entry = entry
        return 0

    @staticmethod
    cdef Work made_pending(object description, object result):
        """``Work(description, result)`` without Python's call."""
        cdef Work work = Work.__new__(Work)
        work._end = Completion.__new__(Completion)
        work._result = result
        work.description = description
        return work

    @staticmethod
    cdef Work made_ended(object description, object result, object exception):
        cdef Work work = Work.__new__(Work)
        work._end = _ENDED
        work._result = result
        work._exception = exception
        work._polled = True
        work.description = description
        return work

    @classmethod
    def ended(cls, description, result, exception=None):
        """The handle of an operation that ended as it began (a send the channel took at
        once, a receive whose message was here): what ``complete`` would leave, made in
        one step.  For the code that begins operations; not for users."""
        return Work.made_ended(description, result, exception)

    def wait(self, timeout=None):
        """Block until the operation ends; return its result or raise its error.

        ``timeout`` (seconds or a ``datetime.timedelta``) bounds this wait only:
        on expiry ``Timeout`` is raised and the operation goes on (its own
        deadline still applies).

        Without a timeout, a wait for a collective that the context's runner
        thread has not started yet runs it here, on the waiting thread (with
        the collectives queued before it, in their order), instead of waking
        the runner and sleeping until it is done: the same work, without two
        thread wake-ups.
        """
        cdef Completion end = self._end
        if not end.done:
            seconds = None if timeout is None else wait_seconds(timeout, "Work.wait")
            _not_in_callback(self, "Work.wait")
            if self._runner is not None:
                if seconds is None:
                    self._runner._run_while_not(end)
                else:
                    self._runner.hurry()
            if not end.done and not end.wait(seconds):
                raise Timeout("%s did not complete within %g s" % (self.description, seconds))
        elif timeout is not None:
            wait_seconds(timeout, "Work.wait")      # a bad timeout is refused all the same
        return self._outcome()

    cdef object _outcome(self):
        """An ended operation's result, or its error raised."""
        if self._exception is not None:
            raise self._exception
        r = self._result
        return (<Later>r).value if type(r) is Later else r

    def is_completed(self):
        """True once the operation has ended, successfully or not.

        A look at a pending operation lets the context's runner run (it yields the GIL
        and the core for a moment), and the first one wakes the runner for it, as MPI's
        Test progresses a request: a loop that polls while it computes gets the operation
        started at once, not at the runner's next look or after the interpreter's switch
        interval.  An allreduce, broadcast or barrier that this rank posted when it was
        called (the shared-memory flags, or a small exchange of two ranks:
        ``Runner.begun_collective``) ends in the look that finds the peers' posts or the
        peer's message there, on the polling thread; a direct allreduce or allgather begun
        in the call takes its step in the look that finds every peer's hello, and ends in
        the one that finds their releases; a queued call that every peer has entered runs
        in the look (``Runner._run_entered``); a send or receive parked in its batch is
        moved one pass by each look (``Runner._poll_batch``)."""
        if self._end.done:
            return True
        if self._runner is not None:
            self._runner.poll(self, not self._polled)
            self._polled = True
            if self._end.done:
                return True
            # Let the runner have the GIL and the core: a loop of polls would otherwise
            # keep the GIL from it for the interpreter's switch interval (5 ms) at a time.
            # Giving up the GIL alone did not give up the core, so that a runner woken onto
            # the poller's core waited to be scheduled before it could take the GIL
            # (async_wait.py's async+poll: 66 us a call; sched_yield: 11 us).
            with nogil:
                sched_yield()
            return self._end.done
        return False

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

        ``fn`` runs on the thread that ran the operation (the context's runner,
        or a thread that waited for it and ran it itself), or on the caller's
        when the operation had already ended; either way a blocking call of the
        context in it is refused.  An exception it raises is logged (logger
        ``pycollect``) and dropped, so that the thread that ran it goes on.
        """
        if not callable(fn):
            raise InvalidArgument("add_done_callback: %r is not callable" % (fn,))
        if self._callbacks is None:
            self._callbacks = collections.deque()
        self._callbacks.append(fn)
        if self._end.done:
            # Run here, on the caller's thread, as a callback all the same: a blocking call
            # in it is refused as in one the runner runs (whether the handle had ended by
            # now differs between ranks, and ranks that differed would fall out of step).
            self._run_callbacks()

    cdef _run_callbacks(self):
        """Run the callbacks, counted as such on the calling thread by the handle's runner
        (``Runner.in_callback``): until they return, nothing of its queue can run there
        (``_not_in_callback``)."""
        cdef Runner runner = self._runner
        if runner is None:
            self._pop_callbacks()
            return
        runner.callbacks_begin()
        try:
            self._pop_callbacks()
        finally:
            runner.callbacks_end()

    cdef _pop_callbacks(self):
        # Each callback is popped, so runs, exactly once, whichever thread gets it.
        callbacks = self._callbacks
        while callbacks:
            try:
                fn = callbacks.popleft()
            except IndexError:
                return
            try:
                fn(self)
            except Exception:
                _log.exception("a done callback of %r raised", self)

    def __repr__(self):
        state = ("failed" if self._exception else "done") if self._end.done else "pending"
        return "<pycollect.Work %s %s%s>" % (
            self.description, state, " (%s)" % self.algorithm if self.algorithm else "")

    cpdef ends_with(self, Work inner):
        """This handle ends when ``inner`` does (a context's handle completed by another's
        callback, as a number's by its array's): a wait on it runs ``inner``'s runner, and
        is refused in that runner's callbacks, as a wait on ``inner`` would be.  For the
        code that makes such handles; not for users."""
        self._runner = inner._runner

    cpdef complete(self, object algorithm=None, object exception=None):
        """End the operation: its algorithm's name, or the error it failed with.  For the
        code that ran it (the context's runner, a waiter, or a context whose handle ends
        with another's); not for users."""
        self.algorithm = algorithm
        self._exception = exception
        self._end.set_done()
        if self._entry >= 0:
            self._rec.end(self._entry, None, exception)
        if self._callbacks is not None:
            self._run_callbacks()


cdef int _not_in_callback(Work work, str what) except -1:
    """Refuse to wait for ``work``, not ended, in a done callback that runs on the thread
    that runs ``work``'s runner: it could never end (the thread would wait for itself)."""
    if work._runner is not None and work._runner.in_callback():
        raise InvalidArgument(
            "%s: %s has not ended, and cannot while this done callback runs: callbacks run "
            "on the thread that runs the context's operations; wait for it outside the "
            "callback, or add a callback to it" % (what, work.description))
    return 0


cdef inline bint _ended(object work) except -1:
    """Whether ``work`` has ended, read without the side effect of ``is_completed`` (which
    wakes the runner for a pending operation)."""
    if type(work) is Work:
        return (<Work>work)._end.done
    end = getattr(work, "_end", None)
    return end.done if end is not None else work.is_completed()


def wait_all(works, timeout=None):
    """Wait for every handle of ``works``; return their results in order (the first error
    raises).  ``timeout`` bounds the whole wait."""
    cdef dict last = None
    cdef object first = None, first_work = None
    cdef list results
    works = _handles(works, "wait_all")
    for w in works:
        if type(w) is Work and not (<Work>w)._end.done:
            _not_in_callback(<Work>w, "wait_all")
    if timeout is None:
        # Run what each context's queue holds up to the last of its handles here, on
        # this thread, first: a wait for the first alone would hand the rest to the
        # runner when it returns (Runner._done_running), and each later wait would then
        # sleep until the runner had run its own.  (One runner, the common case, needs
        # no dict.)
        for w in works:
            if not _ended(w):
                runner = (<Work>w)._runner if type(w) is Work else getattr(w, "_runner", None)
                if runner is None:
                    continue
                if first is None or runner is first:
                    first, first_work = runner, w
                else:
                    if last is None:
                        last = {}
                    last[runner] = w
        if first is not None:
            _run_until(first, first_work)
            if last is not None:
                for runner, w in last.items():
                    _run_until(runner, w)
        results = []
        for w in works:
            if type(w) is Work and (<Work>w)._end.done:
                results.append((<Work>w)._outcome())
            else:
                results.append(w.wait())
        return results
    end = time.monotonic() + wait_seconds(timeout, "wait_all")
    return [w.wait(max(end - time.monotonic(), 0.0)) for w in works]     # each hurries


cdef list _handles(object works, str what):
    """``works`` as a list (an iterator is read once), each an async call's handle."""
    try:
        handles = list(works)
    except TypeError:
        raise InvalidArgument("%s: expected handles (an iterable of what async_op=True "
                              "calls return), got %r" % (what, works)) from None
    for w in handles:
        if not (callable(getattr(w, "wait", None)) and callable(getattr(w, "is_completed",
                                                                        None))):
            raise InvalidArgument("%s: %r is not the handle of an async call" % (what, w))
    return handles


cdef inline _run_until(object runner, object work):
    """``runner.run_until(work)``, as C where both are this module's (as ``Work.wait`` runs
    its runner's queue)."""
    if isinstance(runner, Runner) and type(work) is Work:
        (<Runner>runner)._run_while_not((<Work>work)._end)
    else:
        runner.run_until(work)


def wait_any(works, timeout=None):
    """Wait until one handle of ``works`` has ended; return (its index, its result), or
    raise its error.  ``timeout`` (seconds or a timedelta) raises ``Timeout`` on expiry."""
    works = _handles(works, "wait_any")
    if not works:
        raise InvalidArgument("wait_any: no handles to wait for")
    seconds = wait_seconds(timeout, "wait_any")
    pending = [w for w in works if not _ended(w)]
    if len(pending) == len(works) and all(
            type(w) is Work and (<Work>w)._runner is not None
            and (<Work>w)._runner.in_callback() for w in pending):
        _not_in_callback(pending[0], "wait_any")    # none of them could end
    if not any(_ended(w) for w in works):
        # As Work.wait does: without a timeout, run what each context's queue holds on
        # this thread, in order, until one of these handles has ended; with one, have
        # the runners run it now.  Either way, not at the runner's next look.
        by_runner = {}
        for w in works:
            runner = getattr(w, "_runner", None)
            if runner is not None:
                by_runner.setdefault(runner, []).append(w)
        for runner, mine in by_runner.items():
            if seconds is not None:
                runner.hurry()
            else:
                runner.run_until_any(mine)
                if any(_ended(w) for w in works):
                    break
    if not any(_ended(w) for w in works):
        ended = threading.Event()
        for w in works:
            if _ended(w):
                break
            w.add_done_callback(lambda _w: ended.set())
        else:
            if not ended.wait(seconds):
                raise Timeout("wait_any: none of %d operations completed within %g s"
                              % (len(works), seconds))
    for i, w in enumerate(works):
        if _ended(w):
            return i, w.wait()
    raise Error("wait_any: woken with no operation completed")     # not reached


@cython.final
cdef class _AnyEnded:
    """Whether one of some handles has ended, read as a Completion's ``done``."""

    cdef list ends

    def __init__(self, works):
        self.ends = [w._end for w in works]

    @property
    def done(self):
        cdef Completion end
        for end in self.ends:
            if end.done:
                return True
        return False


cdef Completion _ONE_PASS = Completion(True)   # a drive's end that has come: one pass


cdef inline bint _done(object until) except -1:
    """An end's ``done``: a Completion's read as C."""
    if type(until) is Completion:
        return (<Completion>until).done
    return until.done


cdef class Runner:
    """A daemon thread that runs a context's queued operations.

    Collectives run one at a time, in issue order.  A run of consecutive sends
    and receives runs as one batch, all in flight together (two ranks may each
    send before they receive); sends and receives queued while a batch runs
    join it, and each completes as soon as it is done, in any order (a receive
    when its message, matched by source and tag, has arrived).  A collective
    queued after them starts once they have all completed, unless they are all
    receives that wait for their messages: the collective then runs beside them
    (``_beside_head``), as MPI's collectives run while an Irecv waits.

    A thread that waits for a queued operation may run it itself
    (``run_until``): while nothing runs, it takes what is at the head of the
    queue, in order, up to the operation it waits for (a batch: until that one
    has ended; what the batch still has in flight then goes back to the
    runner).  One operation (or one batch) runs at a time, whichever thread
    runs it: ``busy`` says one does, and the next is taken only once the last
    has ended and its handle has been completed.  The thread sleeps on a
    ``Doorbell`` (pycollect/_ext/_doorbell.pyx), which wakes it for an operation
    only when no waiter has taken it for a while, or when a waiter hands it
    what it left.  Woken while another thread runs an operation, it waits for
    that one's end and no longer: what that thread hands over it runs, else it
    goes back to the doorbell.

    A context and its sub-groups share one runner (``Context._group``), so that their
    async calls, like their blocking ones, run in the order each rank made them: one
    queue, whatever context each operation is of.  ``execute(op)`` runs a queued
    collective (unless ``submit`` was given the operation's own); a batch holds the sends
    and receives of one context (``P2P.owner``), driven under that context's
    ``run_drive(runner)`` (the compiled ``CallPath.run_drive``, which runs ``Runner.drive``
    under the context's lock).
    """

    def __cinit__(self):
        self._handoff_made = False

    def __init__(self, execute, name, kick=None, CallLock wanted=None):
        self._execute = execute
        # The context's lock, which the runner's drive of a batch holds: where another
        # thread waits for it, the drive ends between two slices and leaves the batch
        # parked, to take it up again at its next look (a probe beside the batch waits for
        # the lock so: CallPath._probe_beside_batch).
        self._wanted = wanted
        self._yielded = False   # the last drive ended so
        # Called (from the submitting thread) when an operation is queued while a batch is
        # driven: the drive's wait for its receives' heads returns now and it takes the
        # operation, instead of at the end of its slice (the transport's kick).
        self._kick = kick
        self._queue = collections.deque()
        self._callback_threads = {}
        self._in_batch = 0      # operations taken off the queue by the running batch
        # Operations queued or in the batch (len(_queue) + _in_batch), kept as one number
        # that the compiled call path reads before each blocking call.
        self.backlog = 0
        # An operation or batch is running, on some thread, or a thread holds a claim
        # (the compiled call path reads it, with backlog, before it runs a call itself
        # under the context's lock).
        self.busy = False
        self._batch = None      # the batch of sends and receives in flight, between drivers
        self._batch_owner = None    # ... the context whose operations it holds
        # ... its operations: entry i is (op, work, None) for the batch's operation i, None
        # once it has ended; _n_running of them have not
        self._batch_ops = []
        self._n_running = 0
        self._posting = []      # ... taken off the queue, not yet posted to it
        self._parked = False    # ... begun on a caller's thread (claim), with a doorbell
                                # token for whoever drives it next
        self._begun = 0         # collectives at the head of the queue that callers'
                                # threads posted (begun_collective), not yet taken
        self._alone = False     # the one begun stands alone: none may be begun behind it
        self._mutex = CallLock()    # guards the queue, busy and _in_batch
        if sem_init(&self._handoff, 0, 0) != 0:
            raise MemoryError()
        self._handoff_made = True
        self._runner_waits = False      # the runner waits for busy to end (on _handoff)
        self._handed = False            # ... and is handed what a waiter left
        self.notified = 0
        self._bell = doorbell_type()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def __dealloc__(self):
        if self._handoff_made:
            sem_destroy(&self._handoff)

    cpdef Py_ssize_t pending(self):
        """The number of operations queued or running."""
        return self.backlog

    cpdef bint in_callback(self) except -1:
        """Whether the calling thread runs a done callback of this runner's handles: the
        thread that runs the runner's operations, so that none of them can run until it
        returns, or a waiter that ended one, or a caller whose handle had ended already
        (add_done_callback).  A blocking call there is refused alike on every rank, whichever
        thread ran the callback."""
        return (self._callbacks_running != 0
                and PyThread_get_thread_ident() in self._callback_threads)

    cdef int callbacks_begin(self) except -1:
        """The calling thread starts running done callbacks (with the GIL: each thread's
        count changes under it, whatever other threads run callbacks meanwhile)."""
        ident = PyThread_get_thread_ident()
        self._callback_threads[ident] = self._callback_threads.get(ident, 0) + 1
        self._callbacks_running += 1
        return 0

    cdef int callbacks_end(self) except -1:
        """... and has run them (``callbacks_begin``)."""
        ident = PyThread_get_thread_ident()
        left = self._callback_threads[ident] - 1
        if left:
            self._callback_threads[ident] = left
        else:
            del self._callback_threads[ident]
        self._callbacks_running -= 1
        return 0

    cpdef submit(self, object op, Work work, object execute=None):
        """Queue ``op`` (a send or receive: a ``P2P``; else a collective, which
        ``execute(op)`` runs where given, the runner's ``execute`` otherwise), ``work`` its
        handle."""
        cdef bint kick
        self._mutex.take()
        if self._stopping:
            self._mutex.give()
            raise Error("the context is closed")
        work._runner = self
        self._queue.append((op, work, execute))
        self.backlog += 1
        kick = self.busy and self._batch is not None and self._kick is not None
        self._mutex.give()
        self._bell.queue()
        if kick:
            self._kick()

    def stop(self, timeout):
        """Let queued operations finish (they fail fast once the context is aborted)."""
        self._mutex.take()
        self._stopping = True
        self._notify_runner(False)
        self._mutex.give()
        self._bell.stop()
        self._thread.join(timeout)

    cdef void _notify_runner(self, bint handed) noexcept:
        """Under the mutex: end the runner's wait for busy to end, where it waits, handing
        it what a waiter left (``handed``)."""
        if self._runner_waits:
            self._runner_waits = False
            self._handed = handed
            self.notified += 1
            sem_post(&self._handoff)

    cpdef bint claim(self) except -1:
        """Let the calling thread run an operation itself, now, if nothing is queued, in
        flight or running: True if it may, and it then ends the claim with ``begun`` (or
        ``unclaim``).  Async sends and receives on arrays begin this way
        (pycollect/_ext/_call.pyx), as MPI's Isend and Irecv: posted and moved once on the
        caller's thread, a small send, or a receive whose message is here, has ended when
        the call returns."""
        self._mutex.take()
        if self.busy or self._queue or self._batch is not None or self._stopping:
            self._mutex.give()
            return False
        self.busy = True
        self._mutex.give()
        return True

    cpdef bint claim_post(self, Py_ssize_t limit) except -1:
        """``claim`` for a collective that the calling thread begins without waiting
        (``begun_collective``): it may also while the queue holds nothing but the ends of
        fewer than ``limit`` collectives begun that way, behind which the new one's end
        then goes, and the one begun last does not stand alone (``begun_collective``).
        The caller ends the claim with ``begun_collective`` or ``unclaim(hurry=False)``."""
        self._mutex.take()
        if (self.busy or len(self._queue) != self._begun or self._begun >= limit
                or self._alone or self._batch is not None or self._stopping):
            self._mutex.give()
            return False
        self.busy = True
        self._mutex.give()
        return True

    cpdef unclaim(self, bint hurry=True):
        """End a claim under which nothing was left in flight; ``hurry``: wake the runner
        for what is queued (nothing, after ``claim``; the ends of posted collectives may
        be, after ``claim_post``, and they wait for their next driver as before)."""
        self._done_running(not hurry)

    cpdef Work begun(self, P2P op, object description, object batch, Py_ssize_t index):
        """End a claim under which the calling thread began the send or receive ``op`` (a
        ``P2P``) as operation ``index`` of ``batch``, still in flight; return its handle,
        parked for the next driver (the wait that follows, or the runner when it stays
        untaken from one look of the doorbell to the next: the runner is not woken now, it
        would take the operation from under that wait).  One that ended or failed at once
        ends its claim with ``unclaim`` and gets a ``Work.ended`` handle instead."""
        cdef Work work = Work.made_pending(description, op.result)
        work._runner = self
        self._mutex.take()
        self._batch = batch
        self._batch_owner = op.owner
        self._hold(index, (op, work, None))
        self._in_batch += 1
        self.backlog += 1
        self._mutex.give()
        self._done_running(False, True)
        return work

    cpdef object batch_alone(self):
        """The batch of sends and receives in flight, where nothing is queued behind it
        (and nothing taken from the queue waits to be posted to it), else None: a blocking
        send may then go out beside it, on the caller's thread, where the batch has nothing
        of its own on the wire (``_p2p.send_beside``)."""
        self._mutex.take()
        batch = None if self._queue or self._posting else self._batch
        self._mutex.give()
        return batch

    cpdef bint claim_batch(self, object owner) except -1:
        """Let the calling thread add a send or receive of the context ``owner`` to the
        batch in flight (``join``) when it is that context's and nothing is queued or
        running: True if it may (the batch is its to drive until ``join`` returns), False
        otherwise (the caller queues the operation)."""
        self._mutex.take()
        if (self.busy or self._queue or self._batch is None or self._stopping
                or self._batch_owner is not owner):
            self._mutex.give()
            return False
        try:
            self._take_next()               # the batch: busy now, unparked
        finally:
            self._mutex.give()
        return True

    cpdef Work join(self, P2P op, object description, bint wait):
        """Under ``claim_batch``: post the send or receive ``op`` (a ``P2P``) to the batch in
        flight and drive the batch on the calling thread (completing whatever of it ends
        meanwhile): until ``op`` has ended where the caller ``wait``s for it (a blocking
        call), else, for an async send, for one pass, as an async call begun when nothing
        was in flight moves once (its send goes out now, not at the next wait); an async
        receive is posted only (MPI's Irecv: its message is matched by the next look, wait
        or pass of the batch, as the batch's other receives are); what is left in flight
        stays parked for the next driver.  Its handle."""
        cdef Work work
        try:
            work = Work.made_pending(description, op.result)
            work._runner = self
        except BaseException:
            self._done_running(False, True)      # the claim ends; the batch as it was
            raise
        self._mutex.take()
        self._in_batch += 1
        self.backlog += 1
        self._mutex.give()
        self._posting.append((op, work, None))
        self._run_next(None, work._end if wait else _ENDED,
                       _SLICE_S if wait else _POST_ONLY if op.is_recv else 0.0)
        return work

    cpdef begun_collective(self, object op, Work work, bint alone=False):
        """End a claim (``claim_post``) under which the calling thread posted the
        collective ``op`` (an allreduce, broadcast or barrier through the shared-memory
        flags, begun without waiting) that has not ended: its end goes into the queue
        behind the ends of those posted before it, ahead of anything else, for the next
        driver: the wait that follows, a poll that finds the peers' posts there
        (``op.ends_at_once()`` says so: ``poll``), or the runner at its next look (not
        woken now, as for a queued operation).  ``alone``: nothing may be begun behind it
        until its end is taken (a direct allreduce or allgather, whose later messages and
        staging block another one begun would get in the way of)."""
        work._runner = self
        self._mutex.take()
        self._alone = alone
        # Behind the ends posted before it, ahead of whatever another thread queued
        # since the claim (numbered when it runs: after this one).
        self._queue.insert(self._begun, (op, work, None))
        self.backlog += 1
        self._begun += 1
        # The claim ends as _done_running(goes_on=True) ends it, in the same hold of
        # the mutex: a runner that waits for it is told, and nothing is handed to it.
        self.busy = False
        self._notify_runner(False)
        self._mutex.give()
        self._bell.queue()

    def poll(self, Work work, bint first):
        """``is_completed``'s look at ``work``, pending.  Where a caller's thread began its
        collective (``begun_collective``: posted to the flag area, or a small exchange of
        two ranks), end it here, and the begun ones before it, one by one while nothing
        runs and the one at the head waits for nobody (every peer has posted it, or the
        peer's message has come: ``Queued.ends_at_once``), as MPI's Test completes a
        request whose peers are there; a direct allreduce or allgather begun in steps at
        the head takes its next step where the peers' messages for it have come
        (``Queued.advance``), once a look; the runner is left to its next look.  A queued
        call at the head that every peer has entered runs here (``_run_entered``).
        Anything else (queued, or begun where a look cannot tell: a broadcast's root, a
        large exchange): wake the runner for it on the first look (``first``)."""
        cdef bint posted = False, stepped = False
        cdef Py_ssize_t n, i
        ready = False
        while True:
            step = None
            self._mutex.take()
            try:
                n = self._begun
                if not n:
                    break
                head = self._queue[0]
                posted = head[1] is work
                i = 1
                while not posted and i < n:
                    posted = self._queue[i][1] is work
                    i += 1
                if not posted or self.busy:
                    break
                ready = head[0].ends_at_once()
                if not ready:
                    if stepped:
                        break
                    step = head[0]
            finally:
                self._mutex.give()
            if step is not None:
                # A direct call begun in steps moves one where the peers' messages
                # are there (``advance``, under the context's lock, not this mutex:
                # it reduces); its end may be there at once.
                stepped = True
                if not step.advance():
                    break
                continue
            self._run_while_not((<Work>head[1])._end)
            if work._end.done:
                return
        if not posted and (self._poll_batch(work) or self._run_entered(work)):
            return
        if first and (not posted or ready is None):
            self._bell.hurry()      # queued, or begun as an exchange: the runner ends it

    cdef bint _run_entered(self, Work work) except -1:
        """``poll``'s look at a queued collective at the head of the queue (nothing running,
        begun or in flight): where every peer has entered it already (``op.peers_entered()``:
        each peer's next message is of it), run it on the polling thread, as a wait would:
        it waits only for the peers' parts, and the runner's hand-off (a wake, the GIL to
        and fro, the core shared with the poller) costs more than the operation.  Whether
        it ran."""
        self._mutex.take()
        try:
            if (self.busy or self._begun or self._batch is not None or not self._queue
                    or self._posting or self._queue[0][1] is not work
                    or (self._wanted is not None and self._wanted.held)):
                return False
            op = self._queue[0][0]
        finally:
            self._mutex.give()
        try:
            entered = op.peers_entered
        except AttributeError:      # not a compiled call
            return False
        if not entered():
            return False
        self._run_while_not(work._end)
        return True

    cpdef bint move_batch(self) except -1:
        """One pass of the parked batch on the calling thread, as ``_poll_batch`` makes for
        any of its operations: after a collective run beside the batch handed messages to
        its receives (``CallPath.run``), their handles end now rather than at the next look
        or wait.  Whether it ran."""
        return self._poll_batch(None)

    cdef bint _poll_batch(self, Work work) except -1:
        """``poll``'s look at a send or receive of the parked batch (nothing running, queued
        or being posted, the context's lock free): one pass of the batch on the polling
        thread (``drive`` with an end that has come: it stops after its first pass), as
        MPI's Test progresses a request; what is left stays parked for the next look, a
        wait, or the runner.  Whether it ran (else the runner is woken as before).  ``work``
        None: for whichever operations of the batch end."""
        cdef tuple entry
        cdef bint mine = work is None
        self._mutex.take()
        try:
            if (self.busy or self._batch is None or self._queue or self._posting
                    or (self._wanted is not None and self._wanted.held)):
                return False
            if not mine:
                for entry in self._batch_ops:
                    if entry is not None and entry[1] is work:
                        mine = True
                        break
            if not mine:
                return False
            head = self._take_next()
        finally:
            self._mutex.give()
        self._run_next(head, _ONE_PASS, 0.0)
        return True

    def hurry(self):
        """A thread that waits with a timeout, so does not run the queue itself (a
        collective it ran could outlast the wait), wants the runner to run it now rather
        than at its next look."""
        self._bell.hurry()

    cpdef run_until(self, Work work):
        """Run what is at the head of the queue on the calling thread, in order, until
        ``work`` has ended: collectives one by one, and the batch of sends and receives
        (those at the head, posted together) until ``work`` has ended or the batch has
        nothing left in flight; what it still has in flight then goes back to the runner
        (a receive may wait for a message that the caller's later calls bring about).
        Gives up, leaving the rest to the runner, as soon as an operation is running
        elsewhere."""
        self._run_while_not(work._end)

    def run_until_any(self, works):
        """``run_until`` for whichever of ``works`` (handles of this runner) ends first."""
        self._run_while_not(_AnyEnded(works))

    cdef _run_while_not(self, object until):
        """run_until's steps; ``until``: what must end (its ``done``)."""
        while not _done(until):
            self._mutex.take()
            # Not running and not ended, so still queued or in the batch: a handle is
            # completed before busy is cleared.
            if self.busy or _done(until) or not (self._queue or self._batch is not None):
                self._mutex.give()
                return
            try:
                head = self._take_next()
            finally:
                self._mutex.give()
            self._run_next(head, until, _SLICE_S)

    cdef object _take_next(self):
        """Take what runs next (under the mutex, with nothing running and something queued
        or in flight): the collective at the head, as (op, work), or None for the batch."""
        self.busy = True
        if self._parked:
            self._parked = False
            self._bell.take()
        if self._batch is not None:
            if not self._beside_head():
                return None
        elif type(self._queue[0][0]) is P2P:
            return None
        self._bell.take()
        if self._begun:
            self._begun -= 1        # the head is the oldest posted collective's end
            if not self._begun:
                self._alone = False
        return self._queue[0]

    cdef bint _beside_head(self) except -1:
        """Under the mutex, with the batch in flight and nothing running: whether the
        collective at the head of the queue runs now, beside the batch, as MPI's collectives
        run while an Irecv waits, instead of once the batch has ended: it is of the batch's
        context, the batch's operations are receives that wait for their messages (nothing
        of the batch on the wire, nothing taken to be posted to it), and that context may
        run it so (``CallPath.may_stash_beside``: its transport reads aside the messages
        the collective meets).  The peer may send what those receives wait for only after
        its part of the collective."""
        cdef object execute
        if not self._queue or self._posting or self._batch is None:
            return False
        op, work, execute = self._queue[0]
        if type(op) is P2P or type(op) is tuple and not op[1]:
            return False        # a send or receive; or an item that numbers no collective
                                # (monitored_barrier: its own sends and receives)
        # Its context: a compiled call's own (a Queued's ``ctx``: it is queued without an
        # ``execute``, and the runner's default is the parent's where the runner is shared
        # with sub-groups), else the one whose ``execute`` runs it.
        owner = getattr(op, "ctx", None)
        if owner is None:
            owner = getattr(self._execute if execute is None else execute, "__self__", None)
        if owner is not self._batch_owner:
            return False
        return (self._batch.matches_heads() and not self._batch.on_wire()
                and self._batch_owner.may_stash_beside())

    cdef _run_next(self, object head, object until, double slice_s):
        """Run what ``_take_next`` took, then let the next operation start; ``until``: the
        end a waiter waits for (its ``done``), None on the runner."""
        cdef bint leaves
        try:
            if head is not None:
                self._run_head(head)
            else:
                self._run_batch(until, slice_s)
        finally:
            leaves = until is not None and _done(until) or self._yielded
            # A waiter leaves what its batch still has in flight parked, as ``begun`` does:
            # for the wait that usually follows at once (an exchange's receive after its
            # send), else for the runner at its next look; so does the runner that handed
            # the lock to a thread waiting for it.
            self._done_running(not leaves, leaves and self._batch is not None)

    cdef _run_head(self, object head):
        """Run the collective at the head of the queue, ``(op, work)`` (taken, and ``busy``
        set, by the caller), take it off and complete its handle."""
        op, work, execute = head
        algorithm, exception = None, None
        if execute is None:
            execute = self._execute
        try:
            if self._batch is not None:     # beside the batch (_beside_head)
                algorithm = self._batch_owner.run_beside(execute, op, self._batch)
            else:
                algorithm = execute(op)
        except BaseException as exc:      # handed to the waiter
            exception = exc
        self._mutex.take()
        self._queue.popleft()
        self.backlog -= 1
        self._mutex.give()
        (<Work>work).complete(algorithm, exception)

    cdef _done_running(self, bint goes_on, bint park=False):
        """Let the next operation start.  ``goes_on``: the thread that ran this one takes
        the next itself (the runner; a waiter whose own operation has not ended).  What a
        waiter that leaves (``goes_on`` false) left queued, or in flight in the batch,
        goes to the runner at once, not at its next look: a thread that found the
        operation running waits for the runner to run its own.  ``park`` (``begun``): the
        batch left in flight goes to the runner at its next look instead, as a queued
        operation would."""
        cdef bint hurry, token
        self._mutex.take()
        self.busy = False
        if not (park or self._runner_waits or self._queue or self._batch is not None):
            self._mutex.give()
            return      # nothing left, nobody to tell (a claim ended: the common case)
        hurry = not goes_on and (self._queue or self._batch is not None)
        token = park and not self._parked
        if park:
            self._parked = True
            hurry = bool(self._queue)   # queued meanwhile, behind the parked batch
        if self._runner_waits:
            # The runner found this busy and waits for its end: it takes what is
            # handed to it at once, else goes back to its doorbell's looks.
            self._notify_runner(hurry)
            hurry = False
        self._mutex.give()
        if token:
            self._bell.queue()
        if hurry:
            self._bell.hurry()

    def _loop(self):
        cdef bint stopped = False
        cdef bint at_once = False   # the runner just ran an operation, or one was handed to it
        while True:
            if at_once:
                self._mutex.take()
                at_once = (self._queue or self._batch is not None) and not self.busy
                self._mutex.give()
            if not at_once:     # else what was queued behind the last operation runs now
                stopped = self._bell.sleep()
            self._mutex.take()
            if self.busy:
                # Another thread runs an operation: wait for its end, once.  It hands
                # over what it leaves (_done_running); else the runner goes back to
                # the doorbell, which wakes it only for an operation left untaken from
                # one look to the next (a batch parked for its waiter among them).
                # Waiting on through the busy thread's later operations would have
                # each of them wake this thread.
                self._runner_waits = True
                self._mutex.give()
                with nogil:
                    while sem_wait(&self._handoff) != 0:    # EINTR: a signal came
                        pass
                self._mutex.take()
                at_once, self._handed = self._handed, False
                self._mutex.give()
                continue
            if not self._queue and self._batch is None:
                self._mutex.give()
                if stopped:
                    return
                at_once = False
                continue
            try:
                head = self._take_next()
            finally:
                self._mutex.give()
            self._run_next(head, None, _SLICE_S)
            at_once = not self._yielded     # a yielded batch waits for the next look
            self._yielded = False

    cdef list _take_p2p(self, object owner):
        """The sends and receives of the context ``owner`` at the queue's head, taken off
        it."""
        cdef list taken = []
        if not self._queue:
            return taken
        self._mutex.take()
        try:
            while (self._queue and type(self._queue[0][0]) is P2P
                   and (<P2P>self._queue[0][0]).owner is owner):
                taken.append(self._queue.popleft())
                self._bell.take()
            self._in_batch += len(taken)
        finally:
            self._mutex.give()
        return taken

    def drive_as_queued(self, seq):
        """``drive`` as a queued item runs it (``(fn, seq, ...)``: the context's
        ``_execute``, which says why a closed or failed context does not)."""
        return self.drive()

    cdef int _hold(self, Py_ssize_t index, tuple entry) except -1:
        """Operation ``index`` of the batch runs: its (op, work, None)."""
        cdef list ops = self._batch_ops
        while len(ops) <= index:
            ops.append(None)
        ops[index] = entry
        self._n_running += 1
        return 0

    cdef tuple _release(self, Py_ssize_t index):
        """Operation ``index`` of the batch has ended: its (op, work, None), taken off."""
        cdef list ops = self._batch_ops
        entry = ops[index] if 0 <= index < len(ops) else None
        if entry is None:
            raise KeyError("operation %d of the batch is not running" % index)
        ops[index] = None
        self._n_running -= 1
        return <tuple>entry

    cdef object drive(self):
        """One drive of the batch (``_run_batch``), run under the context's lock
        (``CallPath.run_drive``): post what the queue's head holds, and what is queued
        meanwhile, and complete each operation as it ends, until nothing is left in flight
        and the head is no send or receive, or the waiter's end (``_drive_until``) has come,
        or another thread wants the lock."""
        cdef object until = self._drive_until
        cdef double slice_s = self._drive_slice
        cdef list posting = self._posting
        cdef list ended
        cdef tuple entry
        cdef int i, n_ended
        cdef P2P op
        cdef Work work
        cdef Batch batch
        cdef bint idle, beside
        if self._batch is None:
            self._mutex.take()
            try:
                owner = (<P2P>self._queue[0][0]).owner
            finally:
                self._mutex.give()
            self._batch = owner.p2p_batch()
            self._batch_owner = owner
        batch, owner = <Batch?>self._batch, self._batch_owner
        while True:
            if self._queue:
                posting.extend(self._take_p2p(owner))
            while posting:
                op = posting[0][0]
                self._hold(op.post(batch), posting.pop(0))
            if slice_s == _POST_ONLY:
                return None
            # What ended: the first in first/first_exc, any more in ``ended`` (most passes
            # end one operation: no list is made for it).
            batch.move(slice_s)
            n_ended, first, first_exc, ended = 0, None, None, None
            i = batch.next_ended(0)
            while i >= 0:
                entry = self._release(i)
                failure = None
                try:
                    (<P2P>entry[0]).finish(batch, i)
                except Exception as exc:
                    # Its own failure (a status's set, a staged copy back): its handle
                    # raises it; the rest of the batch goes on.
                    failure = exc
                if n_ended == 0:
                    first, first_exc = entry[1], failure
                else:
                    if ended is None:
                        ended = []
                    ended.append((entry[1], failure))
                n_ended += 1
                i = batch.next_ended(i + 1)
            self._mutex.take()
            self._in_batch -= n_ended
            self.backlog -= n_ended
            idle = self._n_running == 0 and (
                not self._queue or type(self._queue[0][0]) is not P2P
                or (<P2P>self._queue[0][0]).owner is not owner)
            if idle:
                self._batch = None
                self._batch_owner = None
                del self._batch_ops[:]      # the next batch numbers its operations from 0
            beside = not idle and self._beside_head()
            self._mutex.give()
            if n_ended:
                (<Work>first).complete(None, first_exc)
                if ended is not None:
                    for work, exc in ended:
                        work.complete(None, exc)
            if idle or until is not None and _done(until):
                return None
            if beside:
                return None     # the collective queued behind runs now, beside the batch
            if until is None and self._wanted is not None and self._wanted.is_wanted():
                self._yielded = True
                return None

    cdef _run_batch(self, object until, double slice_s):
        """Drive the batch of sends and receives (made for the head's when none is in
        flight): post those at the head of the queue, and those queued meanwhile, and
        complete each as it ends, until nothing is left in flight and the head is no send
        or receive; or, for a waiter (``until``: the end it waits for), until that has
        come, leaving the rest to the next driver.  Each look at the batch moves it for
        ``slice_s`` at most."""
        cdef list failed
        self._drive_until = until
        self._drive_slice = slice_s
        try:
            if self._batch is not None:
                owner = self._batch_owner
            else:
                self._mutex.take()
                try:
                    owner = (<P2P>self._queue[0][0]).owner
                finally:
                    self._mutex.give()
            (<BatchOwner?>owner).run_drive(self)
        except BaseException as exc:      # fails every operation handed to the batch
            failed = [entry[1] for entry in self._batch_ops + self._posting
                      if entry is not None]
            del self._batch_ops[:]
            self._n_running = 0
            del self._posting[:]
            self._mutex.take()
            self._batch = None
            self._batch_owner = None
            self._in_batch -= len(failed)
            self.backlog -= len(failed)
            if not failed and self._queue:
                # The batch could not start: its first operation gets the error.
                failed.append(self._queue.popleft()[1])
                self.backlog -= 1
                self._bell.take()
            self._mutex.give()
            for work in failed:
                (<Work>work).complete(None, exc)
        finally:
            self._drive_until = None
