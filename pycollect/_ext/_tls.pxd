# The TLS hooks of the TCP progress engine (transport "tcp+tls").
#
# _tcp.pyx never links OpenSSL: it cimports only this table of function
# pointers, and _tls.pyx (built where OpenSSL's headers exist) fills it in and
# hands it over in a capsule.  Every function takes an SSL* as void* and
# behaves like the syscall it stands for on a non-blocking socket: a byte
# count, 0 at the end of the stream, or -1 with errno set (EAGAIN: try again
# when the socket is ready; EPROTO: TLS failed).
from posix.uio cimport iovec

ctypedef struct TlsOps:
    ssize_t (*readv)(void* ssl, const iovec* iov, int cnt) noexcept nogil
    ssize_t (*writev)(void* ssl, const iovec* iov, int cnt) noexcept nogil
    int (*pending)(void* ssl) noexcept nogil    # decrypted bytes poll() cannot see
