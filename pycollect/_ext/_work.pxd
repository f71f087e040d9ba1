# Async handles, receive statuses and the runner of a context's queued operations
# (_work.pyx), as the compiled call path (_call.pyx) calls them without Python's call.
from pycollect._ext._doorbell cimport Doorbell
from pycollect._ext._lock cimport CallLock, sem_t
from pycollect._ext._p2p cimport Batch
from pycollect._ext._record cimport Ring

cdef class Completion:
    cdef public bint done
    cdef object _event

    cdef void set_done(self) except *

cdef class Status:
    cdef public object source, count, tag

    cdef Status fill(self, tuple got)

cdef object filled(object status, tuple got)

cdef class Later:
    cdef public object value
    cdef public object status

    @staticmethod
    cdef Later of(object status)

cdef class P2P:
    cdef public bint is_recv
    cdef public object buf
    cdef public int peer, tag
    cdef public object owner, result, timeout, staged

    @staticmethod
    cdef P2P of(bint is_recv, object buf, int peer, int tag, object owner, object result,
                object timeout)
    cpdef Py_ssize_t post(self, Batch batch) except -1
    cpdef finish(self, Batch batch, Py_ssize_t index)

cdef class Runner

cdef class BatchOwner:
    cpdef object run_drive(self, Runner runner)

cdef class Work:
    cdef public Completion _end
    cdef public object _result, _exception, _callbacks
    cdef public Runner _runner
    cdef public bint _polled
    cdef public object algorithm, description
    cdef Ring _rec                  # the flight recorder's ring, and the handle's entry in it
    cdef Py_ssize_t _entry          # ... (-1: none), ended with the handle

    cdef int record_in(self, Ring rec, Py_ssize_t entry) except -1
    @staticmethod
    cdef Work made_pending(object description, object result)
    @staticmethod
    cdef Work made_ended(object description, object result, object exception)
    cpdef complete(self, object algorithm=*, object exception=*)
    cpdef ends_with(self, Work inner)
    cdef object _outcome(self)
    cdef _run_callbacks(self)
    cdef _pop_callbacks(self)

cdef class Runner:
    cdef public object _execute, _kick
    cdef CallLock _wanted
    cdef public bint _yielded, busy, _parked, _runner_waits, _handed, _stopping, _alone
    cdef public object _queue, _batch, _batch_owner, _batch_ops, _posting, _thread
    cdef public Doorbell _bell
    cdef public Py_ssize_t _in_batch, backlog, _begun
    cdef Py_ssize_t _n_running          # operations of _batch_ops that have not ended
    cdef public Py_ssize_t notified     # posts of the hand-off semaphore (tests count them)
    cdef readonly CallLock _mutex
    cdef sem_t _handoff
    cdef bint _handoff_made
    cdef object _drive_until
    cdef double _drive_slice
    cdef int _callbacks_running         # done callbacks of its handles running, any thread
    cdef dict _callback_threads         # ... how many on each thread (by thread ident)

    cpdef bint in_callback(self) except -1
    cdef int callbacks_begin(self) except -1
    cdef int callbacks_end(self) except -1

    cpdef Py_ssize_t pending(self)
    cpdef submit(self, object op, Work work, object execute=*)
    cpdef bint claim(self) except -1
    cpdef bint claim_post(self, Py_ssize_t limit) except -1
    cpdef unclaim(self, bint hurry=*)
    cpdef Work begun(self, P2P op, object description, object batch, Py_ssize_t index)
    cpdef object batch_alone(self)
    cpdef bint claim_batch(self, object owner) except -1
    cpdef Work join(self, P2P op, object description, bint wait)
    cpdef begun_collective(self, object op, Work work, bint alone=*)
    cpdef run_until(self, Work work)
    cdef _run_while_not(self, object until)
    cdef object _take_next(self)
    cdef bint _beside_head(self) except -1
    cdef _run_next(self, object head, object until, double slice_s)
    cdef _run_head(self, object head)
    cdef _done_running(self, bint goes_on, bint park=*)
    cpdef bint move_batch(self) except -1
    cdef bint _run_entered(self, Work work) except -1
    cdef bint _poll_batch(self, Work work) except -1
    cdef void _notify_runner(self, bint handed) noexcept
    cdef list _take_p2p(self, object owner)
    cdef int _hold(self, Py_ssize_t index, tuple entry) except -1
    cdef tuple _release(self, Py_ssize_t index)
    cdef _run_batch(self, object until, double slice_s)
    cdef object drive(self)
