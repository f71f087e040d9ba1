"""``pycollect.init()``: read the job's shape, open the store, join the run, connect.

Where each setting comes from, first match wins:

1. the keyword argument;
2. ``PYCOLLECT_RANK``, ``PYCOLLECT_SIZE``, ``PYCOLLECT_STORE`` (each on its
   own; ``pycollect-run`` sets all three), likewise ``PYCOLLECT_TIMEOUT``,
   ``PYCOLLECT_SOCKET_IFNAME``, ``PYCOLLECT_MAX_SEGMENT_BYTES``;
3. the first launcher found in the environment (``LAUNCHERS``): torchrun
   (``RANK``, ``WORLD_SIZE``, store ``tcp://MASTER_ADDR:MASTER_PORT`` that
   rank 0 hosts), Open MPI (``OMPI_COMM_WORLD_RANK``/``_SIZE``) and MPICH
   (``PMI_RANK``/``PMI_SIZE``), both with store ``mpi://``, then SLURM
   (``SLURM_PROCID``, ``SLURM_NTASKS``; the store must come from
   ``PYCOLLECT_STORE``);
4. the default: size 1 with a private in-process store.

A missing piece is an ``InvalidArgument`` naming the variable to set; with
``PYCOLLECT_DEBUG=1`` what was chosen, and why, is logged.  The variables the
context reads (``CONTEXT_SETTINGS``) are read before the store is opened: a
malformed one fails this rank before it joins, not its peers after.

Before connecting, the ranks join a fresh run in the store (``pycollect/join.py``),
which also diagnoses ranks that are missing, duplicated or started with another size.
"""

import logging
import os
import threading

from . import exit_report, settings
from .context import Context
from .errors import InvalidArgument
from .join import abandon_run, join_run, leave_run
from .plugins.registry import get_transport, open_store, open_transport, transport_options
from .plugins.store import DEFAULT_TIMEOUT, Deadline, PrefixStore, Store, redact

__all__ = ["init", "DEFAULT_TIMEOUT", "LAUNCHERS"]

log = logging.getLogger("pycollect")

# (name, rank variable, size variable): launchers in order of precedence.
LAUNCHERS = (
    ("torchrun", "RANK", "WORLD_SIZE"),
    ("Open MPI", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
    ("MPICH", "PMI_RANK", "PMI_SIZE"),
    ("SLURM", "SLURM_PROCID", "SLURM_NTASKS"),
)
MPI_LAUNCHERS = ("Open MPI", "MPICH")
# torchrun's agent hosts its own store on MASTER_PORT when this says True;
# pycollect's embedded store then takes the next port.
TORCH_AGENT_STORE_ENV = "TORCHELASTIC_USE_AGENT_STORE"

# Contexts opened through one store are numbered per rank, in creation order,
# so every rank of a group derives the same namespace without talking.  An init that fails
# while joining gives its number back: a retry meets a peer whose first init is this one's
# retry.
_context_counter = {}
_counter_lock = threading.Lock()

# The variables the new Context reads (pycollect/context.py): init reads them before it opens
# the store, so that a malformed one fails this rank before it joins, with nothing to close.
CONTEXT_SETTINGS = ("PYCOLLECT_TRACE_SIZE", "PYCOLLECT_TRACE_DIR", "PYCOLLECT_TRACE_SIGNAL",
                    "PYCOLLECT_UNPICKLE_ALLOW")


def _parse(raw, var, parse, what):
    try:
        return parse(raw)
    except ValueError:
        raise InvalidArgument("%s=%r is not a valid %s" % (var, raw, what)) from None


def _debug_enabled():
    """False, True (PYCOLLECT_DEBUG=1: log choices), "detail" (check every collective's
    signature across ranks: pycollect/signature.py), or "all" (1,detail: both)."""
    level = settings.get("PYCOLLECT_DEBUG")
    if level in (True, "all"):
        if not log.handlers:
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("pycollect %(levelname)s %(message)s"))
            log.addHandler(handler)
        log.setLevel(logging.DEBUG)
    return level


def _present(environ, var):
    return environ.get(var, "") != ""


