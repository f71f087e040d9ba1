"""The torch backend after a failure: ProcessGroup.abort() and shutdown() end blocked work at
once, and pycollect.torch.shrink_group goes on without a lost rank (torch's own
dist.shrink_group cannot reach a Python backend: docs/torch.md)."""

import os
import subprocess
import sys

import pytest

pytest.importorskip("torch.distributed")

from jobs import last_json  # noqa: E402

WORKER = """
import datetime, json, os, signal, sys, threading, time
import torch, torch.distributed as dist
import pycollect.torch as pctorch
rank, size, init, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
dist.init_process_group("pycollect", init_method=init, rank=rank, world_size=size,
                        timeout=datetime.timedelta(seconds=60))
pg = dist.group.WORLD
t = torch.ones(4)
dist.all_reduce(t)
out = {}
if mode in ("abort", "shutdown"):
    if rank == 1:
        time.sleep(8)               # never joins the next all_reduce in time
        sys.exit(0)
    threading.Timer(0.5, getattr(pg, mode)).start()
    start = time.monotonic()
    try:
        dist.all_reduce(t)
        out["error"] = None
    except Exception as exc:
        out["error"] = type(exc).__name__ + ": " + str(exc)
    out["seconds"] = time.monotonic() - start
else:                               # shrink
    if rank == size - 1:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        dist.all_reduce(t)
    except Exception as exc:
        out["error"] = type(exc).__name__
    try:
        dist.shrink_group([size - 1])
        out["torch_shrink"] = "worked"
    except (TypeError, RuntimeError) as exc:
        out["torch_shrink"] = type(exc).__name__
    new = pctorch.shrink_group([size - 1])
    x = torch.full((4,), float(rank + 1))
    new.allreduce([x]).wait()
    out.update(size=new.size(), rank=new.rank(), sum=x.tolist())
    new.shutdown()
print(json.dumps(out), flush=True)
"""


def _run(tmp_path, size, mode, survivors):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    init = "file://%s" % (tmp_path / "init")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, str(script), str(r), str(size), init, mode],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env) for r in range(size)]
    return last_json(procs, survivors, 120)


@pytest.mark.parametrize("mode", ["abort", "shutdown"])
def test_abort_and_shutdown_end_blocked_work_at_once(tmp_path, mode):
    (result,) = _run(tmp_path, 2, mode, [0])
    assert result["error"] and "Aborted" in result["error"], result
    assert result["seconds"] < 10, result       # the group's timeout is 60 s


def test_shrink_group_after_a_rank_dies(tmp_path):
    results = _run(tmp_path, 3, "shrink", [0, 1])
    for r, res in enumerate(results):
        assert res["torch_shrink"] in ("TypeError", "RuntimeError"), res
        assert (res["size"], res["rank"]) == (2, r), res
        assert res["sum"] == [3.0] * 4, res
