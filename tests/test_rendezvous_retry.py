"""Retrying ``init`` until a late peer is up: a failed init gives its context number back."""

import os
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.timeout(60)

# Rank 0 retries init on Timeout, as a job script does until its peers are up; rank 1 is a
# fresh process that starts after rank 0's first init failed, during its second.  Both must
# meet in the same context and run a collective.
WORKER = r"""
import sys, time
import pycollect as pc
rank, url, late_s = int(sys.argv[1]), sys.argv[2], float(sys.argv[3])
tries, timeout = (3, 4.0) if rank == 0 else (1, 6.0)
time.sleep(late_s if rank == 1 else 0)
for attempt in range(tries):
    try:
        ctx = pc.init(rank=rank, size=2, store=url, timeout=timeout)
    except pc.Timeout as err:
        print(f"rank {rank}: attempt {attempt} timed out: {err}", flush=True)
        continue
    total = ctx.allreduce_object(rank + 1)
    ctx.barrier()
    ctx.close()
    print(f"rank {rank}: met on attempt {attempt}, total {total}", flush=True)
    break
else:
    sys.exit(f"rank {rank}: never met its peer")
"""


def test_a_retried_init_meets_a_peer_that_starts_late(tmp_path):
    late_s = 4.8
    url = f"file://{tmp_path}/store"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
         os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(rank), url, str(late_s)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              stdin=subprocess.DEVNULL, text=True) for rank in (0, 1)]
    outputs = []
    deadline = time.monotonic() + 40
    for proc in procs:
        try:
            outputs.append(proc.communicate(timeout=max(deadline - time.monotonic(), 1))[0])
        except subprocess.TimeoutExpired:
            for other in procs:
                other.kill()
            pytest.fail("the ranks hung: " + " / ".join(outputs))
    report = "\n".join(outputs)
    for rank, (proc, out) in enumerate(zip(procs, outputs)):
        assert proc.returncode == 0, report
        assert f"rank {rank}: met on attempt" in out and "total 3" in out, report
    assert "rank 0: met on attempt 1" in outputs[0], report
