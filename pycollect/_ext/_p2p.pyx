"""Point-to-point sends and receives, matched by (source, tag) as MPI matches them.

On the wire, the messages between two ranks stay in send order, each with its
header (tag, dtype, byte count).  A receive never posts blindly: it probes the
head of a stream first.  A head that the receive (or, in a batch, the first
pending receive that matches it) wants is read straight into that receive's
buffer; any other point-to-point head is read into this context's ``Mailbox``
of unexpected messages, which later receives look at first.  So rank 0 may
send tags 1 then 2 and rank 1 receive tag 2 first, and async receives complete
in whatever order their messages arrive.

What stays as safe as before: a receive whose message has another dtype, or
is larger than its buffer, raises ``MismatchError``; a collective that meets a
point-to-point message on the wire is a ``MismatchError`` as ever, unless it
runs beside a batch whose receives wait and one of them takes the message
(the collective reads it aside, ``Transport.stash``, and ``stash_to`` hands it
over); and a message left unreceived in the mailbox fails the next collective
(the context checks ``Mailbox.unreceived``) or is named when a receive times
out.

A receive returns (source, element count, tag): the status of MPI.  ``probe``
describes the next matching message without receiving it.
"""

cimport cython
from cpython.bytes cimport PyBytes_FromStringAndSize
from libc.stdint cimport int64_t, uint32_t
from libc.stdlib cimport free, malloc, realloc
from libc.string cimport memcpy

from pycollect._ext._buffer cimport View, pin, check_apart
from pycollect._ext._transport cimport *

from pycollect.errors import MismatchError, Timeout
from pycollect.types import DTYPES

cdef extern from "_sys.h" nogil:
    int64_t pc_now_ns()

ANY_SOURCE = -1
ANY_TAG = -1

cdef enum:
    NOT_POSTED = -1     # a receive's request before its message is matched
    FROM_MAILBOX = -3   # a receive served from the mailbox
    # How long Batch.progress moves requests in flight before it looks again at the
    # heads that its other receives wait for.
    IN_FLIGHT_LOOK_NS = 200000
    # A receive's body up to this many bytes is read as soon as its head is matched,
    # without giving up the GIL (Batch._match): a copy of a few microseconds at most.
    READ_HELD_BYTES = 16384
    # Batch._moving's answers.
    _IDLE = 0
    _IN_FLIGHT = 1
    _ENDED = 2


cdef inline bint _wants(int want_src, int want_tag, int src, int tag) noexcept nogil:
    """Whether a receive for (want_src, want_tag) takes a message from src with tag."""
    return (want_src < 0 or want_src == src) and (
        want_tag == tag or (want_tag == -1 and tag >= 0))


cdef class Mailbox:
    """Point-to-point messages read off the wire that no receive has taken yet, in arrival
    order: each (source, tag, dtype code, payload bytes, stamp), the stamp being the number
    of the sender's next collective when it sent the message (Transport.p2p_seq)."""

    def __init__(self):
        self.mail = []

    def __len__(self):
        return len(self.mail)

    cdef object take(self, int src, int tag):
        """The first message a receive for (src, tag) takes, removed; or None."""
        cdef int i
        for i in range(len(self.mail)):
            m = self.mail[i]
            if _wants(src, tag, m[0], m[1]):
                del self.mail[i]
                return m
        return None

    cdef object peek(self, int src, int tag):
        for m in self.mail:
            if _wants(src, tag, m[0], m[1]):
                return m
        return None

    def sent_before(self, unsigned int seq):
        """Whether a message waits here that its sender sent before it began its collective
        number ``seq``: one left unreceived where this rank begins that collective.  A
        message sent after it (the sender finished its part early, as a broadcast's root
        does, and went on to a send that a receive after the collective takes) came early,
        and waits for its receive."""
        cdef unsigned int stamp
        for m in self.mail:
            stamp = m[4]
            if <int>(stamp - seq) <= 0:
                return True
        return False

    def unreceived(self):
        """What is waiting, in words ("" when nothing is)."""
        return "; ".join("from rank %d, tag %d, %s x %d bytes" % (
            m[0], m[1], DTYPES.get(m[2], "?"), len(m[3])) for m in self.mail)

    def clear(self):
        self.mail = []


