"""OpenSSL for transport "tcp+tls": configuration, handshake, and the TLS channel.

``TlsConfig`` loads a certificate chain, its key and the CA that every peer's
certificate must chain to.  ``TlsStream`` wraps one connected, non-blocking
socket: the rendezvous (``pycollect/plugins/mesh.py``) drives its handshake and
exchanges pycollect's hello through it; ``TlsChannel`` then carries the
pair's bytes through the session for the engine (a socket channel that reads
and writes through OpenSSL instead of ``readv``/``sendmsg``).

Both sides present a certificate and verify the other's (TLS 1.3 only, no
session tickets, no renegotiation).  A stream that ends without TLS's
close_notify reads as an ordinary end of stream: pycollect's own framing
carries every message's length, so a cut stream is still detected.
"""

from pycollect._ext._channel cimport HDR_BYTES, ChannelBase, ChannelOps, MsgHeader, default_ops
from pycollect._ext._socket cimport SocketChannel, socket_setup, socket_shut
from libc.errno cimport EAGAIN, EPIPE, EPROTO, errno
from libc.stdint cimport uint32_t, uint64_t
from libc.string cimport memcpy, memmove
from posix.uio cimport iovec

cdef extern from "_sys.h" nogil:
    void pc_set_errno(int e)

import ipaddress
import os
import stat

from pycollect.errors import InvalidArgument

cdef extern from "<openssl/ssl.h>" nogil:
    ctypedef struct SSL_CTX:
        pass
    ctypedef struct SSL:
        pass
    ctypedef struct SSL_METHOD:
        pass
    ctypedef struct X509:
        pass
    ctypedef struct X509_NAME:
        pass
    ctypedef int (*pem_password_cb)(char* buf, int size, int rwflag, void* userdata) noexcept
    const SSL_METHOD* TLS_method()
    SSL_CTX* SSL_CTX_new(const SSL_METHOD* method)
    void SSL_CTX_free(SSL_CTX* ctx)
    int SSL_CTX_use_certificate_chain_file(SSL_CTX* ctx, const char* path)
    int SSL_CTX_use_PrivateKey_file(SSL_CTX* ctx, const char* path, int kind)
    int SSL_CTX_check_private_key(const SSL_CTX* ctx)
    int SSL_CTX_load_verify_locations(SSL_CTX* ctx, const char* cafile, const char* capath)
    void SSL_CTX_set_verify(SSL_CTX* ctx, int mode, void* callback)
    void SSL_CTX_set_default_passwd_cb(SSL_CTX* ctx, pem_password_cb cb)
    long SSL_CTX_set_mode(SSL_CTX* ctx, long mode)
    uint64_t SSL_CTX_set_options(SSL_CTX* ctx, uint64_t options)
    int SSL_CTX_set_min_proto_version(SSL_CTX* ctx, int version)
    int SSL_CTX_set_num_tickets(SSL_CTX* ctx, size_t n)
    SSL* SSL_new(SSL_CTX* ctx)
    void SSL_free(SSL* ssl)
    int SSL_set_fd(SSL* ssl, int fd)
    void SSL_set_connect_state(SSL* ssl)
    void SSL_set_accept_state(SSL* ssl)
    int SSL_do_handshake(SSL* ssl)
    int SSL_read(SSL* ssl, void* buf, int n)
    int SSL_write(SSL* ssl, const void* buf, int n)
    int SSL_get_error(const SSL* ssl, int ret)
    int SSL_pending(const SSL* ssl)
    long SSL_get_verify_result(const SSL* ssl)
    X509* SSL_get1_peer_certificate(const SSL* ssl)
    const char* SSL_get_version(const SSL* ssl)
    enum:
        SSL_ERROR_NONE
        SSL_ERROR_SSL
        SSL_ERROR_WANT_READ
        SSL_ERROR_WANT_WRITE
        SSL_ERROR_SYSCALL
        SSL_ERROR_ZERO_RETURN
        SSL_VERIFY_PEER
        SSL_VERIFY_FAIL_IF_NO_PEER_CERT
        SSL_FILETYPE_PEM
        SSL_MODE_ENABLE_PARTIAL_WRITE
        SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER
        SSL_OP_IGNORE_UNEXPECTED_EOF
        SSL_OP_NO_RENEGOTIATION
        TLS1_3_VERSION
        X509_V_OK

