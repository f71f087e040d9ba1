# Point-to-point sends and receives (_p2p.pyx): the mailbox, batches, and the blocking
# send and receive, and the async ones' start, that the compiled call path (_call.pyx)
# calls without Python's call.
from libc.stdint cimport int64_t

from pycollect._ext._buffer cimport Buffer, View
from pycollect._ext._transport cimport Probe, Transport

cdef class Mailbox:
    cdef list mail

    cdef object take(self, int src, int tag)
    cdef object peek(self, int src, int tag)

cdef struct BatchOp:
    char* ptr               # the operation's buffer (held by Batch.bufs)
    size_t nbytes
    size_t count            # its element count
    int dtype
    int itemsize
    int peer                # destination, or source (the sender once matched)
    int tag                 # the tag asked for, then the message's
    int req                 # the transport request; NOT_POSTED, or FROM_MAILBOX
    Py_ssize_t got          # a receive's element count, once known from the mailbox
    bint waiting            # a receive not matched yet
    bint open               # not reported complete yet

cdef class Batch:
    cdef Transport t
    cdef Mailbox box
    cdef double timeout
    cdef list bufs          # what keeps each operation's memory: its array, or the
                            # Buffer that holds another object's exported buffer
    cdef BatchOp* ops       # the operations, in the order they were added: ``inline``
    cdef BatchOp inline[4]  # while they fit, else malloc'd
    cdef int n, cap
    cdef int n_waiting      # receives not matched yet
    cdef int first_open     # no operation before it is open

    cdef void _attach(self, Transport t, Mailbox box, double timeout)
    cdef int _append(self, object held, const View* b, int peer, int tag, int req) except -1
    cdef void _wait_for(self, int i) noexcept
    cdef void _close(self, int i) noexcept
    cdef int _waiting_source(self) noexcept
    cdef bint _waits_for(self, int src) noexcept
    cdef _from_mailbox(self, int i, object m)
    cdef bint _offer(self, object m) except -1
    cdef int _taker(self, int src, int tag) except -2
    cdef int _match(self, int64_t until_ns, int64_t now_ns) except -1
    cdef int _head(self, int src, Probe* pr, int64_t until_ns, int64_t now_ns) except -3
    cdef int _moving(self) except -1
    cdef bint _ended(self, int i) except -1
    cpdef bint on_wire(self) except -1
    cpdef bint matches_heads(self) except -1
    cpdef int add_send(self, object buf, int dst, int tag, object timeout=*) except -1
    cpdef int add_recv(self, object buf, int src, int tag, object timeout=*) except -1
    cpdef list progress(self, double seconds)
    cdef int move(self, double seconds) except -1
    cdef int next_ended(self, int start) except -2
    cpdef tuple result(self, int i)

cdef Py_ssize_t stash_to(Transport t, Mailbox box, Batch batch, Py_ssize_t* handed,
                         unsigned int seq) except -1
cpdef int send(Transport t, object buf, int dst, int tag, double timeout) except -1
cpdef tuple recv(Transport t, Mailbox box, object buf, int src, int tag, double timeout)
cpdef tuple start(Transport t, Mailbox box, double timeout, bint is_recv, object buf, int peer,
                  int tag)
cdef int send_beside(Transport t, Batch batch, const View* b, int dst, int tag,
                     double timeout) except -1
cpdef object probe_beside(Transport t, Mailbox box, int src, int tag, double timeout)
