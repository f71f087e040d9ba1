"""benchmarks/tcp_stream_floor.c builds, streams its messages in each way, and refuses
arguments it cannot honour."""

import os
import re
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCE = os.path.join(ROOT, "benchmarks", "tcp_stream_floor.c")


@pytest.fixture(scope="module")
def program(tmp_path_factory):
    cc = shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler")
    out = str(tmp_path_factory.mktemp("floor") / "tcp_stream_floor")
    subprocess.run([cc, "-O2", "-Wall", "-Werror", "-o", out, SOURCE], check=True, timeout=120)
    return out


@pytest.mark.parametrize("args, segment, credits, window", [
    ([], 4194304, 0, 1),
    (["131072", "4"], 131072, 4, 1),
    (["0", "0", "2"], 4194304, 0, 2),
    (["262144", "0", "3"], 262144, 0, 3),
])
def test_the_stream_floor_times_every_way(program, args, segment, credits, window):
    done = subprocess.run([program] + args, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    m = re.fullmatch(r"segment (\d+), credits (\d+), window (\d+): (\d+) us per 4 MiB message\n",
                     done.stdout)
    assert m, done.stdout
    assert (int(m[1]), int(m[2]), int(m[3])) == (segment, credits, window)
    assert int(m[4]) > 0


@pytest.mark.parametrize("args", [["131072", "2", "3"], ["0", "-1"], ["0", "0", "0"],
                                  ["--help-me"], ["abc"], ["12k"], ["131072", "x"], ["-5"],
                                  ["0", "0", "1", "1"]])
def test_the_stream_floor_refuses_what_it_cannot_do(program, args):
    # A word or an extra argument is no reason to run the benchmark (it once ran the default).
    done = subprocess.run([program] + args, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "usage" in done.stderr and not done.stdout


@pytest.mark.parametrize("flag", ["-h", "--help"])
def test_the_stream_floor_says_its_usage_when_asked(program, flag):
    done = subprocess.run([program, flag], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.startswith("usage: ") and "WINDOW" in done.stdout