cdef extern from "<openssl/x509v3.h>" nogil:
    int X509_check_host(X509* cert, const char* name, size_t namelen, unsigned int flags,
                        char** peername)
    int X509_check_ip_asc(X509* cert, const char* address, unsigned int flags)
    void X509_free(X509* cert)
    X509_NAME* X509_get_subject_name(const X509* cert)
    char* X509_NAME_oneline(const X509_NAME* name, char* buf, int size)
    const char* X509_verify_cert_error_string(long n)

cdef extern from "<openssl/err.h>" nogil:
    unsigned long ERR_get_error()
    unsigned long ERR_peek_error()
    void ERR_clear_error()
    const char* ERR_reason_error_string(unsigned long e)

cdef enum:
    STAGE_BYTES = 16384     # one TLS record: a header and the start of its payload go together
    MAX_IO = 1 << 30        # SSL_read/SSL_write take an int


class TlsError(Exception):
    """The TLS handshake or record layer failed; the message is OpenSSL's reason."""


cdef int _no_password(char* buf, int size, int rwflag, void* userdata) noexcept nogil:
    return 0    # never prompt on the terminal for an encrypted key's passphrase


cdef str _openssl_reasons():
    """Drain this thread's OpenSSL error queue into one line."""
    cdef unsigned long e
    cdef const char* s
    reasons = []
    while True:
        e = ERR_get_error()
        if e == 0:
            break
        s = ERR_reason_error_string(e)
        reason = s.decode("utf-8", "replace") if s != NULL else "error 0x%x" % e
        if reason not in reasons:
            reasons.append(reason)
    return "; ".join(reasons)


cdef class TlsConfig:
    """A certificate, its private key and the CA every peer must be signed by."""

    cdef SSL_CTX* ctx
    cdef readonly str cert
    cdef readonly str key
    cdef readonly str ca

    def __cinit__(self):
        self.ctx = NULL

    def __init__(self, cert, key, ca, names=("tls_cert", "tls_key", "tls_ca")):
        """Load the three PEM files; ``names`` say where each path came from, for errors."""
        paths = []
        for path, name in zip((cert, key, ca), names):
            if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
                raise InvalidArgument("transport 'tcp+tls' needs %s, a PEM file path; got %r"
                                      % (name, path))
            path = os.fspath(path)
            try:
                # Before anything opens it: opening a FIFO without a writer (or reading a
                # device) would block past every deadline.
                if not stat.S_ISREG(os.stat(path).st_mode):
                    raise InvalidArgument("%s %r is not a regular file (a FIFO, device, "
                                          "socket or directory): it must be a PEM file"
                                          % (name, path))
                with open(path, "rb"):
                    pass
            except OSError as exc:
                raise InvalidArgument("%s %r cannot be read: %s" % (name, path, exc.strerror)) \
                    from None
            paths.append(path)
        self.cert, self.key, self.ca = paths
        # OpenSSL takes bytes: the file system's own (a path need not be UTF-8).
        cert_path, key_path, ca_path = (os.fsencode(path) for path in paths)
        ERR_clear_error()
        self.ctx = SSL_CTX_new(TLS_method())
        if self.ctx == NULL:
            raise MemoryError("SSL_CTX_new: %s" % _openssl_reasons())
        SSL_CTX_set_default_passwd_cb(self.ctx, _no_password)
        SSL_CTX_set_min_proto_version(self.ctx, TLS1_3_VERSION)
        SSL_CTX_set_num_tickets(self.ctx, 0)
        SSL_CTX_set_options(self.ctx, SSL_OP_IGNORE_UNEXPECTED_EOF | SSL_OP_NO_RENEGOTIATION)
        SSL_CTX_set_mode(self.ctx, SSL_MODE_ENABLE_PARTIAL_WRITE
                         | SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER)
        SSL_CTX_set_verify(self.ctx, SSL_VERIFY_PEER | SSL_VERIFY_FAIL_IF_NO_PEER_CERT, NULL)
        if SSL_CTX_use_certificate_chain_file(self.ctx, cert_path) != 1:
            raise InvalidArgument("%s %r is not a PEM certificate (chain): %s"
                                  % (names[0], self.cert, _openssl_reasons()))
        if SSL_CTX_use_PrivateKey_file(self.ctx, key_path, SSL_FILETYPE_PEM) != 1 \
                or SSL_CTX_check_private_key(self.ctx) != 1:
            why = _openssl_reasons()
            if "mismatch" in why:
                raise InvalidArgument("%s %r is not the key of the certificate in %s %r: %s"
                                      % (names[1], self.key, names[0], self.cert, why))
            raise InvalidArgument("%s %r is not an unencrypted PEM private key: %s"
                                  % (names[1], self.key, why))
        if SSL_CTX_load_verify_locations(self.ctx, ca_path, NULL) != 1:
            raise InvalidArgument("%s %r holds no PEM CA certificate: %s"
                                  % (names[2], self.ca, _openssl_reasons()))

    def __dealloc__(self):
        if self.ctx != NULL:
            SSL_CTX_free(self.ctx)


