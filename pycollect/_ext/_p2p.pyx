"""Point-to-point send and receive with tags.

Messages between two ranks are received in the order they were sent: a
receive from a given rank takes that rank's next message, and its tag must
match (a different tag is a MismatchError, not a reordering).  A receive from
ANY_SOURCE takes the first rank whose next message is a point-to-point
message of this group with the tag (ANY_TAG: any tag).  A message may be
smaller than the receive buffer; the receive returns the source and the
element count.
"""

from pycollect._ext._buffer cimport Buffer, as_buffer
from pycollect._ext._transport cimport *

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
    cdef int rc, peer = -1
    fill_desc(&d, 0, COLL_P2P, b.dtype, 0, 0, tag, b.count)
    with nogil:
        rc = t.begin(&d, timeout)
        if rc == 0:
            peer = t.probe(src, &pr)
            rc = peer if peer < 0 else 0
        if rc == 0:
            if (tag >= 0 and pr.desc.root != tag) or pr.desc.dtype != b.dtype \
                    or pr.nbytes > <uint64_t>b.nbytes:
                t.err.theirs = pr.desc
                t.err.has_theirs = 1
                rc = t.set_error(ERR_MISMATCH, peer, "", 0, "the message does not match "
                                 "this receive (tag, dtype, or larger than the buffer)")
            else:
                t.op = pr.desc      # accept the message as it is described
                rc = t.post_recv(peer, b.ptr, pr.nbytes)
                if rc >= 0:
                    rc = t.wait_all()
    if rc < 0:
        raise_error(t)
    return peer, <Py_ssize_t>(pr.nbytes // b.itemsize if b.itemsize else 0)
