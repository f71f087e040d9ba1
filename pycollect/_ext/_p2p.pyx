"""Point-to-point send and receive with tags.

Messages between two ranks are received in the order they were sent: a
receive from a given rank takes that rank's next point-to-point message, and
its tag must match (a different tag is a MismatchError, not a reordering).  A
receive from ANY_SOURCE takes the first rank whose next message is a
point-to-point message of this group with the tag (ANY_TAG: any tag).  A
message may be smaller than the receive buffer; the receive returns the
source and the element count.

``Batch`` keeps several sends and receives in flight at once: the async
send/recv of a context, so that two ranks that each post a large send
before the matching receive do not wait on each other.
"""

from libc.stdint cimport int64_t

from pycollect._ext._buffer cimport Buffer, as_buffer
from pycollect._ext._transport cimport *

cdef extern from "_sys.h" nogil:
    int64_t pc_now_ns()

ANY_SOURCE = -1
ANY_TAG = -1


def send(Transport t, object buf, int dst, int tag, double timeout):
    """Send ``buf`` to rank ``dst`` with ``tag``; returns once the data has left."""
    cdef Buffer b = as_buffer(buf, "send", "buf", False)
    cdef OpDesc d
    cdef int rc
    fill_desc(&d, 0, COLL_P2P, b.dtype, 0, 0, tag, b.count)
    with nogil:
        rc = t.begin(&d, timeout)
        if rc == 0:
            rc = t.post_send(dst, b.ptr, b.nbytes)
        if rc >= 0:
            rc = t.wait_all()
    if rc < 0:
        raise_error(t)
    return ALGO_NONE


def recv(Transport t, object buf, int src, int tag, double timeout):
    """Receive the next matching message into ``buf``; return (source rank, element count)."""
    cdef Buffer b = as_buffer(buf, "recv", "buf", True)
    cdef OpDesc d
    cdef Probe pr
    cdef int rc, req = -1, peer = src
    fill_desc(&d, 0, COLL_P2P, b.dtype, 0, 0, tag, b.count)
    with nogil:
        rc = t.begin(&d, timeout)
        if rc == 0 and src < 0:
            peer = t.probe(-1, &pr)
            rc = peer if peer < 0 else 0
        if rc == 0:
            req = t.post_recv_upto(peer, b.ptr, b.nbytes)
            rc = req if req < 0 else t.wait_all()
    if rc < 0:
        raise_error(t)
    return peer, _count(t, req, b)


cdef Py_ssize_t _count(Transport t, int req, Buffer b):
    return <Py_ssize_t>(t.received(req) // b.itemsize) if b.itemsize else 0


cdef class Batch:
    """Sends and receives of one context in flight together.

    Sends are posted as they are added.  Receives are posted in the order
    they are added; one from ANY_SOURCE is posted once a matching message
    shows up, and receives added after it wait for that.  ``progress`` moves
    everything for a while and tells how many operations, counted from the
    first, are complete: they complete in the order they were added.
    """

    cdef Transport t
    cdef double timeout
    cdef list bufs          # Buffer of each operation
    cdef list peers         # destination, or source (-1 until an ANY_SOURCE receive is posted)
    cdef list tags
    cdef list reqs          # the transport request, -1 until posted
    cdef list is_recv
    cdef int unposted       # the first receive not posted yet (len(reqs) when none)
    cdef int finished       # operations complete, counted from the first

    def __init__(self, Transport t, double timeout):
        cdef OpDesc d
        cdef int rc
        fill_desc(&d, 0, COLL_P2P, 0, 0, 0, 0, 0)
        self.t = t
        self.timeout = timeout
        self.bufs, self.peers, self.tags, self.reqs, self.is_recv = [], [], [], [], []
        self.unposted = 0
        self.finished = 0
        with nogil:
            rc = t.begin(&d, timeout)
        if rc < 0:
            raise_error(t)

    def __len__(self):
        return len(self.reqs)

    def add_send(self, object buf, int dst, int tag):
        """Post a send; returns its index in the batch."""
        cdef Buffer b = as_buffer(buf, "send", "buf", False)
        cdef OpDesc d
        cdef int req
        fill_desc(&d, 0, COLL_P2P, b.dtype, 0, 0, tag, b.count)
        with nogil:
            self.t.extend_deadline(self.timeout)
            req = self.t.set_op(&d)
            if req == 0:
                req = self.t.post_send(dst, b.ptr, b.nbytes)
        if req < 0:
            raise_error(self.t)
        if self.unposted == len(self.reqs):
            self.unposted += 1
        return self._append(b, dst, tag, req, False)

    def add_recv(self, object buf, int src, int tag):
        """Queue a receive (posted at once unless an earlier one waits); returns its index."""
        cdef Buffer b = as_buffer(buf, "recv", "buf", True)
        cdef int i = self._append(b, src, tag, -1, True)
        with nogil:
            self.t.extend_deadline(self.timeout)
        self._post_ready(1)
        return i

    cdef int _append(self, Buffer b, int peer, int tag, int req, bint is_recv):
        self.bufs.append(b)
        self.peers.append(peer)
        self.tags.append(tag)
        self.reqs.append(req)
        self.is_recv.append(is_recv)
        return len(self.reqs) - 1

    cdef int _post_ready(self, int64_t until_ns) except -1:
        """Post queued receives in order, up to one from ANY_SOURCE with no message yet."""
        cdef Buffer b
        cdef OpDesc d
        cdef Probe pr
        cdef int i, peer, req
        while self.unposted < len(self.reqs):
            i = self.unposted
            if not self.is_recv[i]:
                self.unposted += 1
                continue
            b = self.bufs[i]
            peer = self.peers[i]
            fill_desc(&d, 0, COLL_P2P, b.dtype, 0, 0, self.tags[i], b.count)
            with nogil:
                req = self.t.set_op(&d)
                if req == 0 and peer < 0:
                    peer = self.t.probe_until(-1, &pr, until_ns)
                    req = peer if peer < 0 else 0
                if req == 0:
                    req = self.t.post_recv_upto(peer, b.ptr, b.nbytes)
            if req == -2:
                return 0        # no message for the ANY_SOURCE receive yet
            if req < 0:
                raise_error(self.t)
            self.peers[i] = peer
            self.reqs[i] = req
            self.unposted += 1
        return 0

    def progress(self, double seconds):
        """Move every request for up to ``seconds``; return how many operations, from the
        first, are complete.  Raises the transport's error, which fails them all."""
        cdef int rc = 0
        cdef int64_t until = pc_now_ns() + <int64_t>(seconds * 1e9)
        self._post_ready(1)
        if self.unposted == len(self.reqs):
            with nogil:
                rc = self.t.progress_until(until)
        else:
            # An ANY_SOURCE receive waits for its message; the rest move meanwhile.
            self._post_ready(until)
        if rc < 0:
            raise_error(self.t)
        while self.finished < self.unposted and self.t.done(self.reqs[self.finished]):
            self.finished += 1
        return self.finished

    def result(self, int i):
        """A completed receive's (source rank, element count)."""
        return self.peers[i], _count(self.t, self.reqs[i], self.bufs[i])
