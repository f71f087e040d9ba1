"""torch's own distributed tests (the CPU collective ones) pass on the "pycollect" backend.

tests/torch_suite.py runs DistributedTest._DistTestBase from the torch wheel;
here its --ci selection (24 tests, one or two per collective family, all run on
CPU) at world size 2, bounded in time.  The wider selections and their counts:
docs/torch.md.
"""

import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("expecttest")      # the suite imports it

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SUITE_TIMEOUT = 180     # seconds: about 30 s on 2 busy cores


def test_torch_suite_collectives_pass():
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, "torch_suite.py"), "--ci",
         "--test-timeout", "60", "--budget", str(SUITE_TIMEOUT - 60)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        timeout=SUITE_TIMEOUT)
    lines = proc.stdout.splitlines()
    outcome_lines = [ln for ln in lines if re.match(r"(PASS|FAIL|SKIP|ERROR|XFAIL|XPASS) ", ln)]
    bad = [ln for ln in outcome_lines if ln.startswith(("FAIL", "ERROR", "XPASS"))]
    summary = next((ln for ln in reversed(lines) if "tests selected" in ln), "")
    assert proc.returncode == 0 and not bad, (summary, bad, "\n".join(lines[-40:]))
    passed = sum(ln.startswith("PASS") for ln in outcome_lines)
    assert passed == 24 and len(outcome_lines) == 24, (summary, outcome_lines)
