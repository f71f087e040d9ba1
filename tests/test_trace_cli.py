"""pycollect-trace (pycollect/trace.py) on what a trace directory may hold besides whole dumps,
and its --timeline FILE (pycollect/timeline.py) on what FILE may be.

The dumps here are written by hand (the fields recorder.Ring.snapshot writes), so that each
test names exactly what is malformed.  Nothing here touches a real device: the device nodes
are copies made with mknod in tmp_path (skipped where that is not allowed)."""

import json
import os
import resource
import socket
import stat
import subprocess
import sys

import pytest

from pycollect import trace
from pycollect.recorder import FORMAT, dump_name

TRACE = [sys.executable, "-m", "pycollect.trace"]
# Ranks 0 and 1 failed at #5, both naming rank 2 (which wrote no dump).
FAILURES = {0: "PeerError: rank 0: allreduce(float32 x 10, SUM, flags) #5 failed: rank 2 "
               "(127.0.0.1:1) closed its connection",
            1: "PeerError: rank 1: allreduce(float32 x 10, SUM, flags) #5 failed: rank 2 "
               "(127.0.0.1:2) closed its connection"}
LEFT = "left the group (%s; the others' errors name rank 2) at #5 (allreduce float32[10])"


def entry(seq, state="completed", error=None):
    return {"id": seq - 1, "seq": seq, "name": "allreduce", "algorithm": "flags",
            "dtype": "float32", "count": 10, "root": None, "peers": None, "state": state,
            "queued_ns": 1000 * seq, "started_ns": 1000 * seq, "ended_ns": 1000 * seq + 500,
            "frame": ["victim.py", 8, "<module>"], "error": error}


def dump(rank, size=3):
    failure = FAILURES.get(rank)
    entries = [entry(seq) for seq in range(1, 5)] + [entry(5, "failed", failure)]
    return {"format": FORMAT, "rank": rank, "size": size, "group_id": 0, "members": None,
            "world_members": None, "pid": 100 + rank, "host": "h", "time_ns": 9000,
            "reason": "PeerError", "failure": failure, "recorded": 5, "capacity": 2000,
            "entries": entries}


def write_dumps(directory, ranks=(0, 1), change=None):
    """Write the dumps of ``ranks`` into ``directory``; ``change(dump)`` edits rank 0's."""
    os.makedirs(directory, exist_ok=True)
    for rank in ranks:
        d = dump(rank)
        if change is not None and rank == 0:
            change(d)
        with open(os.path.join(directory, dump_name(rank)), "w") as f:
            json.dump(d, f)
    return str(directory)


def run_trace(*args, memory=None):
    """pycollect-trace as a process (a hang fails the test instead of stopping it)."""
    limit = None
    if memory is not None:
        def limit():
            resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    return subprocess.run(TRACE + [str(a) for a in args], capture_output=True, text=True,
                          timeout=60, preexec_fn=limit)