def _torchrun_store(environ):
    """``tcp://MASTER_ADDR:MASTER_PORT`` (the next port when torch's agent holds that one)."""
    from .plugins.stores.tcp_store import tcp_url
    missing = [var for var in ("MASTER_ADDR", "MASTER_PORT") if not _present(environ, var)]
    if missing:
        raise InvalidArgument("init: running under torchrun (RANK is set) but %s %s not; set "
                              "%s, or set PYCOLLECT_STORE" % (
                                  " and ".join(missing), "is" if len(missing) == 1 else "are",
                                  " and ".join(missing)))
    port = _parse(environ["MASTER_PORT"], "MASTER_PORT", int, "port")
    why = "MASTER_ADDR and MASTER_PORT"
    if environ.get(TORCH_AGENT_STORE_ENV, "").lower() == "true":
        port += 1
        why += " + 1 (%s=True: torch's own store holds MASTER_PORT)" % TORCH_AGENT_STORE_ENV
    if not 0 < port < 65536:
        raise InvalidArgument("init: MASTER_PORT=%r gives no valid port" % environ["MASTER_PORT"])
    return tcp_url(environ["MASTER_ADDR"].strip("[]"), port), why


def detect_launcher(environ=None):
    """What the environment says about this job: a dict, or None outside any launcher.

    Keys: ``launcher``, ``rank``, ``size``, ``store`` (URL or None), ``why``
    (variables each came from).
    """
    environ = os.environ if environ is None else environ
    for name, rank_var, size_var in LAUNCHERS:
        if not _present(environ, rank_var):
            continue
        if not _present(environ, size_var):
            raise InvalidArgument("init: running under %s (%s is set) but %s is not; set %s "
                                  "(or PYCOLLECT_SIZE)" % (name, rank_var, size_var, size_var))
        found = {"launcher": name,
                 "rank": _parse(environ[rank_var], rank_var, int, "rank"),
                 "size": _parse(environ[size_var], size_var, int, "size"),
                 "store": None, "why": "%s and %s" % (rank_var, size_var)}
        if name == "torchrun":
            found["store"], found["store_why"] = _torchrun_store(environ)
        elif name in MPI_LAUNCHERS:
            found["store"], found["store_why"] = "mpi://", "mpirun, no PYCOLLECT_STORE"
        return found
    return None


def _job(rank, size, store):
    """Fill in rank, size and store from the environment; log where each came from."""
    sources = {}
    for field, value, var, what in (("rank", rank, "PYCOLLECT_RANK", "rank"),
                                    ("size", size, "PYCOLLECT_SIZE", "size")):
        if value is not None:
            sources[field] = "argument"
        elif _present(os.environ, var):
            sources[field] = var
    rank = settings.get("PYCOLLECT_RANK") if rank is None else rank
    size = settings.get("PYCOLLECT_SIZE") if size is None else size
    if store is not None:
        sources["store"] = "argument"
    elif settings.get("PYCOLLECT_STORE") is not None:
        store, sources["store"] = settings.get("PYCOLLECT_STORE"), "PYCOLLECT_STORE"
    launcher = None
    if rank is None or size is None or store is None:
        try:
            launcher = detect_launcher()
        except InvalidArgument:
            if rank is None or size is None:
                raise
            # Rank and size are given: an incomplete launcher environment is not used.
    if launcher is not None:
        for field in ("rank", "size"):
            if field not in sources:
                sources[field] = "%s (%s)" % (launcher["launcher"], launcher["why"])
        rank = launcher["rank"] if rank is None else rank
        size = launcher["size"] if size is None else size
        if store is None and launcher["store"] is not None:
            store = launcher["store"]
            sources["store"] = "%s (%s)" % (launcher["launcher"], launcher["store_why"])
    if size is None:
        raise InvalidArgument("init: the group size is unknown; pass size=, set PYCOLLECT_SIZE, "
                              "or start the ranks with pycollect-run, torchrun, mpirun or srun")
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
    if store is None:
        if size > 1:
            where = " under %s" % launcher["launcher"] if launcher else ""
            raise InvalidArgument("init: no store to rendezvous through%s; pass store= or set "
                                  "PYCOLLECT_STORE (e.g. tcp://HOST:PORT, file:///shared/dir, "
                                  "redis://HOST:PORT)" % where)
        store, sources["store"] = "hash://pycollect-single-%d" % os.getpid(), "default (size 1)"
    if sources.get("rank") == sources.get("size"):
        shape = "rank %d of %d from %s" % (rank, size, sources.get("rank", "?"))
    else:
        shape = "rank %d from %s, size %d from %s" % (rank, sources.get("rank", "?"), size,
                                                       sources.get("size", "?"))
    log.debug("init: %s; store %s from %s", shape, redact(store), sources.get("store", "?"))
    return rank, size, store


