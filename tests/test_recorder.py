"""The flight recorder (pycollect/recorder.py) and pycollect-trace (pycollect/trace.py):
the ring, dump_trace, the automatic dump of a failed operation, and the diagnosis of a
killed rank, a mismatch and a hung rank from real processes' dumps."""

import itertools
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import pycollect as pc
from pycollect import timeline, trace
from pycollect.recorder import FIELDS
from group import outcomes, run_ranks
from jobs import stop

VICTIM = """
import os, signal, sys
import numpy as np
import pycollect as pc
rank, store, mode = int(sys.argv[1]), sys.argv[2], sys.argv[3]
ctx = pc.init(rank=rank, size=3, store=store, timeout=3)
x = np.ones(10, np.float32)
for step in range(3):
    ctx.allreduce(x)
ctx.broadcast(x, root=1)
if rank == 2 and mode == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
if rank == 2 and mode == "stop":
    os.kill(os.getpid(), signal.SIGSTOP)
try:
    if rank == 1 and mode == "mismatch":
        ctx.broadcast(x, root=0)
    else:
        ctx.allreduce(x)
    print("ok")
except pc.Error as exc:
    print(type(exc).__name__)
"""


_stores = itertools.count()


def contexts(size, **kwargs):
    store = "hash://recorder-%d" % next(_stores)
    return run_ranks(size, lambda r: pc.init(rank=r, size=size, store=store, **kwargs),
                     timeout=30)


def test_ring_keeps_the_last_operations_in_order(monkeypatch, tmp_path):
    monkeypatch.setenv("PYCOLLECT_TRACE_SIZE", "3")
    ctxs = contexts(2)
    try:
        run_ranks(2, lambda r: ctxs[r].allreduce(np.ones(4)))
        run_ranks(2, lambda r: ctxs[r].broadcast(np.ones(6, np.int32), root=1))
        run_ranks(2, lambda r: ctxs[r].barrier())
        run_ranks(2, lambda r: ctxs[r].allgather(np.ones(2, np.float32)))
        path = ctxs[1].dump_trace(tmp_path)
        assert os.path.basename(path) == "pycollect_trace_rank1.json"
        dump = json.loads(open(path).read())
        assert (dump["rank"], dump["size"], dump["recorded"]) == (1, 2, 4)
        names = [(e["seq"], e["name"], e["state"]) for e in dump["entries"]]
        assert names == [(2, "broadcast", "completed"), (3, "barrier", "completed"),
                         (4, "allgather", "completed")]
        bc = dump["entries"][0]
        assert (bc["dtype"], bc["count"], bc["root"]) == ("int32", 6, 1)
        assert bc["algorithm"] and bc["started_ns"] <= bc["ended_ns"]
        assert bc["frame"][0] == __file__     # the caller, not pycollect's own frames
    finally:
        for c in ctxs:
            c.close()


def test_async_calls_are_recorded_when_queued_and_numbered_when_they_run(tmp_path):
    """The compiled path's queued calls (async_op=True on arrays): an entry made at the
    call, with the caller's frame, started with the collective's number when it runs,
    ended with its algorithm; a failed one ends failed."""
    ctxs = contexts(2, timeout=10)
    try:
        def body(r):
            work = ctxs[r].allreduce(np.ones(4, np.float32), async_op=True)
            queued = json.loads(open(ctxs[r].dump_trace(tmp_path / str(r))).read())
            work.wait()
            ctxs[r].barrier(async_op=True).wait()
            return queued["entries"][-1]
        at_call = run_ranks(2, body)
        for entry in at_call:
            assert entry["name"] == "allreduce" and entry["count"] == 4
            assert entry["state"] in ("queued", "started", "completed")
        bad = outcomes(2, lambda r: ctxs[r].allreduce(np.ones(3, np.float32),
                                                      async_op=True).wait() if r == 0
                       else ctxs[r].broadcast(np.ones(3, np.float32), async_op=True).wait())
        assert all(isinstance(x, pc.MismatchError) for x in bad), bad
        dump = json.loads(open(ctxs[0].dump_trace(tmp_path)).read())
        got = [(e["seq"], e["name"], e["state"], bool(e["algorithm"])) for e in dump["entries"]]
        assert got == [(1, "allreduce", "completed", True), (2, "barrier", "completed", True),
                       (3, "allreduce", "failed", False)], got
        assert dump["entries"][0]["frame"][0] == __file__
        assert dump["entries"][0]["started_ns"] <= dump["entries"][0]["ended_ns"]
        assert dump["entries"][-1]["error"].startswith("MismatchError")
    finally:
        for c in ctxs:
            c.close()


