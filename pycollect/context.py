"""The Context: one rank's handle on a group of ranks, and the collectives it runs.

A Context validates arguments, numbers the collectives, calls the compiled
algorithm (one call, GIL released for the whole collective) and keeps the
failure state: once a collective fails because of a peer, a timeout, a
mismatch or abort(), every later call raises at once.

Every collective takes ``async_op=True`` to return a ``Work`` at once; a
daemon thread of the context then runs the queued operations in issue order,
and a blocking call made while some are queued waits its turn.
"""

import contextlib
import functools
import logging
import operator
import os
import threading
import zlib
from time import monotonic as _now

import numpy as np

from ._ext import (_allgather, _allreduce, _alltoall, _barrier, _broadcast, _buffer, _p2p,
                   _reduce_scatter, _rooted, _transport)
from ._ext._call import CallPath, Queued
from ._ext._lock import CallLock
from ._ext._group import GroupTransport
from ._ext._transport import ALGORITHM_NAMES
from .errors import (Aborted, Error, InvalidArgument, MismatchError, PeerError, Timeout,
                     UnpicklingRefused)
from .hierarchy import PhaseGroup, Topology, multi_level
from . import recorder, recovery, selection, settings, signature, unpickle
from .recorder import Recorder
from .selection import buffer_bytes as _nbytes
from .tensors import Host, as_tensor_like, is_tensor
from .types import DTYPES, ReduceOp
from .work import P2P, Later, Runner, Status, Work, wait_all, wait_seconds

__all__ = ["Context", "ALLREDUCE_ALGORITHMS", "BROADCAST_ALGORITHMS", "REDUCE_ALGORITHMS",
           "ANY_SOURCE", "ANY_TAG"]

ANY_SOURCE = _p2p.ANY_SOURCE
ANY_TAG = _p2p.ANY_TAG
_MONITOR_TAG = -2           # below every user tag: monitored_barrier's messages

log = logging.getLogger("pycollect")

ALLREDUCE_ALGORITHMS = ("auto",) + tuple(_allreduce.ALGORITHMS) + ("hierarchical",)
BROADCAST_ALGORITHMS = ("auto",) + tuple(_broadcast.ALGORITHMS) + ("hierarchical",)
ALLGATHER_ALGORITHMS = ("auto",) + tuple(_allgather.ALGORITHMS)
REDUCE_ALGORITHMS = ("auto",) + tuple(_rooted.REDUCE_ALGORITHMS)

# algorithm="auto" is pycollect/selection.py's table.
DEFAULT_SEGMENT_BYTES = 1 << 20


_REFUSED_AS = {"allreduce_coalesced": "allreduce"}   # the wire's name of a refused call
_ABSENT = object()      # an argument an object collective does not take (Context._object_args)


