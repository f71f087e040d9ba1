"""``pycollect-trace DIR``: read every rank's flight recorder dump and say what happened.

The dumps are the JSON files a context writes (pycollect/recorder.py): on a
failure into ``PYCOLLECT_TRACE_DIR``, on ``Context.dump_trace`` or on
``PYCOLLECT_TRACE_SIGNAL``.  For each group found, the report names the ranks
that wrote no dump, the first collective the ranks disagree on (name, dtype,
count or root), the ranks that are behind or never arrived at the last
collective, a rank that arrived long after the others, and the peer each
rank's error blames; its last line is the verdict.  ``--timeline FILE`` also writes the
dumps as a timeline (pycollect/timeline.py).

``scan`` checks each dump field by field before the analysis reads it: a file that is not a
regular file is never opened; one that is not whole JSON, or not a whole pycollect dump, is
left out and named in the report (its rank's dump counts as unreadable, not as missing); an
entry without what the analysis needs (a name, a state, an int or no sequence number) is
left out, and a malformed optional field is ignored (read as None).
"""

import argparse
import glob
import json
import os
import re
import stat
import sys

from . import timeline
from .recorder import FORMAT

__all__ = ["dump_files", "load", "scan", "analyse", "main"]

# What a rank's error names: the peer it blames.
_BLAME = (
    re.compile(r"that rank (\d+) disagrees"),
    re.compile(r"relayed that rank (\d+) failed"),
    re.compile(r"involving rank (\d+)\)"),
    re.compile(r"failed: rank (\d+) \("),
    re.compile(r"disagrees with rank (\d+) "),
    re.compile(r"waiting for rank (\d+) "),
    re.compile(r"rank\(s\) (\d+)[, \d]* did not arrive"),
)
LATE_S = 1.0        # a rank that entered a collective this long after the first one is late


# What the analysis reads of a dump (recorder.Ring.snapshot writes these and more).
_NEEDED = {"rank": int, "size": int, "group_id": int, "pid": int, "host": str, "reason": str,
           "entries": list}
MAX_NS = 1 << 63        # times are int64 nanoseconds
# The file name a dump gets in a trace directory (recorder.dump_name).
_DUMP_NAME = re.compile(r"pycollect_trace_(?:g([0-9a-f]+)_)?rank(\d+)\.json")


def _int(value):
    return isinstance(value, int) and not isinstance(value, bool)


def _text(value):
    return isinstance(value, str)


def _time(value):
    return _int(value) and 0 <= value < MAX_NS


def _ranks_list(value):
    return isinstance(value, list) and all(map(_int, value))


def _frame(value):
    return isinstance(value, list) and len(value) == 3 and _text(value[0]) and _int(
        value[1]) and _text(value[2])


# Optional fields, of a dump and of an entry: None, or what they must be (else they are
# ignored).  An entry's name and state (text) and sequence number (an int, or None for a
# send or a receive) are not optional: an entry without them is left out.
_DUMP_OPTIONAL = (("failure", _text, "text"), ("members", _ranks_list, "a list of ranks"),
                  ("world_members", _ranks_list, "a list of ranks"),
                  ("time_ns", _time, "a time in ns"))
_ENTRY_OPTIONAL = tuple((key, _text, "text") for key in ("algorithm", "dtype", "error")) + \
    tuple((key, _int, "an int") for key in ("id", "count", "root")) + \
    tuple((key, _time, "a time in ns") for key in ("queued_ns", "started_ns", "ended_ns")) + \
    (("peers", _ranks_list, "a list of ranks"), ("frame", _frame, "[file, line, function]"))


def dump_files(directory):
    """The files in ``directory`` that pycollect-trace reads (``*.json``), sorted."""
    return sorted(glob.glob(os.path.join(directory, "*.json")))


def load(directory):
    """The dumps in ``directory``, by group id: {group_id: {rank: dump}}; files that are not
    whole pycollect dumps (other JSON, a dump cut short) are left out (``scan`` says which)."""
    return scan(directory)[0]