def test_async_sends_and_receives_end_their_entries_with_their_handles(tmp_path):
    """Async sends and receives of arrays begun on the caller's thread: a receive left in
    flight (its message comes later), a send that joins its batch and ends there, and a
    receive that waits past its deadline: each entry ends with its handle, completed or
    failed (the compiled runner ends it: Work.record_in)."""
    ctxs = contexts(2, timeout=10)
    try:
        def body(r):
            ctx = ctxs[r]
            got = np.zeros(4, np.float32)
            if r == 0:
                waiting = ctx.recv(got, 1, tag=5, async_op=True)        # parked
                joined = ctx.send(np.ones(4, np.float32), 1, tag=6, async_op=True)
                pc.wait_all([waiting, joined])
                late = ctx.recv(got, 1, tag=7, async_op=True, timeout=0.3)
                with pytest.raises(pc.Timeout):
                    late.wait()
                return json.loads(open(ctx.dump_trace(tmp_path)).read())["entries"]
            ctx.recv(got, 0, tag=6)
            ctx.send(np.full(4, 2, np.float32), 0, tag=5)
        entries = run_ranks(2, body)[0]
        got = [(e["name"], e["state"], e["peers"]) for e in entries]
        assert got == [("recv", "completed", [1]), ("send", "completed", [1]),
                       ("recv", "failed", [1])], got
        assert entries[-1]["error"].startswith("Timeout")
        assert all(e["started_ns"] <= e["ended_ns"] for e in entries)
    finally:
        for c in ctxs:
            c.close()


def test_dump_trace_makes_the_trace_directory_it_writes_into(monkeypatch, tmp_path):
    monkeypatch.setenv("PYCOLLECT_TRACE_DIR", str(tmp_path / "new" / "trace"))
    ctxs = contexts(1)
    try:
        ctxs[0].barrier()
        path = ctxs[0].dump_trace()
        assert path == str(tmp_path / "new" / "trace" / "pycollect_trace_rank0.json")
        assert trace.main([str(tmp_path / "new" / "trace")]) == 0     # the reader finds it
        # A path given that ends with a separator is a directory too; any other is a file.
        assert ctxs[0].dump_trace(str(tmp_path / "d") + os.sep) == \
            str(tmp_path / "d" / "pycollect_trace_rank0.json")
        assert ctxs[0].dump_trace(tmp_path / "f.json") == str(tmp_path / "f.json")
        assert os.path.isfile(tmp_path / "f.json")
        # Neither a device nor a pipe is renamed over, and bad paths are pycollect errors.
        os.mkfifo(tmp_path / "fifo")
        for bad, message in ((str(tmp_path / "fifo"), "neither a directory nor a regular"),
                             ("/dev/null", "neither a directory nor a regular"),
                             (1, "must be a str or a path"), (b"x", "must be a str"),
                             ("", "is not a file name"),
                             (str(tmp_path / "no" / "such" / "f.json"), "cannot write")):
            with pytest.raises(pc.Error, match=message):
                ctxs[0].dump_trace(bad)
        assert os.path.exists("/dev/null") and not os.path.isfile("/dev/null")
    finally:
        ctxs[0].close()


def test_size_zero_turns_the_recorder_off(monkeypatch, tmp_path):
    monkeypatch.setenv("PYCOLLECT_TRACE_SIZE", "0")
    ctxs = contexts(1)
    with pytest.raises(pc.Error, match="recorder is off"):
        ctxs[0].dump_trace(tmp_path)
    ctxs[0].close()
    monkeypatch.setenv("PYCOLLECT_TRACE_SIZE", "-1")
    with pytest.raises(pc.InvalidArgument, match="PYCOLLECT_TRACE_SIZE"):
        contexts(1)


def test_a_mismatch_dumps_on_every_rank(monkeypatch, tmp_path):
    monkeypatch.setenv("PYCOLLECT_TRACE_DIR", str(tmp_path))
    ctxs = contexts(2, timeout=10)
    try:
        res = outcomes(2, lambda r: ctxs[r].allreduce(np.ones(4)) if r == 0
                       else ctxs[r].broadcast(np.ones(4)))
        assert all(isinstance(x, pc.MismatchError) for x in res), res
        for r in range(2):
            dump = json.loads((tmp_path / ("pycollect_trace_rank%d.json" % r)).read_text())
            assert dump["reason"] == "MismatchError"
            assert dump["entries"][-1]["state"] == "failed"
            assert dump["failure"].startswith("MismatchError")
        report = trace.analyse(trace.load(str(tmp_path))[0])
        assert report[-1].startswith("VERDICT: ranks disagree on collective #1: rank(s) "), \
            report
    finally:
        for c in ctxs:
            c.close()