cdef class TlsStream:
    """TLS over one connected, non-blocking socket (which the caller keeps open)."""

    cdef SSL* ssl
    cdef TlsConfig config   # the SSL_CTX outlives every SSL made from it

    def __cinit__(self):
        self.ssl = NULL

    def __init__(self, TlsConfig config, int fd, bint server):
        self.config = config
        ERR_clear_error()
        self.ssl = SSL_new(config.ctx)
        if self.ssl == NULL or SSL_set_fd(self.ssl, fd) != 1:
            raise MemoryError("SSL_new: %s" % _openssl_reasons())
        if server:
            SSL_set_accept_state(self.ssl)
        else:
            SSL_set_connect_state(self.ssl)

    def __dealloc__(self):
        if self.ssl != NULL:
            SSL_free(self.ssl)

    cdef str _failure(self, int rc, int err):
        cdef int saved = _errno()
        cdef long verify = SSL_get_verify_result(self.ssl)
        why = _openssl_reasons()
        if verify != X509_V_OK:
            why += " (%s)" % X509_verify_cert_error_string(verify).decode("utf-8", "replace")
        if not why:
            if err == SSL_ERROR_SYSCALL and saved:
                why = os.strerror(saved)
            else:
                why = "the peer closed the connection"
        return why

    cdef object _wants(self, int rc):
        """None when ``rc`` is a success, "read"/"write" to wait for, else raise TlsError."""
        cdef int err = SSL_get_error(self.ssl, rc)
        if err == SSL_ERROR_WANT_READ:
            return "read"
        if err == SSL_ERROR_WANT_WRITE:
            return "write"
        raise TlsError(self._failure(rc, err))

    def handshake(self):
        """Advance the handshake: None once done, else "read" or "write" (what to wait for)."""
        cdef int rc
        ERR_clear_error()
        with nogil:
            rc = SSL_do_handshake(self.ssl)
        return None if rc == 1 else self._wants(rc)

    def send(self, data):
        """Write ``data`` (at most one record is buffered): bytes taken, 0 when it must wait."""
        cdef const unsigned char[:] view = memoryview(data).cast("B")
        cdef int rc
        if len(view) == 0:
            return 0
        ERR_clear_error()
        rc = SSL_write(self.ssl, &view[0], <int>min(len(view), MAX_IO))
        if rc > 0:
            return rc
        self._wants(rc)
        return 0

    def recv(self, int n):
        """Up to ``n`` bytes; b"" at the end of the stream, None when nothing is there yet."""
        buf = bytearray(n)
        cdef unsigned char[:] view = buf
        cdef int rc, err
        if n <= 0:
            return b""
        ERR_clear_error()
        rc = SSL_read(self.ssl, &view[0], n)
        if rc > 0:
            return bytes(buf[:rc])
        err = SSL_get_error(self.ssl, rc)
        if err == SSL_ERROR_ZERO_RETURN or (err == SSL_ERROR_SYSCALL and _errno() == 0
                                            and ERR_peek_error() == 0):
            return b""
        self._wants(rc)
        return None

    def peer_matches(self, names):
        """Whether the peer's certificate names one of ``names`` (IP addresses or host names)."""
        cdef X509* cert = SSL_get1_peer_certificate(self.ssl)
        cdef bytes raw
        if cert == NULL:
            return False
        try:
            for name in names:
                if not name:
                    continue
                raw = name.encode()
                try:
                    ipaddress.ip_address(name)
                    is_ip = True
                except ValueError:
                    is_ip = False
                if is_ip and X509_check_ip_asc(cert, raw, 0) == 1:
                    return True
                if not is_ip and X509_check_host(cert, raw, len(raw), 0, NULL) == 1:
                    return True
            return False
        finally:
            X509_free(cert)

    def peer_subject(self):
        """The peer certificate's subject, for messages."""
        cdef X509* cert = SSL_get1_peer_certificate(self.ssl)
        cdef char buf[256]
        if cert == NULL:
            return "no certificate"
        X509_NAME_oneline(X509_get_subject_name(cert), buf, sizeof(buf))
        X509_free(cert)
        return buf.decode("utf-8", "replace")

    @property
    def version(self):
        return SSL_get_version(self.ssl).decode()



