"""The Context: one rank's handle on a group of ranks, and the collectives it runs.

A Context validates arguments, numbers the collectives, calls the compiled
algorithm (one call, GIL released for the whole collective) and keeps the
failure state: once a collective fails because of a peer, a timeout, a
mismatch or abort(), every later call raises at once.
"""

import logging
import threading

from ._ext import _allreduce, _barrier, _broadcast
from .errors import Error, InvalidArgument
from .types import ReduceOp

__all__ = ["Context", "ALLREDUCE_ALGORITHMS", "BROADCAST_ALGORITHMS"]

log = logging.getLogger("pycollect")

ALLREDUCE_ALGORITHMS = ("auto",) + tuple(_allreduce.ALGORITHMS)
BROADCAST_ALGORITHMS = ("auto",) + tuple(_broadcast.ALGORITHMS)
_ALGORITHM_NAME = {code: name for name, code in
                   list(_allreduce.ALGORITHMS.items()) + list(_broadcast.ALGORITHMS.items())}

# Crossovers for algorithm="auto", measured on loopback (benchmarks/crossover.py).
RECURSIVE_DOUBLING_MAX_BYTES = 16 << 10  # up to here: whole-buffer swaps
RING_CHUNKED_MIN_BYTES = 256 << 10       # from here: segments overlap reduction and wire
PIPELINED_BCAST_MIN_BYTES = 256 << 10  # below, or with 2 ranks: binomial tree
DEFAULT_SEGMENT_BYTES = 1 << 20


class Context:
    """A connected group of ``size`` ranks, seen from ``rank``."""

    def __init__(self, rank, size, transport, *, timeout, segment_bytes=None,
                 on_close=(), debug=False):
        self._rank = rank
        self._size = size
        self._transport = transport
        self._timeout = float(timeout)
        self._segment_bytes = int(segment_bytes or DEFAULT_SEGMENT_BYTES)
        if self._segment_bytes < 1:
            raise InvalidArgument("segment_bytes must be >= 1, got %r" % segment_bytes)
        self._seq = 0
        self._lock = threading.Lock()
        self._failure = None
        self._closed = False
        self._on_close = list(on_close)
        self._debug = debug

    # -- properties -------------------------------------------------------

    @property
    def rank(self):
        """This process's rank, 0 <= rank < size."""
        return self._rank

    @property
    def size(self):
        """The number of ranks in the group."""
        return self._size

    @property
    def timeout(self):
        """The deadline of every collective, in seconds."""
        return self._timeout

    @property
    def failed(self):
        """The error that failed this context, or None."""
        return self._failure

    def __repr__(self):
        state = "closed" if self._closed else ("failed" if self._failure else "ready")
        return "<pycollect.Context rank %d of %d, %s>" % (self._rank, self._size, state)

    # -- collectives ------------------------------------------------------

    def barrier(self):
        """Block until every rank has called barrier."""
        with self._lock:
            seq = self._next_seq()
            self._run(_barrier.barrier, self._transport, seq, self._timeout)

    def broadcast(self, buf, root=0, algorithm="auto"):
        """Copy ``buf`` from ``root`` into ``buf`` on every rank, in place; return ``buf``."""
        root = self._check_root(root, "broadcast")
        with self._lock:
            seq = self._next_seq()
            algo = self._broadcast_algorithm(algorithm, buf)
            self._run(_broadcast.broadcast, self._transport, buf, root, algo, seq,
                      self._timeout, self._segment_bytes)
        return buf

    def allreduce(self, buf, op=ReduceOp.SUM, algorithm="auto"):
        """Reduce ``buf`` element-wise across ranks with ``op``, in place; return ``buf``."""
        op = self._check_op(op, "allreduce")
        with self._lock:
            seq = self._next_seq()
            algo = self._allreduce_algorithm(algorithm, buf)
            self._run(_allreduce.allreduce, self._transport, buf, op, algo, seq,
                      self._timeout, self._segment_bytes)
        return buf

    # -- lifecycle --------------------------------------------------------

    def abort(self):
        """End the collective in progress on this rank (from any thread) with Aborted."""
        self._transport.abort()

    def close(self):
        """Close every connection; idempotent.  Collectives after close raise Error."""
        if self._closed:
            return
        self._closed = True
        self._transport.abort()
        with self._lock:
            self._transport.close()
            for fn in self._on_close:
                fn()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()

    # -- helpers ----------------------------------------------------------

    def _next_seq(self):
        if self._closed:
            raise Error("rank %d: the context is closed" % self._rank)
        if self._failure is not None:
            raise type(self._failure)(
                "rank %d: the context failed earlier and cannot be used; open a new "
                "context (%s)" % (self._rank, self._failure))
        return (self._seq + 1) & 0xFFFFFFFF

    def _run(self, fn, *args):
        # A collective consumes its sequence number only once it reaches the
        # wire: arguments refused on one rank must not shift its numbering.
        try:
            algo = fn(*args)
        except Error as exc:
            if self._transport.is_failed:
                self._failure = exc
                self._seq = (self._seq + 1) & 0xFFFFFFFF
            raise
        self._seq = (self._seq + 1) & 0xFFFFFFFF
        if self._debug:
            log.debug("rank %d: collective #%d ran %s", self._rank, self._seq,
                      _ALGORITHM_NAME.get(algo, "the only algorithm"))

    def _check_root(self, root, what):
        if not isinstance(root, int) or isinstance(root, bool) or not 0 <= root < self._size:
            raise InvalidArgument("%s: root %r is not a rank of this group (0..%d)"
                                  % (what, root, self._size - 1))
        return root

    def _check_op(self, op, what):
        if type(op) is ReduceOp:
            return op
        try:
            return ReduceOp(op)
        except ValueError:
            raise InvalidArgument("%s: unknown reduction op %r (use pycollect.ReduceOp)"
                                  % (what, op)) from None

    def _allreduce_algorithm(self, algorithm, buf):
        if algorithm == "auto":
            nbytes = _nbytes(buf)
            if nbytes <= RECURSIVE_DOUBLING_MAX_BYTES:
                algorithm = "recursive_doubling"
            elif nbytes < RING_CHUNKED_MIN_BYTES:
                algorithm = "ring"
            else:
                algorithm = "ring_chunked"
        try:
            return _allreduce.ALGORITHMS[algorithm]
        except (KeyError, TypeError):
            raise InvalidArgument("allreduce: unknown algorithm %r (choose from %s)"
                                  % (algorithm, ", ".join(ALLREDUCE_ALGORITHMS))) from None

    def _broadcast_algorithm(self, algorithm, buf):
        if algorithm == "auto":
            nbytes = _nbytes(buf)
            algorithm = ("pipelined" if self._size > 2 and nbytes >= PIPELINED_BCAST_MIN_BYTES
                         else "binomial")
        try:
            return _broadcast.ALGORITHMS[algorithm]
        except (KeyError, TypeError):
            raise InvalidArgument("broadcast: unknown algorithm %r (choose from %s)"
                                  % (algorithm, ", ".join(BROADCAST_ALGORITHMS))) from None


def _nbytes(buf):
    try:
        return buf.nbytes
    except AttributeError:
        try:
            return memoryview(buf).nbytes
        except TypeError:
            return 0   # the compiled gatekeeper rejects it with the reason
