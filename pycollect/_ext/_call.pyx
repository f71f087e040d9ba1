"""The compiled call path: a Context's hot state, and its blocking calls on NumPy arrays.

``CallPath`` is the base class of ``pycollect.Context``.  It holds what every
call reads (the transport, the sequence number, the failure state, the
flight recorder, the lock) as C fields, and answers the commonest calls
itself: a blocking ``allreduce`` (in place), ``broadcast``, ``barrier``,
``reduce`` (in place), ``allgather``, ``gather``, ``scatter``,
``reduce_scatter``, ``alltoall``, their v-variants, ``send``, ``recv`` (without
``status=``) and ``sendrecv`` on C-contiguous NumPy arrays (the outputs given),
with ``algorithm="auto"`` or
a flat algorithm named (``"ring"``...), with the context's deadline or a
``timeout=`` in seconds.  For those the checks, the plan (auto's rules of this
group, copied into C arrays on first use), the flight recorder's slot, the
sequence number and the call into the algorithm stay in C; the algorithm
releases the GIL for the collective itself.

With ``async_op=True`` the same forms of ``barrier``, ``broadcast``, ``allreduce``,
``reduce``, ``allgather``, ``reduce_scatter`` and ``alltoall`` are checked and planned here
too and queued as a ``Queued`` call (or begun in the call: ``begin_posted``), which the
context's runner (or a thread waiting for it) runs (``run_queued``);
async ``send`` and ``recv`` of arrays begin here (``begin_p2p``).

Every other form (the other kinds' async handles, an allreduce's or a root's reduce
``recvbuf=``, outputs left to be allocated, numbers, torch tensors, a
``timeout=`` as a timedelta or one to refuse, ``"bcube:B"``, ``"hierarchical"``
or a name to refuse, a hierarchical plan, ``PYCOLLECT_DEBUG``, a context with
queued work or unreceived messages, or one that is failed or closed) goes to
the Context's Python method of the same name with a leading ``_`` and trailing
``_any`` (``_allreduce_any``...), which validates and reports exactly as before
(``allreduce_coalesced``, probes and ``sendrecv_replace`` have only that
path).  Both paths number, record and fail a call alike: ``_execute`` in
pycollect/context.py and ``run`` here are the same steps.
"""

cimport numpy as cnp
from libc.stdint cimport int64_t

from pycollect._ext._allreduce cimport allreduce as run_allreduce
from pycollect._ext._allgather cimport allgather as _allgather
from pycollect._ext._allgather cimport allgather_begin, allgather_end, allgather_step
from pycollect._ext._allreduce cimport allreduce_begin, allreduce_end, allreduce_step
from pycollect._ext._alltoall cimport alltoall as _alltoall, alltoall_begin, alltoall_end
from pycollect._ext._direct cimport BEGUN_DIRECT, BEGUN_DIRECT_STAGED
from pycollect._ext._barrier cimport barrier as run_barrier
from pycollect._ext._barrier cimport barrier_begin, barrier_end
from pycollect._ext._broadcast cimport broadcast as run_broadcast
from pycollect._ext._broadcast cimport broadcast_begin, broadcast_end
from pycollect._ext._buffer cimport View, pin
from pycollect._ext._lock cimport CallLock
from pycollect._ext._work cimport BatchOwner, Later, P2P, Runner, Status, Work, filled
from pycollect._ext._p2p cimport Batch, Mailbox
from pycollect._ext._p2p cimport recv as _recv, send as _send, send_beside as _send_beside
from pycollect._ext._p2p cimport probe_beside as _probe_beside
from pycollect._ext._reduce_scatter cimport reduce_scatter as _reduce_scatter
from pycollect._ext._reduce_scatter cimport reduce_scatter_begin, reduce_scatter_end
from pycollect._ext._rooted cimport gather as _gather, reduce as _reduce, scatter as _scatter
from pycollect._ext._p2p cimport start as _p2p_start
from pycollect._ext._p2p cimport stash_to
from pycollect._ext._record cimport NONE, Ring
from pycollect._ext._transport cimport (ALGO_BINOMIAL, ALGO_DIRECT, ALGO_DISSEMINATION,
                                        ALGO_FLAGS, ALGO_HALVING_DOUBLING, ALGO_PAIRWISE,
                                        ALGO_RECURSIVE_DOUBLING, ALGO_RING, OpState, Transport)

from os import sched_yield as _sched_yield
from time import monotonic as _monotonic, sleep as _sleep

from pycollect._ext._allgather import ALGORITHMS as _ALLGATHER_ALGORITHMS
from pycollect._ext._allreduce import ALGORITHMS as _ALLREDUCE_ALGORITHMS
from pycollect._ext._flags import OUTSTANDING as _OUTSTANDING, posts_complete as _posts_complete
from pycollect._ext._flags cimport flags_fit
from pycollect._ext._broadcast import ALGORITHMS as _BROADCAST_ALGORITHMS
from pycollect._ext._p2p import ANY_SOURCE as _ANY_SOURCE, ANY_TAG as _ANY_TAG
from pycollect._ext._p2p import sendrecv as _p2p_sendrecv
from pycollect._ext._rooted import REDUCE_ALGORITHMS as _REDUCE_ALGORITHMS
from pycollect._ext._transport import ALGORITHM_NAMES, fail as _fail_transport
from pycollect.errors import Aborted, Error, InvalidArgument, MismatchError, Timeout
from pycollect.settings import MAX_TIMEOUT_S
from pycollect.types import ReduceOp

cnp.import_array()

__all__ = ["CallPath"]

cdef enum:
    K_BARRIER = 0
    K_BROADCAST = 1
    K_ALLREDUCE = 2
    K_REDUCE = 3
    K_ALLGATHER = 4
    N_KINDS = 5         # the kinds with auto's rules; those below have none
    K_GATHER = 5
    K_SCATTER = 6
    K_REDUCE_SCATTER = 7
    K_ALLTOALL = 8
    K_ALLTOALLV = 9
    K_ALLGATHERV = 10
    K_REDUCE_SCATTERV = 11
    K_GATHERV = 12
    K_SCATTERV = 13
    K_SEND = 14         # point to point: no sequence number, the peer recorded
    K_RECV = 15
    MAX_RULES = 16
    # A begun exchange's message up to this size is ready to end on a poll once its header
    # is here (Queued.ends_at_once): the flags path's small messages, one write each.
    EXCHANGE_LOOK_BYTES = 16384

cdef tuple _COLLECTIVES = ("barrier", "broadcast", "allreduce", "reduce", "allgather", "gather",
                           "scatter", "reduce_scatter", "alltoall", "alltoallv", "allgatherv",
                           "reduce_scatterv", "gatherv", "scatterv", "send", "recv")
cdef object _SUM = ReduceOp.SUM
cdef object _REDUCE_OP = ReduceOp
cdef str _AUTO = "auto"
cdef object _TAKE_SLOW = object()      # run() found the context not ready: the Python path
cdef tuple _NAME_OF_CODE = tuple(ALGORITHM_NAMES.get(c) or None     # as Context._execute names
                                  for c in range(max(ALGORITHM_NAMES) + 1))
cdef dict _NAMED = {K_ALLREDUCE: dict(_ALLREDUCE_ALGORITHMS),
                    K_BROADCAST: dict(_BROADCAST_ALGORITHMS),
                    K_REDUCE: dict(_REDUCE_ALGORITHMS),
                    K_ALLGATHER: dict(_ALLGATHER_ALGORITHMS)}
cdef double _MAX_TIMEOUT_S = MAX_TIMEOUT_S
cdef object _EXACT_INT = 1 << 53         # an int timeout below this converts exactly


cdef object _TAG_END = 1 << 31          # tags are 0 .. 2**31 - 1


cdef inline object _name_of(int code):
    """The algorithm's name for a wire code (None for none), as Context._execute names it."""
    return _NAME_OF_CODE[code] if 0 <= code < len(_NAME_OF_CODE) else None


cdef inline bint _is_tag(object tag, bint allow_any):
    """``tag`` is an int tag (or, where allowed, ANY_TAG); the Python path words the rest."""
    return type(tag) is int and (0 <= tag < _TAG_END or allow_any and tag == _ANY_TAG)


cdef object _status_arg(object status, str call):
    """``status`` as given to ``call``: None, a ``Status``, or what has its ``set``; refused
    before anything is posted (it is filled only once a message has come)."""
    if status is None or type(status) is Status or callable(getattr(status, "set", None)):
        return status
    raise InvalidArgument("%s: status must be a pycollect.Status (or have its set(source, "
                          "count, tag)), not %s" % (call, type(status).__name__))


cdef inline bint _same_data(cnp.ndarray a, cnp.ndarray b) noexcept:
    """alltoall's in-place form: both arrays start at one address (the Python path stages
    the send side in a copy; any other overlap the compiled call refuses)."""
    return cnp.PyArray_DATA(a) == cnp.PyArray_DATA(b) and cnp.PyArray_NBYTES(a) > 0


cdef inline bint _rooted(int kind) noexcept:
    """The kinds whose flight-recorder entry notes a root."""
    return (kind == K_BROADCAST or kind == K_REDUCE or kind == K_GATHER or kind == K_SCATTER
            or kind == K_GATHERV or kind == K_SCATTERV)


cdef Py_ssize_t _note(Ring rec, int kind, object described, int64_t root, object peers,
                      bint started=False, int64_t seq=NONE) except -1:
    """A flight-recorder entry for a call of ``kind``: the dtype and element count of the
    array ``described`` (None: no buffer), the root of a rooted kind, the ``peers`` of a
    send or receive; queued, or ``started`` as collective ``seq``.  Its id."""
    return rec.add(_COLLECTIVES[kind],
                   None if described is None
                   else <object>cnp.PyArray_DESCR(<cnp.ndarray>described),
                   NONE if described is None else cnp.PyArray_SIZE(<cnp.ndarray>described),
                   root if _rooted(kind) else NONE, peers, started, seq)