# -- the channel's I/O --------------------------------------------------------

cdef inline int _errno() noexcept nogil:
    return errno


cdef inline ssize_t _set_errno(int e) noexcept nogil:
    pc_set_errno(e)
    return -1


cdef ssize_t _fail(SSL* ssl, int rc) noexcept nogil:
    """Map a failed SSL_read/SSL_write to the syscall convention."""
    cdef int saved = _errno()
    cdef int err = SSL_get_error(ssl, rc)
    if err == SSL_ERROR_WANT_READ or err == SSL_ERROR_WANT_WRITE:
        return _set_errno(EAGAIN)
    if err == SSL_ERROR_ZERO_RETURN:
        return 0
    if err == SSL_ERROR_SYSCALL and ERR_get_error() == 0:
        if saved == 0:
            return 0        # end of stream without close_notify
        return _set_errno(saved)
    ERR_clear_error()
    return _set_errno(EPROTO)


cdef ssize_t _move(SSL* ssl, const iovec* iov, int cnt, int i, size_t off, size_t total,
                   bint writing) noexcept nogil:
    """Read into (or write from) ``iov``, from piece ``i`` at offset ``off`` on, until it is
    done or the socket must wait; ``total`` bytes were moved before.  The byte count, or
    _fail's result when nothing at all moved."""
    cdef size_t want
    cdef int rc
    while i < cnt:
        want = iov[i].iov_len - off
        if want == 0:
            i += 1
            off = 0
            continue
        if want > MAX_IO:
            want = MAX_IO
        ERR_clear_error()
        if writing:
            rc = SSL_write(ssl, (<char*>iov[i].iov_base) + off, <int>want)
        else:
            rc = SSL_read(ssl, (<char*>iov[i].iov_base) + off, <int>want)
        if rc > 0:
            total += <size_t>rc
            off += <size_t>rc
            continue
        if total:
            return <ssize_t>total     # the next call meets the same condition again
        return _fail(ssl, rc)
    return <ssize_t>total


cdef ssize_t tls_readv(void* handle, const iovec* iov, int cnt) noexcept nogil:
    """Fill ``iov`` from the TLS stream until it is full or the socket is empty."""
    return _move(<SSL*>handle, iov, cnt, 0, 0, 0, False)


cdef ssize_t tls_writev(void* handle, const iovec* iov, int cnt) noexcept nogil:
    """Write ``iov`` to the TLS stream until it is written or the socket is full.

    A header and the start of its payload are staged into one record, so a
    small message costs one record, not two.  A write that must wait is
    retried with the same bytes (OpenSSL requires it): the caller's progress
    decides what comes next, and that is unchanged until a write succeeds.
    """
    cdef SSL* ssl = <SSL*>handle
    cdef char stage[STAGE_BYTES]
    cdef size_t head, body
    cdef int rc
    if cnt < 2 or iov[0].iov_len >= STAGE_BYTES:
        return _move(ssl, iov, cnt, 0, 0, 0, True)
    head = iov[0].iov_len
    body = iov[1].iov_len
    if body > STAGE_BYTES - head:
        body = STAGE_BYTES - head
    memcpy(stage, iov[0].iov_base, head)
    memcpy(stage + head, iov[1].iov_base, body)
    ERR_clear_error()
    rc = SSL_write(ssl, stage, <int>(head + body))
    if rc <= 0:
        return _fail(ssl, rc)
    if <size_t>rc < head + body:
        return rc
    return _move(ssl, iov, cnt, 1, body, <size_t>rc, True)


