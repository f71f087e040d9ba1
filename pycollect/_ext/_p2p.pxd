# Point-to-point sends and receives (_p2p.pyx): the mailbox, batches, and the blocking
# send and receive, and the async ones' start, that the compiled call path (_call.pyx)
# calls without Python's call.
from libc.stdint cimport int64_t

from pycollect._ext._buffer cimport Buffer
from pycollect._ext._transport cimport Probe, Transport

cdef class Mailbox:
    cdef list mail

    cdef object take(self, int src, int tag)
    cdef object peek(self, int src, int tag)

cdef class Batch:
    cdef Transport t
    cdef Mailbox box
    cdef double timeout
    cdef list bufs          # Buffer of each operation
    cdef list peers         # destination, or source (the sender once matched)
    cdef list tags          # the tag asked for, then the message's
    cdef list reqs          # the transport request; NOT_POSTED, or FROM_MAILBOX
    cdef list counts        # a receive's element count, once known from the mailbox
    cdef list is_recv
    cdef list waiting       # receives not matched yet, in the order they were added
    cdef set open_ops       # operations not reported complete yet

    cdef void _attach(self, Transport t, Mailbox box, double timeout)
    cdef int _append(self, Buffer b, int peer, int tag, int req, bint is_recv)
    cdef _from_mailbox(self, int i, object m)
    cdef bint _offer(self, object m) except -1
    cdef int _taker(self, int src, int tag) except -2
    cdef int _match(self, int64_t until_ns) except -1
    cdef int _head(self, int src, Probe* pr, int64_t until_ns) except -3
    cdef int _moving(self) except -1
    cdef bint _ended(self, int i) except -1
    cpdef bint on_wire(self) except -1
    cpdef bint matches_heads(self) except -1

cdef Py_ssize_t stash_to(Transport t, Mailbox box, Batch batch, Py_ssize_t* handed) except -1
cpdef int send(Transport t, object buf, int dst, int tag, double timeout) except -1
cpdef tuple recv(Transport t, Mailbox box, object buf, int src, int tag, double timeout)
cpdef tuple start(Transport t, Mailbox box, double timeout, bint is_recv, object buf, int peer,
                  int tag)
cpdef int send_beside(Transport t, Batch batch, object buf, int dst, int tag,
                      double timeout) except -1
cpdef object probe_beside(Transport t, Mailbox box, int src, int tag, double timeout)
