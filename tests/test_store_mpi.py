"""The MPI rendezvous (``mpi://``) under a real ``mpirun``; MPI only ever runs in child processes.

MPI is initialised in no pytest process of the main run: a process that has
called MPI_Init should not fork, and the rest of the suite forks.  The
conformance suite (``mpi_store_suite.py``, which the test command does not
collect by itself) therefore runs in a child pytest under ``mpirun -n 1``.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

import pytest

import pycollect as pc

pytestmark = pytest.mark.timeout(60)

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
WORKER = os.path.join(HERE, "rendezvous_worker.py")
EXAMPLE = os.path.join(ROOT, "examples", "allreduce.py")
CHILD_SUITE = os.path.join(HERE, "mpi_store_suite.py")
MPIRUN_TIMEOUT_S = 45


def _mpi4py_installed():
    import importlib.util
    return importlib.util.find_spec("mpi4py") is not None


needs_mpirun = pytest.mark.skipif(
    shutil.which("mpirun") is None or not _mpi4py_installed(),
    reason="needs mpirun and mpi4py (apt-get install openmpi-bin libopenmpi-dev; "
           "pip install 'pycollect[mpi]')")


def _mpirun(ranks, *command, env=None, timeout=MPIRUN_TIMEOUT_S):
    """Run ``command`` as ``ranks`` MPI processes; return the CompletedProcess."""
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith(("PYCOLLECT_", "OMPI_", "PMI_", "PMIX_"))}
    # Open MPI keeps its session directory under TMPDIR: one of our own keeps
    # concurrent or stale runs elsewhere on the machine out of the way.
    session_dir = tempfile.mkdtemp(prefix="pycollect-mpirun-")
    clean.update({"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
                  "TMPDIR": session_dir,
                  # Containers often forbid the cross-memory attach Open MPI tries first.
                  "OMPI_MCA_btl_vader_single_copy_mechanism": "none",
                  "PYTHONPATH": os.pathsep.join([HERE, ROOT])})
    clean.update(env or {})
    try:
        return subprocess.run(["mpirun", "-n", str(ranks), "--oversubscribe", *command],
                              env=clean, stdin=subprocess.DEVNULL, capture_output=True,
                              timeout=timeout, text=True)
    finally:
        shutil.rmtree(session_dir, ignore_errors=True)


@needs_mpirun
def test_mpirun_runs_the_example_with_a_bare_init():
    done = _mpirun(3, sys.executable, EXAMPLE)
    assert done.returncode == 0, done.stdout + done.stderr
    for rank in range(3):
        assert f"rank {rank}/3: allreduce of 1048576 float32 = 6 everywhere" in done.stdout


@needs_mpirun
def test_mpirun_rendezvous_uses_mpi_and_logs_its_choice():
    done = _mpirun(3, sys.executable, WORKER, env={"PYCOLLECT_DEBUG": "1"})
    assert done.returncode == 0, done.stdout + done.stderr
    # mpirun forwards each rank's output on its own schedule: two ranks' lines
    # can reach us glued together, so pick the JSON objects out one by one.
    reports = sorted((json.loads(obj) for obj in re.findall(r"\{[^{}\n]*\}", done.stdout)),
                     key=lambda r: r["rank"])
    assert [(r["rank"], r["size"]) for r in reports] == [(0, 3), (1, 3), (2, 3)]
    assert "store mpi:// from Open MPI" in done.stderr
    assert done.stderr.count("through mpi://(rank 0 at 127.0.0.1:") == 3


@needs_mpirun
def test_a_rank_that_never_joins_ends_in_a_timeout_not_a_hang():
    script = ("import sys, time, pycollect as pc\n"
              "from mpi4py import MPI\n"
              "if MPI.COMM_WORLD.Get_rank() == 1:\n"
              "    time.sleep(2); sys.exit(0)\n"
              "try:\n"
              "    pc.init(timeout=1)\n"
              "except pc.Timeout as exc:\n"
              "    print('TIMEOUT', exc); sys.exit(0)\n"
              "sys.exit('rank 0 joined without rank 1')\n")
    done = _mpirun(2, sys.executable, "-c", script)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "TIMEOUT rank 0: the MPI store's allgather of host identities did not complete " \
           "within 1 s" in done.stdout


@needs_mpirun
def test_conformance_suite_in_an_mpi_process():
    done = _mpirun(1, sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                   "--durations=3", CHILD_SUITE)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert " passed" in done.stdout and "skipped" not in done.stdout


def test_missing_mpi4py_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "mpi4py", None)
    with pytest.raises(pc.PluginError, match=r"pip install 'pycollect\[mpi\]'"):
        pc.plugins.open_store("mpi://")


def test_mpi_urls_take_no_host_or_path():
    with pytest.raises(pc.InvalidArgument, match="mpi://"):
        pc.plugins.open_store("mpi://somehost/path")
