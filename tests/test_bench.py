"""pycollect-bench: every benchmark on thread ranks, --local as processes, checks, errors."""

import csv
import io
import itertools
import json
import os
import re
import socket
import stat
import subprocess

import numpy as np
import pytest

import pycollect as pc
from group import run_ranks
from pycollect import bench, exit_report
from pycollect.context import ALLREDUCE_ALGORITHMS
from pycollect.launch import module_command
from pycollect.types import ReduceOp

BENCH = module_command("pycollect.bench")
TINY = ["--elements", "0,1,5,1000", "--iteration-count", "3", "--warmup-iters", "1"]
_stores = itertools.count()


def bench_threads(size, *args):
    """Run pycollect-bench on ``size`` thread ranks over a hash store; return the exit statuses."""
    store = f"hash://bench-{next(_stores)}"
    return run_ranks(size, lambda rank: bench.main(
        ["--size", str(size), "--rank", str(rank), "--store", store, "--quiet", *args]),
        timeout=60)


def bench_local(*args, timeout=60):
    """Run ``pycollect-bench --local ...`` as a process; return the CompletedProcess."""
    return subprocess.run(BENCH + list(args), capture_output=True, text=True, timeout=timeout)


def runnable(size):
    """The benchmark names that run on ``size`` ranks in this build."""
    names = []
    for name, (collective, algorithm) in sorted(bench.BENCHMARKS.items()):
        if collective == "sendrecv_roundtrip" and size != 2:
            continue
        if collective == "allreduce" and algorithm not in ALLREDUCE_ALGORITHMS:
            continue
        names.append(name)
    return names


@pytest.mark.parametrize("size", [2, 3])
def test_every_benchmark_runs_and_checks(size, capsys):
    for name in runnable(size):
        assert bench_threads(size, *TINY, "--json", name) == [0] * size, name
        doc = json.loads(capsys.readouterr().out)
        assert doc["benchmark"] == name and doc["ranks"] == size
        expected_rows = 1 if name.startswith("barrier") else 4
        assert len(doc["results"]) == expected_rows, name
        for row in doc["results"]:
            assert row["iterations"] == 3 and row["verified"] is True
            assert 0 < row["min_us"] <= row["p50_us"] <= row["p99_us"] <= row["max_us"]


def test_local_allreduce_json():
    done = bench_local("--local", "2", *TINY, "--json", "allreduce")
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert doc["ranks"] == 2 and doc["collective"] == "allreduce" and doc["op"] == "sum"
    rows = doc["results"]
    assert [r["elements"] for r in rows] == [0, 1, 5, 1000]
    assert [r["bytes"] for r in rows] == [0, 4, 20, 4000]
    for row in rows[1:]:
        assert row["algbw_GBps"] == pytest.approx(row["bytes"] / row["p50_us"] / 1e3)
        assert row["busbw_GBps"] == pytest.approx(row["algbw_GBps"])   # 2(n-1)/n = 1
        assert row["algorithm"] in ALLREDUCE_ALGORITHMS
    assert rows[0]["algbw_GBps"] is None


def test_local_table_and_csv(tmp_path):
    out = tmp_path / "r.csv"
    done = bench_local("--local", "3", *TINY, f"--csv={out}", "allgather")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("Transport:") and "allgather" in lines[1]
    assert "p50 (us)" in lines[4] and "busbw (GB/s)" in lines[4]
    assert len(lines) == 5 + 4
    assert "4/4 sizes done" in done.stderr          # progress on stderr
    rows = list(csv.DictReader(io.StringIO(out.read_text())))
    assert [int(r["bytes"]) for r in rows] == [0, 12, 60, 12000]   # all 3 blocks
    busbw, algbw = float(rows[-1]["busbw_GBps"]), float(rows[-1]["algbw_GBps"])
    assert busbw == pytest.approx(algbw * 2 / 3, rel=1e-5)
    # floats to 6 significant digits: 147.711, not 147.71099999999998
    digits = [cell.split("e")[0].replace(".", "").lstrip("0") for row in rows
              for cell in row.values() if cell and cell[0].isdigit() and "." in cell]
    assert digits and all(len(d) <= 6 for d in digits), rows