def mknod_null(path):
    """A copy of /dev/null's device node at ``path`` (skip where mknod is not allowed)."""
    try:
        os.mknod(str(path), 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    except (PermissionError, OSError) as exc:
        pytest.skip("cannot make a device node here: %s" % exc)


def kind(path):
    return stat.S_IFMT(os.lstat(str(path)).st_mode)


# -- --timeline FILE ------------------------------------------------------------------


@pytest.mark.parametrize("node", ["fifo", "device", "socket", "link to a fifo"])
def test_the_timeline_never_replaces_what_is_not_a_regular_file(tmp_path, capsys, node):
    """--timeline naming a pipe, a device node, a socket (or a link to one) is refused before
    any dump is read, and the node is still there, as it was."""
    dumps = write_dumps(tmp_path / "dumps")
    target = tmp_path / "out"
    if node in ("fifo", "link to a fifo"):
        os.mkfifo(str(target))
    elif node == "device":
        mknod_null(target)
    else:
        server = socket.socket(socket.AF_UNIX)
        server.bind(str(target))
        server.close()
    named = target
    if node == "link to a fifo":
        named = tmp_path / "link"
        os.symlink(str(target), str(named))
    before = kind(target)
    assert trace.main([dumps, "--timeline", str(named)]) == 2
    out, err = capsys.readouterr()
    assert out == ""                        # refused before reading anything
    assert err.startswith("pycollect-trace: --timeline %s: is not a regular file" % named), err
    assert len(err.splitlines()) == 1
    assert kind(target) == before
    if node == "link to a fifo":
        assert os.path.islink(str(named))
    assert sorted(os.listdir(str(tmp_path))) == sorted(
        ["dumps", "out"] + (["link"] if node == "link to a fifo" else []))   # no .partial


def test_the_timeline_through_a_link_writes_the_link_s_target(tmp_path, capsys):
    dumps = write_dumps(tmp_path / "dumps")
    (tmp_path / "target.json").write_text("old")
    os.symlink("target.json", str(tmp_path / "link.json"))
    assert trace.main([dumps, "--timeline", str(tmp_path / "link.json")]) == 0
    assert "timeline: " in capsys.readouterr().out
    assert os.readlink(str(tmp_path / "link.json")) == "target.json"    # still the link
    events = json.loads((tmp_path / "target.json").read_text())["traceEvents"]
    assert [e["name"] for e in events if e["ph"] == "X" and e["pid"] == 0][-1] == \
        "allreduce #5"
    assert sorted(os.listdir(str(tmp_path))) == ["dumps", "link.json", "target.json"]


@pytest.mark.parametrize("how", ["its name", "another name", "a link"])
def test_the_timeline_never_overwrites_a_dump_it_reads(tmp_path, capsys, how):
    dumps = write_dumps(tmp_path / "dumps")
    first = os.path.join(dumps, dump_name(0))
    before = open(first).read()
    named = first
    if how == "another name":
        named = os.path.join(str(tmp_path), "dumps", "..", "dumps", dump_name(0))
    elif how == "a link":
        named = str(tmp_path / "link.json")
        os.symlink(first, named)
    assert trace.main([dumps, "--timeline", named]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert "--timeline %s: it would overwrite %s, a file that pycollect-trace reads in" % (
        named, first) in err
    assert open(first).read() == before


# -- what a trace directory may hold --------------------------------------------------


def _pop_name(d):
    del d["entries"][0]["name"]


def _set(where, key, value):
    def change(d):
        (d if where is None else d["entries"][where])[key] = value
    return change


@pytest.mark.parametrize("change, note", [
    (_pop_name, "1 of 5 entries left out (first: entries[0]: no name)"),
    (_set(-1, "frame", ["x", 1]), "1 malformed field(s) ignored (first: entries[4]: frame is "
                                  "[\"x\", 1], not [file, line, function])"),
    (_set(0, "seq", "1"), "1 of 5 entries left out (first: entries[0]: seq is \"1\", not an "
                          "int)"),
    (_set(None, "failure", 5), "1 malformed field(s) ignored (first: failure is 5, not text)"),
    (_set(0, "state", None), "1 of 5 entries left out (first: entries[0]: no state)"),
    (_set(1, "started_ns", 10 ** 30), "1 malformed field(s) ignored (first: entries[1]: "
                                      "started_ns is 1000000000000000000000000000000, not a "
                                      "time in ns)"),
    (_set(1, "peers", "x"), "entries[1]: peers is \"x\", not a list of ranks"),
    (_set(None, "members", ["a", "b", "c"]), "members is [\"a\", \"b\", \"c\"], not a list "
                                             "of ranks"),
    (_set(None, "time_ns", "now"), "time_ns is \"now\", not a time in ns"),
    (lambda d: d["entries"].insert(0, 7), "1 of 6 entries left out (first: entries[0]: 7, "
                                          "not an object)"),
])
def test_a_malformed_field_is_left_out_and_named(tmp_path, capsys, change, note):
    """A dump that is valid JSON but has an entry without a name, a frame that is not
    [file, line, function], a sequence number that is text, a failure that is not text...:
    the entry (or the field) is left out and the report says so; no traceback, and the
    timeline is written too."""
    dumps = write_dumps(tmp_path / "dumps", change=change)
    assert trace.main([dumps, "--timeline", str(tmp_path / "t.json")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(os.path.join(dumps, dump_name(0)) + ": "), lines
    assert note in lines[0], lines
    assert lines[-1].startswith("timeline: "), lines
    assert lines[-2].startswith("VERDICT: rank(s) 2 left the group (no dump"), lines
    assert json.loads((tmp_path / "t.json").read_text())["traceEvents"]


def test_a_huge_group_size_is_not_counted_out_rank_by_rank(tmp_path):
    """A dump that says its group has 10^12 ranks: the missing ranks are one run, never a
    list of 10^12 (in 1 GiB of address space, at once)."""
    dumps = write_dumps(tmp_path / "dumps", change=_set(None, "size", 10 ** 12))
    done = run_trace(dumps, memory=1 << 30)
    assert done.returncode == 0, done.stderr
    assert "the dumps disagree on the group's size: 3, 1000000000000 (taken as " \
           "1000000000000)" in done.stdout
    assert "no dump from rank(s) 2..999999999999 (dead" in done.stdout
    assert done.stdout.splitlines()[-1] == "VERDICT: rank(s) 2..999999999999 " + LEFT % (
        "no dump")


def test_what_is_not_a_regular_file_is_never_opened(tmp_path):
    """A pipe (whose open would wait for a writer), a device node and a directory named
    *.json are skipped, named, without being opened."""
    dumps = write_dumps(tmp_path / "dumps")
    os.mkfifo(os.path.join(dumps, "stray.json"))
    os.mkdir(os.path.join(dumps, "dir.json"))
    devices = []
    try:
        os.mknod(os.path.join(dumps, "null.json"), 0o666 | stat.S_IFCHR, os.makedev(1, 3))
        devices.append("null.json")
    except OSError:
        pass
    done = run_trace(dumps)
    assert done.returncode == 0, done.stderr
    for name in ["dir.json", "stray.json"] + devices:
        assert "skipped %s: not a regular file (a pipe, a device or a directory): not " \
               "opened" % os.path.join(dumps, name) in done.stdout, done.stdout
    assert done.stdout.splitlines()[-1] == "VERDICT: rank(s) 2 " + LEFT % "no dump"


def test_a_rank_whose_dump_is_unreadable_is_not_said_to_have_none(tmp_path, capsys):
    """Rank 2's dump was cut short: the report names the file, and the verdict says that
    its dump is unreadable, not that it wrote none."""
    dumps = write_dumps(tmp_path / "dumps", ranks=(0, 1, 2))
    cut = os.path.join(dumps, dump_name(2))
    with open(cut, "r+") as f:
        f.truncate(200)
    assert trace.main([dumps]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "skipped %s: unreadable: not whole JSON (cut short?)" % cut
    assert "  the dump of rank(s) 2 is there but unreadable (left out)" in lines
    assert not any("no dump from" in line for line in lines), lines
    assert lines[-1] == "VERDICT: rank(s) 2 " + LEFT % "its dump is unreadable"


def test_unreadable_dumps_beside_missing_ones(tmp_path, capsys):
    """Of 5 ranks, 3 and 4 wrote nothing and rank 2's file is another tool's JSON."""
    dumps = write_dumps(tmp_path / "dumps", ranks=(0, 1),
                        change=_set(None, "size", 5))
    with open(os.path.join(dumps, dump_name(1))) as f:
        one = json.load(f)
    one["size"] = 5
    with open(os.path.join(dumps, dump_name(1)), "w") as f:
        json.dump(one, f)
    with open(os.path.join(dumps, dump_name(2)), "w") as f:
        json.dump({"rank": 2}, f)
    assert trace.main([dumps]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "skipped %s: not a pycollect dump" % os.path.join(dumps, dump_name(2))
    assert "  no dump from rank(s) 3, 4 (dead, stopped, or never started)" in lines
    assert lines[-1] == "VERDICT: rank(s) 3, 4 " + LEFT % (
        "no dump; the dump of rank(s) 2 is unreadable")


def test_a_directory_of_broken_dumps_names_them(tmp_path, capsys):
    (tmp_path / dump_name(0)).write_text('{"format": "%s", "rank": 0, "si' % FORMAT)
    (tmp_path / dump_name(1)).write_text(json.dumps(dict(dump(1), rank="1")))
    (tmp_path / "nested.json").write_text("[" * 100000 + "]" * 100000)
    assert trace.main([str(tmp_path)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "pycollect-trace: no pycollect dumps in %s" % tmp_path
    assert err[1:] == [
        "pycollect-trace: skipped %s: unreadable: not whole JSON (cut short?)" % (
            tmp_path / "nested.json"),
        "pycollect-trace: skipped %s: unreadable: not whole JSON (cut short?)" % (
            tmp_path / dump_name(0)),
        "pycollect-trace: skipped %s: not a whole pycollect dump: its rank is \"1\", not an "
        "int" % (tmp_path / dump_name(1))]
