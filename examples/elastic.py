"""Elastic data-parallel training: lose a rank, shrink, re-shard, finish.

    python examples/elastic.py [--ranks 4] [--steps 40] [--seed N]

Four processes train a linear model with full-batch gradient descent on the same
synthetic data set, each on its shard of the rows; an allreduce sums the gradients.
At a random step one random rank is killed (SIGKILL).  The survivors catch the
PeerError, agree that the step did not complete, shrink the context to the
three of them, re-shard the rows over three ranks, redo the step and finish.
Then a clean three-rank run starts from that step's model and the two final
models are compared: they must be identical, bit for bit (both runs sum with one
algorithm: see ``step``).
"""

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile

import numpy as np

import pycollect as pc

ROWS, FEATURES, LR = 1200, 8, 0.05


def data():
    """The data set every rank builds for itself (the same seed everywhere)."""
    rng = np.random.default_rng(1234)
    x = rng.standard_normal((ROWS, FEATURES))
    y = x @ np.arange(1.0, FEATURES + 1) + 0.1 * rng.standard_normal(ROWS)
    return x, y


def shard(x, y, rank, size):
    rows = np.array_split(np.arange(ROWS), size)[rank]
    return x[rows], y[rows]


def step(ctx, w, xs, ys):
    """One gradient step: the gradient of the squared error, summed over every rank's rows.

    The sum names its algorithm: floating-point addition depends on its order, and the
    order is the algorithm's.  ``auto`` picks by the group's shape, which differs here (a
    fresh job on one host reduces through its shared-memory flags, the context that
    ``shrink`` returns has none), so with ``auto`` the two runs could end a few ulps apart."""
    grad = 2.0 * xs.T @ (xs @ w - ys)
    ctx.allreduce(grad, algorithm="recursive_doubling")
    return w - LR * grad / ROWS


def train(ctx, w, first, steps, victim, kill_step):
    """Steps first..steps-1; returns the final model and (the step redone, its model) after a
    loss, or None."""
    x, y = data()
    xs, ys = shard(x, y, ctx.rank, ctx.size)
    me = ctx.rank               # the rank at launch (the victim is named by it)
    recovered = None
    s = first
    while s < steps:
        if s == kill_step and me == victim:
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            w = step(ctx, w, xs, ys)
            done = True
        except pc.PeerError as exc:
            print("rank %d: step %d failed: %s" % (ctx.rank, s, exc), file=sys.stderr)
            done = False
        if not done:
            if ctx.agree(False):                # no rank committed the step
                raise SystemExit("a survivor completed a step that failed elsewhere")
            old = ctx.rank
            ctx = ctx.shrink()
            print("rank %d is now rank %d of %d; redoing step %d"
                  % (old, ctx.rank, ctx.size, s), file=sys.stderr)
            xs, ys = shard(x, y, ctx.rank, ctx.size)    # the rows of the lost rank too
            recovered = (s, w.copy())
            continue                            # w is the model from before step s
        s += 1
    return ctx, w, recovered


def worker(args):
    ctx = pc.init(rank=args.rank, size=args.ranks, store=args.store, timeout=30)
    w = np.zeros(FEATURES) if args.start is None else np.array(json.loads(args.start))
    first = 0 if args.first is None else args.first
    ctx, w, recovered = train(ctx, w, first, args.steps, args.victim, args.kill_step)
    if ctx.rank == 0:
        print(json.dumps({"size": ctx.size, "w": w.tolist(),
                          "recovered": None if recovered is None else
                          [recovered[0], recovered[1].tolist()]}))
    ctx.close()


def launch(ranks, steps, victim, kill_step, start=None, first=None):
    """Run ``ranks`` worker processes; the final rank 0's JSON line."""
    with tempfile.TemporaryDirectory() as tmp:
        store = "file://%s" % tmp
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--ranks", str(ranks),
               "--steps", str(steps), "--store", store, "--victim", str(victim),
               "--kill-step", str(kill_step)]
        if start is not None:
            cmd += ["--start", json.dumps(start), "--first", str(first)]
        procs = [subprocess.Popen(cmd + ["--rank", str(r)], stdout=subprocess.PIPE, text=True)
                 for r in range(ranks)]
        try:
            outs = [p.communicate(timeout=120)[0] for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    lines = [o.strip().splitlines()[-1] for o in outs if o and o.strip()]
    if not lines:
        sys.exit("no rank finished")
    return json.loads(lines[0])         # the new rank 0's


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--store", help=argparse.SUPPRESS)
    ap.add_argument("--victim", type=int, default=-1, help=argparse.SUPPRESS)
    ap.add_argument("--kill-step", type=int, default=-1, help=argparse.SUPPRESS)
    ap.add_argument("--start", help=argparse.SUPPRESS)
    ap.add_argument("--first", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    rng = random.Random(args.seed)
    victim, kill_step = rng.randrange(args.ranks), rng.randrange(1, args.steps)
    print("%d ranks, %d steps; rank %d is killed at step %d"
          % (args.ranks, args.steps, victim, kill_step))
    elastic = launch(args.ranks, args.steps, victim, kill_step)
    if elastic["recovered"] is None:
        sys.exit("no rank was lost")
    s, w_at = elastic["recovered"]
    print("the survivors went on at size %d from step %d" % (elastic["size"], s))
    clean = launch(args.ranks - 1, args.steps, -1, -1, start=w_at, first=s)
    same = np.array_equal(np.array(elastic["w"]), np.array(clean["w"]))
    print("final model after the loss: %s" % np.round(elastic["w"], 4).tolist())
    print("clean %d-rank run from step %d: %s" % (args.ranks - 1, s,
                                                   "identical" if same else "DIFFERENT"))
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    main()