def test_injected_fault_fails_the_check():
    done = bench_local("--local", "3", "--elements", "1000", "--iteration-count", "2",
                       "--inject-fault", "allreduce")
    assert done.returncode == 1
    assert "verification failed: allreduce with 1000 elements of float32: rank 2:" \
        in done.stderr
    assert "1 of 1000 elements wrong" in done.stderr


@pytest.mark.parametrize("name", ["broadcast", "alltoallv", "reduce_scatter", "pairwise_exchange"])
def test_injected_fault_caught_in_every_family(name, capsys):
    statuses = bench_threads(2, "--elements", "64", "--iteration-count", "1",
                             "--inject-fault", name)
    assert 1 in statuses
    assert "verification failed" in capsys.readouterr().err


def test_no_verify_skips_the_check(capsys):
    assert bench_threads(2, *TINY, "--no-verify", "--inject-fault", "--json",
                         "allreduce") == [0, 0]
    doc = json.loads(capsys.readouterr().out)
    assert doc["verify"] is False
    assert all(row["verified"] is not True for row in doc["results"])


@pytest.mark.parametrize("dtype, op", [("float16", "sum"), ("bfloat16", "avg"),
                                       ("complex64", "product"), ("int8", "sum"),
                                       ("uint16", "bxor"), ("bool", "max"),
                                       ("float64", "min")])
def test_dtypes_and_ops(dtype, op, capsys):
    pytest.importorskip("ml_dtypes")
    assert bench_threads(3, *TINY, "--dtype", dtype, "--op", op, "--json",
                         "allreduce_ring") == [0] * 3
    doc = json.loads(capsys.readouterr().out)
    assert (doc["dtype"], doc["op"], doc["algorithm"]) == (dtype, op, "ring")
    assert [row["elements"] for row in doc["results"]] == [0, 1, 5, 1000]
    assert all(row["verified"] is True and row["iterations"] == 3 for row in doc["results"])


def test_bcube_base(capsys):
    if "bcube" not in ALLREDUCE_ALGORITHMS:
        pytest.skip("no bcube in this build")
    assert bench_threads(3, *TINY, "--base", "3", "allreduce_bcube") == [0] * 3
    assert "algorithm bcube:3" in capsys.readouterr().out


def test_inputs_are_combined_first(capsys):
    assert bench_threads(2, *TINY, "--inputs", "3", "--json", "allreduce") == [0, 0]
    doc = json.loads(capsys.readouterr().out)
    assert doc["inputs"] == 3
    assert all(row["verified"] is True for row in doc["results"])


def test_float_tolerance_grows_with_terms_but_catches_errors():
    dtype = np.dtype(np.float16)
    terms = [bench.pattern(r, 1000, dtype, ReduceOp.SUM) for r in range(8)]
    expected, tol = bench.reference(terms, dtype, ReduceOp.SUM)
    reversed_sum = terms[-1].astype(np.float32)
    for t in terms[-2::-1]:
        reversed_sum = (reversed_sum + t.astype(np.float32)).astype(np.float16)
    assert bench.mismatch(reversed_sum, expected, tol, "x") is None
    assert bench.mismatch(reversed_sum - terms[0], expected, tol, "x") is not None
    ints = [bench.pattern(r, 10, np.dtype(np.int8), ReduceOp.SUM) for r in range(3)]
    exact, zero = bench.reference(ints, np.dtype(np.int8), ReduceOp.SUM)
    assert zero == 0 and bench.mismatch(exact, exact, 0, "x") is None


def test_busbw_factors():
    assert bench.busbw_factor("allreduce", 4) == 1.5
    assert bench.busbw_factor("allgather", 4) == 0.75
    assert bench.busbw_factor("broadcast", 4) == 1.0
    assert bench.busbw_factor("barrier", 4) is None
    stats = bench.latency_stats([1e-3, 2e-3, 3e-3], 3e6, 1.5)
    assert stats["p50_us"] == pytest.approx(2000)
    assert stats["algbw_GBps"] == pytest.approx(1.5) and stats["busbw_GBps"] == pytest.approx(2.25)


