"""A rank that fails in the middle of a message: what it does with the rest.

A failing rank finishes the messages it was part-way through writing before its abort
frame, so the connection ends at a message boundary and survives into ``shrink``
(docs/errors.md).  Two ends of that rule, each with real processes:

- the peer of the half-written message is dead: there is nobody to finish it for, so the
  failing rank raises at once instead of trying for FINISH_MS (1 s);
- the peer is alive but reads late (it is busy outside pycollect for longer than
  FINISH_MS): ``recover()`` writes the rest, copied when the operation failed, before its
  reset frame, so both ranks stay in the shrunk group.
"""

import json
import os
import subprocess
import sys

import pytest

from jobs import last_json

BIG = 1 << 23       # float64 elements: 64 MiB, many times what the sockets buffer

_HEAD = r"""
import json, os, signal, sys, threading, time
import numpy as np
import pycollect as pc
rank, store, size, mark = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4]
BIG = %d
ctx = pc.init(rank=rank, size=size, store=store, timeout=30)


def die_soon():
    def die():
        with open(mark, "w") as f:
            f.write(repr(time.monotonic()))
        os.kill(os.getpid(), signal.SIGKILL)
    threading.Timer(0.5, die).start()
    time.sleep(60)
""" % BIG

# Rank 0 sends BIG elements to rank 1 in an alltoallv; rank 1 never reads them and dies.
_DEAD_PEER = _HEAD + r"""
ctx.barrier()
if rank == 1:
    die_soon()
send = np.ones(1 + BIG, np.float64)
recv = np.zeros(2, np.float64)
try:
    ctx.alltoallv(send, [1, BIG], recv, [1, 1])
    raise SystemExit("no failure")
except pc.PeerError as exc:
    failed = time.monotonic()
    with open(mark) as f:
        killed = float(f.read())
    print(json.dumps({"after_kill": failed - killed, "message": str(exc)}))
"""

# Rank 0 sends BIG elements to rank 1, which reads them only 2.5 s later; rank 2 dies
# after 0.5 s, so rank 0 fails with the message to rank 1 half written.
_LATE_READER = _HEAD + r"""
ctx.barrier()
if rank == 2:
    die_soon()
if rank == 0:
    send, scounts = np.arange(2 + BIG, dtype=np.float64), [1, BIG, 1]
    recv, rcounts = np.zeros(3, np.float64), [1, 1, 1]
else:
    time.sleep(2.5)
    send, scounts = np.zeros(3, np.float64), [1, 1, 1]
    recv, rcounts = np.zeros(BIG + 2, np.float64), [BIG, 1, 1]
began = time.monotonic()
try:
    ctx.alltoallv(send, scounts, recv, rcounts)
    raise SystemExit("no failure")
except pc.PeerError as exc:
    error, failed = str(exc), time.monotonic()
new = ctx.shrink(timeout=15)
total = new.allreduce(np.full(4, rank + 1.0))
print(json.dumps({"rank": new.rank, "size": new.size, "began": began, "failed": failed,
                  "sum": float(total[0]), "error": error}))
new.close()
ctx.close()
"""


def _ranks(tmp_path, text, size, env):
    script = tmp_path / "ranks.py"
    script.write_text(text)
    store = "file://%s" % (tmp_path / "store")
    mark = str(tmp_path / "killed")
    return [subprocess.Popen([sys.executable, str(script), str(r), store, str(size), mark],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=dict(os.environ, **env))
            for r in range(size)]


# Over shared memory, with cross-memory attach off, the message goes through the ring
# (a message sent by address is not finished: the peer copies it from our memory).
TRANSPORTS = [pytest.param({"PYCOLLECT_TRANSPORT": "tcp"}, id="tcp"),
              pytest.param({"PYCOLLECT_TRANSPORT": "shm", "PYCOLLECT_CMA": "0"}, id="shm-ring")]


@pytest.mark.parametrize("env", TRANSPORTS)
def test_a_half_written_message_to_a_dead_peer_is_given_up_at_once(tmp_path, env):
    [result] = last_json(_ranks(tmp_path, _DEAD_PEER, 2, env), [0], 60)
    assert "alltoallv(float64, pairwise) #2 failed: rank 1" in result["message"], result
    # Trying to finish it for FINISH_MS (1 s) would show here.
    assert 0 <= result["after_kill"] < 0.9, result


@pytest.mark.parametrize("env", TRANSPORTS)
def test_a_peer_that_reads_late_gets_the_rest_and_both_go_on(tmp_path, env):
    results = last_json(_ranks(tmp_path, _LATE_READER, 3, env), [0, 1], 90)
    assert [(r["rank"], r["size"], r["sum"]) for r in results] == [(0, 2, 3.0), (1, 2, 3.0)], \
        results
    first, late = results
    # Rank 1 came to read after rank 0 had stopped waiting for it (FINISH_MS, 1 s) and
    # raised: the rest of the message went out from recover().
    assert late["began"] > first["failed"], results