def scan(directory):
    """Read the dumps in ``directory``: (groups, skipped, notes).  ``groups`` is
    {group_id: {rank: dump}}, each dump checked (entries that do not fit left out, malformed
    optional fields set to None); ``skipped`` lists (file, why, whose) for the files left out
    (not a regular file: never opened; not whole JSON; not a whole pycollect dump), ``whose``
    the (group_id, rank) the file is by its content or name, else None; ``notes`` lists
    (file, what was left out) for the dumps read in part."""
    groups, skipped, notes = {}, [], []
    for name in dump_files(directory):
        match = _DUMP_NAME.fullmatch(os.path.basename(name))
        whose = (int(match.group(1) or "0", 16), int(match.group(2))) if match else None
        dump, why = _read(name)
        if why is None:
            if isinstance(dump, dict) and dump.get("format") == FORMAT and _int(
                    dump.get("rank")) and _int(dump.get("group_id")):
                whose = (dump["group_id"], dump["rank"])
            dump, why, note = _checked(dump)
            if note:
                notes.append((name, note))
        if why is not None:
            skipped.append((name, why, whose))
            continue
        groups.setdefault(dump["group_id"], {})[dump["rank"]] = dump
    return groups, skipped, notes


def _read(name):
    """(the JSON in file ``name``, None), or (None, why not): only a regular file is opened
    (a pipe or a device named *.json could block, or act on being opened)."""
    try:
        if not stat.S_ISREG(os.stat(name).st_mode):
            return None, "not a regular file (a pipe, a device or a directory): not opened"
        fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK)
        with open(fd, encoding="utf-8") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):     # swapped since the stat
                return None, "not a regular file (a pipe, a device or a directory): not read"
            return json.load(f), None
    except OSError as exc:
        return None, "unreadable (%s)" % (exc.strerror or exc)
    except (ValueError, RecursionError):
        return None, "unreadable: not whole JSON (cut short?)"


def _checked(dump):
    """(the dump made fit for the analysis, None, note) or (None, why it is not a whole
    pycollect dump, None); ``note`` says what was left out or ignored (None: nothing)."""
    if not isinstance(dump, dict) or dump.get("format") != FORMAT:
        if isinstance(dump, dict) and "traceEvents" in dump:
            return None, "a timeline (pycollect-trace --timeline), not a dump", None
        return None, "not a pycollect dump", None
    for key, kind in _NEEDED.items():
        if key not in dump:
            return None, "not a whole pycollect dump: it has no %s" % key, None
        value = dump[key]
        if not (_int(value) if kind is int else isinstance(value, kind)):
            return None, "not a whole pycollect dump: its %s is %s, not %s" % (
                key, _short(value), "an int" if kind is int else
                "text" if kind is str else "a list"), None
    if dump["size"] < 1 or not 0 <= dump["rank"] < dump["size"] or dump["group_id"] < 0:
        return None, "not a whole pycollect dump: rank %d of size %d (group id %d)" % (
            dump["rank"], dump["size"], dump["group_id"]), None
    dump = dict(dump)
    problems = _optional(dump, _DUMP_OPTIONAL)
    ignored = len(problems)
    entries, dropped = [], 0
    for i, e in enumerate(dump["entries"]):
        e, problem, fixed = _entry(e)
        if problem:
            problems.append("entries[%d]: %s" % (i, problem))
        if e is None:
            dropped += 1
        else:
            entries.append(e)
        ignored += fixed
    dump["entries"] = entries
    if not problems:
        return dump, None, None
    what = []
    if dropped:
        what.append("%d of %d entries left out" % (dropped, dropped + len(entries)))
    if ignored:
        what.append("%d malformed field(s) ignored" % ignored)
    return dump, None, "%s (first: %s)" % (", ".join(what), problems[0])


