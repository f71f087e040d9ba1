"""Every ``PYCOLLECT_*`` environment variable, declared once: name, parser, default, doc.

``get(name)`` is the one way pycollect reads one: an empty variable counts as
unset (the default), and a value the parser refuses raises ``InvalidArgument``
as ``NAME='value' is not <what it must be>``.  The README's table of variables
is ``markdown_table()`` (a test holds the two together).  Build-time switches
(``PYCOLLECT_DEBUG_BUILD``, ``PYCOLLECT_NATIVE``, ``PYCOLLECT_BUILD_JOBS``)
belong to ``setup.py``, which runs before the package exists.
"""

import os

from .errors import InvalidArgument
from .unpickle import parse as parse_allow_list

__all__ = ["SETTINGS", "Setting", "get", "markdown_table"]


class Setting:
    """One variable: ``parse(raw)`` turns its text into a value or raises ``ValueError``."""

    __slots__ = ("name", "parse", "default", "what", "doc")

    def __init__(self, name, parse, default, what, doc):
        self.name = name
        self.parse = parse
        self.default = default
        self.what = what        # what a valid value is, for the error message
        self.doc = doc          # one line for the README


# The largest pool of shared arrays: 64 TiB, half the 128 TiB of a process's address space on
# x86-64 (a larger one fails to map, and past 2^63 its size rounded to pages wraps off_t).
MAX_POOL_BYTES = 1 << 46


def _int_at_least(low, high=None):
    def parse(raw):
        value = int(raw)
        if value < low or (high is not None and value > high):
            raise ValueError(raw)
        return value
    return parse


# The longest timeout anything takes, in seconds (about 23 days): every deadline is a point on
# the clock in int64 nanoseconds, and the store server waits on epoll in int milliseconds.
MAX_TIMEOUT_S = 2_000_000.0


def _seconds(raw):
    value = float(raw)
    if not 0 < value <= MAX_TIMEOUT_S:
        raise ValueError(raw)
    return value


def _microseconds(raw):
    value = float(raw)
    if not 0 <= value <= 1e6:
        raise ValueError(raw)
    return value


def _text(raw):
    return raw


def _allow_list(raw):
    try:
        return parse_allow_list(raw)    # checked as Context.unpickle_allow checks its names
    except InvalidArgument:
        raise ValueError(raw) from None


def _stripped(raw):
    value = raw.strip()
    if not value:
        raise ValueError(raw)
    return value


def _on_unless_zero(raw):
    return raw.strip() != "0"


def _signal_name(raw):
    """A signal a handler can be set for: SIGKILL and SIGSTOP, which none can, are refused."""
    import signal
    name = raw.strip().upper()
    if name.isdigit():
        value = signal.Signals(int(name))
    else:
        if not name.startswith("SIG"):
            name = "SIG" + name
        try:
            value = signal.Signals[name]
        except KeyError:
            raise ValueError(raw) from None
    if value in (signal.SIGKILL, signal.SIGSTOP):
        raise ValueError(raw)
    return value


def _debug(raw):
    """False; True (logs); "detail" (the cross-rank check alone); "all" (both: "1,detail").
    A word other than 0, 1 and detail ("false", "off", "yes") is refused."""
    flags = {f.strip() for f in raw.lower().split(",")} - {""}
    if not flags <= {"0", "1", "detail"}:
        raise ValueError(raw)
    flags -= {"0"}
    if not flags:
        return False
    if "detail" in flags:
        return "all" if flags - {"detail"} else "detail"
    return True


_TLS_DOC = ("with `transport=\"tcp+tls\"`: this rank's certificate and key, and the CA that signs "
            "every rank's certificate (PEM files; `init`'s `tls_cert`, `tls_key`, `tls_ca` win). "
            "See [docs/security.md](docs/security.md).")

