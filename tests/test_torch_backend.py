"""pycollect as a torch.distributed backend, checked against torch's own Gloo.

tests/torch_worker.py runs, in each of 2 and then 3 processes started the way
torchrun starts them (MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE and a bare
``init_process_group(backend)``), every ``dist.*`` collective under "gloo" and
then under "pycollect", and saves each result.  The tests here compare them:
equal values (and equal dtypes and shapes), or an error under both backends.
One launch per world size serves every comparison.
"""

import datetime
import os
import re
import socket
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

import numpy as np  # noqa: E402

import pycollect  # noqa: E402
import pycollect.torch as pctorch  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
LAUNCH_TIMEOUT = 150    # seconds for one launch (both backends), on 2 busy cores
BACKENDS = ("gloo", "pycollect")

# gloo refuses these; pycollect computes them, checked against gloo's own results
PREMUL_FACTOR = 2.0
GLOO_REFUSES = {"all_to_all uneven"}
# gloo gets these wrong (seen here with torch 2.13.0: the coalesced
# all_gather_into_tensor returns values that are not the inputs); pycollect's
# results are checked against the same calls made one by one
GLOO_WRONG = {"all_gather_into_tensor, reduce_scatter_tensor coalesced"}


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module", params=[2, 3], ids=["2ranks", "3ranks"])
def results(request, tmp_path_factory):
    """{backend: [per-rank {check: result}]} from one launch of ``size`` processes."""
    size = request.param
    outdir = tmp_path_factory.mktemp("torch%d" % size)
    ports = "%d,%d" % (_free_port(), _free_port())
    logs = [open(outdir / ("rank%d.log" % r), "w+") for r in range(size)]
    procs = []
    for r in range(size):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", WORKER_PORTS=ports, RANK=str(r),
                   WORLD_SIZE=str(size), LOCAL_RANK=str(r), OMP_NUM_THREADS="1",
                   PYTHONUNBUFFERED="1",
                   PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
        env.pop("MASTER_PORT", None)
        procs.append(subprocess.Popen(
            [sys.executable, os.path.join(HERE, "torch_worker.py"), str(outdir)] + list(BACKENDS),
            stdout=logs[r], stderr=subprocess.STDOUT, env=env))
    try:
        for p in procs:
            p.wait(timeout=LAUNCH_TIMEOUT)
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for r, (p, log) in enumerate(zip(procs, logs)):
        log.seek(0)
        text = log.read()
        log.close()
        assert p.returncode == 0, "rank %d of %d exited %s:\n%s" % (
            r, size, p.returncode, text[-5000:])
    return {b: [torch.load(outdir / ("%s-rank%d.pt" % (b, r)), weights_only=False)
                for r in range(size)] for b in BACKENDS}


# Checks where both backends must refuse: bitwise ops on floating and complex
# tensors, AVG on integers and bool, PRODUCT/MIN/MAX on complex (dist refuses
# those itself), and all_gather into outputs of different sizes.
_REFUSED = re.compile(r"all_reduce (BAND|BOR|BXOR) torch\.(float|bfloat|complex)"
                      r"|all_reduce AVG torch\.(u?int|bool)"
                      r"|all_reduce (PRODUCT|MIN|MAX) torch\.complex"
                      r"|all_gather uneven$")


def _is_error(v):
    return isinstance(v, tuple) and len(v) == 2 and v[0] == "error"


