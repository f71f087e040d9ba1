"""``pycollect.init()``: read the job's shape, open the store, connect the transport.

Precedence for each setting: the keyword argument, then the environment
(``PYCOLLECT_RANK``, ``PYCOLLECT_SIZE``, ``PYCOLLECT_STORE``,
``PYCOLLECT_TIMEOUT``, ``PYCOLLECT_SOCKET_IFNAME``, ``PYCOLLECT_MAX_SEGMENT_BYTES``),
then the documented default.
"""

import logging
import os
import threading

from .context import Context
from .errors import InvalidArgument, PluginError
from .plugins.registry import get_transport, open_store
from .plugins.store import DEFAULT_TIMEOUT, PrefixStore, Store

__all__ = ["init", "DEFAULT_TIMEOUT"]

log = logging.getLogger("pycollect")


# Contexts opened through one store are numbered per rank, in creation order,
# so every rank of a group derives the same namespace without talking.
_context_counter = {}
_counter_lock = threading.Lock()


def _from_env(value, var, parse, what):
    if value is not None:
        return value
    raw = os.environ.get(var)
    if raw is None or raw == "":
        return None
    try:
        return parse(raw)
    except ValueError:
        raise InvalidArgument("%s=%r is not a valid %s" % (var, raw, what)) from None


def _debug_enabled():
    flag = os.environ.get("PYCOLLECT_DEBUG", "")
    if flag and flag != "0":
        if not log.handlers:
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("pycollect %(levelname)s %(message)s"))
            log.addHandler(handler)
        log.setLevel(logging.DEBUG)
        return True
    return False


def init(rank=None, size=None, store=None, transport="auto", timeout=None, interface=None,
         *, segment_bytes=None):
    """Join a group of ``size`` ranks as ``rank``, rendezvousing through ``store``.

    ``store`` is a URL (``tcp://host:port``, ``file:///dir``, ``hash://name``,
    optionally with ``?prefix=NAME``) or a ``pycollect.Store``.  ``timeout``
    (seconds, default 120) bounds the rendezvous and every collective.
    """
    rank = _from_env(rank, "PYCOLLECT_RANK", int, "rank")
    size = _from_env(size, "PYCOLLECT_SIZE", int, "size")
    store = _from_env(store, "PYCOLLECT_STORE", str, "store URL")
    timeout = _from_env(timeout, "PYCOLLECT_TIMEOUT", float, "timeout in seconds")
    segment_bytes = _from_env(segment_bytes, "PYCOLLECT_MAX_SEGMENT_BYTES", int, "byte count")
    if timeout is None:
        timeout = DEFAULT_TIMEOUT
    if size is None:
        raise InvalidArgument("init: the group size is unknown; pass size= or set PYCOLLECT_SIZE")
    if rank is None:
        raise InvalidArgument("init: this process's rank is unknown; pass rank= or set "
                              "PYCOLLECT_RANK")
    for name, value in (("rank", rank), ("size", size)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise InvalidArgument("init: %s must be an int, got %r" % (name, value))
    if size < 1:
        raise InvalidArgument("init: size must be >= 1, got %d" % size)
    if not 0 <= rank < size:
        raise InvalidArgument("init: rank %d is outside 0..%d" % (rank, size - 1))
    if not isinstance(timeout, (int, float)) or not timeout > 0:
        raise InvalidArgument("init: timeout must be a positive number of seconds, got %r"
                              % (timeout,))
    if store is None:
        if size > 1:
            raise InvalidArgument("init: no store to rendezvous through; pass store= or set "
                                  "PYCOLLECT_STORE (e.g. tcp://HOST:PORT, file:///shared/dir)")
        store = "hash://pycollect-single-%d" % os.getpid()
    if not isinstance(transport, str):
        raise InvalidArgument("init: transport must be a name such as 'tcp', got %r"
                              % (transport,))
    debug = _debug_enabled()
    factory = get_transport(transport)
    owns_store = not isinstance(store, Store)
    base = open_store(store, timeout=timeout, rank=rank, size=size)
    try:
        key = (getattr(base, "url", None) or id(base), rank)
        with _counter_lock:
            number = _context_counter.get(key, 0)
            _context_counter[key] = number + 1
        name = "pycollect/ctx%d" % number
        scoped = PrefixStore(name, base)
        context_id = "%s#%s" % (getattr(base, "url", ""), name)
        t = factory(rank, size, scoped, timeout=float(timeout), interface=interface,
                    context_id=context_id)
    except BaseException:
        if owns_store:
            base.close()
        raise
    log.debug("rank %d of %d: connected over %s through %s", rank, size, transport,
              getattr(base, "url", base))
    return Context(rank, size, t, timeout=timeout, segment_bytes=segment_bytes,
                   on_close=[base.close] if owns_store else [], debug=debug)
