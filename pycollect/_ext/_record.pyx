"""The flight recorder's ring: a context's last N operations, written from compiled code.

A ``Ring`` keeps the last ``capacity`` operations in preallocated slots (the next power
of two of them: an id finds its slot with a mask, not a division); recording an operation
fills the next slot in place (numbers in C structs, the few objects in one C
array of references, each replaced only when it changes: a loop that records
the same operation from the same line moves no reference counts), so that
recording allocates nothing: the caller's frame is kept as
its code object and position, and the line is found only when a dump asks.
An operation is named by its id, the count of operations recorded before it;
``started`` and ``ended`` on an id whose slot has been reused do nothing.
``entries()`` returns the live slots, oldest first, as lists of FIELDS
(pycollect/recorder.py turns them into the dump).

The caller's frame is the first Python frame whose file lies outside the
pycollect package: the user's line, even when the call came through
``pycollect.torch`` or a sub-group.
"""

from cpython.object cimport PyObject
from cpython.ref cimport Py_INCREF, Py_XDECREF
from cpython.unicode cimport PyUnicode_Tailmatch
from libc.stdlib cimport calloc, free

import os
import time

cdef extern from *:
    """
    #include <stdint.h>
    #include <time.h>
    /* The recorder's clock: the CPU's tick counter where there is one (a few ns to read,
       where clock_gettime costs ~100 ns in a virtual machine), else the monotonic clock. */
    #if defined(__x86_64__) || defined(__i386__)
    #include <x86intrin.h>
    static inline int64_t pc_ticks(void) { return (int64_t)__rdtsc(); }
    #elif defined(__aarch64__)
    static inline int64_t pc_ticks(void) {
        uint64_t v; __asm__ __volatile__("mrs %0, cntvct_el0" : "=r"(v)); return (int64_t)v;
    }
    #else
    static inline int64_t pc_ticks(void) {
        struct timespec ts; clock_gettime(CLOCK_MONOTONIC, &ts);
        return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
    }
    #endif
    static inline int64_t pc_wall_ns(void) {
        struct timespec ts; clock_gettime(CLOCK_REALTIME, &ts);
        return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
    }
    /* The caller's frame: the first frame, from the innermost out, whose code object
       `outside` accepts; its code (a new reference, NULL when none) and in *where its
       position: from 3.11 its last instruction's byte offset (the line is found from it
       only when a dump asks), before 3.11 its line.  On 3.11 and 3.12 the walk reads the
       interpreter's frames in place (the layout Cython's own tracebacks read), so that no
       frame object is made for a frame that has none yet (making one costs an allocation
       per call in a function's loop); elsewhere it goes through the frame objects. */
    typedef int (*pc_outside_fn)(void* ring, PyObject* code);
    #if PY_VERSION_HEX >= 0x030B0000
    #define PC_FRAME_LASTI 1
    #else
    #define PC_FRAME_LASTI 0
    #endif
    #if PY_VERSION_HEX >= 0x030B0000 && PY_VERSION_HEX < 0x030D0000 && !defined(Py_GIL_DISABLED)
    #ifndef Py_BUILD_CORE
    #define Py_BUILD_CORE 1
    #endif
    #include "internal/pycore_frame.h"
    static PyObject* pc_caller(pc_outside_fn outside, void* ring, int* where) {
        _PyInterpreterFrame* f = PyThreadState_Get()->cframe->current_frame;
        for (; f != NULL; f = f->previous) {
        #if PY_VERSION_HEX >= 0x030C0000
            if (f->owner == FRAME_OWNED_BY_CSTACK) continue;    /* a C caller's shim */
        #endif
            if (_PyFrame_IsIncomplete(f)) continue;             /* not started yet */
            if (outside(ring, (PyObject*)f->f_code)) {
                *where = (int)(_PyInterpreterFrame_LASTI(f) * sizeof(_Py_CODEUNIT));
                Py_INCREF(f->f_code);
                return (PyObject*)f->f_code;
            }
        }
        return NULL;
    }
    #else
    static PyObject* pc_caller(pc_outside_fn outside, void* ring, int* where) {
        PyFrameObject* f = PyEval_GetFrame();       /* borrowed */
        PyFrameObject* back;
        PyCodeObject* code;
        Py_XINCREF(f);
        while (f != NULL) {
            code = PyFrame_GetCode(f);
            if (outside(ring, (PyObject*)code)) {
            #if PC_FRAME_LASTI
                *where = PyFrame_GetLasti(f);
            #else
                *where = PyFrame_GetLineNumber(f);
            #endif
                Py_DECREF(f);
                return (PyObject*)code;
            }
            Py_DECREF(code);
            back = PyFrame_GetBack(f);
            Py_DECREF(f);
            f = back;
        }
        return NULL;
    }
    #endif
    """
    int64_t pc_ticks() nogil
    int64_t pc_wall_ns() nogil
    bint PC_FRAME_LASTI
    ctypedef int (*pc_outside_fn)(void* ring, PyObject* code) noexcept
    PyObject* pc_caller(pc_outside_fn outside, void* ring, int* where)

