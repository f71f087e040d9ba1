"""pycollect as a torch.distributed backend: collectives on 2 and 3 processes, and DDP.

Each rank is a subprocess running WORKER (written to tmp_path); it checks every
result against values computed with NumPy and prints "OK <scenario>".
"""

import os
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

import numpy as np  # noqa: E402

import pycollect  # noqa: E402
import pycollect.torch as pctorch  # noqa: E402

RANK_TIMEOUT = 45   # seconds, per subprocess

WORKER = textwrap.dedent(r'''
    import sys
    import numpy as np
    import torch
    import torch.distributed as dist
    import pycollect.torch  # registers "pycollect"

    scenario, rank, size, init = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    dist.init_process_group("pycollect", init_method=init, rank=rank, world_size=size)
    assert dist.get_backend() == "pycollect", dist.get_backend()
    R = list(range(size))

    def data(r, n, dtype):
        """Rank r's input: small positive values, exact in every dtype used."""
        return (np.arange(n) % 5 + 1 + r).astype(dtype)

    def close(t, expected, what):
        got = t.float().numpy() if t.dtype in (torch.bfloat16, torch.float16) else t.numpy()
        np.testing.assert_allclose(got, np.asarray(expected, dtype=got.dtype), rtol=1e-2,
                                   err_msg=what)

    def collectives():
        n = 10
        # all_reduce: dtypes x ops
        for tdt, ndt in [(torch.float32, np.float32), (torch.float64, np.float64),
                         (torch.int32, np.int32), (torch.int64, np.int64)]:
            for op, ref in [(dist.ReduceOp.SUM, np.sum), (dist.ReduceOp.PRODUCT, np.prod),
                            (dist.ReduceOp.MIN, np.min), (dist.ReduceOp.MAX, np.max)]:
                t = torch.from_numpy(data(rank, n, ndt))
                dist.all_reduce(t, op=op)
                expected = ref(np.stack([data(r, n, ndt) for r in R]), axis=0)
                close(t, expected, "all_reduce %s %s" % (tdt, op))
        for op, ref in [(dist.ReduceOp.BAND, np.bitwise_and.reduce),
                        (dist.ReduceOp.BOR, np.bitwise_or.reduce),
                        (dist.ReduceOp.BXOR, np.bitwise_xor.reduce)]:
            t = torch.from_numpy(data(rank, n, np.int32) * 7)
            dist.all_reduce(t, op=op)
            close(t, ref(np.stack([data(r, n, np.int32) * 7 for r in R]), axis=0), str(op))
        t = torch.from_numpy(data(rank, n, np.float32))
        dist.all_reduce(t, op=dist.ReduceOp.AVG)
        close(t, np.mean([data(r, n, np.float32) for r in R], axis=0), "AVG")
        premul = torch._C._distributed_c10d._make_nccl_premul_sum(2.0)
        t = torch.from_numpy(data(rank, n, np.float32))
        dist.all_reduce(t, op=premul)
        close(t, 2 * np.sum([data(r, n, np.float32) for r in R], axis=0), "PREMUL_SUM")
        # half precisions, through float32 reference
        for tdt in (torch.bfloat16, torch.float16):
            t = torch.from_numpy(data(rank, n, np.float32)).to(tdt)
            dist.all_reduce(t)
            close(t, np.sum([data(r, n, np.float32) for r in R], axis=0), "sum %s" % tdt)
        # strided tensor: only every other element takes part
        full = torch.from_numpy(data(rank, 2 * n, np.float32))
        before = full.clone()
        dist.all_reduce(full[::2])
        summed = np.sum([data(r, 2 * n, np.float32) for r in R], axis=0)
        close(full[::2].contiguous(), summed[::2], "strided all_reduce")
        close(full[1::2].contiguous(), before[1::2].numpy(), "strided: untouched elements")
        # 2-D transposed tensor
        m = torch.from_numpy(data(rank, 12, np.float64).reshape(3, 4)).t()
        dist.all_reduce(m)
        close(m.contiguous(), np.sum([data(r, 12, np.float64).reshape(3, 4).T for r in R],
                                     axis=0), "transposed all_reduce")
        # async_op handle
        t = torch.ones(5)
        w = dist.all_reduce(t, async_op=True)
        w.wait()
        close(w.get_future().wait()[0], np.full(5, size), "async future")
        # broadcast from the last rank
        root = size - 1
        t = torch.from_numpy(data(rank, n, np.float32))
        dist.broadcast(t, root)
        close(t, data(root, n, np.float32), "broadcast")
        # reduce to rank 0
        t = torch.from_numpy(data(rank, n, np.float64))
        dist.reduce(t, 0, op=dist.ReduceOp.MAX)
        if rank == 0:
            close(t, data(size - 1, n, np.float64), "reduce")
        # all_gather
        outs = [torch.empty(n) for _ in R]
        dist.all_gather(outs, torch.from_numpy(data(rank, n, np.float32)))
        for r in R:
            close(outs[r], data(r, n, np.float32), "all_gather block %d" % r)
        # all_gather_into_tensor
        out = torch.empty(size * n, dtype=torch.int64)
        dist.all_gather_into_tensor(out, torch.from_numpy(data(rank, n, np.int64)))
        close(out, np.concatenate([data(r, n, np.int64) for r in R]), "all_gather_into_tensor")
        # reduce_scatter_tensor
        inp = torch.from_numpy(data(rank, size * n, np.float32))
        out = torch.empty(n)
        dist.reduce_scatter_tensor(out, inp)
        summed = np.sum([data(r, size * n, np.float32) for r in R], axis=0)
        close(out, summed[rank * n:(rank + 1) * n], "reduce_scatter_tensor")
        # reduce_scatter (list form)
        out = torch.empty(n)
        dist.reduce_scatter(out, [torch.from_numpy(data(rank + p, n, np.float32)) for p in R])
        close(out, np.sum([data(r + rank, n, np.float32) for r in R], axis=0), "reduce_scatter")
        # all_to_all_single, equal splits: block p of rank r is 100*r + p
        inp = torch.tensor([100.0 * rank + p for p in R for _ in range(3)])
        out = torch.empty(3 * size)
        dist.all_to_all_single(out, inp)
        close(out, np.repeat([100.0 * r + rank for r in R], 3), "all_to_all_single")
        # all_to_all_single, uneven splits: rank r sends p+1 rows of 2 to rank p
        in_splits = [p + 1 for p in R]
        out_splits = [rank + 1] * size
        inp = torch.cat([torch.full((p + 1, 2), 10.0 * rank + p) for p in R])
        out = torch.empty(sum(out_splits), 2)
        dist.all_to_all_single(out, inp, out_splits, in_splits)
        exp = np.concatenate([np.full((rank + 1, 2), 10.0 * r + rank) for r in R])
        close(out, exp, "all_to_all_single uneven")
        # all_to_all (lists)
        outs = [torch.empty(2) for _ in R]
        dist.all_to_all(outs, [torch.full((2,), 10.0 * rank + p) for p in R])
        for r in R:
            close(outs[r], np.full(2, 10.0 * r + rank), "all_to_all")
        # gather / scatter
        got = [torch.empty(n) for _ in R] if rank == 0 else None
        dist.gather(torch.from_numpy(data(rank, n, np.float32)), got, 0)
        if rank == 0:
            for r in R:
                close(got[r], data(r, n, np.float32), "gather")
        out = torch.empty(4)
        dist.scatter(out, [torch.full((4,), float(p)) for p in R] if rank == 0 else None, 0)
        close(out, np.full(4, float(rank)), "scatter")
        # objects (built on allgather / broadcast)
        objs = [None] * size
        dist.all_gather_object(objs, {"rank": rank})
        assert objs == [{"rank": r} for r in R], objs
        dist.barrier()
        # send / recv: a ring, then recv from any source on rank 0
        t = torch.from_numpy(data(rank, n, np.float32))
        got = torch.empty(n)
        if rank % 2 == 0:
            dist.send(t, (rank + 1) % size)
            dist.recv(got, (rank - 1) % size)
        else:
            dist.recv(got, (rank - 1) % size)
            dist.send(t, (rank + 1) % size)
        close(got, data((rank - 1) % size, n, np.float32), "send/recv ring")
        if rank == 0:
            srcs = set()
            for _ in range(size - 1):
                buf = torch.empty(1)
                src = dist.recv(buf)
                assert buf.item() == src, (buf, src)
                srcs.add(src)
            assert srcs == set(range(1, size)), srcs
        else:
            dist.send(torch.tensor([float(rank)]), 0)
        # a sub-group of ranks 0 and 1
        g = dist.new_group([0, 1])
        if rank < 2:
            t = torch.tensor([rank + 1.0])
            dist.all_reduce(t, group=g)
            close(t, [3.0], "new_group all_reduce")
        dist.barrier()

    def ddp():
        from torch.nn.parallel import DistributedDataParallel as DDP
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 3)
        ddp_model = DDP(model)
        opt = torch.optim.SGD(ddp_model.parameters(), lr=0.1)
        gen = torch.Generator().manual_seed(100 + rank)   # different data per rank
        for _ in range(3):
            x = torch.randn(16, 8, generator=gen)
            y = torch.randn(16, 3, generator=gen)
            opt.zero_grad()
            torch.nn.functional.mse_loss(ddp_model(x), y).backward()
            opt.step()
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        gathered = [torch.empty_like(flat) for _ in range(size)]
        dist.all_gather(gathered, flat)
        for r in range(size):
            assert torch.equal(gathered[r], gathered[0]), "rank %d's parameters differ" % r
        torch.manual_seed(0)
        start = torch.cat([p.reshape(-1) for p in torch.nn.Linear(8, 3).parameters()])
        assert not torch.equal(flat, start.detach()), "parameters did not change"

    {"collectives": collectives, "ddp": ddp}[scenario]()
    dist.barrier()
    dist.destroy_process_group()
    print("OK", scenario, rank, flush=True)
''')