def _same(a, b):
    """Equal values, dtypes and shapes (tensors bit for bit), recursively."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return (type(a) is type(b) and len(a) == len(b)
                and all(_same(x, y) for x, y in zip(a, b)))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def _compared_checks(gloo_rank0):
    return [k for k in gloo_rank0
            if not k.startswith(("seconds", "ddp parameters", "pycollect group in a gloo job"))
            and "PREMUL_SUM" not in k and k not in GLOO_REFUSES | GLOO_WRONG
            and not k.endswith("torch.int16")]


def test_every_collective_equals_gloo(results):
    gloo, pyc = results["gloo"], results["pycollect"]
    names = _compared_checks(gloo[0])
    assert len(names) >= 140, names      # every dtype x op, every collective
    differ = []
    for r, (g, p) in enumerate(zip(gloo, pyc)):
        for name in names:
            a, b = g[name], p[name]
            if _REFUSED.match(name):
                # both refuse: pycollect names the problem with one of its own errors
                assert _is_error(a) and _is_error(b), (name, a, b)
                assert b[1] in ("InvalidArgument", "ValueError"), (name, b)
                continue
            if not _same(a, b):
                differ.append("rank %d, %s: gloo %.300r, pycollect %.300r" % (r, name, a, b))
    assert not differ, "\n".join(differ[:20])
    # every other check ran under both backends (an error is recorded, so the
    # comparison above would only have found two equal errors)
    failed = ["%s: %r / %r" % (n, g[n], p[n]) for g, p in zip(gloo, pyc) for n in names
              if not _REFUSED.match(n) and (_is_error(g[n]) or _is_error(p[n]))]
    assert not failed, failed


def test_premul_sum_is_factor_times_gloos_sum(results):
    # all_reduce, reduce and reduce_scatter(_tensor) with PREMUL_SUM, which gloo lacks
    gloo, pyc = results["gloo"], results["pycollect"]
    checked = 0
    for r in range(len(gloo)):
        for name, got in pyc[r].items():
            if "PREMUL_SUM" not in name or name.endswith("int16"):
                continue
            assert _is_error(gloo[r][name]), name
            summed = gloo[r][name.replace("PREMUL_SUM", "SUM")]
            if summed is None:      # reduce: not the root
                assert got is None, (name, got)
            elif summed.is_floating_point() or summed.is_complex():
                expected = (summed * PREMUL_FACTOR).to(summed.dtype)
                assert _same(got, expected), (name, got, expected)
                checked += 1
            else:      # integers and bool: a clear refusal, as NCCL's premul sum
                assert _is_error(got) and got[1] == "InvalidArgument", (name, got)
    # all_reduce over 4 floating and 2 complex dtypes, reduce_scatter and
    # reduce_scatter_tensor on every rank, reduce on its roots
    assert checked >= 8 * len(gloo) + 1, checked


def test_int16_which_gloo_refuses_equals_gloos_int32(results):
    gloo, pyc = results["gloo"], results["pycollect"]
    checked = 0
    for r in range(len(gloo)):
        for name, got in pyc[r].items():
            if not (name.startswith("all_reduce") and name.endswith("torch.int16")):
                continue
            assert _is_error(gloo[r][name]), name     # gloo has no int16
            wide = gloo[r][name.replace("int16", "int32")]
            if _is_error(wide) or name.startswith("all_reduce PREMUL_SUM"):
                assert _is_error(got), (name, got)
            else:
                assert _same(got, wide.to(torch.int16)), (name, got, wide)
                checked += 1
    assert checked == 7 * len(gloo)     # SUM, PRODUCT, MIN, MAX, BAND, BOR, BXOR


def test_coalesced_gathers_equal_the_same_calls_one_by_one(results):
    for r, res in enumerate(results["pycollect"]):
        got = res["all_gather_into_tensor, reduce_scatter_tensor coalesced"]
        assert _same(got["coalesced"], got["one by one"]), (r, got)
        # and the one-by-one calls agree with gloo's
        gloo = results["gloo"][r]["all_gather_into_tensor, reduce_scatter_tensor coalesced"]
        assert _same(got["one by one"], gloo["one by one"]), (r, got, gloo)


def test_all_to_all_with_blocks_of_different_sizes(results):
    # gloo refuses it; pycollect delivers: rank s sends s+1 elements 10s + p to rank p
    size = len(results["gloo"])
    for r in range(size):
        assert _is_error(results["gloo"][r]["all_to_all uneven"])
        got = results["pycollect"][r]["all_to_all uneven"]
        expected = [torch.full((src + 1,), 10.0 * src + r) for src in range(size)]
        assert _same(got, expected), (r, got)


@pytest.mark.parametrize("suffix", ["", " with fp16_compress_hook"],
                         ids=["no hook", "fp16_compress_hook"])
def test_ddp_trains_the_same_as_gloo(results, suffix):
    gloo, pyc = results["gloo"], results["pycollect"]
    size = len(gloo)
    for r in range(size):
        # every rank ends with the same parameters, under both backends
        for b in (gloo, pyc):
            everyone = b[r]["ddp parameters of every rank" + suffix]
            assert all(torch.equal(everyone[0], x) for x in everyone)
        g, p = gloo[r]["ddp parameters" + suffix], pyc[r]["ddp parameters" + suffix]
        if size == 2:
            # a sum of two is the same in any order: bit-identical
            assert torch.equal(g, p)
        elif not suffix:
            # three gradients summed in a different order differ in the last bit
            torch.testing.assert_close(p, g, rtol=1e-6, atol=1e-7)
        else:
            # ... and in float16 (11-bit significand) the last bit is 2**-11 of a
            # gradient: after 4 steps at lr 0.1, a few 1e-5 at most (seen: 2.4e-5)
            torch.testing.assert_close(p, g, rtol=1e-2, atol=1e-4)
    torch.manual_seed(0)
    start = torch.cat([q.detach().reshape(-1) for q in torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 3)).parameters()])
    assert not torch.equal(start, pyc[0]["ddp parameters"]), "the parameters did not change"


def test_async_all_reduce_overlaps_python(results):
    for r, res in enumerate(results["pycollect"]):
        o = res["overlap"]
        if r == 0:      # its peers joined 0.3 s late: pending when the call returned
            assert o["pending at return"], o
            assert o["thread steps"] > 1000 and o["main steps"] > 10, o
        assert o["correct"] and o["future holds the tensor"], o


def test_wait_with_timeout_then_completion(results):
    size = len(results["pycollect"])
    for r, res in enumerate(results["pycollect"]):
        w = res["wait timeout"]
        if r == 0:
            assert w["outcome"].startswith("Timeout:") and "within 0.1 s" in w["outcome"], w
        assert torch.equal(w["value"], torch.full((3,), float(size)))
        assert torch.equal(res["future then"], torch.full((4,), 10.0 * size))


def test_failed_async_operation_reaches_wait_and_future(results):
    for res in results["pycollect"]:
        got = res["future exception"]
        assert got["future"].startswith("MismatchError") and "disagrees" in got["future"], got
        assert got["wait"] == "MismatchError" and got["is_completed"], got
        assert got["is_success"] is False, got


def test_pycollect_group_next_to_another_backend(results):
    size = len(results["gloo"])
    for r, res in enumerate(results["gloo"]):
        name, t = res["pycollect group in a gloo job"]
        assert name == "pycollect"
        once = sum(torch.arange(5) % 3 + 1 + p for p in range(size)).to(torch.float64)
        assert torch.equal(t, once * size), (r, t)


def test_non_cpu_tensor_is_refused_clearly(results):
    for res in results["pycollect"]:
        msg = res["non-CPU tensor"]
        assert msg.startswith("InvalidArgument") and "CPU tensors only" in msg, msg


def test_registered():
    assert "pycollect" in dist.Backend.backend_list


def test_cuda_like_tensor_is_rejected_with_a_clear_error():
    t = torch.empty(4, device="meta")
    with pytest.raises(pycollect.InvalidArgument, match="CPU tensors only"):
        pctorch._Buf(t, "allreduce tensor")


def test_sparse_tensors_are_refused_and_tensor_subclasses_taken():
    with pytest.raises(pycollect.InvalidArgument, match="only dense"):
        pctorch._Buf(torch.zeros(4).to_sparse(), "allreduce tensor")
    p = torch.nn.Parameter(torch.zeros(3), requires_grad=False)
    pctorch._Buf(p, "allreduce tensor").array[:] = 2
    assert p.tolist() == [2.0] * 3


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


def test_torchs_longer_timeouts_are_pycollects_longest():
    """torch takes a group timeout of days (its gloo does); the backend takes one past
    pc.MAX_TIMEOUT_S as that limit (init refused it), and a wait's as well."""
    month = datetime.timedelta(days=30)
    pg = pctorch._create(dist.HashStore(), 0, 1, month)
    try:
        assert pg._c().timeout == pycollect.MAX_TIMEOUT_S
        t = torch.ones(2)
        work = pg.allreduce([t])
        assert work.wait(month) and t.tolist() == [1.0, 1.0]
    finally:
        pg._c().close()


