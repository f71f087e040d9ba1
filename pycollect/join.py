"""Joining a fresh run in the store, and saying what went wrong when the ranks do not fit.

A store may hold keys of an earlier run that crashed (a reused directory, a
long-lived server).  Before connecting, the ranks therefore join a fresh run:
rank 0 publishes a random run id with its group size, every other rank
answers with a random nonce (and its own size, process and host) under that
id, and rank 0 echoes each nonce back.  A rank accepts a run only when its
own nonce comes back, so a stale id (or a stale echo) is never taken for the
live one; every key of the context then lives under the new id.

The join is also where a job that was started wrong shows itself, so it
diagnoses, on every rank, with the real cause:

* sizes that differ: rank 0 reads each join answer's size (and a rank beyond
  its own size, which it never asks for, says so under ``RUN/outside/K``, K
  counted by ``RUN/outsiders``); on a
  size other than its own it says so at once, and publishes the failure under
  ``RUN/failed``, which every rank of the run polls while it waits.  A rank
  that reads a run of another size does not fail on it: that run may be an
  earlier job's, left in the store, which gives way to this job's rank 0's
  own as soon as it publishes it.  The rank answers under it (a live rank 0
  of that size then reports the mismatch) and keeps reading ``run``; only if
  the run it sees at its deadline is still the other-sized one does it report
  both sizes, saying that the run may be a stale one;
* a run that failed before this rank joined it: a failure is published with
  the run's join count then, so a rank whose own join came later (its
  ticket) knows that the failure is not one of its run (an earlier job's,
  or one of a rank 0 that failed before this rank came).  It takes that run
  for a dead one and waits for rank 0 to publish a live one; at its deadline
  it says that rank 0 never published one, and quotes the dead run's failure;
* a rank started twice: rank 0 counts more join answers than ranks under its
  own, fresh run id (each process answers once per run) and publishes the
  failure.  It counts again once the transport stands, before it confirms the
  run to every rank (which waits for that): the second of two processes
  started at once may join just after rank 0 last counted while joining;
  two processes started as rank 0: the first sees the run id it published
  replaced by another one and fails both runs (the second, which
  found a run in the store when it started, waits two join slices for that
  before it answers anyone);
* a rank that never comes: at the deadline each rank lists which ranks
  joined and which never did.

A rank that publishes a failure keeps the store up a little longer
(``FAILURE_LINGER_S``, past the deadline when that is the failure) so that
ranks whose store it hosts can read it.
"""

import os
import secrets
import socket
import time

from .errors import Error, MismatchError, StoreError, Timeout
from .plugins.store import backoff_delays

__all__ = ["join_run", "leave_run", "abandon_run", "JOIN_SLICE_FIRST_S", "JOIN_SLICE_CAP_S"]

# How long a joining rank waits for its nonce to come back before it looks at
# the run again (doubling from the first to the cap); rank 0 looks at the
# joins as often.
JOIN_SLICE_FIRST_S = 0.05
JOIN_SLICE_CAP_S = 0.5
# After publishing a failure: long enough for every waiting rank to read it.
FAILURE_LINGER_S = 2 * JOIN_SLICE_CAP_S + 0.5


def _whoami():
    return "pid %d on %s" % (os.getpid(), socket.gethostname())


def _parse_run(raw):
    """(run id, size or None) from the ``run`` key (an earlier release wrote the id alone)."""
    fields = raw.decode("ascii", "replace").split()
    run = fields[0] if fields else ""
    size = int(fields[1]) if len(fields) > 1 and fields[1].isdigit() else None
    return run, size


def _parse_join(raw):
    """(nonce, size or None, who) from a join answer."""
    fields = raw.decode("utf-8", "replace").split(" ", 2)
    size = int(fields[1]) if len(fields) > 1 and fields[1].isdigit() else None
    return fields[0], size, fields[2] if len(fields) > 2 else "an unknown process"


