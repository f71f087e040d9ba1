"""benchmarks/compare.py end to end on a tiny case: real worker processes, the report."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

COMPARE = Path(__file__).resolve().parents[1] / "benchmarks" / "compare.py"


@pytest.mark.parametrize("bind", ["core", "none"])
def test_a_tiny_run_reports_p50_average_and_placement(tmp_path, bind):
    out = tmp_path / "run.json"
    done = subprocess.run(
        [sys.executable, "-P", str(COMPARE), "--peers", "pycollect-shm,ceiling-shm",
         "--transports", "shm", "--ranks", "2", "--counts", "1,65536",
         "--collectives", "barrier", "--budget", "0.1", "--rounds", "2", "--bind", bind,
         "--no-write", "--json", str(out)],
        capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert doc["bind"] == bind and not doc["missing"].get("pycollect-shm (2 ranks)")
    cases = {(r["peer"], r["collective"], r["count"]) for r in doc["results"]}
    assert cases == {(p, c, n) for p in ("pycollect-shm", "ceiling-shm")
                     for c, n in (("allreduce", 1), ("allreduce", 65536), ("barrier", 0))}
    for r in doc["results"]:
        # A rank's own calls never take longer than the slowest rank's of the same call.
        assert 0 < r["avg_us"] <= r["max_us"], r
    report = done.stdout
    assert "2 ranks, small messages: p50 / average" in report
    placement = ("every peer's rank r bound to core r mod cores" if bind == "core"
                 else "no peer's ranks bound to cores")
    assert placement in report
    small = report.split("2 ranks, small messages")[1].split("\n\n")[1].splitlines()
    assert [row.split(" | ")[0] for row in small[2:]] == ["| allreduce 1", "| barrier"]
