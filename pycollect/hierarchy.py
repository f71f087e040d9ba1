"""Hierarchical collectives for ranks that span hosts: shared memory inside, TCP between.

Rendezvous leaves every rank the host identity of every rank (the transport's
``host_ids``), so each rank works out the same host groups on its own, with
no message: the ranks of a host in rank order, and the host's lowest rank as
its leader.  A collective then runs in three phases, each an existing
algorithm on a sub-group over the context's own connections:

allreduce
    1. *up*: every host reduces to its leader (binomial tree, over shared
       memory where the host has it);
    2. *across*: the leaders allreduce among themselves (over TCP), with the
       algorithm "auto" would choose for that many ranks and that buffer;
    3. *down*: every leader broadcasts the result to its host (binomial).

broadcast
    1. a root that is not its host's leader sends the buffer to the leader;
    2. the leaders broadcast from the root's host leader;
    3. every host broadcasts from its leader (the root's host without the root).

Hosts with a single rank skip their local phases; ranks that are not leaders
skip the middle one.  AVG sums through all phases and divides once, by the
world size, at the end.  The phases run under the collective's deadline, a
later phase with a short grace (``_grace``) so that a missing rank is named
by the rank that waits for it directly, and by every other rank after it.
A failure in any phase fails the shared connections, so every rank, on every
host, fails fast.

The sub-groups are made with ``Context._group`` under recipes of their own,
so they never take a number from the user's ``split`` / ``new_group``.
Every phase carries its own group id ("up", "across", "down"): a message of a
later phase that arrives early is left for later, never mistaken for one of
the phase in progress.
"""

import logging
import re
from time import monotonic as _now

from ._ext import _allreduce, _broadcast, _buffer, _reduce, _rooted
from ._ext._transport import ALGORITHM_NAMES
from .errors import Error, InvalidArgument
from .types import DTYPES, ReduceOp

__all__ = ["Topology", "HIERARCHICAL", "ALLREDUCE_MIN_BYTES", "BROADCAST_MIN_BYTES"]

log = logging.getLogger("pycollect")

HIERARCHICAL = next(code for code, name in ALGORITHM_NAMES.items() if name == "hierarchical")

NEVER = float("inf")
# From these sizes "auto" runs the hierarchical algorithms on a multi-host job
# whose hosts hold several ranks (measured with benchmarks/hierarchy.py, see
# docs/algorithms.md).  A hierarchical broadcast never beat the binomial tree
# there (the tree already crosses hosts once per host), so auto leaves it out.
ALLREDUCE_MIN_BYTES = 128 << 10
BROADCAST_MIN_BYTES = NEVER

_BINOMIAL_REDUCE = _rooted.REDUCE_ALGORITHMS["binomial"]
_BINOMIAL = _broadcast.ALGORITHMS["binomial"]
_AVERAGED = ("float", "bfloat", "complex")
_GROUP_RANK = re.compile(r"^rank \d+: ")