cdef inline int _code(object algo):
    """An entry point's answer as a code (-1: it names no algorithm)."""
    return <int>algo if type(algo) is int else -1


cdef inline int _named(int kind, object algorithm) except -2:
    """The wire code of the flat algorithm of ``kind`` called ``algorithm``, else -1 (the
    Python path takes the other names: "bcube:B", "hierarchical", and those it refuses)."""
    if type(algorithm) is not str:
        return -1
    code = (<dict>_NAMED[kind]).get(algorithm)
    return -1 if code is None else <int>code


cdef inline double _seconds(object timeout, double default):
    """A call's deadline in seconds: the context's for None, ``timeout`` where it is a
    positive float or int up to MAX_TIMEOUT_S, else -1 (the Python path converts a timedelta and
    refuses the rest, as _call_timeout words it)."""
    cdef double s
    if timeout is None:
        return default
    if type(timeout) is float:
        s = <double>timeout
    elif type(timeout) is int and 0 < timeout < _EXACT_INT:
        s = <double>timeout
    else:
        return -1.0
    return s if 0.0 < s <= _MAX_TIMEOUT_S else -1.0


cdef object _run_other(int kind, Transport t, object buf, object recv, int code, int op,
                       int root, unsigned int seq, double timeout, Py_ssize_t seg,
                       object counts, object recvcounts, object mailbox):
    """The call into the algorithm modules' entry points of the kinds other than allreduce,
    broadcast and barrier (``cpdef``: called as C here, as the Python path calls them from
    Python); what they return: an algorithm code, a receive's (source, count, tag)."""
    if kind == K_REDUCE:
        return _reduce(t, buf, root, op, code, seq, timeout, seg)
    if kind == K_ALLGATHER:
        return _allgather(t, buf, recv, None, seq, timeout, seg, code)
    if kind == K_ALLGATHERV:
        return _allgather(t, buf, recv, counts, seq, timeout, seg)
    if kind == K_GATHER or kind == K_GATHERV:
        return _gather(t, buf, recv, counts, root, seq, timeout)
    if kind == K_SCATTER or kind == K_SCATTERV:
        return _scatter(t, buf, recv, counts, root, seq, timeout)
    if kind == K_REDUCE_SCATTER or kind == K_REDUCE_SCATTERV:
        return _reduce_scatter(t, buf, recv, counts, op, seq, timeout, seg)
    if kind == K_SEND:
        return _send(t, buf, root, op, timeout)
    if kind == K_RECV:
        return _recv(t, mailbox, buf, root, op, timeout)
    return _alltoall(t, buf, counts, recv, recvcounts, seq, timeout)  # alltoall(v)


cdef inline int _sent_by(int kind) noexcept:
    """The algorithm of a collective of ``kind`` begun with its sends (not through the flag
    area): ``_allreduce.allreduce_begin``, ``_broadcast.broadcast_begin`` (a root),
    ``_barrier.barrier_begin``, ``_allgather.allgather_begin`` and
    ``_reduce_scatter.reduce_scatter_begin`` (the ring of 2),
    ``_alltoall.alltoall_begin``."""
    if kind == K_ALLREDUCE:
        return ALGO_RECURSIVE_DOUBLING
    if kind == K_ALLGATHER or kind == K_REDUCE_SCATTER:
        return ALGO_RING
    if kind == K_ALLTOALL:
        return ALGO_PAIRWISE
    return ALGO_BINOMIAL if kind == K_BROADCAST else ALGO_DISSEMINATION


cdef inline bint _every_head_here(Transport t) noexcept:
    """``Transport.head_here`` for every peer of ``t`` (under the context's lock)."""
    cdef int p
    for p in range(t.size):
        if p != t.rank and not t.head_here(p):
            return False
    return True


cdef enum:
    # How far a direct allreduce begun by an async call is (Queued.stage): its hello sent;
    # the peers' hellos taken, its slice reduced and released (allreduce_step); ended.
    DIRECT_HELLO_SENT = 1
    DIRECT_RELEASED = 2
    DIRECT_ENDED = 3


cdef class Queued:
    """A compiled call made with ``async_op=True``, checked and planned when it was made:
    the context's runner, or a thread that waits for it, runs it as ``op(seq)``, as it runs
    the Python path's queued collectives (``Context._execute``: the lock, the sequence
    number, the flight recorder), and gets the algorithm's code.  Arguments that the
    algorithm refuses when it runs are told to the peers, as the Python path's are."""

    cdef readonly CallPath ctx  # the Context, whose ``refused`` tells the peers (and whose
                                # batch of sends and receives it may run beside)
    cdef Py_ssize_t entry       # its flight recorder entry, or -1
    cdef Transport t
    cdef int kind
    cdef int code
    cdef int op
    cdef int root
    cdef double timeout
    cdef Py_ssize_t seg
    cdef object buf
    cdef object recv
    cdef bint begun             # an allreduce, broadcast or barrier begun as number ``seq``
    cdef unsigned int seq       # (CallPath.begin_posted): running it ends it; ``code`` says
                                # how it began (ALGO_FLAGS: posted to the flag area)
    cdef bint staged            # a begun direct allreduce: its buffer was staged,
    cdef int stage              # how far it is (DIRECT_HELLO_SENT, _RELEASED, _ENDED),
    cdef object error           # and what its step failed with, raised by its end

    def __call__(self, unsigned int seq):
        cdef int kind = self.kind
        cdef int code
        if self.begun:
            if kind == K_ALLREDUCE:
                if self.code != ALGO_DIRECT:
                    return allreduce_end(self.t, self.buf, self.op, self.code, seq,
                                         self.timeout)
                if self.error is not None:
                    raise self.error
                if self.stage == DIRECT_ENDED:      # a step ran halving-doubling instead
                    return ALGO_HALVING_DOUBLING
                code = allreduce_end(self.t, self.buf, self.op, ALGO_DIRECT, seq,
                                     self.timeout, self.seg, self.staged,
                                     self.stage == DIRECT_RELEASED)
                self.stage = DIRECT_ENDED
                return code
            if kind == K_ALLGATHER:     # direct, begun as the allreduce above, or the ring
                if self.error is not None:
                    raise self.error
                if self.stage == DIRECT_ENDED:      # a step ran the ring instead
                    return ALGO_RING
                code = allgather_end(self.t, self.buf, self.recv, self.code, seq,
                                      self.timeout, self.seg, self.stage == DIRECT_RELEASED)
                self.stage = DIRECT_ENDED
                return code
            if kind == K_BROADCAST:
                return broadcast_end(self.t, self.buf, self.root, self.code, seq, self.timeout)
            if kind == K_REDUCE_SCATTER:
                return reduce_scatter_end(self.t, self.buf, self.recv, self.op, self.code,
                                          seq, self.timeout)
            if kind == K_ALLTOALL:
                return alltoall_end(self.t, self.buf, self.recv, self.code, seq,
                                    self.timeout)
            return barrier_end(self.t, seq, self.timeout)
        try:
            if kind == K_ALLREDUCE:
                return run_allreduce(self.t, self.buf, self.op, self.code, seq, self.timeout,
                                     self.seg)
            if kind == K_BROADCAST:
                return run_broadcast(self.t, self.buf, self.root, self.code, seq,
                                     self.timeout, self.seg)
            if kind == K_BARRIER:
                return run_barrier(self.t, seq, self.timeout)
            return _run_other(kind, self.t, self.buf, self.recv, self.code, self.op,
                              self.root, seq, self.timeout, self.seg, None, None, None)
        except InvalidArgument as exc:
            self.ctx.refused(kind, exc, seq)
            raise

    def execute(self):
        """Run it now, on the calling thread (the runner's, or a waiter's), as
        ``Context._execute`` runs a queued item; the algorithm's name."""
        return self.ctx.run_queued(self)

    def ends_at_once(self):
        """A begun collective whose peers have posted what it waits for: running it waits for
        nobody (``Runner.poll``).  An allreduce or barrier begun as the exchange of two
        ranks (over TCP, or without a flag area) ends at once where the peer's message has
        come (its header is at the head of the pair's stream, ``Transport.head_here``) and
        is small (up to EXCHANGE_LOOK_BYTES: the rest of it comes with its header).  A
        direct allreduce begun in steps ends at once once its step ran (``advance``) and
        every peer's release has come.  None where that cannot be told without running
        it: a broadcast's root, a larger exchange, or the context's lock held by another
        thread."""
        if not self.begun:
            return False
        if self.code == ALGO_FLAGS:
            return _posts_complete(self.t, self.root if self.kind == K_BROADCAST else -1)
        if self.code == ALGO_DIRECT:
            return self.stage == DIRECT_ENDED or self.error is not None or (
                self.stage == DIRECT_RELEASED and self.ctx.heads_here())
        if self.kind == K_BROADCAST or self.t.size != 2 or (
                self.buf is not None and self.message_bytes() > EXCHANGE_LOOK_BYTES):
            return None
        return self.ctx.head_here(1 - self.t.rank)

    cdef Py_ssize_t message_bytes(self):
        """The size of the peer's message that a collective begun as the exchange of two
        ranks waits for: the buffer (allreduce), a block (allgather, reduce_scatter:
        ``recv`` is the block; alltoall: half of ``buf``)."""
        if self.kind == K_REDUCE_SCATTER:
            return (<cnp.ndarray>self.recv).nbytes
        if self.kind == K_ALLTOALL:
            return (<cnp.ndarray>self.buf).nbytes // 2
        return (<cnp.ndarray>self.buf).nbytes

    def peers_entered(self):
        """A queued collective (not begun) that every peer has entered: the head of each
        peer's stream is a message of it (``Transport.head_of``, with the number it would
        take if it ran now), so running it now waits only for the peers' parts of it,
        not for their arrival (``Runner.poll`` runs it then).  An algorithm in which
        some peer sends this rank nothing first (a ring of more than 2, a gather's root's
        peers) never looks entered here; None where another thread holds the lock."""
        if self.begun:
            return False
        return self.ctx.peers_entered(self.t)

    def advance(self):
        """A look at a begun direct allreduce or allgather whose hello is out: where every
        peer's hello has come, take them, reduce this rank's slice and release it
        (``_allreduce.allreduce_step``), or place and write this rank's block and release
        it (``_allgather.allgather_step``), which waits for nobody; its end then waits
        only for the peers' releases (``ends_at_once``).  Whether it moved; None where the
        context's lock is held by another thread."""
        if not self.begun or self.code != ALGO_DIRECT:
            return False
        return self.ctx.step_direct(self)