def test_local_passes_options_to_the_ranks():
    parser = bench._parser()
    args = parser.parse_args(["--local", "2", "--elements", "-1", "--iteration-time", "250ms",
                              "--no-verify", "--dtype", "int32", "--op", "max", "--json",
                              "allreduce_ring"])
    child = bench._child_argv(parser, args)
    again = parser.parse_args(child)
    for key in ("elements", "iteration_time", "verify", "dtype", "op", "json", "benchmark"):
        assert getattr(again, key) == getattr(args, key), key
    assert again.local is None


@pytest.mark.parametrize("extra, bind", [([], "none"), (["--bind", "core"], "core")])
def test_local_hands_its_placement_to_the_launcher(monkeypatch, extra, bind):
    from pycollect import launch
    seen = []
    monkeypatch.setattr(launch, "main", lambda argv: seen.append(argv) or 0)
    assert bench.main(["--local", "2", *extra, "--quiet", "allreduce"]) == 0
    argv = seen[0]
    assert argv[argv.index("--bind") + 1] == bind
    assert "--bind" not in argv[argv.index("--no-prefix-output"):]   # not the ranks' option


@pytest.mark.parametrize("args, message", [
    (["nosuch"], "unknown benchmark 'nosuch'"),
    (["allreduce_rnig"], "did you mean one of allreduce"),
    (["--op", "sum", "broadcast"], "--op: broadcast does not reduce"),
    (["--op", "band", "allreduce"], "--op band --dtype float32: bitwise ops need"),
    (["--dtype", "float128", "allreduce"], "--dtype 'float128' is not one of"),
    (["--inputs", "2", "gather"], "--inputs > 1 applies to the allreduce"),
    (["--algorithm", "ring", "gather"], "gather has no algorithm to choose"),
    (["--algorithm", "ring", "allreduce_halving_doubling"], "contradicts"),
    (["--algorithm", "magic", "allreduce"], "unknown allreduce algorithm 'magic'"),
    (["--base", "3", "allreduce_ring"], "--base applies to allreduce_bcube only"),
    (["--base", "17", "allreduce_bcube"], "bcube base 17 is outside 2..16"),
    (["--algorithm", "bcube:x", "allreduce"], "bcube base 'x' is not an integer"),
    (["--algorithm", "ring:", "allreduce"], "unknown allreduce algorithm 'ring:'"),
    (["--local", "3", "sendrecv_roundtrip"], "exactly 2 ranks, not 3"),
    (["--local", "2", "--size", "2", "allreduce"], "drop --size/--rank"),
    (["--bind", "core", "allreduce"], "--bind places the ranks that --local starts"),
    (["--local", "2", "--root", "2", "broadcast"], "--root 2 is not a rank of 2"),
    (["--json", "--csv", "allreduce"], "cannot both go to stdout"),
    (["--store", "file:///tmp/x", "--shared-path", "/tmp/y", "allreduce"], "two stores"),
    (["--store", "nosuch://host", "allreduce"], "no store plugin named 'nosuch'"),
    (["--store", "notaurl", "allreduce"], "store URL 'notaurl' has no scheme"),
    (["--local", "2", "--store", "hash://x", "allreduce"], "lives inside one process"),
    (["--json=/nonexistent-dir/x.json", "allreduce"], "cannot write into /nonexistent-dir"),
    (["--csv", "/nonexistent-dir/x.csv", "allreduce"], "cannot write into /nonexistent-dir"),
    (["-x", "run7", "allreduce"], "--prefix needs a store"),
    (["--transport", "carrier-pigeon", "allreduce"], "no transport plugin named"),
    (["--elements", "ten", "allreduce"], "is not -1 or a list of counts"),
    (["--elements", "-2", "allreduce"], "counts must be >= 0"),
    (["--iteration-time", "soon", "allreduce"], "is not a duration"),
    (["--local", "0", "allreduce"], "must be at least 1"),
    ([], "name a benchmark"),
])
def test_argument_errors(args, message, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.main(args)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_gloo_store_flags_build_the_url(tmp_path, monkeypatch):
    parser = bench._parser()
    cfg = bench.Config(parser.parse_args(["--shared-path", str(tmp_path), "-x", "run7",
                                          "allreduce"]), parser)
    assert cfg.store == f"file://{tmp_path}?prefix=run7"
    # Under pycollect-run the store (with the run's prefix) comes from PYCOLLECT_STORE.
    monkeypatch.setenv("PYCOLLECT_STORE", "tcp://127.0.0.1:1?prefix=run-ab")
    cfg = bench.Config(parser.parse_args(["-x", "run7", "allreduce"]), parser)
    assert cfg.store == "tcp://127.0.0.1:1?prefix=run-ab/run7"
    # The transport shown and written is the one init uses: PYCOLLECT_TRANSPORT's, or auto.
    monkeypatch.delenv("PYCOLLECT_TRANSPORT", raising=False)
    assert bench.Config(parser.parse_args(["allreduce"]), parser).transport == "auto"
    monkeypatch.setenv("PYCOLLECT_TRANSPORT", "tcp")
    assert bench.Config(parser.parse_args(["allreduce"]), parser).transport == "tcp"
    if "redis" not in pc.plugins.available()["stores"]:
        pytest.skip("no redis store plugin in this build")
    args = parser.parse_args(["--redis-host", "db", "-p", "7000", "allreduce"])
    assert bench.Config(args, parser).store == "redis://db:7000"


def test_bcube_is_refused_clearly_when_missing(capsys, monkeypatch):
    import pycollect.context
    monkeypatch.setattr(pycollect.context, "ALLREDUCE_ALGORITHMS",
                        tuple(a for a in ALLREDUCE_ALGORITHMS if a != "bcube"))
    with pytest.raises(SystemExit):
        bench.main(["allreduce_bcube"])
    assert "this build of pycollect has no allreduce algorithm 'bcube'" in capsys.readouterr().err


def test_json_flag_does_not_swallow_the_benchmark(capsys):
    parser = bench._parser()
    cfg = bench.Config(parser.parse_args(["--json", "gather"]), parser)
    assert cfg.name == "gather" and cfg.args.json == "-"


def test_shared_buffers_run_checked_on_the_peers_memory():
    """--shared: buffers from pycollect.empty; the direct rows reduce from the peers' pages
    (two processes, each mapping the other's pool), still checked."""
    done = bench_local("--local", "2", "--transport", "shm", "--shared", "--algorithm",
                       "direct", "--elements", "1,5000,300000", "--iteration-count", "3",
                       "allreduce", timeout=120)
    assert done.returncode == 0, done.stderr
    assert "buffers=pycollect.empty" in done.stdout
    rows = [line.split() for line in done.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert [int(r[1]) for r in rows] == [1, 5000, 300000], done.stdout
    for name in runnable(2):
        if name in ("allreduce", "broadcast", "allgather"):
            done = bench_local("--local", "2", "--shared", *TINY, name, timeout=120)
            assert done.returncode == 0, (name, done.stderr)


def _mknod(path, major, minor):
    """A copy of a character device's node at ``path`` (never the real /dev one)."""
    try:
        os.mknod(str(path), 0o666 | stat.S_IFCHR, os.makedev(major, minor))
    except OSError as exc:
        pytest.skip(f"cannot make a device node here: {exc}")


@pytest.mark.parametrize("flag", ["--json", "--csv"])
@pytest.mark.parametrize("what, message", [
    ("a directory", "is a directory; name a file"),
    ("a new directory's name", "is a directory; name a file"),
    ("a socket", "is not a regular file, a character device or a pipe"),
    ("in a missing directory", "cannot write into"),
])
def test_an_output_file_that_cannot_be_written_is_refused_before_the_sweep(
        tmp_path, capsys, flag, what, message):
    """Refused with a usage error before any rank starts, not with a traceback once every
    size has run."""
    path = str(tmp_path)
    if what == "a new directory's name":
        path = str(tmp_path / "new") + os.sep
    elif what == "a socket":
        path = str(tmp_path / "sock")
        server = socket.socket(socket.AF_UNIX)
        server.bind(path)
        server.close()
    elif what == "in a missing directory":
        path = str(tmp_path / "missing" / "out")
    with pytest.raises(SystemExit) as exc:
        bench.main(["--local", "2", f"{flag}={path}", "allreduce"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"pycollect-bench: error: {flag} {path}: {message}" in err, err


def test_an_output_file_may_be_new_a_file_a_pipe_or_a_character_device(tmp_path):
    (tmp_path / "old.json").write_text("x")
    os.mkfifo(str(tmp_path / "fifo"))
    _mknod(tmp_path / "null", 1, 3)
    parser = bench._parser()
    for name in ("new.json", "old.json", "fifo", "null"):
        path = str(tmp_path / name)
        cfg = bench.Config(parser.parse_args([f"--json={path}", f"--csv={path}",
                                              "allreduce"]), parser)
        assert cfg.args.json == path


@pytest.mark.parametrize("elements, message", [
    ("10000000000000", "numpy.empty: 40000000000000 bytes (10000000000000 elements of float32) "
                       "do not fit in this machine's memory"),
    ("9999999999999999999999", "numpy.empty: 9999999999999999999999 elements of float32 are "
                               "more than a NumPy array may hold"),
])
def test_an_element_count_too_large_to_allocate_is_one_line(capsys, elements, message):
    """As with --shared (pycollect.empty's InvalidArgument): a usage error, not NumPy's
    MemoryError or ValueError."""
    assert bench_threads(2, "--elements", elements, "--iteration-count", "1",
                         "--warmup-iters", "0", "allreduce") == [2, 2]
    err = capsys.readouterr().err
    assert err.count(message) == 2, err


def test_an_element_count_too_large_to_allocate_under_local_has_no_traceback():
    done = bench_local("--local", "2", "--elements", "10000000000000", "--iteration-count", "1",
                       "--warmup-iters", "0", "--quiet", "allreduce")
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert "do not fit in this machine's memory" in done.stderr
    assert re.search(r"pycollect-run: rank \d exited with code 2 \(InvalidArgument\)",
                     done.stderr), done.stderr


@pytest.mark.parametrize("error, status, consequence", [
    (pc.PeerError, 1, True), (pc.Error, 1, False), (pc.InvalidArgument, 2, False)])
def test_an_error_bench_turns_into_a_status_is_in_the_exit_report(
        tmp_path, monkeypatch, capsys, error, status, consequence):
    """pycollect-run's exit report (exit_report.report): a PeerError is another rank's
    failure; nothing is written where no report is asked for."""
    def fail(cfg):
        raise error("rank 1: it went wrong\nsecond line")

    monkeypatch.setattr(bench, "run", fail)
    report = tmp_path / "report.json"
    monkeypatch.delenv(exit_report.ENV, raising=False)
    assert bench.main(["--rank", "1", "--quiet", "allreduce"]) == status
    assert not report.exists()
    monkeypatch.setenv(exit_report.ENV, str(report))
    assert bench.main(["--rank", "1", "--quiet", "allreduce"]) == status
    assert exit_report.read(str(report)) == {
        "error": error.__name__, "message": "rank 1: it went wrong", "consequence": consequence}
    assert "pycollect-bench: rank 1: " in capsys.readouterr().err


def test_the_launcher_blames_the_rank_that_could_not_write_the_results(tmp_path):
    """Only rank 0 writes --json; a copy of /dev/full's node takes the check before the
    sweep and fails the write after it.  Rank 1's PeerError (rank 0 left) is another rank's
    failure: rank 0 is blamed, with a one-line error."""
    full = tmp_path / "full"
    _mknod(full, 1, 7)
    done = bench_local("--local", "2", "--elements", "100", "--iteration-count", "2",
                       "--warmup-iters", "0", "--quiet", f"--json={full}", "allreduce")
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert f"pycollect-bench: rank 0: Error: --json {full}: cannot write the results: No " \
           f"space left on device" in done.stderr, done.stderr
    line = re.search(r"pycollect-run: (.*)", done.stderr).group(1)
    assert line.startswith("rank 0 exited with code 1 (Error)"), line
    assert stat.S_ISCHR(os.stat(full).st_mode)
