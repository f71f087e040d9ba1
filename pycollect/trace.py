"""``pycollect-trace DIR``: read every rank's flight recorder dump and say what happened.

The dumps are the JSON files a context writes (pycollect/recorder.py): on a
failure into ``PYCOLLECT_TRACE_DIR``, on ``Context.dump_trace`` or on
``PYCOLLECT_TRACE_SIGNAL``.  For each group found, the report names the ranks
that wrote no dump, the first collective the ranks disagree on (name, dtype,
count or root), the ranks that are behind or never arrived at the last
collective, a rank that arrived long after the others, and the peer each
rank's error blames; its last line is the verdict.  ``--timeline FILE`` also writes the
dumps as a timeline (pycollect/timeline.py).
"""

import argparse
import glob
import json
import os
import re
import sys

from . import timeline
from .recorder import FORMAT

__all__ = ["load", "analyse", "main"]

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


def load(directory):
    """The dumps in ``directory``, by group id: {group_id: {rank: dump}}; files that are not
    whole pycollect dumps (other JSON, a dump cut short) are left out."""
    groups = {}
    for name in sorted(glob.glob(os.path.join(directory, "*.json"))):
        try:
            with open(name) as f:
                dump = json.load(f)
        except (OSError, ValueError):
            continue
        if not isinstance(dump, dict) or dump.get("format") != FORMAT or not all(
                isinstance(dump.get(key), kind) for key, kind in _NEEDED.items()) or not all(
                isinstance(e, dict) for e in dump["entries"]):
            continue
        groups.setdefault(dump["group_id"], {})[dump["rank"]] = dump
    return groups


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


def analyse(dumps):
    """Report lines and a verdict for one group's dumps ({rank: dump})."""
    lines = []
    size = max(d["size"] for d in dumps.values())
    missing = [r for r in range(size) if r not in dumps]
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
    if missing:
        lines.append("no dump from rank(s) %s (dead, stopped, or never started)"
                     % ", ".join(map(str, missing)))

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
    elif missing:
        named = [b for b in blames if b in missing]
        # Judged by the errors that name a missing rank themselves (a rank whose error names
        # another survivor only heard of the failure second hand), else by every error: all
        # timeouts, or peers' relayed timeouts, mean nobody saw the rank leave.
        direct = [r for b in named for r in blames[b]]
        failures = [dumps[r].get("failure") or "" for r in direct] or \
            [d.get("failure") or "" for d in dumps.values()]
        hung = failures and all(f.startswith("Timeout") or "(timeout error" in f
                                for f in failures)
        verdict = "rank(s) %s %s (no dump%s) at #%d (%s)" % (
            ", ".join(map(str, missing)),
            "never arrived: hung or stopped" if hung else "left the group",
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
    if args.timeline is not None and (os.path.isdir(args.timeline) or not os.path.isdir(
            os.path.dirname(os.path.abspath(args.timeline)))):
        print("pycollect-trace: --timeline %s: not a file in an existing directory"
              % args.timeline, file=sys.stderr)
        return 2
    if not os.path.isdir(args.directory):
        print("pycollect-trace: %s is not a directory (give the PYCOLLECT_TRACE_DIR the ranks "
              "dumped into)" % args.directory, file=sys.stderr)
        return 2
    groups = load(args.directory)
    if not groups:
        print("pycollect-trace: no pycollect dumps in %s" % args.directory, file=sys.stderr)
        return 2
    for gid in sorted(groups):
        print("group %s (%d dump(s))" % ("top level" if not gid else "%08x" % gid,
                                         len(groups[gid])))
        for line in analyse(groups[gid]):
            print("  " + line if not line.startswith("VERDICT") else line)
    if args.timeline is not None:
        try:
            n = timeline.write(groups, args.timeline)
        except OSError as exc:
            print("pycollect-trace: cannot write %s: %s" % (args.timeline, exc),
                  file=sys.stderr)
            return 1
        print("timeline: %d events in %s (open it in ui.perfetto.dev or chrome://tracing)"
              % (n, args.timeline))
    return 0


if __name__ == "__main__":
    sys.exit(main())