cdef class CallPath(BatchOwner):
    """A Context's hot state and its compiled blocking calls (see the module's text)."""

    cdef public Transport _transport
    cdef public int _rank
    cdef public int _size
    cdef public double _timeout
    cdef public Py_ssize_t _segment_bytes
    cdef unsigned int seq_          # the last collective's number (_seq)
    cdef public object _failure
    cdef public bint _closed
    cdef public bint _busy          # a collective of this context is running
    cdef public CallLock _lock      # shared with sub-groups
    cdef public Runner _runner      # the thread of queued operations, or None
    cdef public bint _detail        # PYCOLLECT_DEBUG=detail: the Python path checks calls
    cdef public bint _logs          # PYCOLLECT_DEBUG=1: the Python path logs every call
    cdef public Ring _recorder      # the flight recorder, or None
    cdef public Mailbox _mailbox    # point-to-point messages not yet received
    cdef tuple _what                # per kind, a handle's description ("send on rank R")
    cdef tuple _peer_lists          # per rank, [rank]: the recorder's peers (peer_list)
    # auto's rules, per kind: from min_bytes[i] on, run code[i] (-1: hierarchical)
    cdef int n_rules[N_KINDS]
    cdef Py_ssize_t min_bytes[N_KINDS][MAX_RULES]
    cdef int code[N_KINDS][MAX_RULES]

    def __cinit__(self, *args, **kwargs):
        cdef int k
        for k in range(N_KINDS):
            self.n_rules[k] = -1        # not read yet

    # -- the calls --------------------------------------------------------

    def barrier(self, async_op=False, timeout=None):
        """Block until every rank has called barrier."""
        cdef double seconds = _seconds(timeout, self._timeout)
        if async_op and seconds >= 0 and self.ready_async():
            return self.queue(K_BARRIER, None, None, 0, 0, 0, seconds, None)
        if async_op or seconds < 0 or not (self.ready() or self.may_run_beside()):
            return self._barrier_any(async_op, timeout)
        result = self.run(K_BARRIER, None, None, 0, 0, 0, seconds)
        if result is _TAKE_SLOW:
            return self._barrier_any(async_op, timeout)
        return None

    def broadcast(self, buf, root=0, algorithm="auto", async_op=False, timeout=None):
        """Copy ``buf`` from ``root`` into ``buf`` on every rank, in place; return ``buf``."""
        cdef int code
        cdef double seconds = _seconds(timeout, self._timeout)
        if (type(buf) is not cnp.ndarray or seconds < 0 or type(root) is not int
                or not 0 <= root < self._size
                or not (self.ready_async() if async_op
                        else self.ready() or self.may_run_beside())):
            return self._broadcast_any(buf, root, algorithm, async_op, timeout)
        code = self.plan(K_BROADCAST, algorithm, buf)
        if async_op and code >= 0:
            return self.queue(K_BROADCAST, buf, None, code, 0, root, seconds, buf)
        if code < 0 or self.run(K_BROADCAST, buf, None, code, 0, root, seconds) is _TAKE_SLOW:
            return self._broadcast_any(buf, root, algorithm, async_op, timeout)
        return buf

    def allreduce(self, buf, op=_SUM, algorithm="auto", async_op=False, *, recvbuf=None,
                  timeout=None):
        """Reduce ``buf`` element-wise across ranks with ``op``; return the result.

        In place, unless ``recvbuf`` is given: then ``buf`` is only read and the
        result lands in ``recvbuf`` (``ctx.allreduce(send, recv)`` and
        ``ctx.allreduce(send, recv, op)`` mean the same, as in mpi4py).  A Python
        or NumPy number returns the reduced number: ``ctx.allreduce(3.5)``.

        ``algorithm``: "auto", "recursive_doubling", "halving_doubling", "ring",
        "ring_chunked", "bcube" (base 4; "bcube:B" for base B), or "direct" (every rank on
        one host: each reduces its slice straight from the others' memory), or
        "hierarchical" (inside each host, then across hosts: pycollect/hierarchy.py).
        """
        cdef int code
        cdef double seconds = _seconds(timeout, self._timeout)
        if (type(buf) is not cnp.ndarray or type(op) is not _REDUCE_OP or recvbuf is not None
                or seconds < 0 or not (self.ready_async() if async_op
                                       else self.ready() or self.may_run_beside())):
            return self._allreduce_any(buf, op, algorithm, async_op, recvbuf=recvbuf,
                                       timeout=timeout)
        code = self.plan(K_ALLREDUCE, algorithm, buf)
        if async_op and code >= 0:
            return self.queue(K_ALLREDUCE, buf, None, code, op, 0, seconds, buf)
        if code < 0 or self.run(K_ALLREDUCE, buf, None, code, op, 0, seconds) is _TAKE_SLOW:
            return self._allreduce_any(buf, op, algorithm, async_op, recvbuf=recvbuf,
                                       timeout=timeout)
        return buf

    def reduce(self, buf, root=0, op=_SUM, algorithm="auto", async_op=False, *, recvbuf=None,
               timeout=None):
        """Reduce ``buf`` across ranks into root's ``buf`` (or root's ``recvbuf``, leaving
        ``buf`` untouched); other ranks' ``buf`` is untouched.  Returns the result on root
        (a number for a number), ``buf`` elsewhere."""
        cdef int code
        cdef double seconds = _seconds(timeout, self._timeout)
        if (type(buf) is not cnp.ndarray or type(op) is not _REDUCE_OP or recvbuf is not None
                or seconds < 0 or not self.is_rank(root)
                or not (self.ready_async() if async_op else self.ready())):
            return self._reduce_any(buf, root, op, algorithm, async_op, recvbuf=recvbuf,
                                    timeout=timeout)
        code = self.plan(K_REDUCE, algorithm, buf)
        if async_op and code >= 0:
            return self.queue(K_REDUCE, buf, None, code, op, root, seconds, buf)
        if code < 0 or self.run(K_REDUCE, buf, None, code, op, root, seconds) is _TAKE_SLOW:
            return self._reduce_any(buf, root, op, algorithm, async_op, recvbuf=recvbuf,
                                    timeout=timeout)
        return buf

    def allgather(self, sendbuf, recvbuf=None, async_op=False, timeout=None, *,
                  algorithm="auto"):
        """Gather every rank's ``sendbuf`` into ``recvbuf`` (size blocks, rank order) everywhere.

        ``algorithm``: "auto", "ring", or "direct" (every rank on one host: each writes its
        block straight into the others' ``recvbuf``)."""
        cdef int code
        cdef double seconds = _seconds(timeout, self._timeout)
        if (type(sendbuf) is not cnp.ndarray or type(recvbuf) is not cnp.ndarray or seconds < 0
                or not (self.ready_async() if async_op else self.ready())):
            return self._allgather_any(sendbuf, recvbuf, async_op, timeout, algorithm=algorithm)
        code = self.plan(K_ALLGATHER, algorithm, sendbuf)
        if async_op and code >= 0:
            return self.queue(K_ALLGATHER, sendbuf, recvbuf, code, 0, 0, seconds, recvbuf)
        if code < 0 or self.run(K_ALLGATHER, sendbuf, recvbuf, code, 0, 0,
                                seconds) is _TAKE_SLOW:
            return self._allgather_any(sendbuf, recvbuf, async_op, timeout, algorithm=algorithm)
        return recvbuf

    def allgatherv(self, sendbuf, recvbuf=None, counts=None, async_op=False, timeout=None):
        """allgather with ``counts[r]`` elements from rank r, packed in rank order."""
        cdef double seconds = _seconds(timeout, self._timeout)
        if (type(sendbuf) is not cnp.ndarray or type(recvbuf) is not cnp.ndarray or async_op
                or counts is None or seconds < 0 or not self.ready()
                or self.run(K_ALLGATHERV, sendbuf, recvbuf, 0, 0, 0, seconds,
                            counts) is _TAKE_SLOW):
            return self._allgatherv_any(sendbuf, recvbuf, counts, async_op, timeout)
        return recvbuf

    def gather(self, sendbuf, recvbuf=None, root=0, async_op=False, timeout=None):
        """Gather every rank's ``sendbuf`` into root's ``recvbuf``; returns it on root, None elsewhere."""
        return self.rooted(K_GATHER, sendbuf, recvbuf, root, async_op, timeout)

    def gatherv(self, sendbuf, recvbuf=None, counts=None, root=0, async_op=False,
                timeout=None):
        """gather with ``counts[r]`` elements from rank r, packed in rank order on root
        (``recvbuf=None``: allocated there, as gather does)."""
        return self.rooted(K_GATHERV, sendbuf, recvbuf, root, async_op, timeout, counts)

    def scatter(self, sendbuf, recvbuf=None, root=0, async_op=False, timeout=None):
        """Rank r receives block r of root's ``sendbuf`` (size equal blocks) into ``recvbuf``
        (``recvbuf=None``: allocated from ``sendbuf``'s shape, which ranks other than
        root then pass too)."""
        return self.rooted(K_SCATTER, sendbuf, recvbuf, root, async_op, timeout)

    def scatterv(self, sendbuf, counts, recvbuf=None, root=0, async_op=False, timeout=None):
        """scatter with ``counts[r]`` elements for rank r, packed in rank order on root
        (``recvbuf=None``: ``counts[rank]`` elements of ``sendbuf``'s dtype)."""
        return self.rooted(K_SCATTERV, sendbuf, recvbuf, root, async_op, timeout, counts)

    def reduce_scatter(self, sendbuf, recvbuf=None, op=_SUM, async_op=False, timeout=None):
        """Reduce ``sendbuf`` (size equal blocks) across ranks; rank r receives block r."""
        cdef double seconds = _seconds(timeout, self._timeout)
        if (type(sendbuf) is cnp.ndarray and type(recvbuf) is cnp.ndarray
                and type(op) is _REDUCE_OP and async_op and seconds >= 0
                and self.ready_async()):
            return self.queue(K_REDUCE_SCATTER, sendbuf, recvbuf, ALGO_RING, op, 0, seconds,
                              recvbuf)
        if (type(sendbuf) is not cnp.ndarray or type(recvbuf) is not cnp.ndarray
                or type(op) is not _REDUCE_OP or async_op or seconds < 0 or not self.ready()
                or self.run(K_REDUCE_SCATTER, sendbuf, recvbuf, 0, op, 0,
                            seconds) is _TAKE_SLOW):
            return self._reduce_scatter_any(sendbuf, recvbuf, op, async_op, timeout)
        return recvbuf

    def reduce_scatterv(self, sendbuf, recvbuf=None, counts=None, op=_SUM, async_op=False,
                        timeout=None):
        """reduce_scatter where rank r receives the ``counts[r]`` elements of its block."""
        cdef double seconds = _seconds(timeout, self._timeout)
        if (type(sendbuf) is not cnp.ndarray or type(recvbuf) is not cnp.ndarray
                or type(op) is not _REDUCE_OP or async_op or counts is None or seconds < 0
                or not self.ready()
                or self.run(K_REDUCE_SCATTERV, sendbuf, recvbuf, 0, op, 0, seconds,
                            counts) is _TAKE_SLOW):
            return self._reduce_scatterv_any(sendbuf, recvbuf, counts, op, async_op, timeout)
        return recvbuf

    def alltoall(self, sendbuf, recvbuf=None, async_op=False, timeout=None):
        """Block p of ``sendbuf`` goes to rank p; block p of ``recvbuf`` comes from rank p."""
        cdef double seconds = _seconds(timeout, self._timeout)
        if (type(sendbuf) is cnp.ndarray and type(recvbuf) is cnp.ndarray and async_op
                and seconds >= 0 and not _same_data(sendbuf, recvbuf) and self.ready_async()):
            return self.queue(K_ALLTOALL, sendbuf, recvbuf, ALGO_PAIRWISE, 0, 0, seconds,
                              recvbuf)
        if (type(sendbuf) is not cnp.ndarray or type(recvbuf) is not cnp.ndarray or async_op
                or seconds < 0 or _same_data(sendbuf, recvbuf) or not self.ready()
                or self.run(K_ALLTOALL, sendbuf, recvbuf, 0, 0, 0, seconds) is _TAKE_SLOW):
            return self._alltoall_any(sendbuf, recvbuf, async_op, timeout)
        return recvbuf

    def alltoallv(self, sendbuf, sendcounts, recvbuf=None, recvcounts=None, async_op=False,
                  timeout=None):
        """alltoall with ``sendcounts[p]`` elements to and ``recvcounts[p]`` from rank p."""
        cdef double seconds = _seconds(timeout, self._timeout)
        if (type(sendbuf) is not cnp.ndarray or type(recvbuf) is not cnp.ndarray or async_op
                or sendcounts is None or recvcounts is None or seconds < 0
                or _same_data(sendbuf, recvbuf) or not self.ready()
                or self.run(K_ALLTOALLV, sendbuf, recvbuf, 0, 0, 0, seconds, sendcounts,
                            recvcounts) is _TAKE_SLOW):
            return self._alltoallv_any(sendbuf, sendcounts, recvbuf, recvcounts, async_op,
                                       timeout)
        return recvbuf

    def send(self, buf, dst, tag=0, async_op=False, timeout=None):
        """Send ``buf`` to rank ``dst`` with ``tag``; returns once the data has left."""
        cdef double seconds = _seconds(timeout, self._timeout)
        if (async_op and type(buf) is cnp.ndarray and seconds >= 0 and self.is_peer(dst)
                and _is_tag(tag, False) and self.ready_async()):
            work = self.begin_p2p(False, buf, dst, tag, seconds, None)
            if work is None:
                # A batch in flight (MPI's Irecv, then Isend): a send that ends without the
                # peer goes out beside it, as a blocking one does, and its handle has ended.
                work = self.send_beside_async(buf, dst, tag, seconds)
                if work is _TAKE_SLOW:
                    work = self.join_p2p(False, buf, dst, tag, seconds, True)
            if work is not None and work is not _TAKE_SLOW:
                return work
        if (type(buf) is not cnp.ndarray or async_op or seconds < 0 or not self.is_peer(dst)
                or not _is_tag(tag, False)):
            return self._send_any(buf, dst, tag, async_op, timeout)
        if self.ready():
            got = self.run(K_SEND, buf, None, 0, tag, dst, seconds)
        elif self.ready_async():
            got = self.send_beside_batch(buf, dst, tag, seconds)
            if got is _TAKE_SLOW:
                got = self.join_p2p(False, buf, dst, tag, seconds)
        else:
            got = _TAKE_SLOW
        if got is _TAKE_SLOW:
            return self._send_any(buf, dst, tag, async_op, timeout)
        return None

    def recv(self, buf, src=_ANY_SOURCE, tag=0, async_op=False, *, status=None, timeout=None):
        """Receive the first message from ``src`` with ``tag`` (at most ``buf``'s size) into
        ``buf``; return the source rank, and fill ``status`` (a ``pc.Status``) when given.

        ``src=ANY_SOURCE`` and ``tag=ANY_TAG`` take any.  With ``async_op=True`` the
        Work's result is the ``Status`` (source, count, tag).
        """
        cdef double seconds = _seconds(timeout, self._timeout)
        if status is not None:
            _status_arg(status, "recv")
        if (async_op and type(buf) is cnp.ndarray and seconds >= 0
                and (self.is_peer(src) or type(src) is int and src == _ANY_SOURCE)
                and _is_tag(tag, True) and self.ready_async()):
            work = self.begin_p2p(True, buf, src, tag, seconds, status)
            if work is None:
                work = self.join_p2p(True, buf, src, tag, seconds, True, status)
            if work is not None and work is not _TAKE_SLOW:
                return work
        if (type(buf) is cnp.ndarray and not async_op and status is None and seconds >= 0
                and (self.is_peer(src) or type(src) is int and src == _ANY_SOURCE)
                and _is_tag(tag, True)):
            if self.ready():
                got = self.run(K_RECV, buf, None, 0, tag, src, seconds)
                if got is not _TAKE_SLOW:
                    return (<tuple>got)[0]
            elif self.ready_async():
                got = self.join_p2p(True, buf, src, tag, seconds)
                if got is not _TAKE_SLOW:
                    return got.source
        return self._recv_any(buf, src, tag, async_op, status=status, timeout=timeout)

    def sendrecv(self, sendbuf, dst, recvbuf, src=_ANY_SOURCE, sendtag=0, recvtag=_ANY_TAG, *,
                 status=None, timeout=None):
        """Send ``sendbuf`` to ``dst`` and receive into ``recvbuf`` from ``src``, both in
        flight at once (MPI_Sendrecv); return the source rank, filling ``status``."""
        cdef double seconds = _seconds(timeout, self._timeout)
        if status is not None:
            _status_arg(status, "sendrecv")
        if (type(sendbuf) is cnp.ndarray and type(recvbuf) is cnp.ndarray and seconds >= 0
                and self.is_peer(dst) and _is_tag(sendtag, False) and _is_tag(recvtag, True)
                and (self.is_peer(src) or type(src) is int and src == _ANY_SOURCE)
                and self.ready_p2p()):
            got = self.run_sendrecv(sendbuf, dst, sendtag, recvbuf, src, recvtag, seconds)
            if got is not _TAKE_SLOW:
                if status is not None:
                    status.set(*got)
                return (<tuple>got)[0]
        return self._sendrecv_any(sendbuf, dst, recvbuf, src, sendtag, recvtag, status=status,
                                  timeout=timeout)

    # -- the steps --------------------------------------------------------

    @property
    def _seq(self):
        """The number of the last collective this context ran (or, begun, posted)."""
        return self.seq_

    @_seq.setter
    def _seq(self, unsigned int seq):
        self.numbered(seq)

    cdef inline void numbered(self, unsigned int seq) noexcept:
        """The last collective is number ``seq``: point-to-point sends from now on carry
        the next one (Transport.p2p_seq), to tell a message that came early from one left
        unreceived."""
        self.seq_ = seq
        if self._transport is not None:
            self._transport.p2p_seq = seq + 1

    cdef object run_sendrecv(self, object sendbuf, int dst, int sendtag, object recvbuf,
                             int src, int recvtag, double timeout):
        """A send and a receive in flight together (``_p2p.sendrecv``: its message taken from
        the mailbox when it waits there), under the context lock (each recorded as its own
        send and receive, as the Python path records them); the receive's (source, count,
        tag), or _TAKE_SLOW where a buffer was refused before anything went on the wire, or
        the context stopped being ready."""
        cdef Ring rec = self._recorder
        cdef Py_ssize_t sent = -1, got = -1
        cdef CallLock lock = self._lock
        cdef Transport t = self._transport
        lock.take()
        try:
            if self._closed or self._failure is not None or self.runner_engaged():
                return _TAKE_SLOW
            if rec is not None:
                sent = _note(rec, K_SEND, sendbuf, NONE, self.peer_list(dst), True)
                got = _note(rec, K_RECV, recvbuf, NONE, self.peer_list(src), True)
            self._busy = True
            try:
                result = _p2p_sendrecv(t, self._mailbox, sendbuf, dst, sendtag, recvbuf, src,
                                       recvtag, timeout)
            except InvalidArgument as exc:
                if t.is_failed:
                    raise
                # Refused before the wire: the Python path says why.
                if sent >= 0:
                    rec.end(sent, None, exc)
                    rec.end(got, None, exc)
                return _TAKE_SLOW
            except BaseException as exc:
                self.failed(exc, sent, got)
                raise
            finally:
                self._busy = False
        finally:
            lock.give()
        if sent >= 0:
            rec.end(sent, None, None)
            rec.end(got, None, None)
        return result


    cdef object begin_p2p(self, bint is_recv, object buf, int peer, int tag, double timeout,
                          object status):
        """An async send or receive of an array begun on the calling thread when the
        context's runner has nothing queued, in flight or running (``Runner.claim``):
        posted as a batch of its own and moved once (twice for a receive: it matches its
        message, then reads it: ``_p2p.start``), so that a send the channel takes at once,
        or a receive whose message is here, has ended when the call returns (no Batch is
        made for it); what is still in flight is parked in the runner (``Runner.begun``)
        with its Batch, for its wait to drive.  Its Work, or
        None where the Python path queues it (the runner has work, or the call is
        refused)."""
        cdef Ring rec = self._recorder
        cdef Py_ssize_t entry = -1
        cdef CallLock lock = self._lock
        cdef Transport t = self._transport
        cdef Runner runner = self._started_runner() if self._runner is None else self._runner
        cdef Work work
        if not runner.claim():
            return None
        batch, index, ended, got, exception = None, -1, False, None, None
        lock.take()
        try:
            if self._closed or self._failure is not None:
                runner.unclaim()
                return None
            if rec is not None:
                entry = _note(rec, K_RECV if is_recv else K_SEND, buf, NONE,
                              self.peer_list(peer), True)
            self._busy = True
            try:
                batch, index, ended, got = _p2p_start(t, self._mailbox, timeout, is_recv, buf,
                                                      peer, tag)
            except BaseException as exc:    # handed to the Work, raised by its wait
                if isinstance(exc, InvalidArgument) and not t.is_failed:
                    # The buffer refused before the wire: the Python path says why, at once.
                    if entry >= 0:
                        rec.end(entry, None, exc)
                    runner.unclaim()
                    return None
                self.note_failure(exc)
                exception = exc
            finally:
                self._busy = False
        except BaseException:
            runner.unclaim()
            raise
        finally:
            lock.give()
        what = self.what(K_RECV if is_recv else K_SEND)
        if ended or exception is not None:
            runner.unclaim()        # the batch was this call's alone: nothing is left
            result = None
            if ended and is_recv:
                result = filled(status, got)
            work = Work.made_ended(what, result, exception)
            work._runner = runner       # a blocking call in its done callback is refused
        else:
            work = runner.begun(P2P.of(is_recv, buf, peer, tag, self,
                                       Later.of(status) if is_recv else None, timeout),
                                what, batch, index)
        if entry >= 0:
            if ended or exception is not None:
                rec.end(entry, None, exception)
                if exception is not None:
                    self._failed_trace(exception)
            else:
                work.record_in(rec, entry)
        return work

    cdef object send_beside_batch(self, object buf, int dst, int tag, double timeout):
        """A blocking send made while the context's runner holds a batch of sends and
        receives in flight and nothing else, where the batch has nothing of its own on the
        wire (its receives wait for their messages: MPI's Irecv, then Send), and the send
        ends at once without the peer (``Transport.sends_now``): sent on this thread beside
        the batch (``_p2p.send_beside``), rather than joining it through the runner; None.
        _TAKE_SLOW, with nothing done, where that does not apply (the batch has a send or a
        matched receive on the wire, whose messages go first: the send joins it,
        ``join_p2p``; the send would wait for the peer to read, as a large one does, while
        nothing moved the batch's receives, which the peer's own send may wait for;
        something is queued; another thread holds the context's lock, as a driver of the
        batch does; the buffer is refused: the Python path says why)."""
        cdef Ring rec = self._recorder
        cdef Py_ssize_t entry = -1
        cdef CallLock lock = self._lock
        cdef Transport t = self._transport
        cdef Batch batch
        cdef View b
        cdef Runner runner = self._runner
        if runner is None:
            return _TAKE_SLOW
        try:
            held = pin(buf, &b, "send", "buf", False)
        except InvalidArgument:
            return _TAKE_SLOW
        # A thread that drives the batch holds the lock until the batch has nothing left
        # to do, which may be the message this send brings about: the send then goes to
        # the queue, for that drive to post (join_p2p's claim fails, the Python path).
        if not lock.try_take():
            return _TAKE_SLOW
        try:
            batch = self.batch_beside(runner)
            if batch is None or batch.on_wire() or not t.sends_now(dst, b.nbytes):
                return _TAKE_SLOW
            if rec is not None:
                entry = _note(rec, K_SEND, buf, NONE, self.peer_list(dst), True)
            self._busy = True
            try:
                _send_beside(t, batch, &b, dst, tag, timeout)
            except BaseException as exc:    # KeyboardInterrupt fails the context too
                self.failed(exc, entry)
                raise
            finally:
                self._busy = False
        finally:
            lock.give()
        if entry >= 0:
            rec.end(entry, None, None)
        return None

    cdef object send_beside_async(self, object buf, int dst, int tag, double timeout):
        """``send_beside_batch`` for an async send: its handle, made ended (with the error
        where the send failed on the wire: its wait raises it), or _TAKE_SLOW."""
        cdef Work work
        try:
            got = self.send_beside_batch(buf, dst, tag, timeout)
        except Error as exc:
            work = Work.made_ended(self.what(K_SEND), None, exc)
        else:
            if got is _TAKE_SLOW:
                return got
            work = Work.made_ended(self.what(K_SEND), None, None)
        work._runner = self._runner     # a blocking call in its done callback is refused
        return work

    cdef object join_p2p(self, bint is_recv, object buf, int peer, int tag, double timeout,
                         bint async_op=False, object status=None):
        """A send or receive of an array made while the context's runner holds a batch of
        sends and receives in flight and nothing else (an async receive begun earlier
        waits for its message: MPI's Irecv, then Send or Isend): it joins that batch
        (``Runner.claim_batch``, ``Runner.join``), without the Python path's checks and
        queue.  A blocking one drives the batch on this thread until it has ended and
        returns a receive's Status, a send's None; an async send moves the batch once (its
        message goes out now), an async receive is posted only (``Runner.join``); either
        returns its handle.  _TAKE_SLOW, with nothing done, where
        the Python path takes it (the runner has more than that batch, or the buffer is
        refused: the Python path says why)."""
        cdef Ring rec = self._recorder
        cdef Py_ssize_t entry = -1
        cdef Runner runner = self._runner
        cdef Work work
        cdef View checked      # the buffer's check alone: the batch pins it when posted
        if runner is None:
            return _TAKE_SLOW
        try:
            pin(buf, &checked, "recv" if is_recv else "send", "buf", is_recv)
        except InvalidArgument:
            return _TAKE_SLOW
        op = P2P.of(is_recv, buf, peer, tag, self, Later.of(status) if is_recv else None,
                    timeout)
        if not runner.claim_batch(self):
            return _TAKE_SLOW
        if rec is not None:
            entry = _note(rec, K_RECV if is_recv else K_SEND, buf, NONE,
                          self.peer_list(peer), True)
        work = runner.join(op, self.what(K_RECV if is_recv else K_SEND), not async_op)
        if async_op:
            if entry >= 0:
                work.record_in(rec, entry)
            return work
        try:
            result = work.wait()
        except BaseException as exc:
            if entry >= 0:
                rec.end(entry, None, exc)
                self._failed_trace(exc)
            raise
        if entry >= 0:
            rec.end(entry, None, None)
        return result

    def _probe_beside_batch(self, int src, int tag, double timeout, bint block):
        """``probe`` (``block``) or ``iprobe`` made while the context's runner holds a batch
        of sends and receives in flight, with nothing queued behind it and no receive of it
        waiting for its message (MPI's Isend, then Probe or Iprobe, then Recv): it looks beside the batch on this thread (``_p2p.probe_beside``),
        the batch's sends staying in flight, rather than queueing behind the batch, which
        would wait for those sends to end and so for the peer's receive, while the peer's own
        probe waits the same way.  A blocking one looks again until its message is here or
        ``timeout`` passes (``Timeout``), letting the runner drive the batch between looks
        (where the runner drives it, the probe waits for the lock, which the drive gives up
        between two slices while it is wanted).
        (source, byte count, tag, dtype code), or None (an iprobe that found nothing).
        False, with nothing done, where that does not apply (no batch in flight: the
        Python path runs the probe itself; something queued; a receive of the batch waits
        for its message, the heads being its to match; another call holds the lock)."""
        cdef CallLock lock = self._lock
        cdef Transport t = self._transport
        cdef Batch batch
        cdef double end = _monotonic() + timeout
        cdef int looks = 0
        cdef Runner runner = self._runner
        if runner is None:
            return False
        while True:
            if not lock.try_take():
                if not runner.busy:
                    return False    # held by another call: the queue, as before
                # The runner drives the batch and holds the lock until it ends, which may
                # be the peer's receive of this rank's send, while the peer's probe waits
                # the same way: wait for the lock; the drive hands the batch back between
                # two of its slices when the lock is wanted (Runner, ``wanted``).
                lock.take()
            try:
                batch = self.batch_beside(runner)
                if batch is None or batch.matches_heads():
                    return False
                self._busy = True
                try:
                    found = _probe_beside(t, self._mailbox, src, tag, timeout)
                except BaseException as exc:
                    self.note_failure(exc)
                    raise
                finally:
                    self._busy = False
            finally:
                lock.give()
            if found is not None or not block:
                return found
            if _monotonic() >= end:
                raise Timeout("rank %d: a probe from %s with %s timed out after %g s" % (
                    self._rank, "any rank" if src < 0 else "rank %d" % src,
                    "any tag" if tag == -1 else "tag %d" % tag, timeout))
            # The runner may take the batch up meanwhile: the next look queues the probe.
            looks += 1
            if looks % 64:
                _sched_yield()
            else:
                _sleep(0.0001)

    cdef Batch batch_beside(self, Runner runner):
        """Under the context's lock: the runner's batch in flight on this context's
        transport with nothing queued behind it, that an operation may run beside, or None
        (the context is closed or failed, or there is no such batch)."""
        if self._closed or self._failure is not None:
            return None
        got = runner.batch_alone()
        if type(got) is not Batch or (<Batch>got).t is not self._transport:
            return None
        return <Batch>got

    cpdef bint may_stash_beside(self) except -1:
        """Whether a collective of this context may run beside its runner's batch of
        receives that wait (``Runner._beside_head``): its transport reads aside the
        point-to-point messages such a collective meets on the streams
        (``Transport.can_stash``)."""
        return self._transport.can_stash()

    def run_beside(self, execute, item, Batch batch):
        """Run the queued collective ``item`` with ``execute`` (``Context._execute``, under
        the context's lock) beside ``batch``, the runner's batch of waiting receives: the
        batch's descriptor and deadline set aside meanwhile, and the point-to-point messages
        that the collective meets on the streams read aside and handed to its receives
        afterwards (``_p2p.stash_to``; one that no receive takes fails the collective where
        its sender sent it before its part, as a message left unreceived at a collective
        does, and waits in the mailbox otherwise).  What ``execute`` returns."""
        cdef OpState saved
        cdef Py_ssize_t left = 0, handed = 0
        self.enter_beside(&saved)
        try:
            name = execute(item)
        finally:
            lock = self._lock
            with lock:
                left = self.leave_beside(&saved, batch, &handed, self.seq_)
        if left:
            raise self.met_unreceived(self.seq_)
        return name

    cdef void enter_beside(self, OpState* saved) noexcept:
        """Before an operation run beside the runner's batch of waiting receives: the
        batch's descriptor and deadline set aside (the operation runs under its own), and
        the point-to-point messages the operation meets on the streams read aside."""
        cdef Transport t = self._transport
        t.save_op(saved)
        t.stash(1)

    cdef Py_ssize_t leave_beside(self, const OpState* saved, Batch batch,
                                 Py_ssize_t* handed, unsigned int seq) except -1:
        """After it (collective ``seq``), under the context's lock: the batch's descriptor
        and deadline back, and what was read aside handed to ``batch``'s receives
        (``_p2p.stash_to``, their number in ``handed``); the number of messages none of
        them took that their senders sent before their part of it (all that none took wait
        in the mailbox)."""
        cdef Transport t = self._transport
        with nogil:
            # A message a flags wait began to read aside has its rest read first (its
            # sender writes it); one that stalls past the deadline fails the transport,
            # and the batch's receives with it.
            t.finish_aside()
        t.stash(0)
        t.restore_op(saved)
        return stash_to(t, self._mailbox, batch, handed, seq)

    cdef object met_unreceived(self, unsigned int seq):
        """Collective ``seq``, run beside receives that wait, read aside point-to-point
        messages that none of them takes, sent before the peers' parts of it: the program
        is out of step, as where a collective meets such a message on the wire.  Fail this
        context and its transport (whose abort frames tell the peers); the error."""
        error = MismatchError(
            "rank %d: collective #%d met point-to-point messages sent before it that no "
            "receive waited for (%s); receive a message before the collective its sender "
            "made after sending it" % (self._rank, seq, self._mailbox.unreceived()))
        self._mailbox.clear()
        self._failure = error
        _fail_transport(self._transport, "met a point-to-point message nobody received")
        return error

    def p2p_batch(self):
        """A new ``_p2p.Batch`` of this context's sends and receives (its transport, mailbox
        and deadline), for its runner to drive."""
        return Batch(self._transport, self._mailbox, self._timeout)

    cpdef object run_drive(self, Runner runner):
        """The runner's drive of its batch of sends and receives (``Runner.drive``), under
        the context's lock: what ``Context._execute`` makes of ``(runner.drive_as_queued, 0,
        None, None)`` (no sequence number, check or recorder entry; the context fails where
        the transport did), without its Python steps.  A closed or failed context goes to
        ``_execute``, which says so."""
        cdef CallLock lock = self._lock
        lock.take()
        try:
            if not (self._closed or self._failure is not None):
                self._busy = True
                try:
                    return runner.drive()
                except BaseException as exc:    # KeyboardInterrupt fails the context too
                    self.note_failure(exc)
                    raise
                finally:
                    self._busy = False
        finally:
            lock.give()
        return self._execute((runner.drive_as_queued, 0, None, None))

    cdef object head_here(self, int peer):
        """Whether a receive from ``peer`` would find its message at once
        (``Transport.head_here``), looked at under the context's lock; None where another
        thread holds the lock (it may be reading that very stream)."""
        cdef CallLock lock = self._lock
        if not lock.try_take():
            return None
        try:
            return bool(self._transport.head_here(peer))
        finally:
            lock.give()

    cdef object heads_here(self):
        """``head_here`` for every peer at once: whether the next message of each has
        come; None where another thread holds the lock."""
        cdef CallLock lock = self._lock
        if not lock.try_take():
            return None
        try:
            return _every_head_here(self._transport)
        finally:
            lock.give()

    cdef object peers_entered(self, Transport t):
        """``Queued.peers_entered`` under the context's lock (None where another thread
        holds it): every peer's next message is of the collective that runs next."""
        cdef CallLock lock = self._lock
        cdef unsigned int seq
        cdef int p
        if not lock.try_take():
            return None
        try:
            seq = self.seq_ + 1
            for p in range(t.size):
                if p != t.rank and not t.head_of(p, 0, seq):
                    return False
            return t.size > 1
        finally:
            lock.give()

    cdef object step_direct(self, Queued q):
        """``Queued.advance``: under the context's lock, a begun direct allreduce or
        allgather whose hello is out and whose peers' hellos have all come takes its step
        (``allreduce_step``, ``allgather_step``); whether it did, None where another
        thread holds the lock.  A step that fails fails the context where the transport
        did (``note_failure``), and the call's end raises the error."""
        cdef CallLock lock = self._lock
        cdef Transport t = q.t
        cdef int code
        if not lock.try_take():
            return None
        try:
            if q.stage != DIRECT_HELLO_SENT or q.error is not None or not _every_head_here(t):
                return False
            self._busy = True
            try:
                if q.kind == K_ALLGATHER:
                    code = allgather_step(t, q.buf, q.recv, q.seq, q.timeout, q.seg)
                else:
                    code = allreduce_step(t, q.buf, q.op, q.seq, q.timeout, q.seg, q.staged)
            except BaseException as exc:
                q.error = exc
                self.note_failure(exc)
                return True
            finally:
                self._busy = False
            q.stage = DIRECT_RELEASED if code == ALGO_DIRECT else DIRECT_ENDED
            return True
        finally:
            lock.give()

    cdef void note_failure(self, object exc) except *:
        """The context fails with ``exc`` where the transport failed under it (a
        KeyboardInterrupt too); an error that left the transport sound does not."""
        if self._transport.is_failed:
            self._failure = exc if isinstance(exc, Error) else Aborted(
                "rank %d: interrupted by %s" % (self._rank, type(exc).__name__))

    cdef void failed(self, object exc, Py_ssize_t entry, Py_ssize_t other=-1) except *:
        """A call failed with ``exc`` on the wire: the context fails with it where the
        transport did (note_failure); its recorder entry (and ``other``, sendrecv's
        receive) ends failed, and the trace is dumped where that is asked for."""
        self.note_failure(exc)
        if entry >= 0:
            self._recorder.end(entry, None, exc)
            if other >= 0:
                self._recorder.end(other, None, exc)
            self._failed_trace(exc)

    cdef inline bint is_peer(self, object rank) noexcept:
        """``rank`` is an int naming another rank of this group."""
        return self.is_rank(rank) and rank != self._rank

    cdef object rooted(self, int kind, object sendbuf, object recvbuf, object root,
                       bint async_op, object timeout, object counts=None):
        """gather and scatter, and their v-variants (``counts`` given): compiled where this
        rank's block (gather's ``sendbuf``, scatter's ``recvbuf``) is an array and, on the
        root, the blocks of all (gather's ``recvbuf``, scatter's ``sendbuf``) are too; the
        other ranks' blocks argument is not used.  Returns what the call returns (gather:
        None off the root)."""
        cdef bint gathering = kind == K_GATHER or kind == K_GATHERV
        cdef bint v = kind == K_GATHERV or kind == K_SCATTERV
        cdef double seconds = _seconds(timeout, self._timeout)
        mine, blocks = (sendbuf, recvbuf) if gathering else (recvbuf, sendbuf)
        if (type(mine) is cnp.ndarray and not async_op and seconds >= 0 and self.is_rank(root)
                and not (v and counts is None) and self.ready()):
            if root != self._rank:
                blocks = None                       # not used off the root
            elif type(blocks) is not cnp.ndarray:
                mine = None                         # the root's blocks: the Python path's
            if mine is not None:
                if gathering:
                    done = self.run(kind, mine, blocks, 0, 0, root, seconds, counts)
                else:
                    done = self.run(kind, blocks, mine, 0, 0, root, seconds, counts)
                if done is not _TAKE_SLOW:
                    return blocks if gathering else mine
        if kind == K_GATHER:
            return self._gather_any(sendbuf, recvbuf, root, async_op, timeout)
        if kind == K_SCATTER:
            return self._scatter_any(sendbuf, recvbuf, root, async_op, timeout)
        if kind == K_GATHERV:
            return self._gatherv_any(sendbuf, recvbuf, counts, root, async_op, timeout)
        return self._scatterv_any(sendbuf, counts, recvbuf, root, async_op, timeout)

    cdef inline bint is_rank(self, object root) noexcept:
        """``root`` is an int naming a rank of this group (the Python path words the rest)."""
        return type(root) is int and 0 <= root < self._size

    cdef int plan(self, int kind, object algorithm, object buf) except -2:
        """The wire code that ``algorithm`` ("auto" or a flat name) runs for the array
        ``buf``; -1 where the Python path decides (a hierarchical plan, another name)."""
        if algorithm is _AUTO or algorithm == _AUTO:
            return self.auto(kind, cnp.PyArray_NBYTES(<cnp.ndarray>buf))
        return _named(kind, algorithm)

    cdef object queue(self, int kind, object buf, object recv, int code, int op, int root,
                      double timeout, object result):
        """Queue one checked and planned collective (``async_op=True``) as ``run`` would run
        it; its Work, whose result is ``result``.  The queue, the Work and the flight
        recorder's entry are the Python path's (``Context._submit``).  In a world of one
        with nothing queued, the call runs at once and its Work has ended."""
        cdef Queued q
        cdef Ring rec = self._recorder
        cdef Work work
        if self._transport.solo and self.ready():
            # A world of one: nothing to wait for, so the call runs now, on this thread, as
            # a blocking one would (no runner is started for it); its handle has ended, with
            # the error, if any, for its wait to raise.
            try:
                name = self.run(kind, buf, recv, code, op, root, timeout)
            except Exception as exc:
                return Work.made_ended(self.what(kind), None, exc)
            if name is not _TAKE_SLOW:
                work = Work.made_ended(self.what(kind), result, None)
                work.algorithm = name
                return work
        if kind == K_BARRIER or (kind == K_ALLREDUCE and (
                code == ALGO_FLAGS or code == ALGO_RECURSIVE_DOUBLING
                or code == ALGO_DIRECT)) or (
                kind == K_ALLGATHER and (code == ALGO_FLAGS or code == ALGO_DIRECT
                                         or code == ALGO_RING)) or (
                kind == K_BROADCAST and (code == ALGO_FLAGS or code == ALGO_BINOMIAL
                                         and root == self._rank)) or (
                kind == K_REDUCE_SCATTER or kind == K_ALLTOALL):
            work = self.begin_posted(kind, buf, code, op, root, timeout, result, recv)
            if work is not None:
                return work
        q = self.queued(kind, buf, recv, code, op, root, timeout)
        if rec is not None:
            q.entry = _note(rec, kind, buf if kind <= K_REDUCE else recv, root, None)
        cdef Work queued_work = Work(self.what(kind), result)
        cdef Runner runner = self._started_runner() if self._runner is None else self._runner
        runner.submit(q, queued_work)
        return queued_work

    cdef Queued queued(self, int kind, object buf, object recv, int code, int op, int root,
                       double timeout):
        """A ``Queued`` for one checked and planned call, with no recorder entry yet."""
        cdef Queued q = Queued.__new__(Queued)
        q.ctx = self
        q.t = self._transport
        q.kind = kind
        q.code = code
        q.op = op
        q.root = root
        q.timeout = timeout
        q.seg = self._segment_bytes
        q.buf = buf
        q.recv = recv
        q.entry = -1
        return q

    cdef object begin_posted(self, int kind, object buf, int code, int op, int root,
                             double timeout, object result, object recv=None):
        """An async allreduce, broadcast or barrier begun on the calling thread, as MPI's
        Iallreduce begins, when the context's runner has nothing queued, in flight or running
        but the ends of calls begun this way (``Runner.claim_post``) and no point-to-point
        message waits unreceived: through the flag area, this rank posts its part now (up
        to FLAGS_OUTSTANDING posted and not ended); at 2 ranks without one, an allreduce by
        recursive doubling (``code``) and a barrier send their one message of the exchange
        (``allreduce_begin``, ``barrier_begin``), and the root of a binomial broadcast sends
        to its children at any size (``broadcast_begin``); a direct allreduce (up to
        ``_direct.DIRECT_BEGIN_BYTES``, with nothing else begun) stages its buffer and
        sends its hello, as does a direct allgather (its ``recvbuf``), and a poll that
        finds every peer's hello takes its step (``Queued.advance``); an allgather, a
        reduce_scatter and an alltoall begin through the flags, or at 2 ranks as their one
        exchange (``reduce_scatter_begin``, ``alltoall_begin``); an exchange only where the
        channel takes the message whole (``_algo.exchange_fits``).  Where no earlier
        one waits for its end and every peer it waits for had posted already (a
        broadcast's root waits for nobody) the operation ends here; else its end waits in
        the runner's queue behind those (``Runner.begun_collective``) for its wait, a poll
        that finds every post there (``Queued.ends_at_once``), or the runner's next look.
        Its Work, or None where the call is queued as usual (the runner has other work, neither way applies,
        too many are begun, or the arguments are refused)."""
        cdef Ring rec = self._recorder
        cdef Py_ssize_t entry = -1
        cdef CallLock lock = self._lock
        cdef Transport t = self._transport
        cdef unsigned int seq = 0
        cdef int state = -2
        cdef Queued q
        cdef Runner runner = self._started_runner() if self._runner is None else self._runner
        cdef Work work
        # A direct allreduce is begun only with nothing else begun (and nothing is begun
        # behind it: begun_collective's ``alone``).
        if self.has_mail() or not runner.claim_post(1 if code == ALGO_DIRECT
                                                       else _OUTSTANDING):
            return None
        exception = None
        lock.take()
        try:
            if self._closed or self._failure is not None:
                runner.unclaim(False)
                return None
            seq = self.seq_ + 1
            self._busy = True
            try:
                if kind == K_ALLREDUCE:
                    state = allreduce_begin(t, buf, op, code, seq, timeout)
                elif kind == K_ALLGATHER:
                    state = allgather_begin(t, buf, recv, code, seq, timeout,
                                             self._segment_bytes)
                elif kind == K_REDUCE_SCATTER:
                    state = reduce_scatter_begin(t, buf, recv, op, seq, timeout,
                                                 self._segment_bytes)
                elif kind == K_ALLTOALL:
                    state = alltoall_begin(t, buf, recv, seq, timeout)
                elif kind == K_BROADCAST:
                    state = broadcast_begin(t, buf, root, code, seq, timeout)
                else:
                    state = barrier_begin(t, seq, timeout)
            except BaseException as exc:    # handed to the Work, raised by its wait
                if isinstance(exc, InvalidArgument) and not t.is_failed:
                    runner.unclaim(False)   # refused before the wire: queued as usual
                    return None
                exception = exc
            finally:
                self._busy = False
            if state == -2 and exception is None:
                runner.unclaim(False)
                return None
            self.numbered(seq)      # numbered, as run numbers a collective that ran
            if rec is not None:
                entry = _note(rec, kind, buf if kind <= K_REDUCE else recv, root, None,
                              True, seq)
            if exception is not None:
                self.failed(exception, entry)
        except BaseException:
            runner.unclaim(False)
            raise
        finally:
            lock.give()
        what = self.what(kind)
        if state == 1 or exception is not None:
            runner.unclaim(False)
            work = Work.made_ended(what, result, exception)
            work._runner = runner       # a blocking call in its done callback is refused
            if exception is None:
                work.algorithm = _name_of(ALGO_FLAGS)
                if entry >= 0:
                    rec.end(entry, work.algorithm, None)
            return work
        q = self.queued(kind, buf, recv, ALGO_FLAGS if state == 0 else _sent_by(kind), op,
                        root, timeout)
        q.entry = entry
        q.begun = True
        q.seq = seq
        if state == BEGUN_DIRECT or state == BEGUN_DIRECT_STAGED:
            q.code = ALGO_DIRECT
            q.staged = state == BEGUN_DIRECT_STAGED
            q.stage = DIRECT_HELLO_SENT
        work = Work(what, result)
        runner.begun_collective(q, work, q.code == ALGO_DIRECT)
        return work

    cdef list peer_list(self, int peer):
        """``[peer]``: the flight recorder's peers of a send or receive, one list per rank,
        made once (the recorder keeps a reference that changes only when the object does,
        and copies lists out for a dump)."""
        if not 0 <= peer < self._size:
            return [peer]
        if self._peer_lists is None:
            self._peer_lists = tuple([[p] for p in range(self._size)])
        return <list>self._peer_lists[peer]

    cdef str what(self, int kind):
        """A handle's description for ``kind``: "allreduce on rank 3"."""
        if self._what is None:
            self._what = tuple(["%s on rank %d" % (name, self._rank) for name in _COLLECTIVES])
        return self._what[kind]

    cdef void refused(self, int kind, exc, unsigned int seq) except *:
        """A queued call of ``kind``, numbered ``seq``, refused its arguments as it ran:
        tell the peers, as the Python path does (``Context._refuse``)."""
        self._refuse(_COLLECTIVES[kind], exc, seq)

    cdef object run_queued(self, Queued q):
        """Run ``q`` under the context lock as collective number seq + 1, as ``run`` runs
        a blocking call, its recorder entry made when it was queued; the algorithm's name.
        Where the context is closed or failed, or point-to-point messages wait unreceived,
        ``Context._execute`` runs it and words the error.  A begun ``q`` (``begin_posted``)
        was numbered, and its entry started, when it was posted: running it ends it."""
        cdef Ring rec = self._recorder
        cdef CallLock lock = self._lock
        cdef unsigned int seq
        cdef int code
        lock.take()
        if not q.begun and (self._closed or self._failure is not None or self.has_mail()):
            lock.give()
            return self._execute((q, 1, None, None if q.entry < 0 else q.entry))
        try:
            seq = q.seq if q.begun else self.seq_ + 1
            self._busy = True
            try:
                if q.entry >= 0 and not q.begun:
                    rec.begin(q.entry, seq)
                code = q(seq)
            except BaseException as exc:    # KeyboardInterrupt fails the context too
                self.failed(exc, q.entry)
                raise
            finally:
                self._busy = False
            if not q.begun:
                # A begun one took its number when it was posted; calls begun after it
                # have taken theirs since, and the count must not go back to this one's.
                self.numbered(seq)
        finally:
            lock.give()
        name = _name_of(code)
        if q.entry >= 0:
            rec.end(q.entry, name, None)
        return name

    cdef inline bint ready_async(self) noexcept:
        """Nothing stands in the way of queueing a compiled call (queued work does not)."""
        return not (self._closed or self._failure is not None or self._detail or self._logs)

    cdef inline bint ready_p2p(self) noexcept:
        """As ``ready``, but messages waiting in the mailbox do not stand in the way: for a
        call that looks there itself (sendrecv).  A done callback running (on any thread)
        sends a blocking call to the Python path, which refuses it in the callback."""
        cdef Runner runner = self._runner
        return self.ready_async() and (
            runner is None or not (runner.backlog or runner._callbacks_running))

    cdef inline bint may_run_beside(self) noexcept:
        """Outside the lock, for a blocking call that ``ready`` turned away: whether it may
        yet run beside the runner's batch (``runs_beside`` decides under the lock): the
        runner has work and nothing else stands in the way, and the transport has a flag
        area or reads point-to-point messages aside (``Transport.can_stash``)."""
        return (self._runner is not None and self._runner.backlog and self.ready_async()
                and not self._runner._callbacks_running    # the Python path refuses it there
                and not self.has_mail() and (self._transport.flag_area is not None
                                                 or self._transport.can_stash()))

    cdef Batch runs_beside(self, int kind, object buf, int code):
        """Under the context lock, with the runner engaged: the runner's batch where this
        blocking allreduce, broadcast or barrier runs now, beside it, as MPI's Allreduce
        runs while an Irecv waits (the peer may send that message only after its own
        allreduce, which needs this rank's); else None.  The runner's only work is a batch
        whose receives wait for their messages (nothing of the batch on the wire, nothing
        queued behind it, nobody driving or beginning anything, nothing in the mailbox),
        and the collective either runs on the flag area alone (``flags_fit``: it reads no
        stream) or runs on a transport that reads aside the point-to-point messages it
        meets on the streams (``Transport.can_stash``: ``run`` turns that on, and hands
        what was read aside to the batch's receives afterwards, ``_p2p.stash_to``)."""
        cdef Runner runner = self._runner
        cdef Transport t = self._transport
        cdef Batch batch
        cdef size_t nbytes = 0
        if kind == K_ALLREDUCE or kind == K_BROADCAST:
            nbytes = (<cnp.ndarray>buf).nbytes
        elif kind != K_BARRIER:
            return None
        if runner is None or runner.busy or self.has_mail():
            return None
        if not ((code == ALGO_FLAGS or kind == K_BARRIER) and flags_fit(t, nbytes) != NULL
                or t.can_stash()):
            return None
        batch = self.batch_beside(runner)
        return None if batch is None or batch.on_wire() else batch

    cdef inline bint runner_engaged(self) noexcept:
        """Under the context lock, before a call runs itself: whether the runner has work
        queued or in flight, or another thread holds it (a claim: an async call being
        begun, a batch being joined or driven), which took the lock after this call's
        ``ready`` looked.  Such a call goes to the Python path instead, behind that work:
        run here, a receive could read into the mailbox the message that a receive just
        begun waits for, or a send restart the engine under requests still in flight."""
        cdef Runner runner = self._runner
        return runner is not None and (runner.busy or runner.backlog)

    cdef inline bint ready(self) noexcept:
        """Nothing stands in the compiled path's way (the Python path handles the rest)."""
        return self.ready_p2p() and not self.has_mail()

    cdef inline bint has_mail(self) noexcept:
        """Point-to-point messages wait in the mailbox (they came before their receives)."""
        return self._mailbox is not None and len(self._mailbox.mail) != 0

    cdef int auto(self, int kind, Py_ssize_t nbytes) except -2:
        """auto's algorithm code for ``nbytes`` (-1 for a hierarchical plan)."""
        cdef int i, n = self.n_rules[kind]
        if n < 0:
            n = self.load_rules(kind)
        for i in range(n):
            if nbytes >= self.min_bytes[kind][i]:
                return self.code[kind][i]
        return -1

    cdef int load_rules(self, int kind) except -1:
        cdef int n = 0
        if kind == K_BARRIER:
            self.n_rules[kind] = 0
            return 0
        rules = self._auto_rules(_COLLECTIVES[kind])
        if len(rules) > MAX_RULES:
            rules = ()          # more than the C table holds: every call takes the Python path
        for min_bytes, plan in rules:
            self.min_bytes[kind][n] = min_bytes
            self.code[kind][n] = -1 if plan.hierarchical else plan.code
            n += 1
        self.n_rules[kind] = n
        return n

    cdef object run(self, int kind, object buf, object recv, int code, int op, int root,
                    double timeout, object counts=None, object recvcounts=None):
        """Record, number and run one collective under the context lock, within ``timeout``
        seconds (``buf``: the input, or the buffer a kind works in place; ``recv``: the
        output of the kinds that have one, None where this rank has none; ``counts``: a
        v-variant's, alltoallv's send counts beside its ``recvcounts``); the algorithm's
        name, or _TAKE_SLOW when the context stopped being ready while this call waited or
        its arguments were refused; a receive's (source, count, tag) in place of the name."""
        cdef Ring rec = self._recorder
        cdef Py_ssize_t entry = -1
        cdef unsigned int seq
        cdef Transport t = self._transport
        cdef Py_ssize_t seg = self._segment_bytes
        cdef CallLock lock = self._lock
        cdef OpState saved
        cdef bint beside = False        # beside the runner's batch of waiting receives
        cdef Batch batch = None
        cdef Py_ssize_t left = 0, handed = 0
        lock.take()
        # What the flight recorder notes, as the Python path does: the result's buffer
        # (None for barrier and for a gather's non-root) and the root of a rooted kind.
        cdef bint p2p = kind >= K_SEND          # root: the peer; op: the tag
        described = buf if kind <= K_REDUCE or p2p else recv
        result = None
        try:
            if self._closed or self._failure is not None:
                return _TAKE_SLOW
            if self.runner_engaged():
                batch = self.runs_beside(kind, buf, code)
                if batch is None:
                    return _TAKE_SLOW
                beside = True
            seq = self.seq_ + 1
            if rec is not None:     # the lock is held: started
                entry = _note(rec, kind, described, root,
                              self.peer_list(root) if p2p else None, True,
                              NONE if p2p else seq)
            self._busy = True
            if beside:
                self.enter_beside(&saved)
            try:
                if kind == K_ALLREDUCE:
                    code = run_allreduce(t, buf, op, code, seq, timeout, seg)
                elif kind == K_BROADCAST:
                    code = run_broadcast(t, buf, root, code, seq, timeout, seg)
                elif kind == K_BARRIER:
                    code = run_barrier(t, seq, timeout)
                else:
                    result = _run_other(kind, t, buf, recv, code, op, root, seq, timeout, seg,
                                        counts, recvcounts, self._mailbox)
                    code = _code(result)
            except InvalidArgument as exc:
                if t.is_failed:
                    raise
                # Refused before the wire: the Python path refuses it again and tells
                # the peers (Context._refuse).
                if entry >= 0:
                    rec.end(entry, None, exc)
                return _TAKE_SLOW
            except BaseException as exc:    # KeyboardInterrupt fails the context too
                self.failed(exc, entry)
                raise
            finally:
                self._busy = False
                if beside:
                    left = self.leave_beside(&saved, batch, &handed, seq)
            if not p2p:
                self.numbered(seq)
            if left:
                exc = self.met_unreceived(seq)
                if entry >= 0:
                    rec.end(entry, None, exc)
                raise exc
        finally:
            lock.give()
        if handed:
            # Receives of the batch have their messages: their handles end now, as a
            # look would end them (the lock is free again for the batch's pass).
            self._runner.move_batch()
        name = _name_of(code)
        if entry >= 0:
            rec.end(entry, name, None)
        return result if kind == K_RECV else name