class Topology:
    """The hosts of a context's ranks and, on first use, the sub-groups of its phases."""

    def __init__(self, ctx):
        self._ctx = ctx
        rank, size = ctx.rank, ctx.size
        ids = getattr(ctx._transport, "host_ids", None)
        if ids is None or len(ids) != size:
            ids = list(range(size))         # unknown: every rank its own host
        index = {}
        self.host_of = [index.setdefault(h, len(index)) for h in ids]
        self.hosts = [[r for r in range(size) if self.host_of[r] == h]
                      for h in range(len(index))]
        self.leaders = [members[0] for members in self.hosts]
        self.local = self.hosts[self.host_of[rank]]
        #: several hosts, and some host with several ranks: what the hierarchy is for
        self.multi_level = len(self.hosts) > 1 and len(self.leaders) < size
        self.allreduce_min_bytes = ALLREDUCE_MIN_BYTES if self.multi_level else NEVER
        self.broadcast_min_bytes = BROADCAST_MIN_BYTES if self.multi_level else NEVER
        self._groups = None
        self._by_root = {}      # broadcast from a rank that is not its host's leader

    def __repr__(self):
        return "<Topology %d host(s): %s>" % (len(self.hosts), self.hosts)

    def _phases(self):
        """(up, across, down) sub-contexts of this rank; None where it takes no part."""
        if self._groups is None:
            ctx = self._ctx
            host = self.host_of[ctx.rank]
            several = len(self.local) > 1
            up = ctx._group(self.local, ("hierarchy", "up", host)) if several else None
            down = ctx._group(self.local, ("hierarchy", "down", host)) if several else None
            across = (ctx._group(self.leaders, ("hierarchy", "across"))
                      if ctx.rank in self.leaders and len(self.leaders) > 1 else None)
            self._groups = (up, across, down)
            log.debug("rank %d: hierarchy of %d hosts %s; leaders %s", ctx.rank,
                      len(self.hosts), self.hosts, self.leaders)
        return self._groups

    def _root_groups(self, root):
        """On the host of ``root``, not its leader: ([leader, root], the host less root)."""
        if root not in self._by_root:
            ctx, leader = self._ctx, self.local[0]
            pair = (ctx._group([leader, root], ("hierarchy", "to leader", root))
                    if ctx.rank in (leader, root) else None)
            rest = [r for r in self.local if r != root]
            down = (ctx._group(rest, ("hierarchy", "down without", root))
                    if ctx.rank != root and len(rest) > 1 else None)
            self._by_root[root] = (pair, down)
        return self._by_root[root]

    def allreduce(self, buf, op):
        """The ``run(seq)`` of a hierarchical allreduce of ``buf`` with ``op``."""
        code, _ = _buffer.check(buf, "allreduce", "buf", True)
        if op == ReduceOp.AVG and not DTYPES.get(code, "").startswith(_AVERAGED):
            raise InvalidArgument("allreduce: op AVG is not defined on %s: AVG is defined for "
                                  "floating and complex types only; use SUM and divide"
                                  % DTYPES.get(code))
        up, across, down = self._phases()
        total = ReduceOp.SUM if op == ReduceOp.AVG else op
        size, timeout = self._ctx.size, self._ctx.timeout

        def run(seq):
            end, grace = _now() + timeout, _grace(timeout)
            if up is not None:
                _phase("allreduce", "up", self._ctx.rank, end, lambda left: _rooted.reduce(
                    up._transport, buf, 0, total, _BINOMIAL_REDUCE, seq, left,
                    up._segment_bytes))
            if across is not None:
                algo = across._auto_allreduce(buf)
                _phase("allreduce", "across", self._ctx.rank, end + grace,
                       lambda left: _allreduce.allreduce(across._transport, buf, total, algo,
                                                         seq, left, across._segment_bytes))
            if down is not None:
                _phase("allreduce", "down", self._ctx.rank, end + 2 * grace,
                       _broadcast_in(down, buf, 0, _BINOMIAL, seq))
            if op == ReduceOp.AVG and size > 1:
                _reduce.divide(buf, size)
            return HIERARCHICAL

        return run

    def broadcast(self, buf, root):
        """The ``run(seq)`` of a hierarchical broadcast of root's ``buf``."""
        rank = self._ctx.rank
        _buffer.check(buf, "broadcast", "buf", rank != root)
        _, across, down = self._phases()
        root_host = self.host_of[root]
        to_leader = None
        if self.host_of[rank] == root_host and root != self.local[0]:
            # The root hands the buffer to its leader, and stays out of its host's
            # broadcast (its buffer may be read-only).
            to_leader, down = self._root_groups(root)
        timeout = self._ctx.timeout

        def run(seq):
            end, grace = _now() + timeout, _grace(timeout)
            if to_leader is not None:
                _phase("broadcast", "to leader", rank, end,
                       _broadcast_in(to_leader, buf, 1, _BINOMIAL, seq))
            if across is not None:
                algo = across._broadcast_algorithm("auto", buf)
                _phase("broadcast", "across", rank, end + grace,
                       _broadcast_in(across, buf, root_host, algo, seq))
            if down is not None:
                _phase("broadcast", "down", rank, end + 2 * grace,
                       _broadcast_in(down, buf, 0, _BINOMIAL, seq))
            return HIERARCHICAL

        return run


def _broadcast_in(group, buf, root, algo, seq):
    """The call(seconds left) that broadcasts ``buf`` from group rank ``root`` in ``group``."""
    return lambda left: _broadcast.broadcast(group._transport, buf, root, algo, seq, left,
                                             group._segment_bytes)


def _grace(timeout):
    """How much longer a later phase waits than the one before it.

    The rank that waits on a missing peer directly (in an earlier phase) then
    reaches its deadline first and tells the others, so the error on every
    host names that peer instead of the rank that waited for it.
    """
    return min(2.0, max(0.5, 0.1 * timeout))


def _phase(what, phase, rank, end, call):
    """Run ``call(seconds left)``; an error names the context rank and the phase.

    The sub-group's own "rank N: " prefix goes: N is a rank of the sub-group,
    not of the context (its peers are named with their context rank too).
    """
    try:
        call(max(end - _now(), 1e-3))
    except Error as exc:
        raise type(exc)("rank %d: hierarchical %s, %s phase: %s" % (
            rank, what, phase, _GROUP_RANK.sub("", str(exc), count=1))) from exc
