"""One rank of a torch.distributed job, launched the way torchrun launches it.

    MASTER_ADDR=127.0.0.1 WORKER_PORTS=P1,P2 RANK=r WORLD_SIZE=n \
        python tests/torch_worker.py OUTDIR gloo pycollect

For each backend in turn (one process, so torch is imported once), it sets
MASTER_PORT to the next port and calls a bare ``dist.init_process_group(BACKEND)``
(env:// rendezvous, as under torchrun), runs
every ``dist.*`` collective on fixed inputs, a few DDP steps and, under
"pycollect", the async checks, and saves ``{check name: result}`` with
``torch.save`` to OUTDIR/BACKEND-rank<r>.pt.  tests/test_torch_backend.py
compares the gloo and pycollect files.  A call that raises is recorded as
``("error", exception class name)``.
"""

import os
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import pycollect
import pycollect.torch  # noqa: F401  (registers "pycollect")

R = dist.ReduceOp
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
          torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128]
OPS = [("SUM", R.SUM), ("PRODUCT", R.PRODUCT), ("MIN", R.MIN), ("MAX", R.MAX),
       ("BAND", R.BAND), ("BOR", R.BOR), ("BXOR", R.BXOR), ("AVG", R.AVG),
       ("PREMUL_SUM", None)]
PREMUL_FACTOR = 2.0


def data(r, n, dtype):
    """Rank r's input of n elements: small values, every sum and product exact in ``dtype``."""
    i = torch.arange(n)
    if dtype == torch.bool:
        return (i + r) % 3 != 0
    base = (i % 3 + 1 + r).to(torch.float64)
    if dtype.is_complex:
        return torch.complex(base, (i % 2).to(torch.float64)).to(dtype)
    return base.to(dtype)