cdef int tls_pending(void* handle) noexcept nogil:
    # Decrypted bytes only.  Without read-ahead OpenSSL reads no further than the
    # record it works on, so a partial record is still waiting in the kernel (poll()
    # sees it); SSL_has_pending would also count those bytes and keep the engine
    # from ever sleeping while a peer stalls in the middle of a record.
    return SSL_pending(<SSL*>handle) > 0


cdef struct TlsState:
    SSL* ssl
    uint32_t npeeked            # bytes of the next header already decrypted
    char peeked[HDR_BYTES]


cdef inline TlsState* _tls(ChannelBase* c) noexcept nogil:
    return <TlsState*>c.state


cdef ssize_t _tls_writev(ChannelBase* c, iovec* iov, int cnt) noexcept nogil:
    return tls_writev(_tls(c).ssl, iov, cnt)


cdef ssize_t _tls_readv(ChannelBase* c, iovec* iov, int cnt) noexcept nogil:
    """The peeked header bytes first, then what OpenSSL has."""
    cdef TlsState* t = _tls(c)
    cdef size_t taken = 0, k
    cdef int i, left = 0
    cdef iovec rest[2]
    cdef ssize_t n
    if t.npeeked == 0:
        return tls_readv(t.ssl, iov, cnt)
    for i in range(cnt):
        k = iov[i].iov_len
        if k > t.npeeked - taken:
            k = t.npeeked - taken
        memcpy(iov[i].iov_base, t.peeked + taken, k)
        taken += k
        if k < iov[i].iov_len and left < 2:
            rest[left].iov_base = (<char*>iov[i].iov_base) + k
            rest[left].iov_len = iov[i].iov_len - k
            left += 1
    t.npeeked -= <uint32_t>taken
    memmove(t.peeked, t.peeked + taken, t.npeeked)
    # Read on as readv would: a short count tells the caller the socket is empty,
    # and bytes left inside OpenSSL would wake no poll().
    n = tls_readv(t.ssl, rest, left) if left and t.npeeked == 0 else 0
    return <ssize_t>taken + (n if n > 0 else 0)


cdef int _tls_peek(ChannelBase* c, MsgHeader* h) noexcept nogil:
    """TLS has no MSG_PEEK: the header is decrypted into ``peeked``, and the next read
    starts from there."""
    cdef TlsState* t = _tls(c)
    cdef iovec iov
    cdef ssize_t n
    if t.npeeked < HDR_BYTES:
        iov.iov_base = t.peeked + t.npeeked
        iov.iov_len = HDR_BYTES - t.npeeked
        n = tls_readv(t.ssl, &iov, 1)
        if n > 0:
            t.npeeked += <uint32_t>n
        elif t.npeeked == 0:
            return <int>n
    memcpy(h, t.peeked, t.npeeked)
    return <int>t.npeeked


cdef int _tls_take_peeked(ChannelBase* c, MsgHeader* h) noexcept nogil:
    _tls(c).npeeked = 0
    return HDR_BYTES


cdef size_t _tls_held(ChannelBase* c) noexcept nogil:
    return _tls(c).npeeked + (1 if tls_pending(_tls(c).ssl) else 0)


# The socket channel's table with the byte path through OpenSSL.
cdef ChannelOps TLS_OPS
default_ops(&TLS_OPS)
TLS_OPS.writev = _tls_writev
TLS_OPS.readv = _tls_readv
TLS_OPS.peek = _tls_peek
TLS_OPS.take_peeked = _tls_take_peeked
TLS_OPS.held = _tls_held
TLS_OPS.shut = socket_shut


cdef class TlsChannel(SocketChannel):
    """The socket of ``sock`` (its fd moves here) with every byte through ``stream``'s
    TLS session (transport "tcp+tls"); ``stream`` is kept alive with the channel."""

    cdef TlsStream stream
    cdef TlsState tls

    def __init__(self, SocketChannel sock, TlsStream stream):
        socket_setup(&self.sock, sock.release_fd(), &TLS_OPS)
        self.sock.state = &self.tls
        self.sock.send_call = b"SSL_write"
        self.sock.recv_call = b"SSL_read"
        self.base = &self.sock
        self.stream = stream
        self.tls.ssl = stream.ssl
        self.tls.npeeked = 0

    @property
    def encrypted(self):
        return True
