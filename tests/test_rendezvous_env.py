"""``pc.init()`` with no arguments: what each launcher's variables give, precedence, errors."""

import json
import logging
import os
import socket
import subprocess
import sys
import time

import pytest

import pycollect as pc
from pycollect import rendezvous
from pycollect.plugins.store import redact
from pycollect.rendezvous import detect_launcher

pytestmark = pytest.mark.timeout(60)

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "rendezvous_worker.py")
GROUP_TIMEOUT_S = 45
# Every variable a launcher sets that init reads; cleared around each test.
LAUNCHER_VARS = ["PYCOLLECT_RANK", "PYCOLLECT_SIZE", "PYCOLLECT_STORE", "RANK", "WORLD_SIZE",
                 "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE",
                 "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_RANK", "PMI_SIZE",
                 "SLURM_PROCID", "SLURM_NTASKS"]


@pytest.fixture
def env(monkeypatch):
    """A clean launcher environment; call ``env(VAR=value, ...)`` to set variables."""
    for var in LAUNCHER_VARS:
        monkeypatch.delenv(var, raising=False)

    def set_vars(**values):
        for var, value in values.items():
            monkeypatch.setenv(var, value)
    return set_vars


def test_no_launcher_is_none(env):
    assert detect_launcher() is None


def test_torchrun_gives_rank_size_and_a_tcp_store(env):
    env(RANK="2", WORLD_SIZE="4", MASTER_ADDR="node0", MASTER_PORT="29500")
    found = detect_launcher()
    assert (found["launcher"], found["rank"], found["size"], found["store"]) == \
        ("torchrun", 2, 4, "tcp://node0:29500")


def test_torchrun_with_an_ipv6_master_is_bracketed(env):
    env(RANK="0", WORLD_SIZE="2", MASTER_ADDR="fd00::1", MASTER_PORT="29500")
    assert detect_launcher()["store"] == "tcp://[fd00::1]:29500"
    env(MASTER_ADDR="[fd00::2]")
    assert detect_launcher()["store"] == "tcp://[fd00::2]:29500"


def test_torchruns_own_agent_store_moves_ours_to_the_next_port(env):
    env(RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500",
        TORCHELASTIC_USE_AGENT_STORE="True")
    found = detect_launcher()
    assert found["store"] == "tcp://127.0.0.1:29501"
    assert "TORCHELASTIC_USE_AGENT_STORE" in found["store_why"]


@pytest.mark.parametrize("launcher, rank_var, size_var, store", [
    ("Open MPI", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "mpi://"),
    ("MPICH", "PMI_RANK", "PMI_SIZE", "mpi://"),
    ("SLURM", "SLURM_PROCID", "SLURM_NTASKS", None),
])
def test_mpi_and_slurm_variables(env, launcher, rank_var, size_var, store):
    env(**{rank_var: "1", size_var: "3"})
    found = detect_launcher()
    assert (found["launcher"], found["rank"], found["size"], found["store"]) == \
        (launcher, 1, 3, store)