def _give_back_number(key, number):
    """Undo ``init``'s count of context ``number`` through ``key`` after it failed while
    joining (no rank can have a context of that number with this one), unless a later init
    took the next number meanwhile (then the numbers stay as they are).  An init that fails
    after the join keeps its number: its peers may have gone on with theirs."""
    with _counter_lock:
        if _context_counter.get(key) == number + 1:
            _context_counter[key] = number


def init(rank=None, size=None, store=None, transport=None, timeout=None, interface=None,
         *, segment_bytes=None, tls_cert=None, tls_key=None, tls_ca=None):
    """Join a group of ``size`` ranks as ``rank``, rendezvousing through ``store``.

    ``store`` is a URL (``tcp://host:port``, ``file:///dir``, ``redis://host:port``,
    ``mpi://``, ``hash://name``, optionally with ``?prefix=NAME``) or a
    ``pycollect.Store``.  Left out, rank, size and store come from the
    environment (module docstring).  ``transport`` (else ``PYCOLLECT_TRANSPORT``, else
    "auto") names the transport.  ``timeout`` (seconds, default 120) bounds
    the rendezvous and every collective.  With ``transport="tcp+tls"``,
    ``tls_cert``, ``tls_key`` and ``tls_ca`` (else ``PYCOLLECT_TLS_CERT``,
    ``_KEY``, ``_CA``) are this rank's certificate, its key and the CA file.
    """
    debug = _debug_enabled()
    rank, size, store = _job(rank, size, store)
    exit_report.install()       # under pycollect-run: say why this rank ended, if it fails
    timeout = settings.get("PYCOLLECT_TIMEOUT") if timeout is None else timeout
    if segment_bytes is None:
        segment_bytes = settings.get("PYCOLLECT_MAX_SEGMENT_BYTES")
    for name in CONTEXT_SETTINGS:
        settings.get(name)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) \
            or not 0 < timeout <= settings.MAX_TIMEOUT_S:
        # Every blocking path has a deadline: an infinite one is refused too.
        raise InvalidArgument("init: timeout must be a positive number of seconds, at most %d "
                              "(about 23 days), got %r" % (settings.MAX_TIMEOUT_S, timeout))
    if interface is not None and not isinstance(interface, str):
        raise InvalidArgument("init: interface must be a name or an address, such as 'eth0' "
                              "or '10.0.0.1', got %r" % (interface,))
    if transport is None:
        transport = settings.get("PYCOLLECT_TRANSPORT")
    if not isinstance(transport, str):
        raise InvalidArgument("init: transport must be a name such as 'tcp', got %r"
                              % (transport,))
    deadline = Deadline(float(timeout))
    factory = get_transport(transport)
    # The transport's own options, checked before joining: a bad one fails this rank now,
    # not its peers later.
    given = {name: value for name, value in (("tls_cert", tls_cert), ("tls_key", tls_key),
                                             ("tls_ca", tls_ca)) if value is not None}
    options = transport_options(transport, factory, given)
    owns_store = not isinstance(store, Store)
    base = open_store(store, timeout=timeout, rank=rank, size=size)
    key = (getattr(base, "url", None) or id(base), rank)
    with _counter_lock:
        number = _context_counter.get(key, 0)
        _context_counter[key] = number + 1
    run = None
    try:
        name = "pycollect/ctx%d" % number
        scoped = PrefixStore(name, base)
        run = join_run(scoped, rank, size, deadline) if size > 1 else "single"
        # Not the store's URL: ranks may spell one store differently
        # (localhost, 127.0.0.1); the run id is random and shared by all.
        context_id = "%s/%s" % (name, run)
        t = open_transport(transport, factory, rank, size, PrefixStore(run, scoped),
                           timeout=max(deadline.remaining(), 0.001), interface=interface,
                           context_id=context_id, **options)
        if size > 1:
            try:
                leave_run(scoped, run, rank, size, deadline, log)
            except BaseException:
                t.close()
                raise
    except BaseException as exc:
        if run is None:
            _give_back_number(key, number)
        elif size > 1 and isinstance(exc, Exception) and \
                not getattr(exc, "caused_elsewhere", False):
            abandon_run(scoped, run, rank, exc, log)
        if owns_store:
            base.close()
        raise
    log.debug("rank %d of %d: connected over %s through %s (run %s)", rank, size, transport,
              redact(getattr(base, "url", base)), run)
    try:
        return Context(rank, size, t, timeout=timeout, segment_bytes=segment_bytes,
                       on_close=[base.close] if owns_store else [], debug=debug)
    except BaseException:
        # No context owns them: close what this call opened.
        t.close()
        if owns_store:
            base.close()
        raise