@pytest.mark.parametrize("mode,verdict", [
    ("kill", "VERDICT: rank(s) 2 left the group (no dump; the others' errors name rank 2) "
             "at #5 (allreduce float32[10])"),
    ("mismatch", "VERDICT: ranks disagree on collective #5: rank(s) 1 differ from the others"),
    ("stop", "VERDICT: rank(s) 2 never arrived: hung or stopped (no dump; the others' errors "
             "name rank 2) at #5 (allreduce float32[10])"),
])
def test_pycollect_trace_names_the_culprit(tmp_path, mode, verdict):
    _run_victims(tmp_path, mode)
    out = subprocess.run([sys.executable, "-m", "pycollect.trace", str(tmp_path / "trace")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[-1] == verdict, out.stdout


def test_torch_analyzer_reads_a_pycollect_desync(tmp_path):
    pytest.importorskip("torch.distributed.flight_recorder.fr_trace")
    _run_victims(tmp_path, "mismatch")
    names = sorted(os.listdir(tmp_path / "trace"))
    assert [n for n in names if n.startswith("pycollect_fr_rank_")] == [
        "pycollect_fr_rank_0", "pycollect_fr_rank_1", "pycollect_fr_rank_2"], names
    out = subprocess.run([sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace",
                          str(tmp_path / "trace")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    report = out.stdout + out.stderr        # torch logs its findings
    assert "Collective sequence number: 5 has errors" in report, report
    assert "COLLECTIVE_TYPE_MISMATCH" in report, report
    assert "victim.py:17" in report, report      # the broadcast of rank 1


def _run_victims(tmp_path, mode):
    """Three ranks of VICTIM in ``mode``, dumping into tmp_path/trace."""
    script = tmp_path / "victim.py"
    script.write_text(VICTIM)
    env = dict(os.environ, PYCOLLECT_TRACE_DIR=str(tmp_path / "trace"))
    store = "file://%s" % (tmp_path / "store")
    procs = [subprocess.Popen([sys.executable, str(script), str(r), store, mode], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(3)]
    try:
        outs = [procs[r].communicate(timeout=60)[0] for r in (0, 1)]
    finally:
        stop(procs)
    assert all(o.strip() in ("PeerError", "MismatchError", "Timeout") for o in outs), outs


def test_pycollect_trace_on_a_directory_without_dumps(tmp_path, capsys):
    assert trace.main([str(tmp_path)]) == 2
    assert "no pycollect dumps" in capsys.readouterr().err
    # A dump cut short, or other JSON beside the dumps, is not one (no KeyError).
    from pycollect.recorder import FORMAT
    (tmp_path / "short.json").write_text(json.dumps({"format": FORMAT, "rank": 0}))
    (tmp_path / "other.json").write_text("[1, 2]")
    assert trace.main([str(tmp_path)]) == 2
    assert "no pycollect dumps" in capsys.readouterr().err
    assert trace.main([str(tmp_path / "nowhere")]) == 2
    assert "nowhere is not a directory" in capsys.readouterr().err


def test_signal_dumps_every_context(monkeypatch, tmp_path):
    monkeypatch.setenv("PYCOLLECT_TRACE_DIR", str(tmp_path))
    monkeypatch.setenv("PYCOLLECT_TRACE_SIGNAL", "USR2")
    previous = signal.getsignal(signal.SIGUSR2)
    ctx = pc.init(rank=0, size=1, store="hash://recorder-signal")    # the main thread
    try:
        ctx.barrier()
        group = ctx.new_group([0])
        os.kill(os.getpid(), signal.SIGUSR2)
        time.sleep(0.05)    # the handler runs between bytecodes of the main thread
        names = sorted(p.name for p in tmp_path.iterdir())
        assert "pycollect_trace_rank0.json" in names, names
        assert any(n.startswith("pycollect_trace_g") for n in names), names    # the group's
        dump = json.loads((tmp_path / "pycollect_trace_rank0.json").read_text())
        assert dump["reason"] == "signal SIGUSR2"
        assert [e["name"] for e in dump["entries"]] == ["barrier"]
        group.close()
    finally:
        signal.signal(signal.SIGUSR2, previous)
        ctx.close()


def _failed_dump(rank, failure):
    entry = {"id": 0, "seq": 5, "name": "allreduce", "algorithm": None, "dtype": "float32",
             "count": 10, "root": None, "peers": None, "state": "failed", "queued_ns": 1,
             "started_ns": 2, "ended_ns": 3, "frame": None, "error": failure}
    return {"rank": rank, "size": 3, "failure": failure, "group_id": 0, "members": None,
            "pid": 1, "host": "h", "reason": failure.split(":")[0], "entries": [entry]}


@pytest.mark.parametrize("last_link, verdict", [
    ("Timeout: rank 1: allreduce(float32 x 10, SUM, flags) #5 timed out after 3 s waiting "
     "for rank 2 (to arrive)", "never arrived: hung or stopped"),
    ("PeerError: rank 1: allreduce(float32 x 10, SUM, flags) #5 failed: rank 2 "
     "(127.0.0.1:1) closed its connection", "left the group"),
])
def test_the_verdict_on_a_missing_rank_follows_the_errors_that_name_it(last_link, verdict):
    """Rank 1 timed out on the missing rank 2 (or saw it leave); rank 0 only heard that rank 1
    failed (the shared-memory flags path's failure word): the verdict goes by rank 1's error."""
    dumps = {0: _failed_dump(0, "PeerError: rank 0: allreduce(float32 x 10, SUM, flags) #5 "
                                "failed: rank 1 (127.0.0.1:2) failed (seen in the shared flag "
                                "area) and left the group"),
             1: _failed_dump(1, last_link)}
    assert trace.analyse(dumps)[-1] == (
        "VERDICT: rank(s) 2 %s (no dump; the others' errors name rank 2) at #5 "
        "(allreduce float32[10])" % verdict)


def test_the_peers_an_entry_hands_out_are_its_own():
    """The call path records one peers list per rank, kept from call to call: what
    ``entries()`` hands out is a copy, so that changing one entry's peers changes neither
    another entry's nor the next ``entries()``."""
    ctxs = contexts(2, timeout=10)
    try:
        def body(r):
            ctx = ctxs[r]
            buf = np.zeros(2, np.float32)
            for _ in range(2):
                if r == 0:
                    ctx.send(buf, 1, tag=3)
                else:
                    ctx.recv(buf, 0, tag=3)
            first, second = ctx._recorder.entries()[-2:]
            peers = FIELDS.index("peers")
            first[peers].append(99)
            return second[peers], [e[peers] for e in ctx._recorder.entries()[-2:]]

        for r, (second, again) in enumerate(run_ranks(2, body)):
            assert second == [1 - r] and again == [[1 - r], [1 - r]]
    finally:
        for c in ctxs:
            c.close()


def _timeline(tmp_path):
    out = tmp_path / "timeline.json"
    assert trace.main([str(tmp_path / "dumps"), "--timeline", str(out)]) == 0
    with open(out) as f:
        return json.load(f)["traceEvents"]


def test_the_dumps_as_a_timeline(tmp_path, capsys):
    """pycollect-trace --timeline: one process per rank, a thread per context, collectives
    as slices in order, queue waits and sends/receives as paired async slices."""
    ctxs = contexts(2)
    dumps = str(tmp_path / "dumps") + os.sep

    def body(r):
        ctx = ctxs[r]
        ctx.allreduce(np.ones(10))
        ctx.barrier()
        pc.wait_all([ctx.allreduce(np.ones(1000), async_op=True) for _ in range(3)])
        if r == 0:
            ctx.send(np.ones(4), 1, tag=3)
        else:
            ctx.recv(np.ones(4), 0, tag=3)
        sub = ctx.new_group([0, 1])
        sub.allreduce(np.ones(3))
        sub.dump_trace(dumps)
        ctx.dump_trace(dumps)

    try:
        run_ranks(2, body, timeout=30)
    finally:
        for ctx in ctxs:
            ctx.close()
    events = _timeline(tmp_path)
    assert "timeline: %d events in" % len(events) in capsys.readouterr().out
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
             if e["ph"] == "M" and e["name"] == "thread_name"}
    processes = {e["pid"]: e["args"]["name"] for e in events
                 if e["ph"] == "M" and e["name"] == "process_name"}
    assert sorted(processes) == [0, 1] and processes[1].startswith("rank 1 (")
    for rank in (0, 1):
        assert names[(rank, 0)] == "top level" and names[(rank, 1)] == "top level: queued"
        assert names[(rank, 2)].startswith("group ") and names[(rank, 3)].endswith("queued")
        slices = [e for e in events if e["ph"] == "X" and e["pid"] == rank and e["tid"] == 0]
        assert [e["name"] for e in slices] == ["allreduce #1", "barrier #2", "allreduce #3",
                                                "allreduce #4", "allreduce #5"]
        assert all(e["args"]["seq"] == int(e["name"].split("#")[1]) for e in slices)
        assert all(e["ts"] >= 0 and e["dur"] >= 0 for e in slices)
        assert all(a["ts"] + a["dur"] <= b["ts"] + 1e-3 for a, b in zip(slices, slices[1:]))
        assert slices[2]["args"]["count"] == 1000 and slices[2]["args"]["state"] == "completed"
        starts = {e["name"]: e["ts"] for e in slices}
        # Async slices pair up by id; a queue wait ends as its collective starts.
        begins = {(e["cat"], e["id"]): e for e in events
                  if e["ph"] == "b" and e["pid"] == rank}
        ends = {(e["cat"], e["id"]): e for e in events if e["ph"] == "e" and e["pid"] == rank}
        assert set(begins) == set(ends)
        for key, b in begins.items():
            assert ends[key]["ts"] >= b["ts"]
            if key[0] == "queue":
                assert ends[key]["ts"] == starts[b["args"]["for"]]
        p2p = [b["name"] for (cat, _), b in begins.items() if cat == "p2p"]
        assert p2p == (["send to 1"] if rank == 0 else ["recv from 0"])
        group = [e["name"] for e in events if e["ph"] == "X" and e["pid"] == rank
                 and e["tid"] == 2]
        assert group == ["allreduce #1"]


def test_a_timeline_marks_failed_and_unfinished_operations():
    def entry(seq, state, ended):
        return {"id": seq, "seq": seq, "name": "allreduce", "algorithm": "ring",
                "dtype": "float32", "count": 4, "root": None, "peers": None, "state": state,
                "queued_ns": 1000 * seq, "started_ns": 1000 * seq, "ended_ns": ended,
                "frame": ["x.py", 3, "f"], "error": "PeerError: gone" if state == "failed"
                else None}
    dump = {"rank": 1, "size": 4, "members": [0, 2, 4, 6], "host": "h", "pid": 9,
            "time_ns": 9000, "entries": [entry(1, "completed", 1500), entry(2, "failed", 2100),
                                         entry(3, "started", None)]}
    slices = [e for e in timeline.events({7: {1: dump}}) if e["ph"] == "X"]
    assert [e["pid"] for e in slices] == [2, 2, 2]          # the world rank, from members
    assert [e.get("cname") for e in slices] == [None, timeline.FAILED_COLOUR,
                                                timeline.UNFINISHED_COLOUR]
    assert slices[1]["args"]["error"] == "PeerError: gone"
    assert slices[1]["args"]["called at"] == "x.py:3 (f)"
    assert slices[2]["ts"] == 2.0 and slices[2]["dur"] == 6.0   # to the dump's time
    assert timeline.events({}) == []


def test_a_timeline_file_that_cannot_be_written_is_refused_up_front(tmp_path, capsys):
    ctxs = contexts(1)
    try:
        ctxs[0].barrier()
        ctxs[0].dump_trace(str(tmp_path / "dumps") + os.sep)
    finally:
        ctxs[0].close()
    for bad in (tmp_path / "no" / "such" / "t.json", tmp_path):
        assert trace.main([str(tmp_path / "dumps"), "--timeline", str(bad)]) == 2
        assert "--timeline" in capsys.readouterr().err


def test_a_group_of_a_group_is_drawn_under_its_world_ranks(tmp_path):
    """A group's dump names its members in its parent (``members``); a group of a group
    also in the world (``world_members``), which the timeline draws its ranks under."""
    ctxs = contexts(3)
    dumps = str(tmp_path / "dumps") + os.sep

    def body(r):
        outer = ctxs[r].new_group([2, 0, 1])           # world 2, 0, 1 as its ranks 0, 1, 2
        inner = outer.new_group([2, 1])                # outer's 2 and 1: world 1 and 0
        if inner is not None:
            inner.barrier()
            return inner.rank, inner.dump_trace(dumps)
        return None

    try:
        made = run_ranks(3, body, timeout=30)
    finally:
        for ctx in ctxs:
            ctx.close()
    assert made[2] is None and made[1][0] == 0 and made[0][0] == 1
    with open(made[1][1]) as f:
        dump = json.load(f)
    assert dump["members"] == [2, 1] and dump["world_members"] == [1, 0]
    events = _timeline(tmp_path)
    slices = {e["pid"]: e["args"]["seq"] for e in events if e["ph"] == "X"}
    assert slices == {0: 1, 1: 1}               # world ranks 0 and 1, not group ranks 2, 1
    names = {e["pid"]: e["args"]["name"] for e in events
             if e["ph"] == "M" and e["name"] == "thread_name" and e["tid"] == 0}
    assert names[1].endswith("(rank 0 of 2)") and names[0].endswith("(rank 1 of 2)")