@pytest.mark.parametrize("given, missing", [
    ({"RANK": "0"}, "WORLD_SIZE"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h"}, "MASTER_PORT"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "1"}, "MASTER_ADDR"),
    ({"OMPI_COMM_WORLD_RANK": "0"}, "OMPI_COMM_WORLD_SIZE"),
    ({"PMI_RANK": "0"}, "PMI_SIZE"),
    ({"SLURM_PROCID": "0"}, "SLURM_NTASKS"),
])
def test_a_missing_piece_names_the_variable_to_set(env, given, missing):
    env(**given)
    with pytest.raises(pc.InvalidArgument, match="%s is not|%s (is|are) not" % (missing, missing)):
        pc.init(timeout=1)


def test_slurm_without_a_store_asks_for_pycollect_store(env):
    env(SLURM_PROCID="0", SLURM_NTASKS="2")
    with pytest.raises(pc.InvalidArgument, match="no store.*under SLURM.*PYCOLLECT_STORE"):
        pc.init(timeout=1)


@pytest.mark.parametrize("var", ["RANK", "WORLD_SIZE", "MASTER_PORT"])
def test_a_value_that_is_not_a_number_names_its_variable(env, var):
    env(RANK="0", WORLD_SIZE="2", MASTER_ADDR="h", MASTER_PORT="1")
    env(**{var: "two"})
    with pytest.raises(pc.InvalidArgument, match="%s='two'" % var):
        pc.init(timeout=1)


def test_precedence_arguments_then_pycollect_then_launcher(env, caplog):
    env(RANK="1", WORLD_SIZE="4", MASTER_ADDR="127.0.0.1", MASTER_PORT="1",
        PYCOLLECT_SIZE="1")
    caplog.set_level(logging.DEBUG, logger="pycollect")
    assert rendezvous._job(0, None, None) == (0, 1, "tcp://127.0.0.1:1")
    assert "rank 0 from argument, size 1 from PYCOLLECT_SIZE; store tcp://127.0.0.1:1 " \
           "from torchrun (MASTER_ADDR and MASTER_PORT)" in caplog.text
    env(PYCOLLECT_STORE="hash://from-env", PYCOLLECT_SIZE="4")
    assert rendezvous._job(None, None, None) == (1, 4, "hash://from-env")
    assert rendezvous._job(None, None, "hash://arg") == (1, 4, "hash://arg")


def test_pycollect_store_beats_the_mpi_default(env):
    env(OMPI_COMM_WORLD_RANK="0", OMPI_COMM_WORLD_SIZE="2", PYCOLLECT_STORE="hash://x")
    assert rendezvous._job(None, None, None) == (0, 2, "hash://x")


def test_the_debug_log_hides_passwords(env, caplog):
    env(PYCOLLECT_STORE="redis://:hunter2@host:6379/0")
    caplog.set_level(logging.DEBUG, logger="pycollect")
    rendezvous._job(0, 2, None)
    assert "hunter2" not in caplog.text and "redis://:***@host:6379/0" in caplog.text
    assert redact("redis://u:pw@h:1/2?prefix=x") == "redis://u:***@h:1/2?prefix=x"
    assert redact("tcp://h:1") == "tcp://h:1"
    assert redact("redis://:pw@[h:1") == "redis://:***@[h:1"     # urlsplit refuses it


def test_no_launcher_and_no_size_lists_the_launchers(env):
    with pytest.raises(pc.InvalidArgument, match="PYCOLLECT_SIZE.*torchrun, mpirun or srun"):
        pc.init(timeout=1)


def _free_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _launch(tmp_path, envs, *, extra_args=()):
    """Start one worker per environment, as a launcher would; return their reports."""
    base = {k: v for k, v in os.environ.items()
            if k not in LAUNCHER_VARS and not k.startswith("PYCOLLECT_")}
    procs = []
    deadline = time.monotonic() + GROUP_TIMEOUT_S
    try:
        for index, extra in enumerate(envs):
            out = open(tmp_path / f"worker{index}.out", "w+")
            procs.append((subprocess.Popen(
                [sys.executable, WORKER, *extra_args], env={**base, **extra},
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                cwd=tmp_path), out))
        for proc, _ in procs:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
    finally:
        for proc, _ in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(5)
    reports = []
    for proc, out in procs:
        with out:
            out.seek(0)
            text = out.read()
        assert proc.returncode == 0, text
        reports.append(json.loads(text.strip().splitlines()[-1]))
    return sorted(reports, key=lambda report: report["rank"])


def test_a_torchrun_style_launch_of_three_processes(tmp_path):
    port = _free_port()
    envs = [{"RANK": str(rank), "WORLD_SIZE": "3", "LOCAL_RANK": str(rank),
             "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)} for rank in (2, 1, 0)]
    reports = _launch(tmp_path, envs)
    assert [(r["rank"], r["size"]) for r in reports] == [(0, 3), (1, 3), (2, 3)]
    assert all(r["why"] == "route to store host 127.0.0.1" for r in reports)


def test_a_slurm_style_launch_with_a_file_store(tmp_path):
    store = f"file://{tmp_path}/rdv"
    envs = [{"SLURM_PROCID": str(rank), "SLURM_NTASKS": "3", "PYCOLLECT_STORE": store}
            for rank in range(3)]
    reports = _launch(tmp_path, envs)
    assert [(r["rank"], r["size"]) for r in reports] == [(0, 3), (1, 3), (2, 3)]
    leftovers = [name for name in os.listdir(tmp_path / "rdv") if name.startswith("k.")]
    assert leftovers == []


def test_an_mpich_style_launch_with_a_tcp_store(tmp_path):
    store = f"tcp://127.0.0.1:{_free_port()}"
    envs = [{"PMI_RANK": str(rank), "PMI_SIZE": "2", "PYCOLLECT_STORE": store}
            for rank in range(2)]
    reports = _launch(tmp_path, envs)
    assert [(r["rank"], r["size"]) for r in reports] == [(0, 2), (1, 2)]


def test_an_incomplete_launcher_is_ignored_when_rank_and_size_are_given(env):
    env(RANK="0")
    assert rendezvous._job(0, 1, None) == (0, 1, "hash://pycollect-single-%d" % os.getpid())
    with pytest.raises(pc.InvalidArgument, match="WORLD_SIZE"):
        rendezvous._job(0, None, None)
