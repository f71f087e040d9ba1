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

The sub-groups are ``PhaseGroup``s that ``Context.phase_group`` makes under
recipes of their own, so they never take a number from the user's ``split`` /
``new_group``; a phase group runs one compiled call with the sequence number
and deadline of the collective it is a phase of.
Every phase carries its own group id ("up", "across", "down"): a message of a
later phase that arrives early is left for later, never mistaken for one of
the phase in progress.
"""

import logging
import re
from time import monotonic as _now

from ._ext import _allreduce, _broadcast, _buffer, _reduce, _rooted
from .errors import Error
from .selection import HIERARCHICAL, Selector, buffer_bytes
from .types import ReduceOp

__all__ = ["PhaseGroup", "Topology", "HIERARCHICAL"]

log = logging.getLogger("pycollect")

_BINOMIAL_REDUCE = _rooted.REDUCE_ALGORITHMS["binomial"]
_BINOMIAL = _broadcast.ALGORITHMS["binomial"]
_GROUP_RANK = re.compile(r"^rank \d+: ")


class PhaseGroup:
    """A sub-group that runs the phases of its parent's collectives: one compiled call each,
    under the parent's sequence number and deadline (so it takes no lock and no number).

    ``transport`` is the sub-group's ``GroupTransport``; ``facts`` (a
    ``selection.Facts``) is what ``auto`` knows of it.
    """

    def __init__(self, rank, size, transport, segment_bytes, facts):
        self.rank = rank
        self.size = size
        self.transport = transport
        self.segment_bytes = segment_bytes
        self.selector = Selector(facts)

    def plan(self, collective, nbytes):
        """The plan ``auto`` picks for ``collective`` of ``nbytes`` in this group."""
        return self.selector.plan(collective, nbytes)

    def reduce(self, buf, root, op, algo, seq, timeout):
        return _rooted.reduce(self.transport, buf, root, op, algo, seq, timeout,
                              self.segment_bytes)

    def allreduce(self, buf, op, algo, seq, timeout):
        return _allreduce.allreduce(self.transport, buf, op, algo, seq, timeout,
                                    self.segment_bytes)

    def broadcast(self, buf, root, algo, seq, timeout):
        return _broadcast.broadcast(self.transport, buf, root, algo, seq, timeout,
                                    self.segment_bytes)


def multi_level(host_of, size):
    """Several hosts, and some host with several ranks: what the hierarchy is for."""
    hosts = len(set(host_of))
    return hosts > 1 and hosts < size


class Topology:
    """The hosts of a group's ranks and, on first use, the phase groups of its collectives.

    ``host_ids``: one host identity per rank (None: every rank its own host);
    ``phase_group(members, recipe)`` makes a ``PhaseGroup`` of the group's
    ranks ``members`` (``Context.phase_group``).
    """

    def __init__(self, rank, size, host_ids, phase_group, timeout):
        self.rank = rank
        self.size = size
        self.timeout = timeout
        self._make = phase_group
        ids = host_ids
        if ids is None or len(ids) != size:
            ids = list(range(size))         # unknown: every rank its own host
        index = {}
        self.host_of = [index.setdefault(h, len(index)) for h in ids]
        self.hosts = [[r for r in range(size) if self.host_of[r] == h]
                      for h in range(len(index))]
        self.leaders = [members[0] for members in self.hosts]
        self.local = self.hosts[self.host_of[rank]]
        #: several hosts, and some host with several ranks: what the hierarchy is for
        self.multi_level = multi_level(self.host_of, size)
        self._groups = None
        self._by_root = {}      # broadcast from a rank that is not its host's leader

    def __repr__(self):
        return "<Topology %d host(s): %s>" % (len(self.hosts), self.hosts)

    def _phases(self):
        """(up, across, down) sub-contexts of this rank; None where it takes no part."""
        if self._groups is None:
            make, host = self._make, self.host_of[self.rank]
            several = len(self.local) > 1
            up = make(self.local, ("hierarchy", "up", host)) if several else None
            down = make(self.local, ("hierarchy", "down", host)) if several else None
            across = (make(self.leaders, ("hierarchy", "across"))
                      if self.rank in self.leaders and len(self.leaders) > 1 else None)
            self._groups = (up, across, down)
            log.debug("rank %d: hierarchy of %d hosts %s; leaders %s", self.rank,
                      len(self.hosts), self.hosts, self.leaders)
        return self._groups

    def _root_groups(self, root):
        """On the host of ``root``, not its leader: ([leader, root], the host less root)."""
        if root not in self._by_root:
            make, leader = self._make, self.local[0]
            pair = (make([leader, root], ("hierarchy", "to leader", root))
                    if self.rank in (leader, root) else None)
            rest = [r for r in self.local if r != root]
            down = (make(rest, ("hierarchy", "down without", root))
                    if self.rank != root and len(rest) > 1 else None)
            self._by_root[root] = (pair, down)
        return self._by_root[root]

    def allreduce(self, buf, op, timeout=None):
        """The ``run(seq)`` of a hierarchical allreduce of ``buf`` with ``op`` (``timeout``:
        the call's deadline, else the context's)."""
        code, _ = _buffer.check(buf, "allreduce", "buf", True)
        _reduce.check_reduction(code, op, "allreduce")
        nbytes = buffer_bytes(buf)
        up, across, down = self._phases()
        total = ReduceOp.SUM if op == ReduceOp.AVG else op
        rank, size = self.rank, self.size
        timeout = self.timeout if timeout is None else timeout

        def run(seq):
            end, grace = _now() + timeout, _grace(timeout)
            if up is not None:
                _phase("allreduce", "up", rank, end, lambda left: up.reduce(
                    buf, 0, total, _BINOMIAL_REDUCE, seq, left))
            if across is not None:
                algo = across.plan("allreduce", nbytes).code
                _phase("allreduce", "across", rank, end + grace, lambda left: across.allreduce(
                    buf, total, algo, seq, left))
            if down is not None:
                _phase("allreduce", "down", rank, end + 2 * grace,
                       _broadcast_in(down, buf, 0, _BINOMIAL, seq))
            if op == ReduceOp.AVG and size > 1:
                _reduce.divide(buf, size)
            return HIERARCHICAL

        return run

    def broadcast(self, buf, root, timeout=None):
        """The ``run(seq)`` of a hierarchical broadcast of root's ``buf`` (``timeout``: the
        call's deadline, else the context's)."""
        rank = self.rank
        _buffer.check(buf, "broadcast", "buf", rank != root)
        nbytes = buffer_bytes(buf)
        _, across, down = self._phases()
        root_host = self.host_of[root]
        to_leader = None
        if self.host_of[rank] == root_host and root != self.local[0]:
            # The root hands the buffer to its leader, and stays out of its host's
            # broadcast (its buffer may be read-only).
            to_leader, down = self._root_groups(root)
        timeout = self.timeout if timeout is None else timeout

        def run(seq):
            end, grace = _now() + timeout, _grace(timeout)
            if to_leader is not None:
                _phase("broadcast", "to leader", rank, end,
                       _broadcast_in(to_leader, buf, 1, _BINOMIAL, seq))
            if across is not None:
                algo = across.plan("broadcast", nbytes).code
                _phase("broadcast", "across", rank, end + grace,
                       _broadcast_in(across, buf, root_host, algo, seq))
            if down is not None:
                _phase("broadcast", "down", rank, end + 2 * grace,
                       _broadcast_in(down, buf, 0, _BINOMIAL, seq))
            return HIERARCHICAL

        return run


def _broadcast_in(group, buf, root, algo, seq):
    """The call(seconds left) that broadcasts ``buf`` from group rank ``root`` in ``group``."""
    return lambda left: group.broadcast(buf, root, algo, seq, left)


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
        raise exc.restated("rank %d: hierarchical %s, %s phase: %s" % (
            rank, what, phase, _GROUP_RANK.sub("", str(exc), count=1))) from exc