def _entry(e):
    """(the entry, or None to leave it out; the first problem, or None; how many optional
    fields were malformed and are now None)."""
    if not isinstance(e, dict):
        return None, "%s, not an object" % _short(e), 0
    for key in ("name", "state"):
        if not isinstance(e.get(key), str):
            return None, ("no %s" % key if e.get(key) is None else
                          "%s is %s, not text" % (key, _short(e[key]))), 0
    if e.get("seq") is not None and not _int(e["seq"]):
        return None, "seq is %s, not an int" % _short(e["seq"]), 0
    e = dict(e)
    problems = _optional(e, _ENTRY_OPTIONAL)
    return e, (problems[0] if problems else None), len(problems)


def _optional(record, fields):
    """Set each of ``fields`` (key, check, what it must be) of ``record`` that is neither
    None nor what it must be to None; return the problems, as text."""
    problems = []
    for key, fits, what in fields:
        if record.get(key) is not None and not fits(record[key]):
            problems.append("%s is %s, not %s" % (key, _short(record[key]), what))
            record[key] = None
    return problems


def _short(value):
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _describe(e):
    shape = ""
    if e.get("dtype") is not None:
        shape = " %s[%s]" % (e["dtype"], e["count"])
    root = "" if e.get("root") is None else " root=%s" % e["root"]
    return "%s%s%s" % (e["name"], shape, root)


def _where(e):
    frame = e.get("frame")
    return " at %s:%s (%s)" % tuple(frame) if frame else ""


def _blamed(text):
    for pattern in _BLAME:
        m = pattern.search(text or "")
        if m:
            return int(m.group(1))
    return None


def _runs(ranks):
    """Sorted ranks as runs (lo, hi) of consecutive ranks."""
    runs = []
    for r in sorted(set(ranks)):
        if runs and runs[-1][1] == r - 1:
            runs[-1] = (runs[-1][0], r)
        else:
            runs.append((r, r))
    return runs


def _gaps(taken, size):
    """The ranks below ``size`` not in ``taken``, as runs (never one rank at a time: a dump's
    size may be far larger than the ranks that dumped)."""
    runs, lo = [], 0
    for r in sorted(set(taken)):
        if r >= size:
            break
        if r > lo:
            runs.append((lo, r - 1))
        lo = r + 1
    if lo < size:
        runs.append((lo, size - 1))
    return runs


def _ranks(runs):
    """Runs of ranks as text: ``2``, ``0, 1, 2``, and a run of more than 3 as ``3..999``."""
    return ", ".join(", ".join(map(str, range(lo, hi + 1))) if hi - lo < 3 else
                     "%d..%d" % (lo, hi) for lo, hi in runs)