cdef extern from "Python.h":
    ctypedef struct PyCodeObject:
        PyObject* co_filename

__all__ = ["Ring", "FIELDS", "QUEUED", "STARTED", "COMPLETED", "FAILED"]

# An entry, as entries() gives it, is a list of these fields.
FIELDS = ("id", "seq", "name", "algorithm", "dtype", "count", "root", "peers", "state",
          "queued_ns", "started_ns", "ended_ns", "frame", "error")
QUEUED, STARTED, COMPLETED, FAILED = "queued", "started", "completed", "failed"
_STATES = (QUEUED, STARTED, COMPLETED, FAILED)

cdef enum:
    S_QUEUED = 0
    S_STARTED = 1
    S_COMPLETED = 2
    S_FAILED = 3

cdef str _PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


cdef enum:
    CALIBRATION_NS = 20000000   # ticks are turned into times over at least this long


cdef class Ring:
    """The last ``capacity`` operations of one context."""

    def __cinit__(self, *args, **kwargs):
        self.slots = NULL
        self.objects = NULL

    def __init__(self, Py_ssize_t capacity):
        if capacity < 1:
            raise ValueError("a ring needs capacity >= 1, got %d" % capacity)
        if self.slots != NULL:
            raise RuntimeError("Ring.__init__ called twice")
        cdef Py_ssize_t n = 1
        while n < capacity:
            n <<= 1
        self.capacity = capacity
        self.recorded = 0
        self.mask = n - 1
        self.slots = <Slot*>calloc(n, sizeof(Slot))
        self.objects = <PyObject**>calloc(n * N_OBJECTS, sizeof(PyObject*))
        if self.slots == NULL or self.objects == NULL:
            raise MemoryError()
        self.tick0 = pc_ticks()
        self.wall0 = pc_wall_ns()

    def __dealloc__(self):
        # The objects are strings, dtypes, code objects and tuples of ranks: none refers
        # back to a ring, so the references need no cycle collection.
        cdef Py_ssize_t i
        if self.objects != NULL:
            for i in range((self.mask + 1) * N_OBJECTS):
                Py_XDECREF(self.objects[i])
        free(self.objects)
        free(self.slots)

    cdef Py_ssize_t add(self, object name, object dtype, int64_t count, int64_t root,
                        object peers, bint started=False, int64_t seq=NONE) except -1:
        """A new entry, queued, or with ``started`` started at once as collective ``seq``
        (NONE: a send or receive), at the same tick; its id."""
        cdef Py_ssize_t i = self.recorded & self.mask
        cdef PyObject** o = &self.objects[i * N_OBJECTS]
        cdef Slot* s = &self.slots[i]
        cdef PyObject* code
        cdef int line = 0
        s.id = self.recorded
        s.seq = seq
        s.count = count
        s.root = root
        s.queued_ns = pc_ticks()
        s.started_ns = s.queued_ns if started else NONE
        s.ended_ns = NONE
        s.state = S_STARTED if started else S_QUEUED
        # The first frame outside the package: the user's line.
        code = pc_caller(_is_outside, <void*>self, &line)
        s.line = line
        _put(&o[0], name)
        _put(&o[1], None)                   # algorithm
        _put(&o[2], dtype)
        _put(&o[3], peers)
        _give(&o[4], code)
        _put(&o[5], None)                   # error
        self.recorded += 1
        return s.id

    cdef bint is_outside(self, PyObject* code) noexcept:
        """Whether ``code`` lies outside the package; the last answer each way is kept
        (with a reference, so that the address cannot come back as another code object)."""
        if code == <PyObject*>self.code_outside:
            return True
        if code == <PyObject*>self.code_inside:
            return False
        if PyUnicode_Tailmatch(<object>(<PyCodeObject*>code).co_filename, _PACKAGE_DIR, 0,
                               len(_PACKAGE_DIR), -1) == 1:
            self.code_inside = <object>code
            return False
        self.code_outside = <object>code
        return True

    cdef Slot* live(self, Py_ssize_t id) noexcept:
        cdef Slot* s
        if id < 0:
            return NULL
        s = &self.slots[id & self.mask]
        return s if s.id == id and id < self.recorded else NULL

    cdef void begin(self, Py_ssize_t id, int64_t seq) noexcept:
        """Entry ``id`` started as collective ``seq``."""
        cdef Slot* s = self.live(id)
        if s != NULL:
            s.seq = seq
            s.state = S_STARTED
            s.started_ns = pc_ticks()

    cdef int end(self, Py_ssize_t id, object algorithm, object error) except -1:
        cdef Slot* s = self.live(id)
        cdef PyObject** o = &self.objects[(id & self.mask) * N_OBJECTS]
        if s == NULL:
            return 0
        s.ended_ns = pc_ticks()
        if algorithm is not None:
            _put(&o[1], algorithm)
        if error is None:
            s.state = S_COMPLETED
        else:
            s.state = S_FAILED
            _put(&o[5], "%s: %s" % (type(error).__name__, error))
        return 0

    # -- from Python ------------------------------------------------------

    def record(self, name, described, root, peers):
        """A new queued entry for operation ``name`` on the buffer ``described``; its id."""
        dtype = getattr(described, "dtype", None)
        count = None if dtype is None else getattr(described, "size", None)
        if count is not None and not isinstance(count, int):
            numel = getattr(described, "numel", None)     # a torch tensor's size is a method
            count = numel() if numel is not None else None
        return self.add(name, dtype, NONE if count is None else count,
                        NONE if root is None else root, peers)

    def started(self, Py_ssize_t id, seq):
        """Entry ``id`` reached the wire as collective ``seq`` (None: a send or receive)."""
        self.begin(id, NONE if seq is None else seq)

    def ended(self, Py_ssize_t id, algorithm, error=None):
        """Entry ``id`` ended, having run ``algorithm``, with ``error`` (None: completed)."""
        self.end(id, algorithm, error)

    def entries(self):
        """The recorded entries, oldest first, each a list of FIELDS."""
        cdef Py_ssize_t first = self.recorded - self.capacity if self.recorded > self.capacity \
            else 0
        cdef Py_ssize_t id
        cdef PyObject** o
        cdef Slot* s
        cdef int64_t tick1, wall1
        cdef double ns_per_tick
        # Ticks to wall-clock ns: the rate over the ring's life so far (at least
        # CALIBRATION_NS, waited for here when the ring is younger than that).
        wall1 = pc_wall_ns()
        if 0 <= wall1 - self.wall0 < CALIBRATION_NS:
            time.sleep((CALIBRATION_NS - (wall1 - self.wall0)) / 1e9)
        tick1, wall1 = pc_ticks(), pc_wall_ns()
        ns_per_tick = (wall1 - self.wall0) / <double>(tick1 - self.tick0) \
            if tick1 > self.tick0 else 1.0
        out = []
        for id in range(first, self.recorded):
            s = &self.slots[id & self.mask]
            o = &self.objects[(id & self.mask) * N_OBJECTS]
            code = _get(o[4])
            out.append([s.id, _opt(s.seq), _get(o[0]), _get(o[1]), _get(o[2]),
                        _opt(s.count), _opt(s.root), _copied(o[3]), _STATES[s.state],
                        self.wall(s.queued_ns, ns_per_tick),
                        self.wall(s.started_ns, ns_per_tick), self.wall(s.ended_ns, ns_per_tick),
                        None if code is None else (code, _line(code, s.line)), _get(o[5])])
        return out


    cdef object wall(self, int64_t ticks, double ns_per_tick):
        if ticks == NONE:
            return None
        return self.wall0 + <int64_t>((ticks - self.tick0) * ns_per_tick)