def _ranks(ranks):
    ranks = sorted(ranks)
    return ", ".join(map(str, ranks)) if ranks else "none"


class _Join:
    """One rank's side of the join through ``scoped`` (the context's store prefix)."""

    def __init__(self, scoped, rank, size, deadline):
        self.scoped, self.rank, self.size, self.deadline = scoped, rank, size, deadline
        # The run's join count when this rank joined it: a failure published with a
        # lower count predates this rank's join (an earlier job's), and is ignored.
        self.ticket = 0
        # The failure published for the joined run before this rank joined it: the run is
        # dead (an earlier job's, or one whose rank 0 failed before this rank came).
        self.earlier_failure = None
        self.outside = 0        # K where this rank's answer is under RUN/outside/K too

    def left(self):
        return max(self.deadline.remaining(), 0.001)

    def fail(self, runs, message, error=MismatchError):
        """Publish ``message`` as the failure of each of ``runs``; raise it here."""
        self.publish(runs, message, error)
        self.stop(error, message)

    def publish(self, runs, message, error):
        """Publish ``message`` as the failure of each of ``runs``, with the run's join count
        (``check_failed`` takes one published with a lower count for an earlier job's)."""
        for run in runs:
            count = self.scoped.add("%s/joins" % run, 0)
            self.scoped.set("%s/failed" % run,
                            ("%s %d %s" % (error.__name__, count, message)).encode())

    def stop(self, error, message, elsewhere=False):
        """Raise ``message`` (``elsewhere``: another rank's published failure); rank 0,
        whose process may host the store, first lets the others read the failure."""
        if self.rank == 0:
            time.sleep(FAILURE_LINGER_S)
        failure = error("rank %d: %s" % (self.rank, message))
        failure.caused_elsewhere = elsewhere
        raise failure

    def check_failed(self, run):
        """Raise the failure another rank published for ``run``, if any."""
        key = "%s/failed" % run
        raw = scoped_get_or_empty(self.scoped, key, self.left()).decode("utf-8", "replace")
        name, count, message = (raw.split(" ", 2) + ["", ""])[:3]
        if not raw:
            return
        error = Timeout if name == "Timeout" else MismatchError
        if count.isdigit() and int(count) >= self.ticket:
            self.stop(error, message, elsewhere=True)
        # Published before this rank joined: an earlier job's, or this run failed before
        # this rank came.  Either way not this rank's failure: the run is dead.
        self.earlier_failure = (error, message)

    def joined(self, run):
        """The ranks whose join answer is in the store under ``run`` (0 counts as joined)."""
        return [0] + [r for r in range(1, self.size)
                      if self.scoped.check(["%s/join/%d" % (run, r)])]

    def timed_out(self, what):
        raise Timeout("rank %d: timed out after %g s joining the run in store %s: %s" % (
            self.rank, self.deadline.timeout, self.scoped.url, what))

    # -- rank 0 ---------------------------------------------------------------

    def host(self):
        scoped, size = self.scoped, self.size
        earlier = None
        if scoped.check(["run"]):
            earlier = _parse_run(scoped.get("run", timeout=self.left()))[0]
        run = secrets.token_hex(8)
        scoped.set("run", ("%s %d" % (run, size)).encode())
        answers = {}       # rank -> its join answer
        for slice_s in backoff_delays(JOIN_SLICE_FIRST_S, JOIN_SLICE_CAP_S):
            self.check_failed(run)
            self.check_run_is(run)
            for peer in set(range(1, size)) - set(answers):
                key = "%s/join/%d" % (run, peer)
                if scoped.check([key]):
                    answers[peer] = raw = scoped.get(key, timeout=self.left())
                    _, their_size, who = _parse_join(raw)
                    if their_size is not None and their_size != size:
                        self.fail([run], "the ranks were started with different sizes: rank 0 "
                                  "with size %d, rank %d (%s) with size %d"
                                  % (size, peer, who, their_size))
            if self.joined_twice(run, answers):
                # Ranks beyond this size, started with a larger one, answer here (the count
                # read only where one made it: add would leave the key in the store).
                outsiders = "%s/outsiders" % run
                for k in range(1, scoped.add(outsiders, 0) + 1 if scoped.check([outsiders])
                               else 1):
                    outside = scoped_get_or_empty(scoped, "%s/outside/%d" % (run, k),
                                                  self.left())
                    if outside:     # else withdrawn
                        their_rank, _, raw = outside.partition(b" ")
                        _, their_size, who = _parse_join(raw)
                        self.fail([run], "the ranks were started with different sizes: rank "
                                  "0 with size %d, rank %s (%s) with size %s"
                                  % (size, their_rank.decode("ascii", "replace"), who,
                                     "unknown" if their_size is None else their_size))
            if len(answers) == size - 1:
                break
            if self.deadline.expired():
                missing = set(range(1, size)) - set(answers)
                self.fail([run], "timed out after %g s joining the run in store %s: rank(s) "
                          "%s never joined (joined: %s)%s" % (
                              self.deadline.timeout, scoped.url, _ranks(missing),
                              _ranks([0] + list(answers)),
                              "; the store held another run (%s) when this rank 0 started: "
                              "a second process started as rank 0 earlier, or keys an earlier "
                              "job left" % earlier if earlier else ""), Timeout)
            try:        # returns as soon as every missing rank has answered
                scoped.wait(["%s/join/%d" % (run, peer) for peer in range(1, size)
                             if peer not in answers], timeout=min(slice_s, self.left()))
            except Timeout:
                pass
        if earlier is not None:
            # The store held a run when this rank 0 started: an earlier job's keys, or
            # another rank 0 still waiting, which notices this run within one of its
            # slices.  Give it that long to say so before answering anyone.
            try:
                scoped.get("%s/failed" % run, timeout=min(2 * JOIN_SLICE_CAP_S, self.left()))
            except Timeout:
                pass
            self.check_failed(run)
            self.check_run_is(run)
        for peer, raw in answers.items():
            scoped.set("%s/ack/%d" % (run, peer), _parse_join(raw)[0].encode())
        return run

    def joined_twice(self, run, ranks):
        """Fail the run where a rank of ``ranks`` (those answered) joined it twice; say whether
        more processes joined it than ``ranks`` hold (the rest are outsiders).  Each process
        answers once per run, so more answers than ranks means a rank was started twice
        (only this fresh run's counters are read)."""
        scoped = self.scoped
        if scoped.add("%s/joins" % run, 0) <= len(ranks):
            return False
        twice = [r for r in ranks if scoped.add("%s/joins/%d" % (run, r), 0) > 1]
        if twice:
            who = _parse_join(scoped_get_or_empty(scoped, "%s/join/%d" % (run, twice[0]),
                                                  self.left()))[2]
            self.fail([run], "rank %d was started twice: two processes joined as rank %d "
                      "(one is %s)" % (twice[0], twice[0], who))
        return True

    def confirm(self, run):
        """Rank 0, once the transport stands: fail the run where a rank joined it twice
        after the answers were in (the second process's join came after rank 0 last
        counted), else tell every rank the run is confirmed."""
        self.joined_twice(run, range(1, self.size))
        for peer in range(1, self.size):
            self.scoped.set("%s/confirmed/%d" % (run, peer), b"")

    def await_confirmation(self, run):
        """Ranks 1..: wait until rank 0 confirms the run or someone fails it."""
        key = "%s/confirmed/%d" % (run, self.rank)
        for slice_s in backoff_delays(JOIN_SLICE_FIRST_S, JOIN_SLICE_CAP_S):
            self.check_failed(run)
            try:
                self.scoped.wait([key], timeout=min(slice_s, self.left()))
                return
            except Timeout:
                if self.deadline.expired():
                    self.timed_out("rank 0 never confirmed the run once the transport stood "
                                   "(is rank 0 stopped?)")

    def check_run_is(self, run):
        """Fail both runs when another process published a run as rank 0 after this one."""
        now = _parse_run(scoped_get_or_empty(self.scoped, "run", self.left()))[0]
        if now != run:
            self.fail([run] + [now] * bool(now),
                      "two processes were started as rank 0 (one is %s): each published its "
                      "own run in store %s" % (_whoami(), self.scoped.url))

    # -- ranks 1.. ------------------------------------------------------------

    def read_run(self):
        try:
            raw = self.scoped.get("run", timeout=self.left())
        except Timeout:
            self.timed_out("rank 0 never published a run (is rank 0 running, with the same "
                           "store?)")
        return _parse_run(raw)

    def guest(self):
        try:
            return self.try_guest()
        except StoreError as exc:
            if self.earlier_failure is None:
                raise
            # The store went away, likely with the rank 0 that published the failure (it
            # hosted the store and lingered, then left): name that failure, and say so.
            error, message = self.earlier_failure
            self.stop(error, "%s (reported before this rank joined the run; then the store "
                      "went away: %s)" % (message, exc), elsewhere=True)

    def join(self, run, their_size, answer):
        """Answer ``run`` (of rank 0's size ``their_size``) and take this rank's ticket."""
        scoped, rank = self.scoped, self.rank
        scoped.add("%s/joins/%d" % (run, rank), 1)
        self.ticket = scoped.add("%s/joins" % run, 1)
        self.earlier_failure = None
        scoped.set("%s/join/%d" % (run, rank), answer)
        # Rank 0 of a smaller run never asks for this rank's answer: tell it where it looks.
        self.outside = 0
        if their_size is not None and rank >= their_size:
            self.outside = scoped.add("%s/outsiders" % run, 1)
            scoped.set("%s/outside/%d" % (run, self.outside), b"%d %s" % (rank, answer))

    def withdraw(self, run):
        """Take back this rank's join of ``run``, which a newer run replaced in the store (an
        earlier job's, read before this job's rank 0 published its own): its answer and its
        own counter, so that this job leaves no key of its own there.  The run's total
        stays as it is: the tickets it hands out only grow (``check_failed``)."""
        self.scoped.delete("%s/join/%d" % (run, self.rank))
        self.scoped.delete("%s/joins/%d" % (run, self.rank))
        if self.outside:
            self.scoped.delete("%s/outside/%d" % (run, self.outside))

    def try_guest(self):
        rank = self.rank
        nonce = secrets.token_hex(8)
        answer = ("%s %d %s" % (nonce, self.size, _whoami())).encode()
        joined, foreign = None, False
        for slice_s in backoff_delays(JOIN_SLICE_FIRST_S, JOIN_SLICE_CAP_S):
            # A run of another size is answered too, not refused: it may be an earlier
            # job's, which this job's rank 0 replaces, while a live rank 0 of that size
            # reads the answer and reports both sizes at once.
            run, their_size = self.read_run()
            if run != joined:
                if joined is not None:
                    self.withdraw(joined)
                self.join(run, their_size, answer)
                joined, foreign = run, False
            try:
                ack = self.scoped.get("%s/ack/%d" % (run, rank),
                                      timeout=min(slice_s, self.left()))
                if ack == nonce.encode():
                    return run
                foreign = True
                time.sleep(min(slice_s, self.deadline.remaining()))  # an earlier run's echo
            except Timeout:
                pass
            self.check_failed(run)
            if self.deadline.expired():
                self.give_up(run, their_size, foreign)

    def give_up(self, run, their_size, foreign):
        """At the deadline: raise what the run this rank last saw says about the cause."""
        rank, size = self.rank, self.size
        if self.earlier_failure is not None:
            error, message = self.earlier_failure
            self.timed_out("rank 0 never published a run (is rank 0 running, with the same "
                           "store?): the one in the store, %s%s, had failed before this rank "
                           "joined it (keys an earlier job left, or this job's rank 0 failed "
                           "before this rank came), with %s: %s" % (
                               run, "" if their_size is None else " of size %d" % their_size,
                               error.__name__, message))
        if their_size is not None and their_size != size:
            self.stop(MismatchError, "rank 0 of the run in store %s was started with size %d, "
                      "this rank (%s) with size %d, and no rank 0 published a run of size %d "
                      "within %g s: the ranks were started with different sizes, or that run "
                      "is a stale one an earlier job left (is this job's rank 0 running, with "
                      "the same store?)" % (self.scoped.url, their_size, _whoami(), size, size,
                                            self.deadline.timeout))
        if foreign:
            self.timed_out("rank 0 answered another process as rank %d (the echo is not "
                           "this process's nonce): rank %d was started twice, or an "
                           "earlier job left its keys" % (rank, rank))
        present = self.joined(run)
        self.timed_out("rank 0 is up but still waits: rank(s) %s never joined "
                       "(joined: %s)" % (_ranks(set(range(size)) - set(present)),
                                         _ranks(present)))