class Checks:
    def __init__(self, backend, rank, size):
        self.backend, self.rank, self.size = backend, rank, size
        self.results = {}

    def record(self, name, fn):
        try:
            value = fn()
        except Exception as err:    # recorded; the test compares the outcome with gloo's
            value = ("error", type(err).__name__)
        assert name not in self.results, name
        self.results[name] = value

    # -- collectives ------------------------------------------------------

    def all_reduce(self):
        n = 7
        for dt in DTYPES:
            for opname, op in OPS:
                if op is None:
                    op = torch._C._distributed_c10d._make_nccl_premul_sum(PREMUL_FACTOR)

                def run(dt=dt, op=op):
                    t = data(self.rank, n, dt)
                    dist.all_reduce(t, op=op)
                    return t
                self.record("all_reduce %s %s" % (opname, dt), run)

        def strided():
            # gloo gives wrong values for a strided tensor, so it reduces a
            # contiguous copy: the results must still be equal.
            full = data(self.rank, 2 * n, torch.float32)
            if self.backend == "gloo":
                part = full[::2].contiguous()
                dist.all_reduce(part)
                full[::2] = part
            else:
                dist.all_reduce(full[::2])
            return full
        self.record("all_reduce strided", strided)

        def transposed():
            m = data(self.rank, 12, torch.float64).reshape(3, 4).t()
            if self.backend == "gloo":
                m = m.contiguous()
            dist.all_reduce(m)
            return m.contiguous()
        self.record("all_reduce transposed", transposed)

        def zero_dim():
            t = torch.tensor(float(self.rank + 1))
            dist.all_reduce(t)
            return t
        self.record("all_reduce 0-dim", zero_dim)

        def empty():
            t = torch.empty(0)
            dist.all_reduce(t)
            return t
        self.record("all_reduce empty", empty)

        def large():
            t = data(self.rank, 300_001, torch.float32)
            dist.all_reduce(t)
            return t
        self.record("all_reduce 300001 float32", large)

        def asynchronous():
            t = data(self.rank, 1000, torch.float64)
            w = dist.all_reduce(t, async_op=True)
            w.wait()
            return [t, w.get_future().wait()[0]]
        self.record("all_reduce async + future", asynchronous)

        def coalesced():
            ts = [data(self.rank, 5, torch.float32), data(self.rank, 3, torch.float32)]
            with dist._coalescing_manager():
                for t in ts:
                    dist.all_reduce(t)
            return ts
        self.record("all_reduce coalescing manager", coalesced)

        def coalesced_gather_scatter():
            size = self.size
            outs = [torch.empty(size * 3), torch.empty(size * 2, dtype=torch.float64)]
            ins = [data(self.rank, 3, torch.float32), data(self.rank, 2, torch.float64)]
            with dist._coalescing_manager():
                for o, i in zip(outs, ins):
                    dist.all_gather_into_tensor(o, i)
            rs = [torch.empty(2), torch.empty(4)]
            with dist._coalescing_manager():
                for o in rs:
                    dist.reduce_scatter_tensor(o, data(self.rank, size * o.numel(),
                                                       torch.float32))
            # the same calls one by one: the coalesced results must equal these
            plain = [torch.empty_like(t) for t in outs + rs]
            for o, i in zip(plain, ins):
                dist.all_gather_into_tensor(o, i)
            for o in plain[2:]:
                dist.reduce_scatter_tensor(o, data(self.rank, size * o.numel(), torch.float32))
            return {"coalesced": outs + rs, "one by one": plain}
        self.record("all_gather_into_tensor, reduce_scatter_tensor coalesced",
                    coalesced_gather_scatter)

    def data_movers(self):
        n, size, rank = 6, self.size, self.rank
        ranks = range(size)
        for dt in (torch.float32, torch.bfloat16, torch.float16, torch.bool, torch.int8,
                   torch.complex64, torch.int64):
            def bcast(dt=dt):
                t = data(rank, n, dt)
                dist.broadcast(t, src=size - 1)
                return t
            self.record("broadcast %s" % dt, bcast)

            def agit(dt=dt):
                out = torch.empty(size * n, dtype=dt)
                dist.all_gather_into_tensor(out, data(rank, n, dt))
                return out
            self.record("all_gather_into_tensor %s" % dt, agit)

            def a2a(dt=dt):
                out = torch.empty(size * 2, dtype=dt)
                dist.all_to_all_single(out, data(rank, size * 2, dt))
                return out
            self.record("all_to_all_single %s" % dt, a2a)

        premul = torch._C._distributed_c10d._make_nccl_premul_sum(PREMUL_FACTOR)
        for root in (0, size - 1):
            for opname, op in (("SUM", R.SUM), ("MAX", R.MAX), ("PRODUCT", R.PRODUCT),
                               ("PREMUL_SUM", premul)):
                def red(root=root, op=op):
                    t = data(rank, n, torch.float32)
                    dist.reduce(t, root, op=op)
                    return t if rank == root else None   # non-roots' buffers: unspecified
                self.record("reduce root %d %s" % (root, opname), red)

        def all_gather():
            outs = [torch.empty(n, dtype=torch.int32) for _ in ranks]
            dist.all_gather(outs, data(rank, n, torch.int32))
            return outs
        self.record("all_gather", all_gather)

        def all_gather_coalesced():
            # dist requires one dtype across the inputs
            inputs = [data(rank, 3, torch.float32), data(rank, 2, torch.float32)]
            outs = [[torch.empty(3), torch.empty(2)] for _ in ranks]
            dist.all_gather_coalesced(outs, inputs)
            return outs
        self.record("all_gather_coalesced", all_gather_coalesced)

        def all_gather_uneven():
            # all_gather with a different size per rank
            outs = [torch.empty(r + 1) for r in ranks]
            dist.all_gather(outs, data(rank, rank + 1, torch.float32))
            return outs
        self.record("all_gather uneven", all_gather_uneven)

        for opname, op in (("SUM", R.SUM), ("MAX", R.MAX), ("AVG", R.AVG),
                           ("PREMUL_SUM", premul)):
            def rst(op=op):
                out = torch.empty(n)
                dist.reduce_scatter_tensor(out, data(rank, size * n, torch.float32), op=op)
                return out
            self.record("reduce_scatter_tensor %s" % opname, rst)

            def rs(op=op):
                out = torch.empty(n, dtype=torch.float64)
                dist.reduce_scatter(out, [data(rank + p, n, torch.float64) for p in ranks],
                                    op=op)
                return out
            self.record("reduce_scatter %s" % opname, rs)

        def a2a_uneven():
            in_splits = [p + 1 for p in ranks]
            out_splits = [rank + 1] * size
            inp = torch.cat([torch.full((p + 1, 2), 10.0 * rank + p) for p in ranks])
            out = torch.empty(sum(out_splits), 2)
            dist.all_to_all_single(out, inp, out_splits, in_splits)
            return out
        self.record("all_to_all_single uneven splits", a2a_uneven)

        def a2a_list():
            outs = [torch.empty(3, dtype=torch.float16) for p in ranks]
            dist.all_to_all(outs, [torch.full((3,), 10.0 * rank + p, dtype=torch.float16)
                                   for p in ranks])
            return outs
        self.record("all_to_all", a2a_list)

        def a2a_list_uneven():
            # gloo refuses blocks of different sizes; pycollect moves them
            outs = [torch.empty(p + 1) for p in ranks]
            dist.all_to_all(outs, [torch.full((rank + 1,), 10.0 * rank + p) for p in ranks])
            return outs
        self.record("all_to_all uneven", a2a_list_uneven)

        for root in (0, size - 1):
            def gather(root=root):
                got = [torch.empty(n) for _ in ranks] if rank == root else None
                dist.gather(data(rank, n, torch.float32), got, dst=root)
                return got
            self.record("gather root %d" % root, gather)

            def scatter(root=root):
                out = torch.empty(4, dtype=torch.int64)
                src = [torch.full((4,), 10 * p + 1) for p in ranks] if rank == root else None
                dist.scatter(out, src, src=root)
                return out
            self.record("scatter root %d" % root, scatter)

        self.record("barrier", lambda: dist.barrier() or "passed")

        def barrier_async():
            w = dist.barrier(async_op=True)
            w.wait()
            return "passed"
        self.record("barrier async", barrier_async)

    def async_variants(self):
        """async_op=True for calls whose results are copied out at completion."""
        n, size, rank = 5, self.size, self.rank
        ranks = range(size)

        def run():
            full = data(rank, 2 * n, torch.float32)
            if self.backend == "gloo":          # see "all_reduce strided"
                part = full[::2].contiguous()
            else:
                part = full[::2]
            works = [dist.all_reduce(part, async_op=True)]
            outs = [torch.empty(n, dtype=torch.int64) for _ in ranks]
            works.append(dist.all_gather(outs, data(rank, n, torch.int64), async_op=True))
            got = [torch.empty(n) for _ in ranks] if rank == 0 else None
            works.append(dist.gather(data(rank, n, torch.float32), got, dst=0, async_op=True))
            sc = torch.empty(3)
            works.append(dist.scatter(sc, [torch.full((3,), 1.0 + p) for p in ranks]
                                      if rank == 0 else None, src=0, async_op=True))
            a2a = [torch.empty(2) for _ in ranks]
            works.append(dist.all_to_all(a2a, [torch.full((2,), 10.0 * rank + p) for p in ranks],
                                         async_op=True))
            rs = torch.empty(n, dtype=torch.float64)
            works.append(dist.reduce_scatter(rs, [data(rank + p, n, torch.float64)
                                                  for p in ranks], async_op=True))
            tr = data(rank, 12, torch.float64).reshape(3, 4).t()
            if self.backend == "gloo":
                tr = tr.contiguous()
            works.append(dist.broadcast(tr, src=size - 1, async_op=True))
            for w in works:
                w.wait()
            if self.backend == "gloo":
                full[::2] = part
            return [full, outs, got, sc, a2a, rs, tr.contiguous()]
        self.record("async collectives copied out at completion", run)

    def point_to_point(self):
        rank, size = self.rank, self.size

        def ring():
            t = data(rank, 5, torch.float32)
            got = torch.empty(5)
            if rank % 2 == 0:
                dist.send(t, (rank + 1) % size)
                dist.recv(got, (rank - 1) % size)
            else:
                dist.recv(got, (rank - 1) % size)
                dist.send(t, (rank + 1) % size)
            return got
        self.record("send/recv ring", ring)

        def iring():
            # every rank sends a large message first: isend must return before
            # its send completes, and the sends and receives progress together
            t = data(rank, 100_000, torch.float32)
            got = torch.empty(100_000)
            ws = [dist.isend(t, (rank + 1) % size), dist.irecv(got, (rank - 1) % size)]
            for w in ws:
                w.wait()
            return got
        self.record("isend/irecv ring", iring)

        def batch():
            t = data(rank, 8, torch.int64)
            got = torch.empty(8, dtype=torch.int64)
            ops = [dist.P2POp(dist.isend, t, (rank + 1) % size),
                   dist.P2POp(dist.irecv, got, (rank - 1) % size)]
            for w in dist.batch_isend_irecv(ops):
                w.wait()
            return got
        self.record("batch_isend_irecv", batch)

        def by_tag():
            # Gloo matches by tag: rank 1 receives the second send first
            if rank == 0:
                ws = [dist.isend(torch.full((3,), 7.0), 1, tag=7),
                      dist.isend(torch.full((4,), 8.0), 1, tag=8)]
            elif rank == 1:
                eight, seven = torch.empty(4), torch.empty(3)
                ws = [dist.irecv(eight, 0, tag=8), dist.irecv(seven, 0, tag=7)]
            else:
                return None
            for w in ws:
                w.wait()
            return (eight, seven) if rank == 1 else None
        self.record("isend/irecv out of tag order", by_tag)

        def anysource():
            if rank == 0:
                seen = []
                for _ in range(size - 1):
                    buf = torch.empty(1)
                    src = dist.recv(buf)
                    seen.append((src, buf.item()))
                return sorted(seen)
            dist.send(torch.tensor([float(rank)]), 0)
            return None
        self.record("recv from any source", anysource)

        def strided_recv():
            got = torch.zeros(10)
            if rank == 0:
                dist.send(torch.arange(5.0) + 1, 1)
            elif rank == 1:
                if self.backend == "gloo":
                    part = torch.empty(5)
                    dist.recv(part, 0)
                    got[::2] = part
                else:
                    dist.recv(got[::2], 0)
            return got
        self.record("recv into strided tensor", strided_recv)

    def objects(self):
        rank, size = self.rank, self.size

        def agobj():
            objs = [None] * size
            dist.all_gather_object(objs, {"rank": rank, "text": "x" * rank})
            return objs
        self.record("all_gather_object", agobj)

        def bobj():
            objs = [{"a": rank}, [rank] * 3] if rank == 1 else [None, None]
            dist.broadcast_object_list(objs, src=1)
            return objs
        self.record("broadcast_object_list", bobj)

        def gobj():
            out = [None] * size if rank == 0 else None
            dist.gather_object(("r", rank), out, dst=0)
            return out
        self.record("gather_object", gobj)

        def sobj():
            out = [None]
            dist.scatter_object_list(out, [{"to": p} for p in range(size)] if rank == 0
                                     else None, src=0)
            return out
        self.record("scatter_object_list", sobj)

    def groups(self):
        rank = self.rank
        g = dist.new_group([0, 1])

        def sub():
            if rank >= 2:
                return None
            t = data(rank, 4, torch.float32)
            dist.all_reduce(t, group=g)
            objs = [None, None]
            dist.all_gather_object(objs, rank, group=g)
            return [t, objs]
        self.record("new_group([0, 1])", sub)
        dist.barrier()
        if self.backend == "gloo":
            # a pycollect group inside a job whose default group is another backend's
            pg = dist.new_group(backend="pycollect")
            t = data(rank, 5, torch.float64)
            dist.all_reduce(t, group=pg)
            w = dist.all_reduce(t, group=pg, async_op=True)
            w.wait()
            self.results["pycollect group in a gloo job"] = [dist.get_backend(pg), t]
            dist.destroy_process_group(pg)

    def ddp(self, hook=None):
        from torch.nn.parallel import DistributedDataParallel as DDP
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(),
                                    torch.nn.Linear(32, 3))
        # a small bucket cap: several bucket all-reduces per step
        ddp_model = DDP(model, bucket_cap_mb=0.0005)
        if hook is not None:
            # a Python communication hook: dist.all_reduce(async_op=True).get_future().then()
            ddp_model.register_comm_hook(None, hook)
        opt = torch.optim.SGD(ddp_model.parameters(), lr=0.1)
        gen = torch.Generator().manual_seed(100 + self.rank)   # different data per rank
        for _ in range(4):
            x = torch.randn(16, 8, generator=gen)
            y = torch.randn(16, 3, generator=gen)
            opt.zero_grad()
            torch.nn.functional.mse_loss(ddp_model(x), y).backward()
            opt.step()
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        everyone = [torch.empty_like(flat) for _ in range(self.size)]
        dist.all_gather(everyone, flat)
        suffix = "" if hook is None else " with %s" % hook.__name__
        self.results["ddp parameters" + suffix] = flat
        self.results["ddp parameters of every rank" + suffix] = everyone

    # -- pycollect only ---------------------------------------------------

    def overlap(self):
        """An async all_reduce is pending when the call returns; Python runs meanwhile."""
        rank = self.rank
        n = 4 << 20
        t = torch.ones(n)
        if rank != 0:
            time.sleep(0.3)       # rank 0's operation cannot complete before this
        dist.barrier()            # ... nor before rank 0 has seen it pending, below
        if rank != 0:
            time.sleep(0.3)
        counter = [0]
        w = dist.all_reduce(t, async_op=True)
        pending_at_return = not w.is_completed()

        def spin():
            while not w.is_completed():
                counter[0] += 1
        th = threading.Thread(target=spin)
        th.start()
        main_steps = 0
        while not w.is_completed():
            main_steps += 1
            time.sleep(0.001)
        w.wait()
        th.join(10)
        fut_value = w.get_future().wait()[0]
        self.results["overlap"] = {
            "pending at return": pending_at_return,
            "thread steps": counter[0], "main steps": main_steps,
            "correct": bool(torch.equal(t, torch.full((n,), float(self.size)))),
            "future holds the tensor": fut_value is t or torch.equal(fut_value, t)}

    def wait_timeout(self):
        rank = self.rank
        t = torch.ones(3)
        if rank != 0:
            time.sleep(0.5)
        w = dist.all_reduce(t, async_op=True)
        outcome = None
        if rank == 0:
            try:
                w.wait(timedelta(seconds=0.1))
                outcome = "returned"
            except pycollect.Timeout as err:
                outcome = "Timeout: %s" % err
        w.wait()
        self.results["wait timeout"] = {"outcome": outcome, "value": t}

    def future_then(self):
        t = torch.ones(4)
        fut = dist.all_reduce(t, async_op=True).get_future()
        chained = fut.then(lambda f: f.value()[0] * 10)
        self.results["future then"] = chained.wait()

    def future_exception(self):
        """A failing async operation: its error reaches wait() and the future."""
        g = dist.new_group(list(range(self.size)))
        # ranks disagree on the element count: a MismatchError on every rank
        t = torch.ones(4 + self.rank)
        w = dist.all_reduce(t, group=g, async_op=True)
        got = {}
        try:
            w.get_future().wait()
            got["future"] = "completed"
        except Exception as err:
            got["future"] = type(err).__name__ + ": " + str(err)[:300]
        try:
            w.wait()
            got["wait"] = "returned"
        except Exception as err:
            got["wait"] = type(err).__name__
        got["is_completed"] = w.is_completed()
        got["is_success"] = w.is_success()
        self.results["future exception"] = got

    def cuda_error(self):
        try:
            dist.all_reduce(torch.empty(4, device="meta"))
            self.results["non-CPU tensor"] = "accepted"
        except Exception as err:
            self.results["non-CPU tensor"] = "%s: %s" % (type(err).__name__, err)


