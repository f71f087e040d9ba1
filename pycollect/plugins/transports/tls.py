"""Transport "tcp+tls": the TCP transport with every pair encrypted and mutually authenticated.

Each rank presents a certificate and checks its peer's: signed by the run's
CA, and naming the address the peer listens on (an IP address in the
subjectAltName) or the host name the peer publishes.  The TLS handshake
runs right after the TCP connect, before pycollect's own hello, so the run's
token never crosses the network in clear.  Every pair goes over TLS, also
between ranks of one host (no shared memory).  See docs/security.md.
"""

from ... import settings
from ...errors import InvalidArgument
from .tcp import open_tcp

# (keyword argument of pc.init, environment variable, what the file holds)
SETTINGS = (
    ("tls_cert", "PYCOLLECT_TLS_CERT", "this rank's certificate (chain), PEM"),
    ("tls_key", "PYCOLLECT_TLS_KEY", "the certificate's private key, PEM, unencrypted"),
    ("tls_ca", "PYCOLLECT_TLS_CA", "the CA certificate(s) every peer must be signed by, PEM"),
)


def _engine():
    try:
        from ..._ext import _tls
    except ImportError as exc:
        raise InvalidArgument(
            "transport 'tcp+tls' needs pycollect._ext._tls, which this pycollect was built "
            "without: the build compiles it only where the C compiler finds OpenSSL's headers "
            "and libssl (Debian/Ubuntu: apt-get install libssl-dev; conda: conda install "
            "openssl), so install those, then reinstall pycollect (%s)" % exc) from None
    return _tls


def load_tls(tls_cert=None, tls_key=None, tls_ca=None):
    """The TLS configuration from arguments, else ``PYCOLLECT_TLS_*``: a ``TlsConfig``.

    A missing or unreadable file, a key that is not the certificate's, or a
    file that is not PEM raises ``InvalidArgument`` naming the setting and file.
    """
    paths, names = [], []
    for value, (arg, var, what) in zip((tls_cert, tls_key, tls_ca), SETTINGS):
        if value is not None:
            paths.append(value)
            names.append(arg)
        elif settings.get(var) is not None:
            paths.append(settings.get(var))
            names.append(var)
        else:
            raise InvalidArgument("init: transport 'tcp+tls' needs %s: pass %s= or set %s"
                                  % (what, arg, var))
    return _engine().TlsConfig(*paths, names=tuple(names))


class TlsHook:
    """What the rendezvous mesh calls to put a socket under TLS before the hello."""

    def __init__(self, config):
        self.engine = _engine()
        self.config = config
        self.error = self.engine.TlsError

    def stream(self, sock, server):
        """A TLS stream over ``sock``, not yet shaken hands (the mesh drives that)."""
        return self.engine.TlsStream(self.config, sock.fileno(), server)


def prepare_tls(tls_cert=None, tls_key=None, tls_ca=None):
    """``init``'s options for ``tcp+tls``, checked before the rendezvous (a bad file fails
    this rank at once): the factory's keyword arguments."""
    return {"tls": load_tls(tls_cert, tls_key, tls_ca)}


def create_tls_transport(rank, size, store, *, tls=None, **options):
    """The TCP transport over TLS to every peer (``tls``: a ``TlsConfig``; left out, from
    ``PYCOLLECT_TLS_*``)."""
    hook = TlsHook(load_tls() if tls is None else tls)
    transport, joined = open_tcp(rank, size, store, tls=hook, transport="tcp+tls", **options)
    try:
        for peer, stream in enumerate(joined.streams):
            if peer != rank:
                transport.set_channel(peer, hook.engine.TlsChannel(transport.channel(peer),
                                                                   stream))
    except BaseException:
        transport.close()
        raise
    return transport


create_tls_transport.options = tuple(arg for arg, _, _ in SETTINGS)
create_tls_transport.prepare = prepare_tls