def analyse(dumps, unreadable=()):
    """Report lines and a verdict for one group's dumps ({rank: dump}); ``unreadable``: the
    ranks of the group whose dump file is there but was left out (``scan``'s skipped)."""
    lines = []
    sizes = sorted({d["size"] for d in dumps.values()})
    size = sizes[-1]
    unreadable = sorted(set(unreadable) - set(dumps))
    nodump = _gaps(list(dumps) + unreadable, size)

    def is_missing(rank):
        return rank in unreadable or (0 <= rank < size and rank not in dumps)

    collectives = {r: [e for e in d["entries"] if e.get("seq") is not None]
                   for r, d in dumps.items()}
    by_seq = {r: {e["seq"]: e for e in es} for r, es in collectives.items()}
    last = {r: (es[-1] if es else None) for r, es in collectives.items()}
    for r in sorted(dumps):
        d, e = dumps[r], last[r]
        state = "no collective recorded" if e is None else "last #%d %s: %s%s" % (
            e["seq"], _describe(e), e["state"], _where(e))
        lines.append("rank %d (pid %s on %s, dumped on %s): %s" % (
            r, d["pid"], d["host"], d["reason"], state))
        if d.get("failure"):
            lines.append("  error: %s" % d["failure"])
    if len(sizes) > 1:
        lines.append("the dumps disagree on the group's size: %s (taken as %d)"
                     % (", ".join(map(str, sizes)), size))
    if nodump:
        lines.append("no dump from rank(s) %s (dead, stopped, or never started)"
                     % _ranks(nodump))
    if unreadable:
        lines.append("the dump of rank(s) %s is there but unreadable (left out)"
                     % _ranks(_runs(unreadable)))

    # The first sequence number where the ranks that reached it disagree.
    mismatch = None
    for seq in sorted(set().union(*(set(s) for s in by_seq.values()))):
        calls = {r: s[seq] for r, s in by_seq.items() if seq in s}
        kinds = {}
        for r, e in calls.items():
            kinds.setdefault((e["name"], e.get("dtype"), e.get("count"), e.get("root")),
                             []).append(r)
        if len(kinds) > 1:
            mismatch = (seq, calls, kinds)
            break

    reached = {r: (e["seq"] if e else 0) for r, e in last.items()}
    top = max(reached.values()) if reached else 0
    behind = sorted(r for r, s in reached.items() if s < top)
    late = []
    if top:
        starts = {r: by_seq[r][top]["started_ns"] for r in by_seq
                  if top in by_seq[r] and by_seq[r][top].get("started_ns")}
        if starts:
            first = min(starts.values())
            late = sorted(r for r, t in starts.items() if (t - first) / 1e9 > LATE_S)
    blames = {}
    for r, d in dumps.items():
        b = _blamed(d.get("failure"))
        if b is not None:
            blames.setdefault(b, []).append(r)

    if mismatch is not None:
        seq, calls, kinds = mismatch
        lines.append("ranks disagree on collective #%d:" % seq)
        for (name, dtype, count, root), ranks in sorted(kinds.items(), key=lambda kv: kv[1]):
            e = calls[ranks[0]]
            lines.append("  rank(s) %s called %s%s" % (", ".join(map(str, ranks)),
                                                      _describe(e), _where(e)))
    for r in behind:
        e = last[r]
        lines.append("rank %d is behind: it last entered #%s%s, the others reached #%d (%s)"
                     % (r, e["seq"] if e else "-", (" " + _describe(e) + _where(e)) if e else "",
                        top, _top_name(by_seq, top)))
    for r in late:
        e = by_seq[r][top]
        lines.append("rank %d arrived at #%d %.1f s after the first rank%s"
                     % (r, top, (e["started_ns"] - min(
                         by_seq[q][top]["started_ns"] for q in by_seq if top in by_seq[q]))
                        / 1e9, _where(e)))
    for b, ranks in sorted(blames.items()):
        lines.append("rank(s) %s blame rank %d" % (", ".join(map(str, sorted(ranks))), b))

    # The verdict: the most specific finding wins.
    if mismatch is not None:
        seq, calls, kinds = mismatch
        groups = sorted(kinds.values(), key=len)
        verdict = "ranks disagree on collective #%d: rank(s) %s differ from the others" % (
            seq, ", ".join(map(str, groups[0])))
    elif nodump or unreadable:
        named = [b for b in blames if is_missing(b)]
        # Judged by the errors that name a missing rank themselves (a rank whose error names
        # another survivor only heard of the failure second hand), else by every error: all
        # timeouts, or peers' relayed timeouts, mean nobody saw the rank leave.
        direct = [r for b in named for r in blames[b]]
        failures = [dumps[r].get("failure") or "" for r in direct] or \
            [d.get("failure") or "" for d in dumps.values()]
        hung = failures and all(f.startswith("Timeout") or "(timeout error" in f
                                for f in failures)
        # The ranks that wrote no dump, else those whose dump is there but unreadable.
        if not unreadable:
            dumped = "no dump"
        elif not nodump:
            dumped = "its dump is unreadable" if len(unreadable) == 1 else \
                "their dumps are unreadable"
        else:
            dumped = "no dump; the dump of rank(s) %s is unreadable" % _ranks(_runs(unreadable))
        verdict = "rank(s) %s %s (%s%s) at #%d (%s)" % (
            _ranks(nodump or _runs(unreadable)),
            "never arrived: hung or stopped" if hung else "left the group", dumped,
            "; the others' errors name rank %d" % named[0] if named else "",
            top, _top_name(by_seq, top))
    elif behind:
        verdict = "rank(s) %s never arrived at #%d (%s)" % (
            ", ".join(map(str, behind)), top, _top_name(by_seq, top))
    elif late:
        verdict = "rank(s) %s arrived late at #%d (%s)" % (
            ", ".join(map(str, late)), top, _top_name(by_seq, top))
    elif blames:
        b = max(blames, key=lambda k: len(blames[k]))
        verdict = "the ranks' errors point at rank %d" % b
    else:
        verdict = "every rank reached #%d; no failure recorded" % top
    lines.append("VERDICT: " + verdict)
    return lines