cdef tuple _deliver(object m, const View* b, str what):
    """Copy mailbox message ``m`` into ``b``; return (source, element count, tag)."""
    cdef bytes payload = m[3]
    cdef Py_ssize_t n = len(payload)
    if m[2] != b.dtype or n > b.nbytes:
        raise MismatchError(
            "%s: the message from rank %d with tag %d (%s, %d bytes) does not fit this "
            "receive (%s, %d bytes)" % (what, m[0], m[1], DTYPES.get(m[2], "?"), n,
                                        DTYPES.get(b.dtype, "?"), b.nbytes))
    if n:
        memcpy(b.ptr, <const char*>payload, n)
    return m[0], (n // b.itemsize if b.itemsize else 0), m[1]


cdef Py_ssize_t stash_to(Transport t, Mailbox box, Batch batch, Py_ssize_t* handed,
                         unsigned int seq) except -1:
    """After collective ``seq`` run beside ``batch`` (or None): hand the point-to-point
    messages that ``t`` read aside meanwhile (``Transport.stash``), in the order they
    arrived, each to the first of the batch's waiting receives that takes it
    (``Batch._offer``; their number in ``handed``); the others go to ``box``.  The number
    of those whose senders sent them before their part of the collective
    (``Mailbox.sent_before``'s rule), which no receive waited for, left unreceived at it;
    one sent after it (read aside from a stream the collective did not read, its sender
    done with its part) came early, and waits in ``box`` for its receive."""
    cdef Stashed* s = t.stashed()
    cdef Py_ssize_t left = 0
    cdef unsigned int stamp
    handed[0] = 0
    while s != NULL:
        try:
            m = (s.peer, s.tag, s.dtype,
                 PyBytes_FromStringAndSize(s.data, <Py_ssize_t>s.nbytes), s.seq)
        finally:
            free(s)
        if batch is not None and batch._offer(m):
            handed[0] += 1
        else:
            box.mail.append(m)
            stamp = m[4]
            if <int>(stamp - seq) <= 0:
                left += 1
        s = t.stashed()
    return left


cdef int _park(Transport t, Mailbox box, Probe* pr) except -1:
    """Read the message ``pr`` describes into the mailbox."""
    cdef bytearray payload = bytearray(pr.nbytes)
    cdef char* ptr = payload
    cdef int req = -1, rc, peer = pr.peer
    cdef size_t n = pr.nbytes
    with nogil:
        rc = t.set_op(&pr.desc)
        if rc == 0:
            req = t.post_recv_upto(peer, ptr, n)
            rc = req if req < 0 else t.wait(req)
    if rc < 0:
        raise_error(t)
    # (source, tag, dtype, payload, the sender's next collective when it sent it)
    box.mail.append((peer, pr.desc.root, pr.desc.dtype, bytes(payload), pr.desc.seq))
    return 0


cdef raise_timeout(Transport t, Mailbox box, int src, int tag, double timeout):
    waiting = box.unreceived()
    raise Timeout("rank %d: a receive from %s with %s timed out after %g s%s" % (
        t.rank, "any rank" if src < 0 else "rank %d" % src,
        "any tag" if tag == -1 else "tag %d" % tag, timeout,
        "; received meanwhile, and not matched: " + waiting if waiting else ""))


cpdef int send(Transport t, object buf, int dst, int tag, double timeout) except -1:
    """Send ``buf`` to rank ``dst`` with ``tag``; returns once the data has left."""
    cdef View b
    held = pin(buf, &b, "send", "buf", False)
    return _send(t, &b, dst, tag, timeout)


cdef int _send(Transport t, const View* b, int dst, int tag, double timeout) except -1:
    """``send`` of an array already described (``send_beside``'s caller pinned it)."""
    cdef OpDesc d
    cdef int rc
    fill_desc(&d, t.p2p_seq, COLL_P2P, b.dtype, 0, 0, tag, b.count)
    with nogil:
        rc = t.begin(&d, timeout)
        if rc == 0:
            rc = t.post_send(dst, b.ptr, b.nbytes)
        if rc >= 0:
            rc = t.wait_all()
    if rc < 0:
        raise_error(t)
    return ALGO_NONE


cdef int send_beside(Transport t, Batch batch, const View* b, int dst, int tag,
                     double timeout) except -1:
    """``send`` made while ``batch`` (on ``t``, with nothing ``on_wire``: receives waiting
    for their messages) is in flight: sent as ``send`` sends it, on an operation of the
    transport's own, the descriptor and deadline the batch's receives run under set aside
    meanwhile and put back after, so that the batch goes on as it was.  The caller holds
    the context's lock and has checked ``on_wire`` and ``t.sends_now``: nothing here
    moves the batch's receives, so a send that waited for the peer to read could wait for
    ever where the peer's own send waits for them."""
    cdef OpState saved
    t.save_op(&saved)
    try:
        _send(t, b, dst, tag, timeout)
    finally:
        t.restore_op(&saved)
    return ALGO_NONE


cdef inline int _probe_head(Transport t, int src, Probe* pr, int64_t until_ns) noexcept nogil:
    """Wait for the next point-to-point head from ``src`` (-1: any rank), whatever its
    tag: its peer, -2 once ``until_ns`` (when not 0) passes, -1 after the transport's
    error."""
    cdef OpDesc d
    fill_desc(&d, 0, COLL_P2P, 0, 0, 0, -1, 0)
    t.set_op(&d)
    pr.within = NULL        # a group narrows it to its members
    return t.probe_until(src, pr, until_ns)


cdef inline int _post_body(Transport t, int peer, const Probe* pr, char* ptr, size_t nbytes,
                           int dtype, size_t count) noexcept nogil:
    """Post the receive of the body of the head ``pr`` (from ``peer``) into ``ptr``, as an
    operation of the receive's dtype and count and the message's tag: the request, or -1
    after the transport's error."""
    cdef OpDesc d
    fill_desc(&d, 0, COLL_P2P, dtype, 0, 0, pr.desc.root, count)
    if t.set_op(&d) < 0:
        return -1
    return t.post_recv_upto(peer, ptr, nbytes)


cdef int _read_body(Transport t, int peer, Probe* pr, char* ptr, size_t nbytes, int dtype,
                    size_t count, int* req) noexcept nogil:
    """Read the body of the head ``pr`` (from ``peer``) into ``ptr``; 0, or -1 after the
    transport's error (``req[0]``: the request, for the byte count received)."""
    req[0] = _post_body(t, peer, pr, ptr, nbytes, dtype, count)
    return req[0] if req[0] < 0 else t.wait(req[0])


cdef int _receive_failed(Transport t, Mailbox box, const OpDesc* asked, int src, int tag,
                         double timeout) except -1:
    """Raise the transport's error from a wait for a head, naming the operation ``asked``
    (the wait itself runs as a look at any tag, _probe_head; its group is kept); a timeout
    as the receive's."""
    cdef uint32_t group_id = t.err.mine.group_id
    if t.err.mine.coll == COLL_P2P:
        t.err.mine = asked[0]
        t.err.mine.group_id = group_id
    try:
        raise_error(t)
    except Timeout:
        raise_timeout(t, box, src, tag, timeout)
    return -1


cpdef tuple recv(Transport t, Mailbox box, object buf, int src, int tag, double timeout):
    """Receive the first message from ``src`` with ``tag`` into ``buf``; return (source
    rank, element count, tag)."""
    cdef View b
    held = pin(buf, &b, "recv", "buf", True)
    cdef OpDesc d
    cdef Probe pr
    cdef int rc, req = -1, peer = -1
    cdef bint taken = False
    m = box.take(src, tag)
    if m is not None:
        return _deliver(m, &b, "recv")
    fill_desc(&d, 0, COLL_P2P, b.dtype, 0, 0, tag, b.count)
    # The common case in one stretch without the GIL: the first head to come is the one
    # asked for, and its body is read straight into buf.  Any other head is parked in
    # the mailbox (with the GIL) and the wait goes on in _matching_loop.
    with nogil:
        rc = t.begin(&d, timeout)
        if rc == 0:
            rc = _first_look(t, src, tag, &pr, b.ptr, b.nbytes, b.dtype, b.count, &peer, &req,
                             &taken)
    if rc < 0:
        raise_error(t)
    return _received(t, box, &d, src, tag, timeout, peer, taken, &pr, &b, req)


cdef inline int _first_look(Transport t, int src, int tag, Probe* pr, char* ptr,
                            size_t nbytes, int dtype, size_t count, int* peer, int* req,
                            bint* taken) noexcept nogil:
    """A receive's first look at the wire: the next head from ``src`` (``peer[0]``, -1 after
    the transport's error); where it is the one asked for (``taken[0]``), its body is read
    straight into ``ptr`` (request ``req[0]``).  0, or -1 after the transport's error."""
    peer[0] = _probe_head(t, src, pr, 0)
    if peer[0] >= 0 and _wants(src, tag, peer[0], pr.desc.root):
        taken[0] = True
        return _read_body(t, peer[0], pr, ptr, nbytes, dtype, count, req)
    return 0


cdef tuple _received(Transport t, Mailbox box, const OpDesc* d, int src, int tag,
                     double timeout, int peer, bint taken, Probe* pr, const View* b, int req):
    """The rest of receive ``d`` into ``b`` after its first look at the wire, which found
    ``peer``'s head ``pr`` (-1: the transport failed) and, when ``taken`` (the head asked
    for), read its body with request ``req``: another head is parked in the mailbox and
    the wait goes on (``_matching_loop``).  Returns (source rank, element count, tag)."""
    cdef int rc
    if peer == -1:
        _receive_failed(t, box, d, src, tag, timeout)
    if not taken:
        _park(t, box, pr)
        peer = _matching_loop(t, box, d, src, tag, timeout, 0, pr)
        with nogil:
            rc = _read_body(t, peer, pr, b.ptr, b.nbytes, b.dtype, b.count, &req)
        if rc < 0:
            raise_error(t)
    return peer, _count(t, req, b.itemsize), pr.desc.root


def probe(Transport t, Mailbox box, int src, int tag, double timeout, bint block):
    """Describe the first message from ``src`` with ``tag`` without receiving it: (source,
    byte count, tag, dtype code), or None when ``block`` is false and none is here yet."""
    return _probe(t, box, src, tag, timeout, 0 if block else pc_now_ns(), False)


cpdef object probe_beside(Transport t, Mailbox box, int src, int tag, double timeout):
    """``probe``'s one look, without waiting, made while a batch (on ``t``, with no
    receive waiting for its message: ``Batch.matches_heads``) is in flight: the mailbox,
    then the heads on the wire now (other point-to-point heads parked in the mailbox, as
    probe parks them; a pair whose body the batch reads is not looked at), on an operation
    of the transport's own, the batch's descriptor and deadline set aside meanwhile and put
    back after (``Transport.save_op``), as ``send_beside`` does.  Nothing is begun, so the
    batch's requests stay in flight: a send of the batch that waits for the peer to read
    it goes on while this rank looks for the peer's message (MPI's Isend, then Probe or
    Iprobe, then Recv).  (source, byte count, tag, dtype code), or None.  The caller holds
    the context's lock."""
    return _probe(t, box, src, tag, timeout, pc_now_ns(), True)


cdef object _probe(Transport t, Mailbox box, int src, int tag, double timeout,
                   int64_t until_ns, bint beside):
    """``probe`` and ``probe_beside``: the mailbox, then the wire until ``until_ns`` (0:
    until the message comes); ``beside``: on an operation of the transport's own, nothing
    begun, the operation in progress set aside and put back after."""
    cdef OpDesc d
    cdef OpState saved
    cdef Probe pr
    cdef int peer
    m = box.peek(src, tag)
    if m is not None:
        return m[0], len(m[3]), m[1], m[2]
    fill_desc(&d, 0, COLL_P2P, 0, 0, 0, tag, 0)
    if not beside:
        peer = _matching_head(t, box, &d, src, tag, timeout, until_ns, &pr)
    else:
        t.save_op(&saved)
        try:
            with nogil:
                t.set_op(&d)
                t.extend_deadline(timeout)
            peer = _matching_loop(t, box, &d, src, tag, timeout, until_ns, &pr)
        finally:
            t.restore_op(&saved)
    if peer == -2:
        return None
    return peer, pr.nbytes, pr.desc.root, pr.desc.dtype


cdef int _matching_head(Transport t, Mailbox box, OpDesc* d, int src, int tag, double timeout,
                        int64_t until_ns, Probe* pr) except -3:
    """Begin operation ``d``, then wait for the first head from ``src`` with ``tag``,
    parking the other point-to-point heads in the mailbox: its peer, described in
    ``pr``; -2 when ``until_ns`` (when not 0) passes first."""
    cdef int rc
    with nogil:
        rc = t.begin(d, timeout)
    if rc < 0:
        raise_error(t)
    return _matching_loop(t, box, d, src, tag, timeout, until_ns, pr)


cdef int _matching_loop(Transport t, Mailbox box, const OpDesc* d, int src, int tag,
                        double timeout, int64_t until_ns, Probe* pr) except -3:
    """_matching_head's wait, on operation ``d``, already begun."""
    cdef int peer = -1
    while True:     # bounded by the deadline: each turn takes one message off the wire
        with nogil:
            peer = _probe_head(t, src, pr, until_ns)
        if peer == -1:
            _receive_failed(t, box, d, src, tag, timeout)
        if peer == -2 or _wants(src, tag, peer, pr.desc.root):
            return peer
        _park(t, box, pr)


cdef Py_ssize_t _count(Transport t, int req, int itemsize):
    return <Py_ssize_t>(t.received(req) // itemsize) if itemsize else 0


def sendrecv(Transport t, Mailbox box, object sendbuf, int dst, int sendtag, object recvbuf,
             int src, int recvtag, double timeout):
    """Send ``sendbuf`` to ``dst`` and receive into ``recvbuf`` from ``src`` with
    ``recvtag``, both in flight at once; return the receive's (source rank, element count,
    tag).  Both buffers are checked before anything goes out.

    The common case runs as one stretch without the GIL, as ``recv``'s does: the send is
    posted, the first head to come is the one asked for and is read straight into
    ``recvbuf``, then the send is waited for.  A message already in the mailbox, or another
    head first, takes ``recv``'s other paths while the send stays in flight."""
    cdef View sb, rb
    held_sb = pin(sendbuf, &sb, "sendrecv", "sendbuf", False)
    held_rb = pin(recvbuf, &rb, "sendrecv", "recvbuf", True)
    check_apart(sb, rb, "sendrecv", ", or sendrecv_replace with one")
    cdef OpDesc ds, dr
    cdef Probe pr
    cdef int rc, req = -1, peer = -1
    cdef bint taken = False
    fill_desc(&ds, t.p2p_seq, COLL_P2P, sb.dtype, 0, 0, sendtag, sb.count)
    fill_desc(&dr, 0, COLL_P2P, rb.dtype, 0, 0, recvtag, rb.count)
    m = box.take(src, recvtag)
    if m is not None:       # checked, and copied, before the send goes out
        got = _deliver(m, &rb, "sendrecv")
    with nogil:
        rc = t.begin(&ds, timeout)
        if rc == 0:
            rc = t.post_send(dst, sb.ptr, sb.nbytes)
        if rc >= 0 and m is None:
            rc = _first_look(t, src, recvtag, &pr, rb.ptr, rb.nbytes, rb.dtype, rb.count,
                             &peer, &req, &taken)
    if rc < 0:
        raise_error(t)
    if m is None:
        got = _received(t, box, &dr, src, recvtag, timeout, peer, taken, &pr, &rb, req)
    with nogil:
        rc = t.set_op(&ds)      # a failure from here on is the send's
        if rc == 0:
            rc = t.wait_all()
    if rc < 0:
        raise_error(t)
    return got


cpdef tuple start(Transport t, Mailbox box, double timeout, bint is_recv, object buf, int peer,
                  int tag):
    """Begin one async send or receive on ``t`` as a batch of its own and move it once (a
    receive: it matches its message, then reads it), as ``progress(0)`` would; return
    (batch, index, ended, status).  Where it has ended, batch is None (none was made) and
    status is a receive's (source, element count, tag); where it is still in flight, it is
    operation ``index`` of the Batch returned, for the runner to drive.  A receive while
    messages wait in the mailbox takes the Batch's way (``add_recv``) from the start."""
    cdef View b
    cdef OpDesc d
    cdef Probe pr
    cdef Batch batch
    cdef int rc = 0, req = -1, got = -2
    cdef int64_t now
    if is_recv and len(box.mail):
        batch = Batch(t, box, timeout)
        i = batch.add_recv(buf, peer, tag)
        now = pc_now_ns()
        batch._match(now, now)
        return _moved(batch, i)
    held = pin(buf, &b, "recv" if is_recv else "send", "buf", is_recv)
    if held is None:
        held = buf
    fill_desc(&d, 0 if is_recv else t.p2p_seq, COLL_P2P, b.dtype, 0, 0, tag, b.count)
    with nogil:
        rc = t.begin(&d, timeout)
        if rc == 0 and not is_recv:
            req = rc = t.post_send_async(peer, b.ptr, b.nbytes)
        elif rc == 0:
            t.past_collectives(1)       # a peer's collective first: wait behind it (Batch._head)
            got = _probe_head(t, peer, &pr, PROBE_ONCE)
            t.past_collectives(0)
            if got >= 0 and _wants(peer, tag, got, pr.desc.root):
                req = rc = _post_body(t, got, &pr, b.ptr, b.nbytes, b.dtype, b.count)
        if rc >= 0 and req >= 0 and not t.done(req):
            rc = t.progress_until(PROGRESS_ONCE)
    if rc < 0:
        raise_error(t)
    if got == -1:
        _receive_failed(t, box, &d, peer, tag, timeout)
    if req >= 0 and t.done(req):
        return (None, -1, True, (got, _count(t, req, b.itemsize), pr.desc.root) if is_recv
                else None)
    batch = Batch.__new__(Batch)
    batch._attach(t, box, timeout)
    if req >= 0:            # a send in flight, or a receive reading its message
        i = batch._append(held, &b, got if is_recv else peer, pr.desc.root if is_recv else tag,
                          req)
        return batch, i, False, None
    # A receive whose message has not come (or another's head came first): the Batch's way.
    i = batch._append(held, &b, peer, tag, NOT_POSTED)
    batch._wait_for(i)
    if got >= 0:
        now = pc_now_ns()
        batch._match(now, now)
    return _moved(batch, i)


cdef tuple _moved(Batch batch, int i):
    """``start``'s answer for operation ``i`` of ``batch``, a receive moved once by
    ``_match``: moved once more, as progress(0) would."""
    cdef int rc
    if not batch._ended(i) and not batch.n_waiting:
        with nogil:
            rc = batch.t.progress_until(PROGRESS_ONCE)
        if rc < 0:
            raise_error(batch.t)
    if batch._ended(i):
        batch._close(i)
        return None, -1, True, batch.result(i)
    return batch, i, False, None


@cython.freelist(4)
cdef class Batch:
    """Sends and receives of one context in flight together, completing in any order.

    Sends are posted as they are added.  A receive first looks in the mailbox;
    otherwise it waits for a message: each point-to-point head that shows up
    goes to the first pending receive (in the order they were added) that
    takes it, straight into its buffer, or to the mailbox when none does.
    ``progress`` moves everything for a while and returns the indices of the
    operations that completed since the last call.
    """

    # Its fields: _p2p.pxd.  The operations' state lies in one C array (``ops``), so
    # that moving a batch of one or two operations makes no Python objects but the list
    # of those that ended.

    def __init__(self, Transport t, Mailbox box, double timeout):
        cdef OpDesc d
        cdef int rc
        fill_desc(&d, 0, COLL_P2P, 0, 0, 0, 0, 0)
        self._attach(t, box, timeout)
        with nogil:
            rc = t.begin(&d, timeout)
        if rc < 0:
            raise_error(t)

    def __dealloc__(self):
        if self.ops != self.inline:
            free(self.ops)

    cdef void _attach(self, Transport t, Mailbox box, double timeout):
        """Empty, on ``t``'s operation (begun by the caller)."""
        self.t = t
        self.box = box
        self.timeout = timeout
        self.bufs = []
        self.n = self.n_waiting = self.first_open = 0

    def __len__(self):
        return self.n

    cpdef int add_send(self, object buf, int dst, int tag, object timeout=None) except -1:
        """Post a send (``timeout``: its deadline, else the batch's); its index."""
        cdef View b
        cdef OpDesc d
        cdef int req
        cdef double tmo = self.timeout if timeout is None else timeout
        held = pin(buf, &b, "send", "buf", False)
        fill_desc(&d, self.t.p2p_seq, COLL_P2P, b.dtype, 0, 0, tag, b.count)
        with nogil:
            self.t.extend_deadline(tmo)
            req = self.t.set_op(&d)
            if req == 0:
                req = self.t.post_send_async(dst, b.ptr, b.nbytes)
        if req < 0:
            raise_error(self.t)
        return self._append(buf if held is None else held, &b, dst, tag, req)

    cpdef int add_recv(self, object buf, int src, int tag, object timeout=None) except -1:
        """Add a receive (matched at once from the mailbox when it can be; ``timeout``: its
        deadline, else the batch's); its index."""
        cdef View b
        cdef int i
        cdef double tmo = self.timeout if timeout is None else timeout
        held = pin(buf, &b, "recv", "buf", True)
        i = self._append(buf if held is None else held, &b, src, tag, NOT_POSTED)
        self.t.extend_deadline(tmo)     # a clock read: with the GIL held
        m = self.box.take(src, tag)
        if m is not None:
            self._from_mailbox(i, m)
        else:
            self._wait_for(i)
        return i

    cdef int _append(self, object held, const View* b, int peer, int tag, int req) except -1:
        """Add an operation on ``b``, whose memory ``held`` keeps (the array itself, or the
        Buffer that ``pin`` made for another object); its index."""
        cdef BatchOp* grown
        cdef BatchOp* op
        cdef int cap
        if self.cap == 0:
            self.ops, self.cap = self.inline, 4
        elif self.n == self.cap:
            cap = 2 * self.cap
            if self.ops == self.inline:
                grown = <BatchOp*>malloc(cap * sizeof(BatchOp))
                if grown != NULL:
                    memcpy(grown, self.inline, self.n * sizeof(BatchOp))
            else:
                grown = <BatchOp*>realloc(self.ops, cap * sizeof(BatchOp))
            if grown == NULL:
                raise MemoryError("a batch of %d sends and receives" % cap)
            self.ops, self.cap = grown, cap
        self.bufs.append(held)
        op = &self.ops[self.n]
        op.ptr, op.nbytes, op.count, op.dtype = b.ptr, b.nbytes, b.count, b.dtype
        op.itemsize = b.itemsize
        op.peer, op.tag, op.req, op.got = peer, tag, req, 0
        op.waiting, op.open = False, True
        self.n += 1
        return self.n - 1

    cdef void _wait_for(self, int i) noexcept:
        """Receive ``i`` waits for its message (``_match`` hands it one)."""
        self.ops[i].waiting = True
        self.n_waiting += 1

    cdef void _close(self, int i) noexcept:
        """Operation ``i`` is reported complete."""
        self.ops[i].open = False
        while self.first_open < self.n and not self.ops[self.first_open].open:
            self.first_open += 1

    cdef _from_mailbox(self, int i, object m):
        cdef BatchOp* op = &self.ops[i]
        cdef View b
        b.ptr, b.nbytes, b.count, b.dtype, b.itemsize = op.ptr, op.nbytes, op.count, op.dtype, \
            op.itemsize
        b.readonly = False
        op.peer, op.got, op.tag = _deliver(m, &b, "recv")
        op.req = FROM_MAILBOX

    cdef bint _offer(self, object m) except -1:
        """Give the message ``m`` (a mailbox entry) to the first waiting receive that takes
        it: whether one did.  A message read aside by a collective run beside the batch
        (``stash_to``) comes so, before anything the wire still holds from its sender."""
        cdef int i = self._taker(m[0], m[1])
        if i < 0:
            return False
        self._from_mailbox(i, m)
        return True

    cdef int _taker(self, int src, int tag) except -2:
        """The first waiting receive that takes a message from ``src`` with ``tag``, no
        longer waiting; -1 where none does."""
        cdef int i
        for i in range(self.first_open, self.n):
            if self.ops[i].waiting and _wants(self.ops[i].peer, self.ops[i].tag, src, tag):
                self.ops[i].waiting = False
                self.n_waiting -= 1
                return i
        return -1

    cdef int _waiting_source(self) noexcept:
        """The one source every waiting receive names, else -1 (any rank)."""
        cdef int i, src = -2
        for i in range(self.first_open, self.n):
            if self.ops[i].waiting:
                if src == -2:
                    src = self.ops[i].peer
                elif self.ops[i].peer != src:
                    return -1
        return -1 if src == -2 else src

    cdef bint _waits_for(self, int src) noexcept:
        """A waiting receive names ``src``."""
        cdef int i
        for i in range(self.first_open, self.n):
            if self.ops[i].waiting and self.ops[i].peer == src:
                return True
        return False

    cdef int _match(self, int64_t until_ns, int64_t now_ns) except -1:
        """Hand the heads that show up before ``until_ns`` to the waiting receives (``now_ns``:
        the clock read at or before the call)."""
        cdef BatchOp* op
        cdef Probe pr
        cdef int i, peer = -1, req, src
        while self.n_waiting:
            src = self._waiting_source()
            peer = self._head(src, &pr, until_ns, now_ns)
            if peer == -2 and src < 0:
                # A look at any rank's head passes over pairs that ended: look at each
                # rank a receive waits for, so that one that left is named.
                for src in range(self.t.size):
                    if self._waits_for(src):
                        peer = self._head(src, &pr, PROBE_ONCE, PROBE_ONCE)
                        if peer != -2:
                            break
            if peer == -2:
                return 0
            i = self._taker(peer, pr.desc.root)
            if i < 0:
                _park(self.t, self.box, &pr)
                continue
            op = &self.ops[i]
            # Posting is bookkeeping; a small body is read at once, as start() reads it,
            # so that the progress that reports it need not move the transport again.
            req = _post_body(self.t, peer, &pr, op.ptr, op.nbytes, op.dtype, op.count)
            if req >= 0 and pr.nbytes <= READ_HELD_BYTES and not self.t.done(req) \
                    and self.t.progress_until(PROGRESS_ONCE) < 0:
                req = -1
            if req < 0:
                raise_error(self.t)
            op.peer, op.tag, op.req = peer, pr.desc.root, req
        return 0

    cdef int _head(self, int src, Probe* pr, int64_t until_ns, int64_t now_ns) except -3:
        """The next head from ``src`` (-1: any rank), -2 once ``until_ns`` passes (``now_ns``:
        a clock reading at or before the call, so that none is needed to tell whether
        ``until_ns`` has passed already: an older one only costs a wait that ends at
        once); a failure raised naming a waiting receive: one from the rank the failure
        names, else the first added."""
        cdef BatchOp* op
        cdef OpDesc d
        cdef int peer, i, j
        # A peer's collective at the head, where nothing of the batch is on the wire:
        # wait behind it for the collective to run beside the batch (Runner).
        self.t.past_collectives(not self.on_wire())
        # One look with the GIL held (a message that is here costs no release of it),
        # then the wait without it.
        peer = _probe_head(self.t, src, pr, PROBE_ONCE)
        if peer == -2 and until_ns > now_ns:
            with nogil:
                peer = _probe_head(self.t, src, pr, until_ns)
        self.t.past_collectives(0)
        if peer != -1:
            return peer
        i = -1
        for j in range(self.first_open, self.n):
            if self.ops[j].waiting:
                if i < 0:
                    i = j
                if self.ops[j].peer == self.t.err.peer:
                    i = j
                    break
        op = &self.ops[i]
        fill_desc(&d, 0, COLL_P2P, op.dtype, 0, 0, op.tag, op.count)
        return _receive_failed(self.t, self.box, &d, op.peer, op.tag, self.timeout)

    cdef int _moving(self) except -1:
        """_ENDED where an open operation has ended (not reported yet), else _IN_FLIGHT
        where one has a posted request (a send, a matched receive's body), else _IDLE."""
        cdef int i, moving = _IDLE
        for i in range(self.first_open, self.n):
            if self.ops[i].open:
                if self._ended(i):
                    return _ENDED
                if self.ops[i].req >= 0:
                    moving = _IN_FLIGHT
        return moving

    cpdef bint matches_heads(self) except -1:
        """A receive of the batch waits for its message: the heads that come are its to
        match (``_match``), and nothing beside the batch may park one in the mailbox, which
        that receive no longer looks at (a collective run beside the batch hands what it
        read aside to the receives first: ``stash_to``)."""
        return self.n_waiting > 0

    cpdef bint on_wire(self) except -1:
        """An open operation has a request of the transport's: a send, or a matched
        receive's body (in flight, or ended and not reported yet).  Where none has, the
        batch's receives wait for their heads with nothing of theirs on the transport, and
        an operation of the transport's own may run beside them (``send_beside``)."""
        cdef int i
        for i in range(self.first_open, self.n):
            if self.ops[i].open and self.ops[i].req >= 0:
                return True
        return False

    cdef bint _ended(self, int i) except -1:
        """Operation ``i`` has ended: served from the mailbox, or its request is done."""
        cdef int req = self.ops[i].req
        return req == FROM_MAILBOX or req >= 0 and self.t.done(req)

    cpdef list progress(self, double seconds):
        """Move every request for up to ``seconds`` (``move``); return the indices of the
        operations that completed since the last call (``next_ended``).  Raises the
        transport's error (which fails them all)."""
        cdef int i
        self.move(seconds)
        done = []
        i = self.next_ended(0)
        while i >= 0:
            done.append(i)
            i = self.next_ended(i + 1)
        return done

    cdef int move(self, double seconds) except -1:
        """Move every request for up to ``seconds``; raises the transport's error.

        An operation that has ended, or a request in flight (a send, a matched
        receive's body), does not wait for the heads that other receives wait for: the
        heads already here are matched, then the requests move until they end (not at
        all where one has ended already) or, while receives still wait,
        IN_FLIGHT_LOOK_NS at most, after which the caller's next call looks at the heads
        again.  (A receive waiting for a message that came late held a blocking send
        beside it for the whole of ``seconds``.)"""
        cdef int rc = 0
        cdef int64_t now = pc_now_ns()
        cdef int64_t until = now + <int64_t>(seconds * 1e9)
        cdef int moving = self._moving()
        if moving == _ENDED:
            until = now         # what has ended is reported without waiting
        if self.n_waiting and moving == _IDLE:
            self._match(until, now)
        else:
            if self.n_waiting:
                self._match(now, now)
                if self.n_waiting and until - now > IN_FLIGHT_LOOK_NS:
                    until = now + IN_FLIGHT_LOOK_NS
            with nogil:
                rc = self.t.progress_until(until)
            if rc < 0:
                raise_error(self.t)
        return 0

    cdef int next_ended(self, int start) except -2:
        """The first operation from ``start`` on that has ended and was not reported yet,
        now reported (closed); -1 where none has."""
        cdef int i
        for i in range(start if start > self.first_open else self.first_open, self.n):
            if self.ops[i].open and self._ended(i):
                self._close(i)
                return i
        return -1

    cpdef tuple result(self, int i):
        """A completed receive's (source rank, element count, tag)."""
        cdef BatchOp* op
        if not 0 <= i < self.n:
            raise IndexError("batch operation %d of %d" % (i, self.n))
        op = &self.ops[i]
        if op.req == FROM_MAILBOX:
            return op.peer, op.got, op.tag
        return op.peer, _count(self.t, op.req, op.itemsize), op.tag