SETTINGS = {s.name: s for s in (
    Setting("PYCOLLECT_RANK", int, None, "a rank (an int)",
            "this process's rank, `0 <= rank < size`"),
    Setting("PYCOLLECT_SIZE", int, None, "a group size (an int)",
            "the number of ranks"),
    Setting("PYCOLLECT_STORE", _text, None, "a store URL",
            "the rendezvous store URL: `tcp://HOST:PORT`, `file:///dir`, `hash://NAME`, "
            "`redis://[:password@]HOST:PORT[/db]` (`pip install '.[redis]'`) or `mpi://` "
            "(`pip install '.[mpi]'`), optionally with `?prefix=NAME`. Without it, `pc.init()` "
            "also reads torchrun's, Open MPI's, MPICH's and SLURM's variables (see "
            "[docs/api.md](docs/api.md))."),
    Setting("PYCOLLECT_TRANSPORT", _stripped, "auto", "a transport name",
            "the transport `pc.init()` uses when its `transport` argument is left out: `auto` "
            "(shared memory between ranks of a host, TCP between hosts), `tcp`, `shm`, "
            "`tcp+tls`, or a plugin's name"),
    Setting("PYCOLLECT_TIMEOUT", _seconds, 120.0, "a positive number of seconds, at most 2000000",
            "seconds (default 120). This bounds the rendezvous and every operation. It is also "
            "the default timeout of any store opened without one."),
    Setting("PYCOLLECT_SOCKET_IFNAME", _text, None, "an interface spec",
            "which local address the listener binds: a comma list of interface name prefixes "
            "(`=NAME` for one exact name), address ranges (`198.18.0.0/15`) and addresses, or "
            "`^`-led, those excluded; among the addresses allowed, the one that routes to the "
            "store's host wins (docs/stores.md). The default is the local address that routes "
            "to the store's host (`tcp://`, `redis://`, `mpi://`); for other stores it is the "
            "host name's address, or `127.0.0.1` when that address is loopback."),
    Setting("PYCOLLECT_MAX_SEGMENT_BYTES", _int_at_least(1), None, "a byte count (an int >= 1)",
            "the segment size of `ring_chunked` allreduce (at 2 ranks below 16 MiB at most "
            "128 KiB), `pipelined` broadcast, and the ring phases of `reduce`, `allgather` and "
            "`reduce_scatter` (default 1048576)"),
    Setting("PYCOLLECT_CMA", _on_unless_zero, True, "0 or 1",
            "`0` turns off single-copy reads of a same-host peer's memory "
            "(`process_vm_readv`); large messages then stream through the shared-memory rings"),
    Setting("PYCOLLECT_CMA_MIN_BYTES", _int_at_least(0), 64 << 10,
            "a byte count (an int >= 0)",
            "messages to a same-host peer from this size (default 65536) are read straight "
            "from the sender's memory, except async sends up to 256 KiB (a quarter of the "
            "ring at most), which go through the ring and end at once"),
    Setting("PYCOLLECT_POOL_BYTES", _int_at_least(1 << 20, MAX_POOL_BYTES), 64 << 30,
            "a byte count (an int from 1048576 to 2**46)",
            "the address space of this process's pool of shared arrays (`pycollect.empty`, "
            "`pycollect.zeros`; default 64 GiB, at most 2^46, 64 TiB, sparse: only the pages "
            "of live arrays take memory). Read when the first such array is made"),
    Setting("PYCOLLECT_SPIN_US", _microseconds, None,
            "a number of microseconds in 0..1000000",
            "how many microseconds a waiting rank polls its sockets, rings and shared-memory "
            "flags without sleeping before it blocks in `poll()` (0 = block at once). Default: "
            "1000 where no more of the job's ranks on this host may run on this process's "
            "CPUs than it has (ranks bound to cores of their own, `pycollect-run --bind core`, "
            "share none), 50 where more may (the ranks then yield the core between polls; a "
            "longer spin there slows the ranks that copy large messages on the same core: "
            "docs/performance.md). It is read when a context connects."),
    Setting("PYCOLLECT_DEBUG", _debug, False, "0, 1, detail or 1,detail",
            "`1` sends DEBUG logs of logger `pycollect` to stderr: the listen address, the "
            "connection, and the algorithm each operation ran (a sub-group's lines name the "
            "group). `detail` checks, before every collective, that all ranks called the same "
            "one with the same arguments: ranks that disagree all raise the same "
            "`MismatchError` before any data moves "
            "([docs/errors.md](docs/errors.md#pycollect_debugdetail)); it logs nothing by "
            "itself. `1,detail` does both. Any other word (`false`, `off`) is refused."),
    Setting("PYCOLLECT_HOST_ID", _stripped, None, "a host name of your choice",
            "ranks that give the same string are one host (shared memory between them, "
            "hierarchical collectives across hosts). Default: host name + boot id + network "
            "namespace."),
    Setting("PYCOLLECT_TLS_CERT", _text, None, "a file name", _TLS_DOC),
    Setting("PYCOLLECT_TLS_KEY", _text, None, "a file name", _TLS_DOC),
    Setting("PYCOLLECT_TLS_CA", _text, None, "a file name", _TLS_DOC),
    Setting("PYCOLLECT_AUTH", _text, None, "a secret",
            "the shared secret of the embedded TCP store. A `tcp://` store opened from a URL "
            "sends it, and a store that rank 0 hosts requires it. `pycollect-run` sets a random "
            "secret when it hosts the store."),
    Setting("PYCOLLECT_TRACE_SIZE", _int_at_least(0), 2000, "a count (an int >= 0)",
            "how many of its last operations each context's flight recorder keeps (default "
            "2000; 0 turns the recorder off). See [docs/errors.md](docs/errors.md#recovering)."),
    Setting("PYCOLLECT_TRACE_DIR", _stripped, None, "a directory name",
            "where each rank writes its flight recorder's dump when an operation fails with a "
            "timeout, a mismatch or a peer failure (and on `PYCOLLECT_TRACE_SIGNAL`); "
            "`pycollect-trace DIR` says what happened. Unset: no automatic dumps."),
    Setting("PYCOLLECT_TRACE_SIGNAL", _signal_name, None,
            "a signal name or number that a handler can catch (e.g. USR1; not KILL or STOP)",
            "a signal (e.g. `USR1`; not `KILL` or `STOP`, which no handler can catch) on which "
            "every context of the process dumps its flight recorder into `PYCOLLECT_TRACE_DIR`; "
            "read when a context is made"),
    Setting("PYCOLLECT_UNPICKLE_ALLOW", _allow_list, None,
            "a comma-separated list of globals ('module.name') and modules ('module.*')",
            "the globals the object collectives may unpickle, comma-separated: "
            "`module.name` (one global), or `module.*` (the classes of a module and its "
            "submodules). Plain values, the standard library's containers and NumPy arrays "
            "(not of objects) always load; a pickle that reaches any other global is refused before it loads. "
            "Unset: anything unpickles (trusted peers only). See "
            "[docs/security.md](docs/security.md#the-object-collectives-and-pickle)."),
    Setting("PYCOLLECT_EXIT_REPORT", _stripped, None, "a file name",
            "set by `pycollect-run` for the program it starts: the file a rank writes, when "
            "an exception ends it, saying whether that was another rank's failure, so that "
            "the launcher blames the rank whose failure is its own"),
    Setting("PYCOLLECT_LOCAL_RANK", _int_at_least(0), None, "a rank (an int >= 0)",
            "set by `pycollect-run` for the program it starts: the rank among the ranks of "
            "this machine (pycollect itself does not read it)"),
    Setting("PYCOLLECT_LOCAL_SIZE", _int_at_least(1), None, "a count (an int >= 1)",
            "set by `pycollect-run` for the program it starts: how many ranks run on this "
            "machine (pycollect itself does not read it)"),
)}


def get(name, environ=None):
    """The value of the variable ``name`` (in ``environ``, default ``os.environ``), parsed."""
    setting = SETTINGS[name]
    raw = (os.environ if environ is None else environ).get(name)
    if raw is None or raw == "":
        return setting.default
    try:
        return setting.parse(raw)
    except ValueError:
        raise InvalidArgument("%s=%r is not %s" % (name, raw, setting.what)) from None


def markdown_table():
    """The README's table of variables: one row per doc, variables that share a doc together."""
    rows, seen = [], {}
    for setting in SETTINGS.values():
        if setting.doc in seen:
            rows[seen[setting.doc]][0].append(setting.name)
        else:
            seen[setting.doc] = len(rows)
            rows.append(([setting.name], setting.doc))
    lines = ["| variable | effect |", "| --- | --- |"]
    for names, doc in rows:
        lines.append("| %s | %s |" % (", ".join("`%s`" % n for n in names), doc))
    return "\n".join(lines) + "\n"
