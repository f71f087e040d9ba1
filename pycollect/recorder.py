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
import threading
import time
import weakref

from . import trace_torch
from ._ext._record import FIELDS, Ring
from .errors import InvalidArgument

__all__ = ["Recorder", "FIELDS", "entry_dict", "dump_name", "dump_all", "install_signal", "FORMAT"]

FORMAT = "pycollect-trace/1"

_live = weakref.WeakSet()           # every recorder of the process, for the signal dump
_live_lock = threading.Lock()


def entry_dict(e):
    """An entry as the dump writes it (the dtype as text, the frame as file, line, function)."""
    d = dict(zip(FIELDS, e))
    if d["dtype"] is not None:
        d["dtype"] = str(d["dtype"])
    code, line = d["frame"] or (None, None)
    d["frame"] = None if code is None else [code.co_filename, line, code.co_name]
    return d


class Recorder(Ring):
    """The last ``capacity`` operations of one context (rank ``rank`` of ``size``).

    The ring itself (``record``, ``started``, ``ended``, ``entries``) is compiled
    (pycollect/_ext/_record.pyx), so that the Context's compiled call path fills
    a slot without leaving C; this class adds who the ring belongs to and its dump.
    """

    def __init__(self, rank, size, capacity, group_id=0, members=None, world_members=None):
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:
            raise InvalidArgument("recorder capacity must be an int >= 1, got %r" % (capacity,))
        super().__init__(capacity)
        self.rank = rank
        self.size = size
        self.group_id = group_id
        self.members = members      # this group's ranks in the parent (None: top level)
        self.world_members = world_members      # ... and at the top level
        self.failure = None         # the error that failed the context, as text
        with _live_lock:
            _live.add(self)

    def close(self):
        """Leave the process's live recorders (a closed context dumps on no signal)."""
        with _live_lock:
            _live.discard(self)

    def snapshot(self, reason):
        """The dump's content: who, why, and the entries."""
        return {
            "format": FORMAT,
            "rank": self.rank,
            "size": self.size,
            "group_id": self.group_id,
            "members": self.members,
            "world_members": self.world_members,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "time_ns": time.time_ns(),
            "reason": reason,
            "failure": self.failure,
            "recorded": self.recorded,
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
