"""Flight recorder dumps as a timeline: the Trace Event Format that chrome://tracing and
Perfetto (ui.perfetto.dev) open, written by ``pycollect-trace DIR --timeline FILE``.

Each rank is a process of the timeline (named by its world rank, host and pid), and each of
its contexts a thread (the top level, or a sub-group by its id).  A collective is a complete
slice from its start to its end, named by the call and its sequence number (``allreduce
#12``); its time waiting in the context's queue, where it waited, is an async slice
``queued`` on a thread of its own beside (async calls queue while the one before them
runs, so these overlap).  Sends and receives (``send to 1``, ``recv from 0``), which may
overlap each other too, are async slices.  An operation the dump caught unfinished ends at
the dump's time; a failed one is coloured and carries its error.  The dumps' times are
wall-clock nanoseconds, so the ranks of one host line up; across hosts they are as close as
the hosts' clocks.

``write`` replaces a regular file only: a device, a pipe or a directory named as the
timeline is refused (``check_target``), and a symbolic link is followed (its target is
written, the link stays).
"""

import json
import os
import stat

__all__ = ["check_target", "events", "write"]

# A collective's slice when it failed, or the dump caught it unfinished (Trace Event
# Format colour names).
FAILED_COLOUR = "terrible"
UNFINISHED_COLOUR = "bad"
P2P = ("send", "recv")


def _world_rank(dump):
    """The rank's top-level rank: through ``world_members`` (a group of a group names its
    parent's ranks in ``members``), else ``members``, else its own."""
    members = dump.get("world_members") or dump.get("members")
    rank = dump["rank"]
    if isinstance(members, list) and 0 <= rank < len(members):
        return members[rank]
    return rank


def _where(e):
    frame = e.get("frame")
    return "%s:%s (%s)" % tuple(frame) if frame else None


def _args(e):
    args = {key: e.get(key) for key in ("seq", "algorithm", "dtype", "count", "root", "peers",
                                        "state", "error") if e.get(key) is not None}
    where = _where(e)
    if where:
        args["called at"] = where
    return args


def events(groups):
    """The timeline's events for ``groups`` (``trace.load``'s {group_id: {rank: dump}}):
    a list of Trace Event Format dicts, times in microseconds from the earliest entry."""
    dumps = [d for g in groups.values() for d in g.values()]
    stamps = [e[key] for d in dumps for e in d["entries"]
              for key in ("queued_ns", "started_ns") if isinstance(e.get(key), int)]
    if not stamps:
        return []
    origin = min(stamps)

    def us(ns):
        return (ns - origin) / 1000.0

    out, named, threads = [], set(), {}
    for gid in sorted(groups):
        for rank in sorted(groups[gid]):
            dump = groups[gid][rank]
            pid = _world_rank(dump)
            tid = 2 * threads.setdefault(gid, len(threads))     # tid + 1: its queue
            if pid not in named:
                named.add(pid)
                out.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0,
                            "args": {"name": "rank %d (%s, pid %s)"
                                     % (pid, dump.get("host"), dump.get("pid"))}})
                out.append({"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0,
                            "args": {"sort_index": pid}})
            context = "top level" if not gid else "group %08x (rank %d of %d)" % (
                gid, rank, dump["size"])
            out.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid,
                        "args": {"name": context}})
            out.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid + 1,
                        "args": {"name": context + ": queued"}})
            out.extend(_entry_events(dump, pid, tid, us))
    return out


def _entry_events(dump, pid, tid, us):
    end_of_dump = dump.get("time_ns")
    for e in dump["entries"]:
        queued, started, ended = e.get("queued_ns"), e.get("started_ns"), e.get("ended_ns")
        begin = started if isinstance(started, int) else queued
        if not isinstance(begin, int):
            continue
        finish = ended if isinstance(ended, int) else end_of_dump
        if not isinstance(finish, int) or finish < begin:
            finish = begin
        name = "%s #%s" % (e.get("name"), e.get("seq")) if e.get("seq") is not None \
            else str(e.get("name"))
        if e.get("name") in P2P and e.get("peers"):
            name = "%s %s %s" % (e["name"], "to" if e["name"] == "send" else "from",
                                 ", ".join(map(str, e["peers"])))
        args = _args(e)
        colour = FAILED_COLOUR if e.get("state") == "failed" else \
            UNFINISHED_COLOUR if not isinstance(ended, int) else None
        ident = "%s/%s/%s" % (pid, tid, e.get("id"))
        if e.get("name") in P2P:
            # Sends and receives in flight together: async slices, paired by the entry id.
            yield from _async(name, "p2p", pid, tid, ident, us(begin), us(finish), args,
                              colour)
            continue
        if isinstance(queued, int) and isinstance(started, int) and started > queued:
            yield from _async("queued", "queue", pid, tid + 1, ident, us(queued), us(started),
                              {"for": name}, None)
        event = {"name": name, "cat": "collective", "ph": "X", "pid": pid, "tid": tid,
                 "ts": us(begin), "dur": (finish - begin) / 1000.0, "args": args}
        if colour:
            event["cname"] = colour
        yield event


def _async(name, cat, pid, tid, ident, begin, end, args, colour):
    """An async slice: its begin and end events, paired by ``ident``."""
    common = {"name": name, "cat": cat, "pid": pid, "tid": tid, "id": ident}
    if colour:
        common["cname"] = colour
    yield dict(common, ph="b", ts=begin, args=args)
    yield dict(common, ph="e", ts=end)


def check_target(path):
    """The file ``write`` writes for ``path``: ``path`` itself, or where a symbolic link
    leads.  Raises ValueError (why, without the path) where it may not be written: it is a
    directory, or exists and is not a regular file (a device, a pipe, a socket: the timeline
    is written beside it and renamed over it, which would replace the node), or its directory
    does not exist or is not writable."""
    target = os.path.realpath(path)
    try:
        mode = os.stat(target).st_mode
    except FileNotFoundError:
        mode = None
    except OSError as exc:
        raise ValueError("cannot be written (%s)" % (exc.strerror or exc)) from None
    if mode is not None and stat.S_ISDIR(mode):
        raise ValueError("is a directory; name a file")
    if mode is not None and not stat.S_ISREG(mode):
        raise ValueError("is not a regular file (a device, a pipe or a socket): the timeline "
                         "replaces the file it names")
    where = os.path.dirname(target)
    if not os.path.isdir(where):
        raise ValueError("not a file in an existing directory")
    if not os.access(where, os.W_OK):
        raise ValueError("cannot write into %s (not writable)" % where)
    return target


def write(groups, path):
    """Write the timeline of ``groups`` to ``path`` (JSON): into a new file beside it, then
    renamed over it; return the number of events.  Raises ValueError where ``check_target``
    refuses ``path``, OSError where the writing fails."""
    target = check_target(path)
    trace = {"traceEvents": events(groups), "displayTimeUnit": "ns",
             "otherData": {"source": "pycollect flight recorder dumps"}}
    partial = "%s.%d.partial" % (target, os.getpid())
    # O_EXCL: never through a file (or a pipe) already there under the partial's name.
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with open(fd, "w", encoding="utf-8") as out:
            json.dump(trace, out)
        os.replace(partial, target)
    except BaseException:
        try:
            os.unlink(partial)
        except OSError:
            pass
        raise
    return len(trace["traceEvents"])
