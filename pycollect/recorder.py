"""The flight recorder: each context's last N operations, dumped when something fails.

A ``Recorder`` keeps a ring of entries (lists of ``FIELDS``), one per operation submitted
to its context: the sequence number, the collective, the algorithm it ran, the
dtype and element count of its buffer, the root, the peers, the state
(queued, started, completed, failed), the times of each step and the caller's
Python frame.  ``PYCOLLECT_TRACE_SIZE`` sizes the ring (0 turns it off).

``dump(path, reason)`` writes the ring as JSON (``pycollect-trace`` reads it:
pycollect/trace.py).  A context dumps on its own when an operation fails with
a timeout, a mismatch or a peer failure, into ``PYCOLLECT_TRACE_DIR`` when it
is set; ``PYCOLLECT_TRACE_SIGNAL`` names a signal on which every live
recorder of the process dumps there.
"""

import json
import os
import signal
import socket
import sys
import threading
import time
import weakref
from time import time_ns as _time_ns

from . import trace_torch
from .errors import InvalidArgument

__all__ = ["Recorder", "FIELDS", "entry_dict", "dump_name", "dump_all", "install_signal", "FORMAT"]

FORMAT = "pycollect-trace/1"
QUEUED, STARTED, COMPLETED, FAILED = "queued", "started", "completed", "failed"

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
_live = weakref.WeakSet()           # every recorder of the process, for the signal dump
_live_lock = threading.Lock()


# An entry is a list (the cheapest object to make and fill), indexed by these fields.
FIELDS = ("id", "seq", "name", "algorithm", "dtype", "count", "root", "peers", "state",
          "queued_ns", "started_ns", "ended_ns", "frame", "error")
_SEQ, _ALGO, _STATE, _STARTED, _ENDED, _ERROR = 1, 3, 8, 10, 11, 13


def entry_dict(e):
    """An entry as the dump writes it (the dtype as text, the frame as file, line, function)."""
    d = dict(zip(FIELDS, e))
    if d["dtype"] is not None:
        d["dtype"] = str(d["dtype"])
    code, line = d["frame"] or (None, None)
    d["frame"] = None if code is None else [code.co_filename, line, code.co_name]
    return d


def _caller():
    """(code, line) of the first frame outside the pycollect package."""
    f = sys._getframe(2)
    while f is not None and f.f_code.co_filename.startswith(_PACKAGE_DIR):
        f = f.f_back
    return None if f is None else (f.f_code, f.f_lineno)


class Recorder:
    """The last ``capacity`` operations of one context (rank ``rank`` of ``size``)."""

    def __init__(self, rank, size, capacity, group_id=0, members=None):
        if not isinstance(capacity, int) or capacity < 0:
            raise InvalidArgument("recorder capacity must be an int >= 0, got %r" % (capacity,))
        self.rank = rank
        self.size = size
        self.group_id = group_id
        self.members = members      # this group's ranks in the parent (None: top level)
        self.capacity = capacity
        self._ring = [None] * capacity
        self._next = 0              # entries ever recorded
        self.failure = None         # the error that failed the context, as text
        with _live_lock:
            _live.add(self)

    def record(self, name, result, root, peers):
        """A new queued entry for operation ``name`` whose output is ``result``."""
        dtype = getattr(result, "dtype", None)
        e = [self._next, None, name, None, dtype,
             None if dtype is None else result.size, root, peers, QUEUED, _time_ns(),
             None, None, _caller(), None]
        self._ring[self._next % self.capacity] = e
        self._next += 1
        return e

    @staticmethod
    def started(e, seq):
        e[_SEQ] = seq
        e[_STATE] = STARTED
        e[_STARTED] = _time_ns()

    @staticmethod
    def ended(e, algorithm, error=None):
        e[_ALGO] = algorithm
        e[_ENDED] = _time_ns()
        if error is None:
            e[_STATE] = COMPLETED
        else:
            e[_STATE] = FAILED
            e[_ERROR] = "%s: %s" % (type(error).__name__, error)

    def close(self):
        """Leave the process's live recorders (a closed context dumps on no signal)."""
        with _live_lock:
            _live.discard(self)

    def entries(self):
        """The recorded entries, oldest first."""
        n, cap = self._next, self.capacity
        if n <= cap:
            return self._ring[:n]
        i = n % cap
        return self._ring[i:] + self._ring[:i]

    def snapshot(self, reason):
        """The dump's content: who, why, and the entries."""
        return {
            "format": FORMAT,
            "rank": self.rank,
            "size": self.size,
            "group_id": self.group_id,
            "members": self.members,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "time_ns": time.time_ns(),
            "reason": reason,
            "failure": self.failure,
            "recorded": self._next,
            "capacity": self.capacity,
            "entries": [entry_dict(e) for e in self.entries()],
        }

    def dump(self, path, reason="requested"):
        """Write the snapshot to the file ``path`` (or, for a directory, its dump file there,
        and for a top-level context also the file torch's analyzer reads:
        pycollect/trace_torch.py); return the JSON file's name."""
        snapshot = self.snapshot(reason)
        if os.path.isdir(path):
            if not self.group_id:
                trace_torch.write(path, snapshot)
            path = os.path.join(path, dump_name(self.rank, self.group_id))
        data = json.dumps(snapshot, indent=1)
        tmp = "%s.%d.tmp" % (path, os.getpid())
        with open(tmp, "w") as f:
            f.write(data)
        os.replace(tmp, path)
        return path


def dump_name(rank, group_id=0):
    """The file name of rank ``rank``'s dump of group ``group_id`` in a trace directory."""
    if group_id:
        return "pycollect_trace_g%08x_rank%d.json" % (group_id, rank)
    return "pycollect_trace_rank%d.json" % rank


def dump_all(directory, reason):
    """Every live recorder of the process dumps into ``directory``; the file names."""
    os.makedirs(directory, exist_ok=True)
    with _live_lock:
        recorders = list(_live)
    return [r.dump(directory, reason) for r in recorders if r.capacity]


_installed = {}


def install_signal(signum, directory):
    """On ``signum``, every live recorder dumps into ``directory`` (then the previous
    handler, if it was a Python function, runs)."""
    if _installed.get(signum) is not None and signal.getsignal(signum) is _installed[signum]:
        return
    previous = signal.getsignal(signum)

    def handler(sig, frame):
        dump_all(directory, "signal %s" % signal.Signals(sig).name)
        if callable(previous):
            previous(sig, frame)

    try:
        signal.signal(signum, handler)
    except ValueError:      # not the main thread: only the main thread sets handlers
        return
    _installed[signum] = handler
