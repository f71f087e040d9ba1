"""One rank of a shrink fault test (tests/test_shrink.py): argv rank, size, store URL,
collective ("allreduce", "broadcast", "alltoall", "alltoall-large"), mode ("kill", "stop",
"second"), trace directory.

Every rank runs ``collective`` over 64 Ki floats in a loop ("alltoall-large": blocks of
16 MiB); the last rank dies (SIGKILL from a timer, mid-collective; for "alltoall-large",
10 ms into its second call) or stops (SIGSTOP).  The survivors catch the error, shrink,
and print one JSON line: the error, the new size and rank, and the collective's result at
the new size checked against NumPy.  Mode "second": rank size-2 also dies, once it has
caught the first error, while the others shrink.
"""

import json
import os
import signal
import sys
import threading
import time

import numpy as np

import pycollect as pc

rank, size, store, collective, mode = (int(sys.argv[1]), int(sys.argv[2]), sys.argv[3],
                                       sys.argv[4], sys.argv[5])
N = 1 << 16
LARGE = 1 << 21     # "alltoall-large": 16 MiB blocks, many times a socket's buffers
ctx = pc.init(rank=rank, size=size, store=store, timeout=3 if mode == "stop" else 20)


def run(c, step):
    """The collective on context ``c``; returns (result, expected)."""
    n, me = c.size, c.rank
    if collective == "allreduce":
        x = np.full(N, me + step, np.float64)
        return c.allreduce(x), np.full(N, sum(r + step for r in range(n)), np.float64)
    if collective == "broadcast":
        x = np.full(N, me + step, np.float64)
        return c.broadcast(x, root=0), np.full(N, step, np.float64)
    block = 64 if collective == "alltoall" else LARGE
    x = np.arange(n * block, dtype=np.float64) + 1000 * me + step
    expected = np.concatenate([np.arange(me * block, (me + 1) * block) + 1000 * r + step
                               for r in range(n)])
    return c.alltoall(x), expected


victim = rank == size - 1
if victim and mode in ("kill", "second") and collective != "alltoall-large":
    threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGKILL)).start()
t_fail = None
try:
    for step in range(1000000):
        if victim and mode == "stop" and step == 20:
            os.kill(os.getpid(), signal.SIGSTOP)
        if victim and collective == "alltoall-large" and step == 1:
            # Die while the blocks are on the wire: the survivors are in the middle of
            # messages to each other when they fail.
            threading.Timer(0.01, os.kill, (os.getpid(), signal.SIGKILL)).start()
        got, want = run(ctx, step)
        assert np.array_equal(got, want)
        time.sleep(0.001)
    raise SystemExit("no failure")
except pc.Error as exc:
    error = type(exc).__name__
    t_fail = time.monotonic()
if mode == "second" and rank == size - 2:
    time.sleep(0.05)
    os.kill(os.getpid(), signal.SIGKILL)
attempts = 0
while True:
    attempts += 1
    try:
        new = ctx.shrink(timeout=2)
        break
    except pc.PeerError as exc:
        print("rank %d: shrink attempt %d: %s" % (rank, attempts, exc), file=sys.stderr)
        if attempts == 3:
            raise
t_new = time.monotonic()
got, want = run(new, 7)
algorithm = None
if collective == "allreduce":
    # The algorithm that ran, as its handle reports it (not what a plan would pick now).
    work = new.allreduce(np.full(N, new.rank + 8, np.float64), async_op=True)
    summed = np.array_equal(work.wait(), np.full(N, sum(r + 8 for r in range(new.size)),
                                                  np.float64))
    algorithm = work.algorithm if summed else "a wrong sum"
print(json.dumps({"error": error, "size": new.size, "rank": new.rank, "attempts": attempts,
                  "algorithm": algorithm,
                  "correct": bool(np.array_equal(got, want)), "old_failed": ctx.failed is not None,
                  "agree": new.agree(new.rank != 0), "shrink_s": t_new - t_fail}))
new.close()
ctx.close()
