"""``PYCOLLECT_DEBUG=detail``: every collective first checks that all ranks called the same one.

Without it, ranks that disagree are caught by the descriptor every message
carries, but only where two disagreeing ranks exchange a message: a rank that
only waits on ranks which agree with it (a leaf of a broadcast tree, say)
times out instead.  Under ``detail`` each collective starts with an allgather
of a small signature (which collective, dtype, count, op, root, algorithm and
the v-counts: whatever must agree across ranks), and every rank raises the
same ``MismatchError`` naming what each rank called before any data moves.
The check costs one small allgather per collective; the context survives it.
It is a step of submission: each collective hands ``Context._submit`` its
arguments, which encodes them here and checks them before running the call.
"""

import zlib

import numpy as np

from ._ext import _allgather, _allreduce, _broadcast, _buffer, _rooted
from .errors import MismatchError
from .tensors import Host, is_tensor
from .types import DTYPES, ReduceOp

__all__ = ["COLLECTIVES", "describe", "encode", "verify"]

# What must agree across ranks, per collective: (argument, what of it).
#   dtype / count: of a buffer argument (count -1 when the rank passes None)
#   value: an int argument; name: a string argument; list: a sequence (hashed)
_BUF, _COUNT, _VALUE, _NAME, _LIST = "dtype", "count", "value", "name", "list"
COLLECTIVES = {
    "barrier": (),
    "broadcast": (("buf", _BUF), ("buf", _COUNT), ("root", _VALUE), ("algorithm", _NAME)),
    "allreduce": (("buf", _BUF), ("buf", _COUNT), ("op", _VALUE), ("algorithm", _NAME)),
    "reduce": (("buf", _BUF), ("buf", _COUNT), ("op", _VALUE), ("root", _VALUE),
               ("algorithm", _NAME)),
    "allgather": (("sendbuf", _BUF), ("sendbuf", _COUNT)),
    "allgatherv": (("sendbuf", _BUF), ("recvbuf", _COUNT), ("counts", _LIST)),
    "gather": (("sendbuf", _BUF), ("sendbuf", _COUNT), ("root", _VALUE)),
    "gatherv": (("sendbuf", _BUF), ("counts", _LIST), ("root", _VALUE)),
    "scatter": (("recvbuf", _BUF), ("recvbuf", _COUNT), ("root", _VALUE)),
    "scatterv": (("recvbuf", _BUF), ("counts", _LIST), ("root", _VALUE)),
    "reduce_scatter": (("sendbuf", _BUF), ("sendbuf", _COUNT), ("op", _VALUE)),
    "reduce_scatterv": (("sendbuf", _BUF), ("sendbuf", _COUNT), ("counts", _LIST),
                        ("op", _VALUE)),
    "alltoall": (("sendbuf", _BUF), ("sendbuf", _COUNT)),
    "alltoallv": (("sendbuf", _BUF), ("recvbuf", _BUF)),
    "allreduce_coalesced": (("bufs", _LIST), ("op", _VALUE)),
}
_NAMES = sorted(COLLECTIVES)
_WIDTH = 1 + max(len(f) for f in COLLECTIVES.values())
# String arguments travel as CRC-32s; these are printed by name (and any a rank encodes).
_KNOWN_NAMES = {zlib.crc32(n.encode()): n for n in (
    ("auto", "hierarchical", "None") + tuple(_allreduce.ALGORITHMS) +
    tuple(_broadcast.ALGORITHMS) + tuple(_rooted.REDUCE_ALGORITHMS))}


def encode(name, arguments):
    """The int64 signature vector of a call."""
    vec = np.zeros(_WIDTH, np.int64)
    vec[0] = _NAMES.index(name) + 1
    for i, (arg, what) in enumerate(COLLECTIVES[name], 1):
        value = arguments.get(arg)
        if what == _BUF or what == _COUNT:
            if value is None:
                vec[i] = -1
            else:
                vec[i] = _buffer.check(_checkable(value, name, arg), name, arg)[
                    0 if what == _BUF else 1]
        elif what == _VALUE:
            try:
                vec[i] = int(value)
            except (TypeError, ValueError, OverflowError):
                vec[i] = -1         # the collective itself refuses it, with the reason
        elif what == _NAME:
            vec[i] = zlib.crc32(str(value).encode())
            _KNOWN_NAMES.setdefault(int(vec[i]), str(value))
        else:
            vec[i] = zlib.crc32(repr(_canonical(value)).encode())
    return vec


def _checkable(value, name, arg):
    """What the buffer gatekeeper can look at for ``value`` (a tensor, a number)."""
    if is_tensor(value):
        return Host(value, name, arg).array
    if isinstance(value, (int, float, complex, np.number)) and not isinstance(value, bool):
        return np.array([value])
    return value


def _canonical(value):
    """A sequence of counts or of buffers, as what must agree: ints, or (dtype, count)."""
    out = []
    for v in value:
        if isinstance(v, (int, np.integer)):
            out.append(int(v))
        else:
            out.append(_buffer.check(v, "signature", "bufs"))
    return out


def describe(vec):
    """A signature vector in words, as MismatchError prints it."""
    index = int(vec[0]) - 1
    if not 0 <= index < len(_NAMES):
        return "signature %s" % vec.tolist()
    name = _NAMES[index]
    parts = []
    for i, (arg, what) in enumerate(COLLECTIVES[name], 1):
        v = int(vec[i])
        if what == _BUF:
            parts.append("%s %s" % (arg, DTYPES.get(v, "none" if v < 0 else "dtype#%d" % v)))
        elif what == _COUNT:
            parts.append("%s count %s" % (arg, "none" if v < 0 else v))
        elif arg == "op":
            try:
                parts.append(ReduceOp(v).name)
            except ValueError:
                parts.append("op#%d" % v)
        elif what == _VALUE:
            parts.append("%s %d" % (arg, v))
        elif what == _NAME and (v & 0xFFFFFFFF) in _KNOWN_NAMES:
            parts.append("%s %s" % (arg, _KNOWN_NAMES[v & 0xFFFFFFFF]))
        else:
            parts.append("%s #%08x" % (arg, v & 0xFFFFFFFF))
    return "%s(%s)" % (name, ", ".join(parts))


def verify(transport, rank, size, vec, seq, timeout, segment_bytes):
    """Allgather ``vec`` (collective ``seq``); the MismatchError every rank raises when
    ranks called different collectives, or None."""
    table = np.empty((size, _WIDTH), np.int64)
    _allgather.allgather(transport, vec, table, None, seq, timeout, segment_bytes)
    if (table == table[0]).all():
        return None
    groups = {}
    for r in range(size):
        groups.setdefault(describe(table[r]), []).append(r)
    said = "; ".join("rank%s %s called %s" % ("s" if len(rs) > 1 else "",
                                              ", ".join(map(str, rs)), what)
                     for what, rs in groups.items())
    return MismatchError("rank %d: collective #%d: ranks disagree (PYCOLLECT_DEBUG=detail "
                        "check, before any data moved; the context is still usable): %s"
                        % (rank, seq, said))