def _top_name(by_seq, top):
    for s in by_seq.values():
        if top in s:
            return _describe(s[top])
    return "?"


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="pycollect-trace",
        description="Read every rank's pycollect flight recorder dump in DIR and say what "
                    "happened: who is behind, which collective the ranks disagree on, which "
                    "rank never arrived.")
    parser.add_argument("directory", help="the PYCOLLECT_TRACE_DIR the ranks dumped into")
    parser.add_argument("--timeline", metavar="FILE",
                        help="also write the dumps as a timeline to FILE (JSON in the Trace "
                             "Event Format: open it in ui.perfetto.dev or chrome://tracing)")
    args = parser.parse_args(argv)
    # Everything the command line names is checked before any dump is read.
    if args.timeline is not None:
        try:
            timeline.check_target(args.timeline)
        except ValueError as exc:
            print("pycollect-trace: --timeline %s: %s" % (args.timeline, exc), file=sys.stderr)
            return 2
    if not os.path.isdir(args.directory):
        print("pycollect-trace: %s is not a directory (give the PYCOLLECT_TRACE_DIR the ranks "
              "dumped into)" % args.directory, file=sys.stderr)
        return 2
    if args.timeline is not None:
        read = _same_file(args.timeline, dump_files(args.directory))
        if read is not None:
            print("pycollect-trace: --timeline %s: it would overwrite %s, a file that "
                  "pycollect-trace reads in %s; name another file"
                  % (args.timeline, read, args.directory), file=sys.stderr)
            return 2
    groups, skipped, notes = scan(args.directory)
    if not groups:
        print("pycollect-trace: no pycollect dumps in %s" % args.directory, file=sys.stderr)
        for name, why, _ in skipped:
            print("pycollect-trace: skipped %s: %s" % (name, why), file=sys.stderr)
        return 2
    for name, why, _ in skipped:
        print("skipped %s: %s" % (name, why))
    for name, note in notes:
        print("%s: %s" % (name, note))
    for gid in sorted(groups):
        print("group %s (%d dump(s))" % ("top level" if not gid else "%08x" % gid,
                                         len(groups[gid])))
        unreadable = [whose[1] for _, _, whose in skipped if whose and whose[0] == gid]
        for line in analyse(groups[gid], unreadable):
            print("  " + line if not line.startswith("VERDICT") else line)
    if args.timeline is not None:
        try:
            n = timeline.write(groups, args.timeline)
        except (OSError, ValueError) as exc:
            print("pycollect-trace: cannot write %s: %s" % (args.timeline, exc),
                  file=sys.stderr)
            return 1
        print("timeline: %d events in %s (open it in ui.perfetto.dev or chrome://tracing)"
              % (n, args.timeline))
    return 0


def _same_file(path, names):
    """The one of ``names`` that is the file ``path`` names (links followed), or None."""
    for name in names:
        try:
            if os.path.samefile(path, name):
                return name
        except OSError:     # either is not there (path: a new file)
            continue
    return None


if __name__ == "__main__":
    sys.exit(main())