cdef object _line(object code, int where):
    """The line of ``code`` that a slot's frame position names."""
    if not PC_FRAME_LASTI:
        return where
    for start, end, line in code.co_lines():
        if start <= where < end:
            return line
    return code.co_firstlineno


cdef inline void _put(PyObject** at, object value) noexcept:
    """Store a reference to ``value`` at ``at``, dropping the one it replaces."""
    cdef PyObject* old = at[0]
    if old != <PyObject*>value:
        Py_INCREF(value)
        at[0] = <PyObject*>value
        Py_XDECREF(old)


cdef inline void _give(PyObject** at, PyObject* ref) noexcept:
    """Store the new reference ``ref`` (NULL: None) at ``at``, dropping the one it replaces."""
    cdef PyObject* old = at[0]
    if ref == NULL:
        ref = <PyObject*>None
        Py_INCREF(None)
    at[0] = ref
    Py_XDECREF(old)


cdef int _is_outside(void* ring, PyObject* code) noexcept:
    return (<Ring>ring).is_outside(code)


cdef inline object _get(PyObject* p):
    return None if p == NULL else <object>p


cdef inline object _copied(PyObject* p):
    """A slot's peers as a list of the entry's own (the call path records one list per
    rank, kept from call to call)."""
    return None if p == NULL else list(<object>p) if type(<object>p) is list else <object>p


cdef inline object _opt(int64_t v):
    return None if v == NONE else v