def run(backend, outdir):
    dist.init_process_group(backend, timeout=timedelta(seconds=30))
    assert dist.get_backend() == backend, dist.get_backend()
    checks = Checks(backend, dist.get_rank(), dist.get_world_size())
    started = time.monotonic()
    checks.all_reduce()
    checks.data_movers()
    checks.async_variants()
    checks.point_to_point()
    checks.objects()
    checks.groups()
    checks.ddp()
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    checks.ddp(default_hooks.fp16_compress_hook)
    if backend == "pycollect":
        checks.overlap()
        checks.wait_timeout()
        checks.future_then()
        checks.cuda_error()
        checks.future_exception()
    dist.barrier()
    checks.results["seconds"] = time.monotonic() - started
    path = os.path.join(outdir, "%s-rank%d.pt" % (backend, checks.rank))
    torch.save(checks.results, path + ".tmp")
    os.replace(path + ".tmp", path)
    dist.destroy_process_group()
    print("OK", backend, checks.rank, flush=True)


def main():
    outdir, backends = sys.argv[1], sys.argv[2:]
    ports = os.environ["WORKER_PORTS"].split(",")    # one rendezvous per backend
    for backend, port in zip(backends, ports):
        os.environ["MASTER_PORT"] = port
        run(backend, outdir)


if __name__ == "__main__":
    main()