def test_every_torch_store_adapter_numbers_its_contexts_afresh():
    """A group's first context is ctx0 on every rank, whatever adapters the process made
    and freed before (an adapter keyed by id() could inherit a freed one's count)."""
    urls = set()
    for _ in range(50):
        adapter = pctorch.TorchStore(dist.HashStore(), timeout=5)
        urls.add(adapter.url)
        del adapter
    assert len(urls) == 50


def test_view_cache_follows_the_tensor():
    t = torch.zeros(4)
    a = pctorch._cached_view(t)
    assert pctorch._cached_view(t) is a          # reused while the tensor is unchanged
    t.set_(torch.zeros(1000))                    # new memory: a new view
    b = pctorch._cached_view(t)
    assert b.size == 1000 and b is not a
    b[:] = 3
    assert t.sum().item() == 3000
    t.data = t.data.view(torch.int32)            # same memory and count, another dtype
    c = pctorch._cached_view(t)
    assert c is not b and c.dtype == np.int32
    big = torch.zeros((pctorch._VIEW_CACHE_MAX_BYTES // 4) + 1)
    pctorch._cached_view(big)
    assert id(big) not in pctorch._VIEW_CACHE    # large tensors are not kept alive
    for _ in range(3 * pctorch._VIEW_CACHE_SIZE):
        pctorch._cached_view(torch.zeros(2))
    assert len(pctorch._VIEW_CACHE) <= pctorch._VIEW_CACHE_SIZE
