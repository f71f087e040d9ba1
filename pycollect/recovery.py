"""Surviving a lost rank: the survivors decide together who goes on (``Context.shrink``,
``Context.agree``).

``survivors`` runs on every rank that goes on, over the context's own connections:

1. The pairs come back: ``recover()`` (the engine's, pycollect/_ext/_engine.pyx) sends a
   reset frame on every pair to a rank not excluded and not known gone, and discards what
   arrives before the peer's reset frame.  A peer that closed, one whose pair broke
   mid-message, and one whose reset frame does not come in time (a stopped
   process) is unreachable from here.
2. Every rank sends its report (its vote, and the ranks it cannot reach) to every rank
   it reaches, and receives theirs.  When every report says the same (the common
   case: the same ranks are dead for everyone), every rank holds every report.
   Otherwise a second round relays all the reports each rank holds, so a rank
   learns the reports of ranks it cannot reach itself.
3. Every rank computes the same group from the same reports: ranks nobody heard
   from are out; while two remaining ranks cannot reach each other, the one with
   the most broken links (the higher rank on a tie) is out.  The vote is the AND
   of the remaining ranks' votes.

A rank that dies during steps 1-2 fails the exchange with ``PeerError`` naming it;
calling again (every survivor does) runs the steps afresh and leaves it out.
"""

from time import monotonic as _now

import numpy as np

from ._ext import _p2p
from ._ext._group import GroupTransport
from .errors import Timeout
from .work import BATCH_SLICE_S

__all__ = ["survivors", "decide"]

_UNKNOWN = -1


def survivors(transport, rank, size, exclude, flag, timeout, gid):
    """The ranks that go on (sorted) and the AND of their ``flag`` votes, as every
    survivor computes them; ``exclude``: ranks to leave out whatever their state;
    ``timeout``: the deadline of step 1 and, again, of step 2; ``gid``: the context id
    of the exchange's messages (the same on every rank)."""
    gone = set(exclude) | set(transport.unreachable())
    gone.discard(rank)
    live = [p for p in range(size) if p != rank and p not in gone]
    lost = set(transport.recover(live, timeout))
    deadline = _now() + timeout         # the exchange's own deadline
    reach = [p for p in live if p not in lost]
    mine = np.zeros(size + 1, np.int8)
    mine[0] = 1 if flag else 0
    for p in range(size):
        if p != rank and p not in reach:
            mine[p + 1] = 1
    exchange = GroupTransport(transport, list(range(size)), gid)
    got = _swap(exchange, reach, mine, deadline)
    rows = np.full((size, size + 1), _UNKNOWN, np.int8)
    rows[rank] = mine
    for p, row in got.items():
        rows[p] = row
    if not _uniform(rows, rank, reach):
        for p, table in _swap(exchange, reach, rows.reshape(-1), deadline).items():
            table = table.reshape(size, size + 1)
            heard = table[:, 0] != _UNKNOWN
            rows[heard] = table[heard]
    return decide(rows)


def _uniform(rows, rank, reach):
    """Every report here names the same unreachable ranks, and they are all the ranks
    this rank did not hear from: every rank then holds the same reports."""
    heard = [rank] + list(reach)
    missing = sorted(set(range(rows.shape[0])) - set(heard))
    return all(sorted(np.flatnonzero(rows[p, 1:] == 1).tolist()) == missing for p in heard)


def decide(rows):
    """The group and the vote from the reports ``rows`` (row i: rank i's vote, then 1 for
    each rank it cannot reach; -1 throughout for a rank not heard from)."""
    size = rows.shape[0]
    group = [i for i in range(size) if rows[i, 0] != _UNKNOWN]

    def broken(i, j):
        return rows[i, j + 1] == 1 or rows[j, i + 1] == 1

    while True:
        degree = {i: sum(1 for j in group if j != i and broken(i, j)) for i in group}
        worst = max(group, key=lambda i: (degree[i], i))
        if degree[worst] == 0:
            break
        group.remove(worst)
    return group, all(rows[i, 0] == 1 for i in group)


def _swap(transport, peers, data, deadline):
    """Send ``data`` to every rank of ``peers`` and receive one array like it from each."""
    got = {p: np.empty_like(data) for p in peers}
    if not peers:
        return got
    left = deadline - _now()
    if left <= 0:
        raise Timeout("rank %d: the survivors' exchange ran out of time" % transport.rank)
    batch = _p2p.Batch(transport, _p2p.Mailbox(), left)
    for p in peers:
        batch.add_send(data, p, 0)
    for p in peers:
        batch.add_recv(got[p], p, 0)
    done = 0
    while done < len(batch):
        done += len(batch.progress(BATCH_SLICE_S))
    return got