def _refusable(method):
    """A collective whose argument errors on this rank are announced to the peers
    (Context._refuse) before they are raised (``_allreduce_any`` is allreduce's)."""
    what = method.__name__[1:-4] if method.__name__.endswith("_any") else method.__name__

    @functools.wraps(method)
    def collective(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except InvalidArgument as exc:
            self._refuse(what, exc)
            raise
    return collective


class Context(CallPath):
    """A connected group of ``size`` ranks, seen from ``rank``.

    Its hot state and its commonest calls (the blocking collectives on NumPy arrays:
    ``allreduce``, ``broadcast``, ``barrier``, ``reduce``, ``allgather``, ``gather``,
    ``scatter``, ``reduce_scatter``, ``alltoall`` and their v-variants; tagged ``send`` and
    ``recv``) are compiled: ``CallPath`` (pycollect/_ext/_call.pyx), and so is the queueing of
    the async forms of the first five.  Every other form of those calls arrives at
    ``_allreduce_any`` and its kin here.
    """

    def __init__(self, rank, size, transport, *, timeout, segment_bytes=None,
                 on_close=(), debug=False, lock=None, group_id=0, name=""):
        seg = DEFAULT_SEGMENT_BYTES if segment_bytes is None else segment_bytes
        if not isinstance(seg, int) or isinstance(seg, bool) or seg < 1:
            raise InvalidArgument("segment_bytes must be an int >= 1, got %r" % (segment_bytes,))
        self._segment_bytes = seg
        self._rank = rank
        self._size = size
        self._transport = transport
        self._timeout = float(timeout)
        self._seq = 0
        self._lock = lock or CallLock()     # shared with sub-groups
        self._group_id = group_id
        self._groups_made = 0
        self._selector = None   # auto's rules for this group, found on first use
        self._rules = {}        # ... per collective: ((min_bytes, Plan), ...)
        self._failure = None
        self._closed = False
        self._handed_over = False   # shrink() gave the connections to a new context
        self._recoveries = 0        # shrink() and agree() calls: numbers their exchanges
        self._on_close = list(on_close)
        self._debug = debug
        self._logs = debug in (True, "all")      # PYCOLLECT_DEBUG=1 (or 1,detail)
        self._detail = debug in ("detail", "all")   # ... =detail: cross-rank call checks
        self._name = name       # a sub-group's recipe, in its log lines ("" at the top)
        self._runner = None
        self._runner_shared = False     # the runner is the parent's (a sub-group: _group)
        self._busy = False      # a collective of this context is running
        # The hosts of the ranks (pycollect/hierarchy.py).
        self._topology = Topology(rank, size, transport.host_ids, self.phase_group,
                                  self._timeout)
        self._kinds = None      # per rank, how it is reached: read from the transport once
        self._mailbox = _p2p.Mailbox()  # messages that arrived before their receive
        # The flight recorder (pycollect/recorder.py); None when PYCOLLECT_TRACE_SIZE is 0.
        size_n = settings.get("PYCOLLECT_TRACE_SIZE")
        self._recorder = Recorder(rank, size, size_n, group_id, transport.members_in_parent,
                                  transport.members_in_world) if size_n else None
        self._trace_dir = settings.get("PYCOLLECT_TRACE_DIR")
        self.unpickle_allow = settings.get("PYCOLLECT_UNPICKLE_ALLOW")
        trace_signal = settings.get("PYCOLLECT_TRACE_SIGNAL")
        if trace_signal is not None and self._trace_dir is not None:
            recorder.install_signal(trace_signal, self._trace_dir)

    # -- properties -------------------------------------------------------

    @property
    def unpickle_allow(self):
        """The globals this context's object collectives may unpickle (a tuple of
        ``module.name`` entries, one global each, and ``module.*`` entries, that module's
        classes), or None: anything unpickles.  Set it to a list, or a comma-separated
        string, to restrict them (pycollect/unpickle.py); sub-groups made later take it.
        Default: ``PYCOLLECT_UNPICKLE_ALLOW``."""
        return self._unpickle_allow

    @unpickle_allow.setter
    def unpickle_allow(self, entries):
        allowed = None if entries is None else unpickle.parse(entries)
        self._loads = unpickle.loads_for(allowed)
        self._unpickle_allow = allowed

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
        """The deadline of every collective, in seconds (a call's ``timeout=`` overrides it)."""
        return self._timeout

    @property
    def local_rank(self):
        """This rank's index among the ranks of its host, in rank order."""
        return self._topology.local.index(self._rank)

    @property
    def local_size(self):
        """The number of ranks of this group on this rank's host."""
        return len(self._topology.local)

    @property
    def failed(self):
        """The error that failed this context, or None."""
        return self._failure

    def __repr__(self):
        state = "closed" if self._closed else ("failed" if self._failure else "ready")
        return "<pycollect.Context rank %d of %d, %s>" % (self._rank, self._size, state)

    # -- collectives ------------------------------------------------------
    #
    # Every collective takes ``timeout=`` (seconds or a timedelta: this call's
    # deadline instead of the context's) and ``async_op=``.  Buffers may be
    # NumPy arrays, anything with the buffer protocol or CUDA array interface,
    # or CPU torch tensors (pycollect/tensors.py); an output left as None is
    # allocated, shaped like the input.

    @_refusable
    def _barrier_any(self, async_op=False, timeout=None):
        # barrier() in every form (pycollect/_ext/_call.pyx answers the commonest itself)
        t, tmo = self._transport, self._call_timeout(timeout, "barrier")
        return self._submit("barrier", lambda seq: _barrier.barrier(t, seq, tmo), None,
                            async_op, checked=self._detail and {})

    @_refusable
    def _broadcast_any(self, buf, root=0, algorithm="auto", async_op=False, timeout=None):
        # broadcast() in every form (pycollect/_ext/_call.pyx answers the commonest itself)
        checked = self._detail and dict(buf=buf, root=root, algorithm=algorithm)
        root = self._check_root(root, "broadcast")
        tmo = self._call_timeout(timeout, "broadcast")
        call = _Call(self, "broadcast", checked)
        data = call.inout(buf, "buf")
        plan = self.plan("broadcast", data, algorithm)
        if plan.hierarchical:
            return call.submit(self._topology.broadcast(data, root, tmo), buf, async_op,
                               root=root)
        t, seg, algo = self._transport, self._segment_bytes, plan.code
        return call.submit(lambda seq: _broadcast.broadcast(
            t, data, root, algo, seq, tmo, seg), buf, async_op, root=root)

    @_refusable
    def _allreduce_any(self, buf, op=ReduceOp.SUM, algorithm="auto", async_op=False, *,
                       recvbuf=None, timeout=None):
        # allreduce() in every form (pycollect/_ext/_call.pyx answers the commonest itself)
        if recvbuf is None and _is_buffer(op):
            # mpi4py's order, Allreduce(sendbuf, recvbuf, op): the third argument is the op,
            # unless it names an algorithm (algorithm= beside the two buffers)
            recvbuf, op = op, ReduceOp.SUM
            if not isinstance(algorithm, str):
                op, algorithm = algorithm, "auto"
        if _is_number(buf, "allreduce"):
            _no_recvbuf_for_a_number(recvbuf, "allreduce")
            return self._number("allreduce", buf, async_op, lambda a, **kw: self.allreduce(
                a, op, algorithm, **kw), timeout, op)
        checked = self._detail and dict(buf=buf, op=op, algorithm=algorithm)
        if type(op) is not ReduceOp:
            op = self._check_op(op, "allreduce")
        tmo = self._call_timeout(timeout, "allreduce")
        call = _Call(self, "allreduce", checked)
        if recvbuf is None:
            data, result = call.inout(buf, "buf"), buf
        else:
            data, result = call.out_of_place(buf, recvbuf), recvbuf
        algorithm, base = allreduce_algorithm(algorithm)
        plan = self.plan("allreduce", data, algorithm)
        if plan.hierarchical:
            return call.submit(self._topology.allreduce(data, op, tmo), result, async_op)
        t, seg, algo = self._transport, self._segment_bytes, plan.code
        return call.submit(lambda seq: _allreduce.allreduce(
            t, data, op, algo, seq, tmo, seg, base), result, async_op)

    @_refusable
    def _reduce_any(self, buf, root=0, op=ReduceOp.SUM, algorithm="auto", async_op=False, *,
                    recvbuf=None, timeout=None):
        # reduce() in every form (pycollect/_ext/_call.pyx answers the commonest itself)
        root = self._check_root(root, "reduce")
        op = self._check_op(op, "reduce")
        if _is_number(buf, "reduce"):
            _no_recvbuf_for_a_number(recvbuf, "reduce")
            return self._number("reduce", buf, async_op, lambda a, **kw: self.reduce(
                a, root, op, algorithm, **kw), timeout, op, self._rank == root)
        checked = self._detail and dict(buf=buf, root=root, op=op, algorithm=algorithm)
        tmo = self._call_timeout(timeout, "reduce")
        call = _Call(self, "reduce", checked)
        if recvbuf is None or self._rank != root:
            data, result = call.inout(buf, "buf"), buf
        else:
            data, result = call.out_of_place(buf, recvbuf), recvbuf
        algo = self.plan("reduce", data, algorithm).code
        t, seg = self._transport, self._segment_bytes
        return call.submit(lambda seq: _rooted.reduce(
            t, data, root, op, algo, seq, tmo, seg), result, async_op, root=root)

    @_refusable
    def _allgather_any(self, sendbuf, recvbuf=None, async_op=False, timeout=None, *,
                       algorithm="auto"):
        # allgather() in every form (pycollect/_ext/_call.pyx answers the commonest itself)
        checked = self._detail and dict(sendbuf=sendbuf, recvbuf=recvbuf, algorithm=algorithm)
        tmo = self._call_timeout(timeout, "allgather")
        call = _Call(self, "allgather", checked)
        send = call.inp(sendbuf, "sendbuf")
        recv = call.output(recvbuf, "recvbuf", lambda: _blocks_like(send, self._size,
                                                                    "allgather"))
        t, seg, algo = self._transport, self._segment_bytes, self.plan("allgather", send,
                                                                       algorithm).code
        return call.submit(lambda seq: _allgather.allgather(
            t, send, recv, None, seq, tmo, seg, algo), call.result, async_op)

    @_refusable
    def _allgatherv_any(self, sendbuf, recvbuf=None, counts=None, async_op=False, timeout=None):
        # allgatherv() in every form (pycollect/_ext/_call.pyx answers the commonest itself)
        checked = self._detail and dict(sendbuf=sendbuf, recvbuf=recvbuf, counts=counts)
        counts = _check_counts(counts, self._size, "allgatherv")
        tmo = self._call_timeout(timeout, "allgatherv")
        call = _Call(self, "allgatherv", checked)
        send = call.inp(sendbuf, "sendbuf")
        recv = call.output(recvbuf, "recvbuf", lambda: _flat_like(send, _total(counts),
                                                                  "allgatherv"))
        t, seg = self._transport, self._segment_bytes
        return call.submit(lambda seq: _allgather.allgather(
            t, send, recv, counts, seq, tmo, seg), call.result, async_op)

    @_refusable
    def _gather_any(self, sendbuf, recvbuf=None, root=0, async_op=False, timeout=None):
        # gather() in every form (pycollect/_ext/_call.pyx answers the commonest itself)
        checked = self._detail and dict(sendbuf=sendbuf, recvbuf=recvbuf, root=root)
        root = self._check_root(root, "gather")
        tmo = self._call_timeout(timeout, "gather")
        call = _Call(self, "gather", checked)
        send = call.inp(sendbuf, "sendbuf")
        out = None
        if self._rank == root:
            out = call.output(recvbuf, "recvbuf", lambda: _blocks_like(send, self._size,
                                                                       "gather"))
        t = self._transport
        return call.submit(lambda seq: _rooted.gather(
            t, send, out, None, root, seq, tmo), call.result, async_op, root=root)

    @_refusable
    def _gatherv_any(self, sendbuf, recvbuf=None, counts=None, root=0, async_op=False,
                     timeout=None):
        # gatherv() in every form (pycollect/_ext/_call.pyx answers the commonest itself)
        checked = self._detail and dict(sendbuf=sendbuf, recvbuf=recvbuf, counts=counts,
                                        root=root)
        root = self._check_root(root, "gatherv")
        counts = _check_counts(counts, self._size, "gatherv")
        tmo = self._call_timeout(timeout, "gatherv")
        call = _Call(self, "gatherv", checked)
        send = call.inp(sendbuf, "sendbuf")
        out = None
        if self._rank == root:
            out = call.output(recvbuf, "recvbuf", lambda: _flat_like(send, _total(counts),
                                                                     "gatherv"))
        t = self._transport
        return call.submit(lambda seq: _rooted.gather(
            t, send, out, counts, root, seq, tmo), call.result, async_op,
            root=root)

    @_refusable
    def _scatter_any(self, sendbuf, recvbuf=None, root=0, async_op=False, timeout=None):
        # scatter() in every form (pycollect/_ext/_call.pyx answers the commonest itself)
        checked = self._detail and dict(sendbuf=sendbuf, recvbuf=recvbuf, root=root)
        root = self._check_root(root, "scatter")
        tmo = self._call_timeout(timeout, "scatter")
        call = _Call(self, "scatter", checked)
        send = call.inp(sendbuf, "sendbuf") if sendbuf is not None else None
        recv = call.output(recvbuf, "recvbuf", lambda: _block_of(
            _needed(send, "scatter", "sendbuf"), self._size, "scatter", squeeze=True))
        send = send if self._rank == root else None
        t = self._transport
        return call.submit(lambda seq: _rooted.scatter(
            t, send, recv, None, root, seq, tmo), call.result, async_op, root=root)

    @_refusable
    def _scatterv_any(self, sendbuf, counts, recvbuf=None, root=0, async_op=False,
                      timeout=None):
        # scatterv() in every form (pycollect/_ext/_call.pyx answers the commonest itself)
        checked = self._detail and dict(sendbuf=sendbuf, counts=counts, recvbuf=recvbuf,
                                        root=root)
        root = self._check_root(root, "scatterv")
        counts = _check_counts(counts, self._size, "scatterv")
        tmo = self._call_timeout(timeout, "scatterv")
        call = _Call(self, "scatterv", checked)
        send = call.inp(sendbuf, "sendbuf") if sendbuf is not None else None
        recv = call.output(recvbuf, "recvbuf", lambda: _flat_like(
            _needed(send, "scatterv", "sendbuf"), _total(counts, self._rank),
            "scatterv"))
        send = send if self._rank == root else None
        t = self._transport
        return call.submit(lambda seq: _rooted.scatter(
            t, send, recv, counts, root, seq, tmo), call.result, async_op,
            root=root)

    @_refusable
    def _reduce_scatter_any(self, sendbuf, recvbuf=None, op=ReduceOp.SUM, async_op=False,
                            timeout=None):
        # reduce_scatter() in every form (pycollect/_ext/_call.pyx answers the commonest itself)
        checked = self._detail and dict(sendbuf=sendbuf, recvbuf=recvbuf, op=op)
        op = self._check_op(op, "reduce_scatter")
        tmo = self._call_timeout(timeout, "reduce_scatter")
        call = _Call(self, "reduce_scatter", checked)
        send = call.inp(sendbuf, "sendbuf")
        recv = call.output(recvbuf, "recvbuf", lambda: _block_of(send, self._size,
                                                                 "reduce_scatter"))
        t, seg = self._transport, self._segment_bytes
        return call.submit(lambda seq: _reduce_scatter.reduce_scatter(
            t, send, recv, None, op, seq, tmo, seg), call.result, async_op)

    @_refusable
    def _reduce_scatterv_any(self, sendbuf, recvbuf=None, counts=None, op=ReduceOp.SUM,
                             async_op=False, timeout=None):
        # reduce_scatterv() in every form (pycollect/_ext/_call.pyx answers the commonest)
        checked = self._detail and dict(sendbuf=sendbuf, recvbuf=recvbuf, counts=counts, op=op)
        op = self._check_op(op, "reduce_scatterv")
        counts = _check_counts(counts, self._size, "reduce_scatterv")
        tmo = self._call_timeout(timeout, "reduce_scatterv")
        call = _Call(self, "reduce_scatterv", checked)
        send = call.inp(sendbuf, "sendbuf")
        recv = call.output(recvbuf, "recvbuf", lambda: _flat_like(send, _total(counts, self._rank),
                                                                  "reduce_scatterv"))
        t, seg = self._transport, self._segment_bytes
        return call.submit(lambda seq: _reduce_scatter.reduce_scatter(
            t, send, recv, counts, op, seq, tmo, seg), call.result, async_op)

    @_refusable
    def _alltoall_any(self, sendbuf, recvbuf=None, async_op=False, timeout=None):
        # alltoall() in every form (pycollect/_ext/_call.pyx answers the commonest itself)
        checked = self._detail and dict(sendbuf=sendbuf, recvbuf=recvbuf)
        tmo = self._call_timeout(timeout, "alltoall")
        call = _Call(self, "alltoall", checked)
        send = call.inp(sendbuf, "sendbuf")
        recv = call.output(recvbuf, "recvbuf", lambda: np.empty_like(_as_array(send,
                                                                               "alltoall")))
        send = _staged_in_place(send, recv)
        t = self._transport
        return call.submit(lambda seq: _alltoall.alltoall(
            t, send, None, recv, None, seq, tmo), call.result, async_op)

    @_refusable
    def _alltoallv_any(self, sendbuf, sendcounts, recvbuf=None, recvcounts=None, async_op=False,
                       timeout=None):
        # alltoallv() in every form (pycollect/_ext/_call.pyx answers the commonest itself)
        checked = self._detail and dict(sendbuf=sendbuf, sendcounts=sendcounts, recvbuf=recvbuf,
                                        recvcounts=recvcounts)
        sendcounts = _check_counts(sendcounts, self._size, "alltoallv", "sendcounts")
        recvcounts = _check_counts(recvcounts, self._size, "alltoallv", "recvcounts")
        tmo = self._call_timeout(timeout, "alltoallv")
        call = _Call(self, "alltoallv", checked)
        send = call.inp(sendbuf, "sendbuf")
        recv = call.output(recvbuf, "recvbuf", lambda: _flat_like(send, _total(recvcounts),
                                                                  "alltoallv"))
        send = _staged_in_place(send, recv)
        t = self._transport
        return call.submit(lambda seq: _alltoall.alltoall(
            t, send, sendcounts, recv, recvcounts, seq, tmo), call.result, async_op)

    @_refusable
    def allreduce_coalesced(self, bufs, op=ReduceOp.SUM, async_op=False, timeout=None):
        """Allreduce many arrays in place with one collective per dtype; return ``bufs``."""
        checked = self._detail and dict(bufs=bufs, op=op)
        op = self._check_op(op, "allreduce_coalesced")
        tmo = self._call_timeout(timeout, "allreduce_coalesced")
        call = _Call(self, "allreduce_coalesced", checked)
        try:
            bufs = list(bufs)
        except TypeError:
            raise InvalidArgument("allreduce_coalesced: bufs must be a list of arrays, got %r"
                                  % (bufs,)) from None
        groups = {}
        for i, b in enumerate(bufs):
            data = call.inout(b, "bufs[%d]" % i)
            code, _ = _buffer.check(data, "allreduce_coalesced", "bufs[%d]" % i, True)
            groups.setdefault(code, []).append(np.asarray(data))
        t, seg = self._transport, self._segment_bytes

        def run(seq):
            # One collective per dtype, numbered seq, seq+1, ...
            algo = None
            for arrays in groups.values():
                flat = np.concatenate([a.reshape(-1) for a in arrays])
                algo = self.plan("allreduce_coalesced", flat).code
                _allreduce.allreduce(t, flat, op, algo, seq, tmo, seg)
                offset = 0
                for a in arrays:
                    a.reshape(-1)[...] = flat[offset:offset + a.size]
                    offset += a.size
                seq = (seq + 1) & 0xFFFFFFFF
            return algo

        if not groups:
            return self._finished(bufs, async_op)
        return call.submit(run, bufs, async_op, span=len(groups))

    def _refuse(self, what, exc, seq=None):
        """This rank refused its arguments to collective ``what`` (``exc`` says why): tell
        the peers, so that those running it fail at once with an error naming this rank,
        the call and the reason instead of at their deadline, and take its sequence
        number as they do.  ``seq``: the number, when it was running already (under the
        lock); else the refusal takes its turn like a collective."""
        if getattr(exc, "_refusal_sent", False):
            return
        exc._refusal_sent = True
        if self._size == 1 or self._closed or self._failure is not None:
            return
        t, tmo, wire = self._transport, self._timeout, _REFUSED_AS.get(what, what)
        try:
            if seq is None:
                self._submit(what, lambda seq: _transport.refuse(t, seq, wire, str(exc), tmo),
                             None, False)
            elif not t.is_failed:
                self._seq = seq
                _transport.refuse(t, seq, wire, str(exc), tmo)
        except Error as err:    # the peers are gone: the context failed, the refusal stands
            log.warning("rank %d: could not tell the peers that %s was refused: %s",
                        self._rank, what, err)

    # -- value forms ------------------------------------------------------

    def _number(self, what, value, async_op, collective, timeout, op, result_here=True):
        """Run ``collective`` (with ``op``) on a one-element array holding the number
        ``value``; return the resulting number (with ``async_op``, a Work whose result it
        is).  A Python int's SUM is exact (no int64 wrap) and its PRODUCT refused where it
        may not fit: ``_int_number``.  ``result_here``: this rank gets the result (reduce's
        root); elsewhere the call returns None, as mpi4py's ``comm.reduce`` does."""
        if isinstance(value, int) or type(value) is np.int64:   # both travel as Python's
            arr, pick = _int_number(value, what, _as_reduce_op(op), result_here)
        else:
            arr = _number_array(value, what)
            if isinstance(value, np.number):
                def pick():
                    return arr[0]
            else:
                def pick():
                    return type(value)(arr[0].item())
        if not result_here:
            def pick():
                return None
        if not async_op:
            collective(arr, timeout=timeout)
            return pick()
        later = Later()
        work = Work("%s on rank %d" % (what, self._rank), later)

        def done(inner):
            exception = inner.exception()
            if exception is None:
                try:
                    later.value = pick()
                except Error as exc:
                    exception = exc
            work.complete(inner.algorithm, exception)

        inner = collective(arr, timeout=timeout, async_op=True)
        work.ends_with(inner)
        inner.add_done_callback(done)
        return work

    def allreduce_object(self, obj, op=ReduceOp.SUM, timeout=None):
        """Reduce any picklable values across ranks, as mpi4py's ``comm.allreduce(obj, op)``:
        ``op`` is SUM, PRODUCT, MIN or MAX (Python's +, *, min, max) or a function of
        two values; every rank gets the result, combined in rank order (pickle)."""
        with self._inside("allreduce_object"):
            args = self._object_args("allreduce_object", timeout, op=op)
            values = self._allgather_objects(obj, args, "allreduce_object")
        return _combined(args.fn, values, "allreduce_object")

    def reduce_object(self, obj, root=0, op=ReduceOp.SUM, timeout=None):
        """``allreduce_object``'s result on root, None elsewhere (pickle)."""
        with self._inside("reduce_object"):
            args = self._object_args("reduce_object", timeout, root, op)
            values = self._gather_objects(obj, args, "reduce_object")
        return None if values is None else _combined(args.fn, values, "reduce_object")

    # -- point to point --------------------------------------------------
    #
    # Receives match messages by (source, tag), as MPI's do (pycollect/_ext/_p2p.pyx):
    # a message that arrives before its receive waits in this context's mailbox.

    def _send_any(self, buf, dst, tag=0, async_op=False, timeout=None):
        # send() in every form (pycollect/_ext/_call.pyx answers the commonest itself)
        dst = self._check_peer(dst, "send", "dst")
        tag = self._check_tag(tag, "send", allow_any=False)
        tmo = self._call_timeout(timeout, "send")
        buf = _Call(self, "send", None).inp(buf, "buf")
        _buffer.check(buf, "send", "buf", False)
        t = self._transport
        return self._submit("send", lambda seq: _p2p.send(t, buf, dst, tag, tmo), None,
                            async_op, span=0,
                            queued=P2P(False, buf, dst, tag, self, None, tmo),
                            peer=dst, described=buf)

    def _recv_any(self, buf, src=ANY_SOURCE, tag=0, async_op=False, *, status=None,
                  timeout=None):
        # recv() in every form (pycollect/_ext/_call.pyx answers the commonest itself)
        if src != ANY_SOURCE:
            src = self._check_peer(src, "recv", "src")
        tag = self._check_tag(tag, "recv", allow_any=True)
        tmo = self._call_timeout(timeout, "recv")
        call = _Call(self, "recv", None)
        data = call.inout(buf, "buf")
        _buffer.check(data, "recv", "buf", True)
        t, box = self._transport, self._mailbox
        got = Later(status)

        def run(seq):
            got.value = got.status.set(*_p2p.recv(t, box, data, src, tag, tmo))
            for host in call.staged:
                host.finish()
            return None

        queued = P2P(True, data, src, tag, self, got, tmo, call.staged)
        if async_op:
            return self._submit("recv", run, got, True, span=0, queued=queued, peer=src,
                                described=data)
        self._submit("recv", run, None, False, span=0, queued=queued, peer=src,
                     described=data)
        return got.value.source

    def probe(self, src=ANY_SOURCE, tag=ANY_TAG, timeout=None):
        """Wait for a message from ``src`` with ``tag`` and describe it, without receiving
        it: a ``Status`` (source, count in elements of its dtype, tag)."""
        return self._probe("probe", src, tag, timeout, True)

    def iprobe(self, src=ANY_SOURCE, tag=ANY_TAG):
        """``probe`` that does not wait: the Status of a message here now, or None."""
        return self._probe("iprobe", src, tag, None, False)

    def _probe(self, what, src, tag, timeout, block):
        if src != ANY_SOURCE:
            src = self._check_peer(src, what, "src")
        tag = self._check_tag(tag, what, allow_any=True)
        tmo = self._call_timeout(timeout, what)
        if self._runner is not None and not self._detail and not self._logs:
            got = self._probe_beside_batch(src, tag, tmo, block)
            if got is not False:
                return None if got is None else Status(got[0], got[1] // _itemsize(got[3]),
                                                       got[2])
        t, box, found = self._transport, self._mailbox, []

        def run(seq):
            found.append(_p2p.probe(t, box, src, tag, tmo, block))
            return None

        self._submit(what, run, None, False, span=0, peer=src)
        if found[0] is None:
            return None
        source, nbytes, msg_tag, dtype = found[0]
        return Status(source, nbytes // _itemsize(dtype), msg_tag)

    def _sendrecv_any(self, sendbuf, dst, recvbuf, src=ANY_SOURCE, sendtag=0, recvtag=ANY_TAG,
                      *, status=None, timeout=None):
        # sendrecv() in every form (pycollect/_ext/_call.pyx answers the commonest itself).
        # Both ranks, tags and arrays are checked before the send goes out: a refused
        # receive must not leave its send on the wire.
        self._check_peer(dst, "sendrecv", "dst")
        if src != ANY_SOURCE:
            self._check_peer(src, "sendrecv", "src")
        self._check_tag(sendtag, "sendrecv", allow_any=False)
        self._check_tag(recvtag, "sendrecv", allow_any=True)
        for buf, arg, writable in ((sendbuf, "sendbuf", False), (recvbuf, "recvbuf", True)):
            if not is_tensor(buf):
                _buffer.check(buf, "sendrecv", arg, writable)
        views = _Call(self, "sendrecv", None)       # a tensor as the array it is checked as
        _buffer.apart(views.inp(sendbuf, "sendbuf"), views.inp(recvbuf, "recvbuf"),
                      "sendrecv", ", or sendrecv_replace with one")
        sent = self.send(sendbuf, dst, sendtag, async_op=True, timeout=timeout)
        got = self.recv(recvbuf, src, recvtag, async_op=True, status=status, timeout=timeout)
        wait_all([sent, got])
        return got.result().source

    def sendrecv_replace(self, buf, dst, src=ANY_SOURCE, sendtag=0, recvtag=ANY_TAG, *,
                         status=None, timeout=None):
        """sendrecv with one buffer: ``buf`` goes to ``dst``, and what ``src`` sends
        replaces it (MPI_Sendrecv_replace); return the source rank."""
        data = _Call(self, "sendrecv_replace", None).inp(buf, "buf")
        outgoing = np.array(np.asarray(data), copy=True)
        return self.sendrecv(outgoing, dst, buf, src, sendtag, recvtag, status=status,
                             timeout=timeout)

    def monitored_barrier(self, timeout=None):
        """A barrier whose failure names every rank that did not arrive in ``timeout`` seconds.

        Rank 0 collects one message from every other rank, then releases them
        all.  On expiry rank 0 raises ``Timeout`` listing the missing ranks, and
        the context fails on every rank (the others learn it at once).
        """
        timeout = self._call_timeout(timeout, "monitored_barrier")    # as every call's
        t, token = self._transport, np.zeros(1, np.uint8)

        def run(seq):
            if self._rank != 0:
                # Wait longer than rank 0 does, so that rank 0, which knows
                # who is missing, is the one to time out and report.
                _p2p.send(t, token, 0, _MONITOR_TAG, 2 * timeout + 1.0)
                _p2p.recv(t, self._mailbox, token, 0, _MONITOR_TAG, 2 * timeout + 1.0)
                return None
            arrived, end = {0}, _now() + timeout
            try:
                while len(arrived) < self._size:
                    src, _, _ = _p2p.recv(t, self._mailbox, token, ANY_SOURCE, _MONITOR_TAG,
                                          max(end - _now(), 1e-3))
                    arrived.add(src)
            except Timeout:
                missing = sorted(set(range(self._size)) - arrived)
                raise Timeout("rank 0: monitored_barrier: rank(s) %s did not arrive within "
                              "%g s (arrived: %s)" % (", ".join(map(str, missing)), timeout,
                                                      sorted(arrived))) from None
            for r in range(1, self._size):
                _p2p.send(t, token, r, _MONITOR_TAG, max(end - _now(), 1e-3))
            return None

        return self._submit("monitored_barrier", run, None, False, span=0)

    # -- sub-groups -------------------------------------------------------

    def split(self, color, key=0):
        """MPI_Comm_split: ranks with the same ``color`` form a group ordered by (key, rank).

        Every rank calls it; a rank passing ``color=None`` (or a negative color)
        gets None.  The group reuses this context's connections.
        """
        for name, value in (("color", color), ("key", key)):
            if value is not None and not isinstance(value, (int, np.integer)) \
                    or isinstance(value, bool) or (name == "key" and value is None):
                raise InvalidArgument("split: %s must be an int%s, got %r" % (
                    name, " or None" if name == "color" else "", value))
            if value is not None and not -2**63 <= value < 2**63:
                raise InvalidArgument("split: %s %d does not fit in 64 bits" % (name, value))
        mine = -1 if color is None else int(color)
        table = self.allgather(np.array([mine, int(key)], np.int64)).reshape(self._size, 2)
        number = self._groups_made
        self._groups_made += 1
        if mine < 0:
            return None
        members = sorted((r for r in range(self._size) if table[r, 0] == mine),
                         key=lambda r: (table[r, 1], r))
        return self._group(members, ("split", number, mine))

    def new_group(self, ranks):
        """A group of ``ranks`` (group rank i is ``ranks[i]``); None on ranks outside it.

        Every rank of this context calls it, with the same list, in the same order
        as its other new_group and split calls.
        """
        if self._closed:
            raise Error("rank %d: new_group: the context is closed" % self._rank)
        try:
            ranks = list(ranks)
        except TypeError:
            raise InvalidArgument("new_group: ranks must be a list of ranks, got %r"
                                  % (ranks,)) from None
        members = [self._check_rank(r, "new_group", "rank") for r in ranks]
        if len(set(members)) != len(members) or not members:
            raise InvalidArgument("new_group: ranks must be distinct and non-empty, got %r"
                                  % (list(ranks),))
        number = self._groups_made
        self._groups_made += 1
        if self._rank not in members:
            return None
        return self._group(members, ("new_group", number, tuple(members)))

    def phase_group(self, members, recipe):
        """A ``PhaseGroup`` of this context's ranks ``members`` for the phases of a composite
        collective (``pycollect/hierarchy.py``): named by ``recipe`` (the same on every
        member), never numbered like ``split`` and ``new_group``, and run inside a collective
        of this context, under its sequence number and deadline."""
        group_id = zlib.crc32(repr((self._group_id, recipe)).encode()) or 1
        transport = GroupTransport(self._transport, members, group_id)
        kinds, host_ids = self._pair_kinds(), self._transport.host_ids
        shm = len(members) > 1 and all(_shared(kinds[m]) for m in members)
        multi = host_ids is not None and multi_level([host_ids[m] for m in members],
                                                    len(members))
        return PhaseGroup(members.index(self._rank), len(members), transport,
                          self._segment_bytes, selection.Facts(len(members), shm, multi))

    def plan(self, collective, buf, algorithm="auto"):
        """The ``selection.Plan`` that ``collective`` ("allreduce", "allreduce_coalesced",
        "broadcast", "reduce" or "allgather") runs for ``buf`` with ``algorithm`` in this group."""
        if not isinstance(collective, str) or collective not in selection.FLAT:
            raise InvalidArgument("plan: %r is not a collective that picks an algorithm "
                                  "(choose from %s)" % (collective, ", ".join(selection.FLAT)))
        if algorithm != "auto":
            if collective == "allreduce":
                algorithm = allreduce_algorithm(algorithm)[0]   # "bcube:B": bcube, B checked
            return selection.named(collective, algorithm)
        # The rules of this group, scanned here: the small-message path of every collective.
        rules = self._rules.get(collective) or self._auto_rules(collective)
        try:
            nbytes = buf.nbytes
        except AttributeError:
            nbytes = _nbytes(buf)
        for min_bytes, plan in rules:
            if nbytes >= min_bytes:
                return plan

    def _auto_rules(self, collective):
        """auto's rules of ``collective`` in this group: ((min_bytes, Plan), ...), found once
        (the compiled call path copies them too)."""
        rules = self._rules.get(collective)
        if rules is None:
            if self._selector is None:
                self._selector = selection.Selector(selection.Facts(
                    self._size, self._all_shared(), self._topology.multi_level,
                    self._transport.flag_area is not None))
            rules = self._rules[collective] = self._selector.rules(collective)
        return rules

    def _group(self, members, recipe):
        group_id = zlib.crc32(repr((self._group_id, recipe)).encode()) or 1
        transport = GroupTransport(self._transport, members, group_id)
        if recipe[0] == "split":
            name = "split#%d color %s" % recipe[1:]
        else:
            name = "new_group#%d %s" % (recipe[1], list(recipe[2]))
        name = "%s > %s" % (self._name, name) if self._name else name
        group = Context(members.index(self._rank), len(members), transport,
                        timeout=self._timeout, segment_bytes=self._segment_bytes,
                        debug=self._debug, lock=self._lock, group_id=group_id, name=name)
        # One runner for a context and its sub-groups: their async calls run in the order
        # this rank made them, as their blocking calls do (each context's own runner ran
        # them in an order of its own, which could differ between ranks).
        group._runner = self._started_runner()
        group._runner_shared = True
        group.unpickle_allow = self._unpickle_allow
        return group

    # -- surviving a lost rank --------------------------------------------

    def shrink(self, exclude=None, timeout=None):
        """A new Context of the ranks that are neither in ``exclude`` nor gone, renumbered
        in their old order, over this context's connections (no store, no new listener).

        Call it on every surviving rank after a failure, or on every rank at any time
        with ``exclude`` to drop ranks on purpose (every rank passes the same list; an
        excluded rank gets None at once).  The survivors agree on who is gone
        (pycollect/recovery.py), so each gets the same group; a rank that waits longer
        than ``timeout`` seconds (default: the context's) to answer is gone too.  This
        context stays failed.  A rank that dies during the shrink makes it raise
        ``PeerError``: call shrink again.  None on a rank left out.
        """
        exclude = self._check_excluded(exclude, "shrink")
        if self._rank in exclude:
            self._retire("rank %d was excluded by shrink()" % self._rank)
            return None
        members, _ = self._survivors(exclude, True, timeout, "shrink")
        if self._rank not in members:
            self._retire("shrink() left rank %d out (its links to the others broke)"
                         % self._rank)
            return None
        group = self._group(members, ("shrink", self._recoveries, tuple(members)))
        # The new context owns the connections now: closing it closes them.
        group._on_close = [self._transport.close] + self._on_close
        self._on_close = []
        self._handed_over = True
        self._retire("rank %d: the context was shrunk to ranks %s of it; use the context "
                     "shrink() returned" % (self._rank, members))
        log.info("rank %d: shrunk to %d rank(s) %s", self._rank, len(members), members)
        return group

    def agree(self, flag, timeout=None):
        """A fault-tolerant AND of ``flag`` over the ranks that are alive (ULFM's agree):
        every live rank gets the same answer, even when ranks died before or during the
        call.  Works on a failed context.  A healthy context stays usable if every rank
        took part; when some are gone it becomes failed (``shrink()`` goes on without
        them)."""
        try:
            flag = bool(flag)
        except Exception as exc:      # an array of many elements, an object that refuses
            raise InvalidArgument("agree: flag must be true or false, got %r (%s)"
                                  % (flag, exc)) from None
        members, result = self._survivors((), flag, timeout, "agree")
        if len(members) < self._size and self._failure is None:
            gone = sorted(set(range(self._size)) - set(members))
            self._failure = PeerError("rank %d: agree() found rank(s) %s gone; shrink() the "
                                      "context to go on without them"
                                      % (self._rank, ", ".join(map(str, gone))))
        return result

    def _survivors(self, exclude, flag, timeout, what):
        timeout = self._call_timeout(timeout, what)
        if self._closed:
            raise Error("rank %d: the context is closed" % self._rank)
        if self._handed_over:
            raise Error("rank %d: %s: the context was shrunk already; use the context "
                        "shrink() returned" % (self._rank, what))
        entry = None if self._recorder is None else self._recorder.record(
            what, None, None, None)
        with self._lock:
            if self._transport.take_abort() and self._failure is None:
                # An abort() no operation raised: the context is failed, and this call,
                # which runs on failed contexts, goes on with every rank.
                self._failure = Aborted("rank %d: abort() was called" % self._rank)
            self._recoveries += 1
            gid = zlib.crc32(repr((self._group_id, what, self._recoveries)).encode()) or 1
            if entry is not None:
                self._recorder.started(entry, None)
            try:
                found = recovery.survivors(self._transport, self._rank, self._size, exclude,
                                           flag, float(timeout), gid)
            except BaseException as exc:
                if entry is not None:
                    self._recorder.ended(entry, None, exc)
                raise
        if entry is not None:
            self._recorder.ended(entry, None)
        return found

    def _check_excluded(self, exclude, what):
        if exclude is None:
            return set()
        try:
            ranks = list(exclude)
        except TypeError:
            raise InvalidArgument("%s: exclude must be a list of ranks, got %r"
                                  % (what, exclude)) from None
        return {self._check_rank(r, what, "excluded rank") for r in ranks}

    def _retire(self, why):
        """Fail this context for good (shrink replaced it or left this rank out)."""
        if self._failure is None:
            self._failure = Aborted(why)

    # -- object collectives (pickle: only with trusted peers) -------------
    #
    # Each is made of array collectives; an error names the user's call, and an
    # argument one rank refuses (a root, op or timeout out of place, a value that
    # does not pickle, a wrong-length list on root) travels in the first exchange,
    # so that every rank raises the same InvalidArgument and the context stays
    # usable everywhere.

    def _object_args(self, what, timeout, root=_ABSENT, op=_ABSENT):
        """An object collective's ``timeout``, ``root`` (where it has one) and ``op`` (where
        it reduces), checked on this rank: an ``_ObjectArgs`` whose ``refusal`` (bytes, b""
        where none) travels in the first exchange instead of raising here, where the other
        ranks would not hear of it.  A refused timeout leaves the context's for that
        exchange; a refused root leaves None."""
        args = _ObjectArgs()
        try:
            args.timeout = self._call_timeout(timeout, what)
        except InvalidArgument as exc:
            args.refusal = _reason(exc, what)
        if root is not _ABSENT:
            try:
                args.root = self._check_root(root, what)
            except InvalidArgument as exc:
                args.refusal = args.refusal or _reason(exc, what)
        if op is not _ABSENT:
            try:
                args.fn = _object_op(op, what)
                args.terms = "op %s" % _op_name(op)
            except InvalidArgument as exc:
                args.refusal = args.refusal or _reason(exc, what)
        return args

    def broadcast_object(self, obj=None, root=0, timeout=None):
        """Return root's ``obj`` on every rank (pickle protocol 5, buffers out of band)."""
        with self._inside("broadcast_object"):
            args = self._object_args("broadcast_object", timeout, root)
            root, timeout, refusal = args.root, args.timeout, None
            if self._rank == root and not args.refusal:
                try:
                    buffers = []
                    main = unpickle.dumps(obj, buffer_callback=buffers.append)
                    parts = [np.frombuffer(main, np.uint8)] + [
                        np.frombuffer(b.raw(), np.uint8) for b in buffers]
                    sizes = np.array([len(parts)] + [p.size for p in parts], np.int64)
                except Exception as exc:      # raised on every rank below
                    refusal = "%s: %s" % (type(exc).__name__, exc)
                    sizes = np.zeros(0, np.int64)
            else:
                sizes = np.zeros(0, np.int64)
            text = args.refusal or _encoded(refusal)
            # An allgather, not a broadcast from root: every rank checks that all name
            # the same root (a broadcast's root does not wait for the others).
            count = self._agreed(sizes.size, text, "broadcast_object", args)[root]
            if self._rank != root:
                sizes = np.zeros(int(count), np.int64)
            self.broadcast(sizes, root, timeout=timeout)
            if self._rank != root:
                parts = [np.empty(int(n), np.uint8) for n in sizes[1:]]
            for p in parts:
                self.broadcast(p, root, timeout=timeout)
            if self._rank == root:
                return obj
            return self._unpickled(parts[0], root, parts[1:])

    def allgather_object(self, obj, timeout=None):
        """Return the list of every rank's ``obj`` in rank order (pickle)."""
        with self._inside("allgather_object"):
            return self._allgather_objects(
                obj, self._object_args("allgather_object", timeout), "allgather_object")

    def _allgather_objects(self, obj, args, what):
        """allgather_object's steps, for the user's call ``what`` with its checked ``args``
        (``args.terms``: what every rank must pass alike besides, allreduce_object's op,
        checked with the sizes)."""
        data, text = _pickled(obj, args.refusal)
        sizes = self._agreed(data.size, text, what, args)
        out = np.empty(int(sizes.sum()), np.uint8)
        self.allgatherv(data, out, sizes.tolist(), timeout=args.timeout)
        return self._unpickled_blocks(out, sizes)

    def gather_object(self, obj, root=0, timeout=None):
        """Return the list of every rank's ``obj`` on root, None elsewhere (pickle)."""
        with self._inside("gather_object"):
            return self._gather_objects(
                obj, self._object_args("gather_object", timeout, root), "gather_object")

    def _gather_objects(self, obj, args, what):
        """gather_object's steps (``args``, ``what``: as ``_allgather_objects``'s)."""
        data, text = _pickled(obj, args.refusal)
        sizes = self._agreed(data.size, text, what, args)
        root = args.root
        out = np.empty(int(sizes.sum()), np.uint8) if self._rank == root else None
        self.gatherv(data, out, sizes.tolist(), root, timeout=args.timeout)
        return self._unpickled_blocks(out, sizes) if self._rank == root else None

    def _agreed(self, count, text, what, args):
        """Allgather this rank's ``count`` and refusal (``text``, b"" where none) with a
        checksum of what the ranks must do alike (the user's call ``what``; ``args.root``,
        None where there is none; ``args.terms``); return every rank's count.  Where a rank
        refused, every rank raises every rank's refusal (the ranks then need not agree on
        the rest: a refused root is none, and a refusing rank sends no checksum); else,
        where the checksums differ, every rank raises the same MismatchError, naming what
        each did.  An object collective's values are reduced (or kept) by each rank itself:
        ranks that disagree on the call, root or op would otherwise each go on with an
        answer of its own, and no later call would notice."""
        root, terms, timeout = args.root, args.terms, args.timeout
        said = ("root %d" % root if root is not None else "") + \
            (", " if root is not None and terms else "") + terms
        mine = _encoded("%s\0%s" % (what, said))
        table = self.allgather(np.array([count, len(text), -1 if text else zlib.crc32(mine)],
                                        np.int64), timeout=timeout).reshape(self._size, 3)
        if table[:, 1].any():
            self._refused_anywhere(what, text, table[:, 1], timeout)
        if (table[:, 2] != table[0, 2]).any():
            lengths = self.allgather(np.array([len(mine)], np.int64),
                                     timeout=timeout).reshape(-1)
            out = np.empty(int(lengths.sum()), np.uint8)
            self.allgatherv(np.frombuffer(mine, np.uint8), out, lengths.tolist(),
                            timeout=timeout)
            each = [text.partition("\0")[::2] for text in _unbytes(out, lengths)]
            if len({call for call, _ in each}) == 1:
                raise MismatchError("ranks passed different arguments: %s" % "; ".join(
                    "rank %d %s" % (r, said or "(nothing)") for r, (_, said) in
                    enumerate(each)))
            raise MismatchError("ranks made different calls: %s" % "; ".join(
                "rank %d %s%s" % (r, call, " (%s)" % said if said else "") for r, (call, said)
                in enumerate(each)))
        return table[:, 0]

    def scatter_object(self, objs=None, root=0, timeout=None):
        """Return ``objs[rank]`` of root's list on every rank (pickle)."""
        with self._inside("scatter_object"):
            args = self._object_args("scatter_object", timeout, root)
            root, timeout = args.root, args.timeout
            refusal, data, sizes = None, None, np.zeros(self._size, np.int64)
            if self._rank == root and not args.refusal:
                try:
                    objs = list(objs)
                    if len(objs) != self._size:
                        raise InvalidArgument("root passed %d objects for %d ranks"
                                              % (len(objs), self._size))
                    blobs = [unpickle.dumps(o) for o in objs]
                    sizes = np.array([len(b) for b in blobs], np.int64)
                    data = np.frombuffer(b"".join(blobs), np.uint8)
                except Exception as exc:      # raised on every rank below
                    refusal = (str(exc) if isinstance(exc, InvalidArgument) else
                               "%s: %s" % (type(exc).__name__, exc)) or type(exc).__name__
            text = args.refusal or _encoded(refusal)
            # An allgather, not a broadcast: every rank checks that all name one root and
            # make one call (its row as long as the other object collectives' rows).
            self._agreed(0, text, "scatter_object", args)
            self.broadcast(sizes, root, timeout=timeout)
            mine = np.empty(int(sizes[self._rank]), np.uint8)
            self.scatterv(data, sizes.tolist(), mine, root, timeout=timeout)
            return self._unpickled(mine, root)

    def _unpickled(self, data, sender, buffers=None):
        """The object ``sender`` pickled into ``data`` (and out-of-band ``buffers``),
        loaded as this context's allow-list permits (``unpickle_allow``)."""
        try:
            return self._loads(data, buffers=buffers)
        except UnpicklingRefused as exc:
            raise UnpicklingRefused("rank %d did not unpickle the object from rank %d: %s"
                                    % (self._rank, sender, exc)) from None
        except Exception as exc:    # not a pickle: what the unpickler stumbled on
            raise UnpicklingRefused("rank %d could not unpickle the object from rank %d: "
                                    "%s: %s" % (self._rank, sender, type(exc).__name__,
                                                exc)) from exc

    def _unpickled_blocks(self, data, sizes):
        """Every rank's object, block r of ``data`` (``sizes[r]`` bytes) from rank r."""
        out, offset = [], 0
        for rank, n in enumerate(sizes):
            out.append(self._unpickled(data[offset:offset + int(n)], rank))
            offset += int(n)
        return out

    def _refused_anywhere(self, what, text, lengths, timeout):
        """Some ranks refused their arguments (reason ``lengths[r]`` bytes long, ``text``
        here): every rank receives every reason and raises them."""
        out = np.empty(int(lengths.sum()), np.uint8)
        self.allgatherv(np.frombuffer(text, np.uint8), out, lengths.tolist(), timeout=timeout)
        refusal = InvalidArgument("%s: %s" % (what, "; ".join(
            "rank %d refused its arguments: %s" % (r, why)
            for r, why in enumerate(_unbytes(out, lengths)) if why)))
        refusal.caused_elsewhere = not lengths[self._rank]
        raise refusal

    @contextlib.contextmanager
    def _inside(self, what):
        """Errors of the collectives inside ``what`` name ``what``, the user's call."""
        try:
            yield
        except Error as exc:
            if isinstance(exc, InvalidArgument) and str(exc).startswith(what + ":"):
                raise
            raise exc.restated("%s: %s" % (what, exc)) from exc

    # -- lifecycle --------------------------------------------------------

    def dump_trace(self, path=None):
        """Write this context's flight recorder (its last operations) to ``path`` (a file,
        or a directory that gets ``pycollect_trace_rank<R>.json``: one that exists or whose
        name ends with a separator; default PYCOLLECT_TRACE_DIR, a directory); return the
        file name.  A directory that does not exist yet is made.  ``pycollect-trace DIR``
        reads it."""
        if self._recorder is None:
            raise Error("rank %d: the flight recorder is off (PYCOLLECT_TRACE_SIZE=0)"
                        % self._rank)
        if path is not None and not isinstance(path, (str, os.PathLike)):
            raise InvalidArgument("dump_trace: path must be a str or a path, got %r" % (path,))
        path = self._trace_dir if path is None else os.fspath(path)
        if not isinstance(path, str) or not path:
            raise InvalidArgument("dump_trace: no path given and PYCOLLECT_TRACE_DIR is unset"
                                  if path is None else "dump_trace: path %r is not a file "
                                  "name" % (path,))
        if os.path.exists(path) and not (os.path.isdir(path) or os.path.isfile(path)):
            # The dump replaces a file by renaming over it: never a device or a pipe.
            raise InvalidArgument("dump_trace: %s is neither a directory nor a regular file"
                                  % path)
        try:
            if path == self._trace_dir or path.endswith(os.sep):
                os.makedirs(path, exist_ok=True)
            return self._recorder.dump(path, "dump_trace")
        except (OSError, ValueError) as exc:
            raise Error("rank %d: dump_trace: cannot write %s: %s" % (self._rank, path, exc)) \
                from exc

    def abort(self):
        """End the collective in progress on this rank (from any thread) with Aborted."""
        self._transport.abort()

    def close(self):
        """Close every connection; idempotent.  Collectives after close raise Error."""
        if self._closed:
            return
        self._closed = True
        runner = self._runner
        # A sub-group's queued work, in the runner it shares with its parent, fails when its
        # turn comes (the group is closed); the parent's goes on.
        if not self._handed_over and (self._busy or (runner is not None and not
                                                     self._runner_shared and runner.pending())):
            self._transport.abort(closing=True)   # work in flight or queued fails fast
        if runner is not None and not self._runner_shared:
            runner.stop(self._timeout)
        if self._recorder is not None:
            self._recorder.close()
        if self._handed_over:
            return          # the context shrink() made owns the connections
        with self._lock:
            self._transport.close()
            for fn in self._on_close:
                fn()

    def __enter__(self):
        if self._closed:
            raise Error("rank %d: the context is closed; open a new one with pycollect.init()"
                        % self._rank)
        return self

    def __exit__(self, *exc_info):
        self.close()

    # -- helpers ----------------------------------------------------------

    def _submit(self, name, op, result, async_op, span=1, queued=None, checked=None,
                root=None, peer=None, described=None):
        """Run ``op(seq)`` now or queue it (``queued``, when given, is what the queue
        takes instead: a send or receive); return ``result`` or a Work.

        ``checked``: the call's arguments, under ``PYCOLLECT_DEBUG=detail``, that every
        rank checks against the others' before the collective (pycollect/signature.py).
        ``root``, ``peer`` and ``described`` (the buffer, when not ``result``) are what
        the flight recorder notes besides the name.
        """
        runner = self._runner
        if not async_op and runner is not None and runner.in_callback():
            raise InvalidArgument(
                "%s: a blocking call cannot run in a done callback: callbacks run on the "
                "thread that runs this context's operations, and this one would wait for "
                "that thread; pass async_op=True, or make the call outside the callback"
                % name)
        sig = signature.encode(name, checked) if self._detail and checked is not None \
            else None
        rec = self._recorder
        entry = None if rec is None else rec.record(
            name, result if described is None else described, root,
            None if peer is None else [peer])
        # Run here only while holding the runner's claim, where there is a runner: another
        # thread may be beginning a send or receive (or driving a batch) that a call run
        # beside it would disturb; then this call queues behind it instead.
        claimed = not async_op and runner is not None and runner.claim()
        if async_op or (runner is not None and not claimed):
            if self._closed:
                raise Error("rank %d: the context is closed" % self._rank)
            work = Work("%s on rank %d" % (name, self._rank), result)
            self._started_runner()
            if queued is not None and entry is not None:
                # A queued send or receive runs inside a batch: it ends with its Work.
                rec.started(entry, None)
                work.add_done_callback(lambda w: rec.ended(entry, None, w.exception()))
            self._runner.submit(queued if queued is not None else (op, span, sig, entry), work,
                                self._execute)
            return work if async_op else work.wait()
        try:
            self._execute((op, span, sig, entry))
        finally:
            if claimed:
                runner.unclaim()
        return result

    def _started_runner(self):
        """The thread that runs this context's queued operations, started at first need."""
        if self._runner is None:
            self._runner = Runner(self._execute, "pycollect-rank%d" % self._rank,
                                  kick=self._transport.kick, wanted=self._lock)
        return self._runner

    def _pair_kinds(self):
        """Per rank: how it is reached ("self", "shm", "shm+cma", "tcp", ...)."""
        if self._kinds is None:
            self._kinds = self._transport.pair_kinds()
        return self._kinds

    def _all_shared(self):
        """Every pair is on this host's shared memory (the same answer on every rank)."""
        return self._size > 1 and all(_shared(k) for k in self._pair_kinds())

    def _finished(self, result, async_op):
        if not async_op:
            return result
        work = Work("no-op on rank %d" % self._rank, result)
        work.complete(None, None)
        return work

    def _execute(self, item):
        """Run ``op(seq)``, which uses ``span`` sequence numbers, under the context lock
        (after the cross-rank check of its signature ``sig``, when not None); ``entry`` is
        its flight recorder entry, or None.  A compiled call queued by ``CallPath.queue``
        (a ``Queued``) runs itself."""
        if type(item) is Queued:
            return item.execute()
        op, span, sig, entry = item
        with self._lock:
            if self._closed:
                raise Error("rank %d: the context is closed" % self._rank)
            if self._failure is not None:
                raise self._failure.restated(
                    "rank %d: the context failed earlier and cannot be used; open a new "
                    "context (%s)" % (self._rank, self._failure))
            seq = (self._seq + 1) & 0xFFFFFFFF
            if span and self._mailbox.sent_before(seq):
                self._unreceived(op, seq)
            # A collective consumes its sequence number once it has run; one whose
            # arguments this rank refused consumes it through _refuse.
            self._busy = True
            try:
                if sig is not None:
                    clash = signature.verify(self._transport, self._rank, self._size, sig, seq,
                                             self._timeout, self._segment_bytes)
                    self._seq = seq         # the check was collective #seq on every rank
                    if clash is not None:
                        raise clash
                    seq = (seq + 1) & 0xFFFFFFFF
                if entry is not None:
                    self._recorder.started(entry, seq if span else None)
                algo = op(seq)
            except BaseException as exc:    # KeyboardInterrupt fails the context too
                if self._transport.is_failed:
                    self._failure = exc if isinstance(exc, Error) else Aborted(
                        "rank %d: interrupted by %s" % (self._rank, type(exc).__name__))
                if entry is not None:
                    self._recorder.ended(entry, None, exc)
                    self._failed_trace(exc)
                raise
            finally:
                self._busy = False
            self._seq = (self._seq + span) & 0xFFFFFFFF
        name = ALGORITHM_NAMES.get(algo) or None
        if entry is not None:
            self._recorder.ended(entry, name)
        if self._logs:
            log.debug("rank %d%s: collective #%d ran %s", self._rank,
                      " of group %s" % self._name if self._name else "", self._seq,
                      name or "its only algorithm")
        return name

    def _failed_trace(self, exc):
        """Note the error that ended an operation; dump the recorder when it is a timeout,
        a mismatch or a peer failure and PYCOLLECT_TRACE_DIR is set."""
        rec = self._recorder
        if rec.failure is None and self._failure is not None:
            rec.failure = "%s: %s" % (type(exc).__name__, exc)
        if self._trace_dir is not None and isinstance(exc, (Timeout, MismatchError, PeerError)):
            try:
                os.makedirs(self._trace_dir, exist_ok=True)
                path = rec.dump(self._trace_dir, "%s" % type(exc).__name__)
                log.warning("rank %d: flight recorder written to %s", self._rank, path)
            except OSError as err:
                log.warning("rank %d: cannot write the flight recorder into %s: %s",
                            self._rank, self._trace_dir, err)

    def _unreceived(self, op, seq):
        """A collective met point-to-point messages nobody received: the program is out of
        step.  Fail this context, and the collective at once on every rank (abort frames)."""
        error = MismatchError(
            "rank %d: collective #%d began while point-to-point messages that arrived before "
            "it were never received (%s)" % (self._rank, seq, self._mailbox.unreceived()))
        self._mailbox.clear()
        self._failure = error
        self._transport.abort()
        try:
            op(seq)         # fails at once, telling the peers
        except Error:
            pass
        raise error

    def _call_timeout(self, timeout, what):
        """A call's deadline in seconds: ``timeout`` (seconds or a timedelta), else the context's."""
        if timeout is None:
            return self._timeout
        seconds = wait_seconds(timeout, what)
        if not 0 < seconds:
            raise InvalidArgument("%s: timeout must be a positive number of seconds, at most "
                                  "%d (about 23 days), got %r"
                                  % (what, settings.MAX_TIMEOUT_S, timeout))
        return seconds

    def _check_rank(self, rank, what, arg="root"):
        if not isinstance(rank, (int, np.integer)) or isinstance(rank, bool) \
                or not 0 <= rank < self._size:
            raise InvalidArgument("%s: %s %r is not a rank of this group (0..%d)"
                                  % (what, arg, rank, self._size - 1))
        return int(rank)

    _check_root = _check_rank

    def _check_peer(self, peer, what, arg):
        peer = self._check_rank(peer, what, arg)
        if peer == self._rank:
            raise InvalidArgument("%s: %s %d is this rank itself" % (what, arg, peer))
        return peer

    def _check_tag(self, tag, what, allow_any):
        if not isinstance(tag, (int, np.integer)) or isinstance(tag, bool) \
                or not (0 <= tag < 2 ** 31 or allow_any and tag == ANY_TAG):
            raise InvalidArgument("%s: tag %r must be an int in 0..2**31-1%s"
                                  % (what, tag, " or ANY_TAG" if allow_any else ""))
        return int(tag)

    def _check_op(self, op, what):
        checked = _as_reduce_op(op)
        if checked is None:
            raise InvalidArgument("%s: unknown reduction op %r (use pycollect.ReduceOp)"
                                  % (what, op))
        return checked


def allreduce_algorithm(algorithm):
    """(the name, the bcube base) of an allreduce's ``algorithm``: "bcube:B" is bcube in base
    B, which must be an integer in 2..16; any other is returned as it is, with the default
    base, for the plan to check."""
    if not (isinstance(algorithm, str) and algorithm.startswith("bcube:")):
        return algorithm, _allreduce.DEFAULT_BCUBE_BASE
    name, _, digits = algorithm.partition(":")
    try:
        base = int(digits)
    except ValueError:
        raise InvalidArgument("allreduce: bcube base %r is not an integer" % digits) from None
    if base not in _allreduce.BCUBE_BASES:
        raise InvalidArgument("allreduce: bcube base %d is outside %d..%d" % (
            base, _allreduce.BCUBE_BASES[0], _allreduce.BCUBE_BASES[-1]))
    return name, base


def _shared(kind):
    """A pair kind on shared memory (or this rank itself)."""
    return kind == "self" or kind.startswith("shm")


def _as_array(buf, what):
    """``sendbuf`` as the array its output is shaped from: raw bytes (``bytes``, a ``'c'``
    memoryview) as the uint8 the compiled side counts them as, where NumPy makes ``bytes`` a
    0-d string."""
    _buffer.check(buf, what, "sendbuf", False)
    if isinstance(buf, bytes) or isinstance(buf, memoryview) and buf.format == "c":
        view = memoryview(buf)
        return np.frombuffer(view, np.uint8).reshape(view.shape)
    return np.asarray(buf)


def _blocks_like(sendbuf, size, what):
    """A new array of ``size`` blocks shaped like ``sendbuf``: result[r] is rank r's block."""
    arr = _as_array(sendbuf, what)
    return np.empty((size,) + arr.shape, dtype=arr.dtype)


def _block_of(sendbuf, size, what, squeeze=False):
    """A new array for one of ``size`` blocks of ``sendbuf``: its first dimension divided by
    ``size`` (dropped when it equals ``size`` and ``squeeze``), else flat."""
    arr = _as_array(sendbuf, what)
    if arr.ndim and arr.shape[0] % size == 0:
        rows = arr.shape[0] // size
        shape = arr.shape[1:] if squeeze and rows == 1 else (rows,) + arr.shape[1:]
        return np.empty(shape, dtype=arr.dtype)
    if arr.size % size:
        raise InvalidArgument("%s: 'sendbuf' holds %d elements, not a multiple of the group "
                              "size %d" % (what, arr.size, size))
    return np.empty(arr.size // size, dtype=arr.dtype)


def _pickled(obj, refusal=b""):
    """(the pickle of ``obj``, b""), or (nothing, why it does not pickle, encoded); (nothing,
    ``refusal``) where the caller refused its arguments already."""
    if refusal:
        return np.zeros(0, np.uint8), refusal
    try:
        return np.frombuffer(unpickle.dumps(obj), np.uint8), b""
    except Exception as exc:      # raised on every rank, with the reason
        return np.zeros(0, np.uint8), _encoded("%s: %s" % (type(exc).__name__, exc))


def _encoded(reason):
    return b"" if reason is None else reason.encode("utf-8", "replace")


def _reason(exc, what):
    """An InvalidArgument's message without the call's name, encoded: a refusal's reason."""
    text = str(exc)
    return _encoded(text[len(what) + 2:] if text.startswith(what + ": ") else text)


class _ObjectArgs:
    """An object collective's arguments as ``Context._object_args`` checked them."""

    __slots__ = ("timeout", "root", "fn", "terms", "refusal")

    def __init__(self):
        self.timeout, self.root, self.fn, self.terms, self.refusal = None, None, None, "", b""


def _combined(fn, values, what):
    """``values`` (every rank's, in rank order) combined with ``fn``; what it raises, an
    InvalidArgument naming ``what`` (every rank that combines them combines the same values,
    so each of them raises it: every rank for allreduce_object, root for reduce_object; the
    context stays usable)."""
    try:
        return functools.reduce(fn, values)
    except Exception as exc:
        raise InvalidArgument("%s: the op failed on the ranks' values: %s: %s" % (
            what, type(exc).__name__, exc)) from exc


def _unbytes(data, sizes):
    out, offset = [], 0
    for n in sizes:
        out.append(bytes(data[offset:offset + int(n)]).decode("utf-8", "replace"))
        offset += int(n)
    return out


class _Call:
    """One collective call's buffers: torch tensors hosted as arrays (staged ones copied
    back when the collective has run), outputs left as None allocated, and the result."""

    __slots__ = ("ctx", "what", "checked", "staged", "tensor_in", "result")

    def __init__(self, ctx, what, checked):
        self.ctx, self.what, self.checked = ctx, what, checked
        self.staged = []
        self.tensor_in = False
        self.result = None

    def inp(self, obj, arg):
        """An input the collective only reads."""
        if is_tensor(obj):
            self.tensor_in = True
            return Host(obj, self.what, arg).array
        return obj

    def inout(self, obj, arg):
        """A buffer the collective writes (in place, or an output)."""
        if is_tensor(obj):
            self.tensor_in = True
            host = Host(obj, self.what, arg)
            if host.staging is not None:
                host.check_writable(self.what, arg)
                self.staged.append(host)
            return host.array
        return obj

    def output(self, obj, arg, allocate):
        """The output buffer: ``obj``, or ``allocate()`` when None (a tensor for tensor input)."""
        if obj is None:
            arr = allocate()
            self.result = as_tensor_like(arr) if self.tensor_in else arr
            return arr
        self.result = obj
        return self.inout(obj, arg)

    def out_of_place(self, sendbuf, recvbuf):
        """``recvbuf`` holding a copy of ``sendbuf`` (same dtype and count), to reduce in place."""
        send = self.inp(sendbuf, "buf")
        recv = self.inout(recvbuf, "recvbuf")
        if recv is send:
            return recv
        mine = _buffer.check(send, self.what, "buf", False)
        theirs = _buffer.check(recv, self.what, "recvbuf", True)
        if mine != theirs:
            raise InvalidArgument("%s: recvbuf (%s x %d) must have buf's dtype and element "
                                  "count (%s x %d)" % (self.what, DTYPES.get(theirs[0], "?"),
                                                       theirs[1], DTYPES.get(mine[0], "?"),
                                                       mine[1]))
        _bytes_of(recv)[...] = _bytes_of(send)
        return recv

    def submit(self, op, result, async_op, span=1, root=None):
        staged = self.staged
        if async_op and span == 1:
            # Arguments the compiled call refuses, when it runs later in the queue.
            checked_run, ctx, what = op, self.ctx, self.what

            def op(seq):
                try:
                    return checked_run(seq)
                except InvalidArgument as exc:
                    ctx._refuse(what, exc, seq)
                    raise
        if staged:
            run = op

            def op(seq):
                algo = run(seq)
                for host in staged:     # before the Work completes: its result is final
                    host.finish()
                return algo
        return self.ctx._submit(self.what, op, result, async_op, span, checked=self.checked,
                                root=root)


def _itemsize(dtype_code):
    """The element size of a wire dtype code (1 where NumPy does not know the name)."""
    try:
        return np.dtype(DTYPES.get(dtype_code, "uint8")).itemsize
    except TypeError:
        return 2 if DTYPES.get(dtype_code) == "bfloat16" else 1


def _bytes_of(buf):
    return np.asarray(buf).reshape(-1).view(np.uint8)


def _is_buffer(obj):
    """Whether ``obj`` looks like a buffer (for mpi4py's positional ``(sendbuf, recvbuf)``):
    not a NumPy scalar, which has an ``__array_interface__`` too (``op=np.int64(3)``)."""
    if isinstance(obj, np.generic):
        return False
    if isinstance(obj, (np.ndarray, memoryview, bytearray)) or is_tensor(obj) or any(
            hasattr(obj, a) for a in ("__array_interface__", "__cuda_array_interface__",
                                      "__dlpack__")):
        return True
    try:                        # anything else with the buffer protocol (array.array, ctypes)
        memoryview(obj).release()
    except TypeError:
        return False
    return True


def _no_recvbuf_for_a_number(recvbuf, what):
    """A number's reduction returns the reduced number: a ``recvbuf`` beside it would be left
    as it was."""
    if recvbuf is not None:
        raise InvalidArgument("%s: a number's result is returned, not written; pass an array "
                              "to have recvbuf filled, or no recvbuf" % what)


def _is_number(obj, what):
    """Whether ``obj`` is a number (its collective returns the reduced number); a bool is
    refused: Python's sum counts bools while a bool array's is a logical or."""
    if isinstance(obj, (bool, np.bool_)):
        raise InvalidArgument("%s: a bool is not taken as a number (Python's sum of bools "
                              "counts them, a bool array's is a logical or): pass int(...), "
                              "a one-element bool array, or use %s_object" % (what, what))
    return isinstance(obj, (int, float, complex, np.number))


def _number_array(value, what):
    """A one-element array holding ``value`` (Python ints as int64)."""
    if isinstance(value, np.number):
        return np.array([value])
    kind = {int: np.int64, float: np.float64, complex: np.complex128}[
        int if isinstance(value, int) else float if isinstance(value, float) else complex]
    try:
        return np.array([value], kind)
    except OverflowError:
        raise InvalidArgument("%s: %d does not fit in an int64; use %s_object for Python's "
                              "unbounded ints" % (what, value, what)) from None


# A Python int's SUM travels as two int64 limbs, value >> 32 and its low 32 bits: their sums
# over fewer than 2**31 ranks cannot wrap, and rebuild the exact sum.
_LIMB_BITS = 32


def _int_number(value, what, op, result_here):
    """The array for an integer ``value``, a Python int or a NumPy int64, and the function
    that reads the result from it.  SUM: two limbs, so the sum is exact however large (a
    NumPy int64 gets it wrapped, as NumPy's sum would be).  PRODUCT: the value and a
    witness, the least power of two 2**k >= |value| as an int64 (1 for 0 and 1; a poison,
    -2**63, past 2**62); the witnesses' product stays positive only while the exponents add
    up to at most 62, so that the product of the values, at most 2**62 in magnitude, fits,
    and otherwise every rank that gets a Python int's result raises instead of returning a
    wrapped number.  Other ops cannot leave the inputs' range.  Both kinds travel alike, so
    ranks may pass one each (``ctx.allreduce(0)`` beside ``ctx.allreduce(arr.sum())``)."""
    wrap = isinstance(value, np.integer)
    arr = _number_array(value, what)        # refuses a value beyond int64
    value = int(value)
    if op == ReduceOp.SUM:
        arr = np.array([value >> _LIMB_BITS, value & ((1 << _LIMB_BITS) - 1)], np.int64)

        def pick():
            total = (int(arr[0]) << _LIMB_BITS) + int(arr[1])
            return np.int64((total + (1 << 63)) % (1 << 64) - (1 << 63)) if wrap else total
    elif op == ReduceOp.PRODUCT:
        bits = (abs(value) - 1).bit_length() if abs(value) > 1 else 0
        arr = np.array([value, (1 << bits) if bits < 63 else -(1 << 63)], np.int64)

        def pick():
            if wrap:
                return arr[0]
            if result_here and arr[1] <= 0:
                raise Error("%s: the PRODUCT of the ranks' Python ints may not fit in an "
                            "int64 (their magnitudes, each rounded up to a power of two, "
                            "multiply past 2**62); use "
                            "%s_object for Python's unbounded ints" % (what, what))
            return int(arr[0])
    else:
        def pick():
            return arr[0] if wrap else int(arr[0])
    return arr, pick


_OBJECT_OPS = {ReduceOp.SUM: operator.add, ReduceOp.PRODUCT: operator.mul,
               ReduceOp.MIN: min, ReduceOp.MAX: max, ReduceOp.BAND: operator.and_,
               ReduceOp.BOR: operator.or_, ReduceOp.BXOR: operator.xor}


def _as_reduce_op(op):
    """``op`` as a ReduceOp: the member itself or its integer (a bool or a float is none);
    None for anything else."""
    if type(op) is ReduceOp:
        return op
    if isinstance(op, bool) or not isinstance(op, (int, np.integer)):
        return None
    try:
        return ReduceOp(int(op))
    except ValueError:
        return None


def _op_name(op):
    """How a rank's op is named when the ranks compare theirs (a function by its name)."""
    if callable(op) and not isinstance(op, ReduceOp):
        return "%s.%s" % (getattr(op, "__module__", None) or "?",
                          getattr(op, "__qualname__", None) or type(op).__qualname__)
    return _as_reduce_op(op).name


def _object_op(op, what):
    """A function of two values for ``op`` (a ReduceOp, or already a function)."""
    if callable(op) and not isinstance(op, ReduceOp):
        return op
    fn = _OBJECT_OPS.get(_as_reduce_op(op))
    if fn is None:
        raise InvalidArgument("%s: op %r has no meaning on Python values; pass SUM, PRODUCT, "
                              "MIN, MAX, BAND, BOR, BXOR or a function of two values"
                              % (what, op))
    return fn


def _check_counts(counts, size, what, arg="counts"):
    """``counts``, which must be given (the compiled call checks its entries)."""
    if counts is None:
        raise InvalidArgument("%s: %s is required (one element count per rank)" % (what, arg))
    return counts


def _total(counts, pick=None):
    """The element count an output needs for ``counts`` (all of them, or entry ``pick``);
    0 where they are malformed, which the compiled call then reports."""
    try:
        values = [operator.index(c) for c in counts]
        return max(values[pick] if pick is not None else sum(values), 0)
    except (TypeError, IndexError):
        return 0


def _needed(buf, what, arg):
    if buf is None:
        raise InvalidArgument("%s: recvbuf is None and there is no %s to size it from"
                              % (what, arg))
    return buf


def _staged_in_place(send, recv):
    """alltoall's in-place form (MPI_IN_PLACE): ``send`` and ``recv`` the very same memory.
    The exchange writes ``recv`` while the peers still read ``send``, so the send side goes
    from a copy; any other overlap the compiled call refuses (``check_apart``)."""
    try:
        mine, theirs = np.asarray(send), np.asarray(recv)
    except Exception:       # not arrays: the compiled call says what is wrong with them
        return send
    if (mine.nbytes and mine.nbytes == theirs.nbytes
            and mine.__array_interface__["data"][0] == theirs.__array_interface__["data"][0]):
        return mine.copy()
    return send


def _flat_like(sendbuf, count, what):
    """A new flat array of ``count`` elements of ``sendbuf``'s dtype."""
    dtype = _as_array(sendbuf, what).dtype
    try:
        return np.empty(count, dtype=dtype)
    except ValueError:      # more bytes than an array may have (MemoryError stays one)
        raise InvalidArgument("%s: the counts call for %d elements of %s, more than an "
                              "array can hold" % (what, count, dtype)) from None