def scoped_get_or_empty(store, key, timeout):
    """``store``'s value for ``key``, or b"" when there is none (no waiting)."""
    if not store.check([key]):
        return b""
    try:
        return store.get(key, timeout=timeout)
    except Timeout:         # deleted between the two calls
        return b""


def join_run(scoped, rank, size, deadline):
    """Agree on a fresh run id under ``scoped`` (see the module docstring); return it."""
    join = _Join(scoped, rank, size, deadline)
    return join.host() if rank == 0 else join.guest()


def leave_run(scoped, run, rank, size, deadline, log):
    """Confirm the run, then delete this rank's join keys (every rank is past joining).

    Rank 0 checks that the run is still its own (a second process started as
    rank 0 while this one connected fails both) and counts the joins once more:
    a process that joined as a rank after rank 0 last counted, while the ranks
    connected, is a rank started twice, and fails the run.  Else it confirms
    the run to every rank, which waits for that (or the run's failure, naming
    the cause).  A store that rank 0 hosted may be gone with rank 0 meanwhile
    (it confirmed and left): where a rank's store calls fail, it leaves the keys
    (each such call may wait out the store's timeout).
    """
    join = _Join(scoped, rank, size, deadline)
    try:
        join.check_failed(run)
        if rank == 0:
            join.check_run_is(run)
            join.confirm(run)
        else:
            join.await_confirmation(run)
    except StoreError as exc:
        if rank == 0:
            raise
        log.debug("rank %d: could not read rank 0's confirmation (the store is gone with "
                  "rank 0?): %s", rank, exc)
        return
    keys = (["run", "%s/joins" % run] if rank == 0 else
            ["%s/join/%d" % (run, rank), "%s/ack/%d" % (run, rank), "%s/joins/%d" % (run, rank),
             "%s/confirmed/%d" % (run, rank)])
    try:
        for key in keys:
            scoped.delete(key)
    except Error as exc:
        log.debug("rank %d: could not delete join keys %s: %s", rank, keys, exc)


def abandon_run(scoped, run, rank, exc, log):
    """Rank 0 failed after joining ``run`` (its transport, or confirming): publish that, so
    that the ranks waiting for the confirmation raise it at once instead of at their
    deadline, and linger while they read it (this process may host the store).  Best effort:
    the store may be what failed."""
    if rank != 0:
        return
    try:
        if scoped.check(["%s/failed" % run]):
            return          # published already (a rank started twice), and read
        _Join(scoped, rank, 0, None).publish(
            [run], "rank 0 failed after the ranks joined: %s: %s" % (type(exc).__name__, exc),
            Timeout if isinstance(exc, Timeout) else MismatchError)
    except Error as err:
        log.debug("rank 0: could not publish its failure of run %s: %s", run, err)
        return
    time.sleep(FAILURE_LINGER_S)