def _run(tmp_path, scenario, size):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    init = "file://" + str(tmp_path / ("init-%s-%d" % (scenario, size)))
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, str(script), scenario, str(r), str(size), init],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                              text=True) for r in range(size)]
    outputs = []
    try:
        for p in procs:
            try:
                out, _ = p.communicate(timeout=RANK_TIMEOUT)
            except subprocess.TimeoutExpired:
                p.kill()
                out, _ = p.communicate()
                out += "\n[timed out after %d s]" % RANK_TIMEOUT
            outputs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for r, (p, out) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0 and ("OK %s %d" % (scenario, r)) in out, (
            "rank %d of %d (%s) exited %s:\n%s" % (r, size, scenario, p.returncode, out[-4000:]))


@pytest.mark.parametrize("size", [2, 3])
def test_collectives(tmp_path, size):
    _run(tmp_path, "collectives", size)


def test_ddp_two_ranks(tmp_path):
    _run(tmp_path, "ddp", 2)


def test_registered():
    assert "pycollect" in dist.Backend.backend_list


def test_cuda_like_tensor_is_rejected_with_a_clear_error():
    t = torch.empty(4, device="meta")
    with pytest.raises(RuntimeError, match="CPU tensors only"):
        pctorch._Buf(t, "allreduce tensor")


def test_views_share_memory():
    t = torch.zeros(6)
    b = pctorch._Buf(t, "x")
    b.array[:] = 1
    assert t.sum().item() == 6 and b.staging is None
    bf = torch.zeros(4, dtype=torch.bfloat16)
    v = pctorch._Buf(bf, "x").array
    v[:] = np.asarray([1.5] * 4, dtype=v.dtype)
    assert bf.float().tolist() == [1.5] * 4
    s = torch.zeros(8)[::2]
    b = pctorch._Buf(s, "x")
    assert b.staging is not None
    b.array[:] = 2
    b.finish()
    assert s.tolist() == [2.0] * 4


def test_torch_store_adapter():
    store = pctorch.TorchStore(dist.HashStore(), timeout=5)
    assert isinstance(store, pycollect.Store)
    store.set("a", b"1")
    assert store.get("a") == b"1"
    assert store.check(["a"]) and not store.check(["b"])
    assert store.add("n", 2) == 2 and store.add("n", 3) == 5
    store.wait(["a", "n"])
    assert store.delete("a") is True
    with pytest.raises(pycollect.Timeout):
        store.get("missing", timeout=0.2)
