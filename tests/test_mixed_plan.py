"""A seeded plan that every rank walks in step, in real processes: collectives and four MPI
shapes of point-to-point exchange, blocking and async, from one float to 1 MiB, over shared
memory and TCP.  Every result is checked; a call that waits for a peer that never comes ends
at the 30 s deadline as an error, never as a hang."""

import pytest

from jobs import last_json, run_script

_PLAN = r"""
import json, sys, time
import numpy as np
import pycollect as pc
rank, store = int(sys.argv[1]), sys.argv[2]
size, transport, seed, steps = SIZE, TRANSPORT, SEED, STEPS
ctx = pc.init(rank=rank, size=size, store=store, transport=transport, timeout=30)
r, P = ctx.rank, ctx.size
plan = np.random.default_rng(seed)
counts = [1, 7, 64, 1000, 16384, 65536, 262144]
ran = {}
pending = []        # (handle, check) of async collectives not waited for yet


def settle():
    for work, check in pending:
        work.wait(30)
        check()
    pending.clear()


def run(kind, call, check, async_op):
    ran[kind] = ran.get(kind, 0) + 1
    if async_op:
        pending.append((call(True), check))
    else:
        call(False)
        check()


for step in range(steps):
    kind = int(plan.integers(0, 9))
    n = int(plan.choice(counts))
    async_op = bool(plan.random() < 0.5)
    tag = step % 100
    if kind == 0:
        a = np.full(n, r + 1, np.float32)
        def check(a=a, step=step):
            assert np.all(a == P * (P + 1) / 2), ("allreduce", step)
        run("allreduce", lambda x, a=a: ctx.allreduce(a, async_op=x), check, async_op)
    elif kind == 1:
        root = int(plan.integers(0, P))
        a = np.full(n, r, np.float32)
        def check(a=a, root=root, step=step):
            assert np.all(a == root), ("broadcast", step)
        run("broadcast", lambda x, a=a, root=root: ctx.broadcast(a, root, async_op=x),
            check, async_op)
    elif kind == 2:
        run("barrier", lambda x: ctx.barrier(async_op=x), lambda: None, async_op)
    elif kind == 3:
        settle()
        out = np.full(n, r, np.float32)
        got = np.zeros(n * P, np.float32)
        ran["allgather"] = ran.get("allgather", 0) + 1
        ctx.allgather(out, got)
        assert np.all(got.reshape(P, n) == np.arange(P, dtype=np.float32)[:, None]), step
    else:
        # Around the ring: send to r + 1, receive from r - 1, in one of five shapes.
        shape = ("irecv+send+wait", "isend+irecv+wait_all", "sendrecv",
                 "irecv+isend+poll", "send+recv")[kind - 4]
        if plan.random() < 0.5:
            settle()        # else the exchange meets async collectives still queued
            ctx.barrier()   # ... and here the ranks begin it in step, as after a collective
        dst, src = (r + 1) % P, (r - 1) % P
        out = np.full(n, r * 1000 + step, np.float32)
        got = np.zeros(n, np.float32)
        ran[shape] = ran.get(shape, 0) + 1
        if shape == "irecv+send+wait":
            w = ctx.recv(got, src, tag=tag, async_op=True)
            ctx.send(out, dst, tag=tag)
            w.wait(30)
        elif shape == "isend+irecv+wait_all":
            pc.wait_all([ctx.send(out, dst, tag=tag, async_op=True),
                         ctx.recv(got, src, tag=tag, async_op=True)], timeout=30)
        elif shape == "sendrecv":
            ctx.sendrecv(out, dst, got, src, tag, tag)
        elif shape == "irecv+isend+poll":
            w = ctx.recv(got, src, tag=tag, async_op=True)
            if plan.random() < 0.3:
                time.sleep(0.002)       # the runner may take the receive up meanwhile
            s = ctx.send(out, dst, tag=tag, async_op=True)
            end = time.monotonic() + 30
            while not w.is_completed() and time.monotonic() < end:
                pass
            w.wait(0)
            s.wait(30)
        elif r % 2 == 0:        # send+recv: even ranks send first, odd ones receive first
            ctx.send(out, dst, tag=tag)
            ctx.recv(got, src, tag=tag)
        else:
            ctx.recv(got, src, tag=tag)
            ctx.send(out, dst, tag=tag)
        assert np.all(got == src * 1000 + step), (shape, step, n)
    if len(pending) > 6:
        settle()
settle()
ctx.barrier()
ctx.close()
print(json.dumps(ran))
"""


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_seeded_plan_of_collectives_and_exchanges_in_step(tmp_path, transport, size):
    steps = 400
    script = (_PLAN.replace("SIZE", str(size)).replace("TRANSPORT", repr(transport))
              .replace("SEED", str(size * 10 + len(transport))).replace("STEPS", str(steps)))
    procs = run_script(tmp_path, script, size=size)
    results = last_json(procs, range(size), timeout=240)
    # Every rank ran the same plan, every kind of step came up, none was left out.
    assert all(res == results[0] for res in results), results
    assert sum(results[0].values()) == steps, results[0]
    assert len(results[0]) == 9, results[0]
