"""pycollect as a Ray collective backend, on a real local Ray (``ray.init`` once per module).

Ray's own single-node CPU collective cases (allreduce, reduce, broadcast,
allgather, reducescatter, send/recv, the group APIs) run with backend
"pycollect" at 2 and 3 actors against NumPy results, plus what Ray's "gloo"
backend lacks: more dtypes, the group's pycollect Context, a failure that
names the dead actor's rank, and a small data-parallel training loop.  The
Ray store runs the shared store suite.  The actors are made once per module
and take part in many groups, one fresh group name per test.
"""

import contextlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'pycollect[ray]')",
                         exc_type=ImportError)
col = pytest.importorskip("ray.util.collective", reason="this Ray has no ray.util.collective")

import pycollect as pc  # noqa: E402
import pycollect.ray as pcray  # noqa: E402
from pycollect.plugins import open_store  # noqa: E402
from pycollect.plugins.stores.ray_store import RayStore  # noqa: E402
from abstract import StoreSuite  # noqa: E402
from ray_worker import Member  # noqa: E402
from netns import SUBNET  # noqa: E402  (conftest.py provides the namespaces fixture, hosts)

try:
    import torch
except ImportError:
    torch = None

ReduceOp = col.types.ReduceOp
TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
CALL_TIMEOUT_S = 60        # every ray.get of the driver is bounded
pytestmark = pytest.mark.timeout(180)
needs_torch = pytest.mark.skipif(torch is None, reason="torch is not installed")
_names = itertools.count()


@pytest.fixture(scope="module")
def cluster():
    """One local Ray for this module, sized for a 2-core machine (shut down after it)."""
    path = os.pathsep.join(p for p in (TESTS_DIR, os.environ.get("PYTHONPATH")) if p)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": path}})
    yield
    ray.shutdown()


def _get(refs, timeout=CALL_TIMEOUT_S):
    return ray.get(refs, timeout=timeout)


def _actors(count):
    actors = [Member.remote() for _ in range(count)]
    _get([a.pid.remote() for a in actors])
    return actors


@pytest.fixture(scope="module", params=[2, 3], ids=["2actors", "3actors"])
def actors(request, cluster):
    made = _actors(request.param)
    yield made
    for actor in made:
        ray.kill(actor)


@pytest.fixture(scope="module")
def pair(cluster):
    made = _actors(2)
    yield made
    for actor in made:
        ray.kill(actor)


class Group:
    """A group of ``actors`` named ``name`` (fresh unless given), destroyed on exit.

    Entering resets the actors' buffers to Ray's test buffers, unless ``keep``.
    """

    def __init__(self, actors, name=None, ranks=None, keep=False):
        self.actors = actors
        self.name = name or "g%d-%d" % (os.getpid(), next(_names))
        self.ranks = list(range(len(actors))) if ranks is None else ranks
        self.size = len(actors)
        self.keep = keep

    def __enter__(self):
        if not self.keep:
            _get([a.reset.remote(self.size) for a in self.actors])
        assert _get([a.join.remote(self.size, r, self.name)
                     for a, r in zip(self.actors, self.ranks)]) == [True] * self.size
        return self

    def __exit__(self, *exc_info):
        _get([a.leave.remote(self.name) for a in self.actors])

    def by_rank(self):
        """The actors in rank order."""
        return [a for _, a in sorted(zip(self.ranks, self.actors), key=lambda p: p[0])]

    def call(self, method, *args, **kwargs):
        """``method`` on every actor (rank order), the group name passed; the results."""
        return _get([getattr(a, method).remote(*args, group_name=self.name, **kwargs)
                     for a in self.by_rank()])

    def load(self, arrays):
        """Give rank r's actor ``arrays[r]`` as its buffer."""
        _get([a.set_buffer.remote(x) for a, x in zip(self.by_rank(), arrays)])

    def load_lists(self, lists):
        _get([a.set_list_buffer.remote(x) for a, x in zip(self.by_rank(), lists)])


def _inputs(size, count, dtype, seed=0):
    """Per rank an array of small integers (exact in every dtype), as NumPy."""
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 4, count).astype(dtype) for _ in range(size)]


NUMPY_OPS = {ReduceOp.SUM: np.sum, ReduceOp.PRODUCT: np.prod, ReduceOp.MIN: np.min,
             ReduceOp.MAX: np.max}


def _reference(arrays, op):
    return NUMPY_OPS[op](np.stack(arrays), axis=0).astype(arrays[0].dtype)


# -- the store ---------------------------------------------------------------

class TestRayStore(StoreSuite):
    @pytest.fixture
    def store(self, cluster):
        store = RayStore("suite-%d-%d" % (os.getpid(), next(_names)))
        yield store
        store.cleanup()


def test_the_ray_store_is_found_through_its_entry_point(cluster):
    store = open_store("ray://entry-%d" % next(_names), timeout=5)
    try:
        assert isinstance(store, RayStore) and store.timeout == 5
        store.set("k", b"v")
        assert store.get("k") == b"v"
    finally:
        store.cleanup()
    with pytest.raises(pc.InvalidArgument, match="names no store"):
        open_store("ray://")


def test_stores_of_different_names_do_not_see_each_others_keys(cluster):
    first, second = RayStore("a"), RayStore("a/b")
    try:
        first.set("b/k", b"first")
        second.set("k", b"second")
        assert first.get("b/k") == b"first" and second.get("k") == b"second"
        first.cleanup()
        assert second.get("k") == b"second"
    finally:
        second.cleanup()


def test_cleanup_removes_every_key_of_the_store(cluster):
    store = RayStore("cleanup-%d" % next(_names))
    store.set("x", b"1")
    store.add("n", 3)
    assert not store.empty()
    store.cleanup()
    again = RayStore(store.name)
    try:
        assert again.empty() and not again.check(["x"]) and not again.check(["n"])
    finally:
        again.cleanup()


def test_the_ray_store_without_a_running_ray_says_to_call_ray_init():
    code = ("import pycollect as pc\n"
            "from pycollect.plugins import open_store\n"
            "try:\n    open_store('ray://x')\n"
            "except pc.StoreError as err:\n    print('StoreError', err)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert "StoreError" in out.stdout and "ray.init()" in out.stdout, out.stdout + out.stderr


# -- Ray's cases, backend "pycollect" ----------------------------------------

@pytest.mark.parametrize("name", ["default", "test", "123?34!"])
def test_allreduce_under_group_names(actors, name):
    with Group(actors, name) as g:
        results = g.call("allreduce")
    for result in results:
        np.testing.assert_array_equal(result, np.full(10, len(actors), np.float32))


@pytest.mark.parametrize("count", [0, 1, 2, 2 ** 10, 2 ** 15, 2 ** 20 + 3])
def test_allreduce_sizes(actors, count):
    with Group(actors) as g:
        inputs = _inputs(g.size, count, np.float32)
        g.load(inputs)
        results = g.call("allreduce")
    for result in results:
        np.testing.assert_array_equal(result, _reference(inputs, ReduceOp.SUM))


@pytest.mark.parametrize("op", list(NUMPY_OPS), ids=lambda op: op.name)
@pytest.mark.parametrize("dtype", [np.uint8, np.int32, np.int64, np.float16, np.float32,
                                   np.float64])
def test_allreduce_ops_and_dtypes(actors, op, dtype):
    with Group(actors) as g:
        inputs = _inputs(g.size, 100, dtype, seed=3)
        g.load(inputs)
        results = g.call("allreduce", op=op)
    for result in results:
        assert result.dtype == dtype
        np.testing.assert_array_equal(result, _reference(inputs, op))


def test_allreduce_dtypes_beyond_gloo(pair):
    with Group(pair) as g:
        values = [np.array([1 + 2j, 3 - 1j], np.complex128), np.array([2j, 1], np.complex128)]
        g.load(values)
        assert all((r == values[0] + values[1]).all() for r in g.call("allreduce"))
        flags = [np.array([True, False, False]), np.array([False, False, True])]
        g.load(flags)
        assert all((r == [True, False, True]).all() for r in g.call("allreduce"))
        if torch is not None:
            g.load([torch.ones(8, dtype=torch.bfloat16) * (r + 1) for r in range(2)])
            for result in g.call("allreduce"):
                assert result.dtype == torch.bfloat16 and (result == 3).all()


@needs_torch
def test_allreduce_of_torch_and_numpy_in_one_group(pair):
    with Group(pair) as g:
        g.load([np.ones(10, np.float32), torch.ones(10)])
        numpy_result, torch_result = g.call("allreduce")
        assert isinstance(numpy_result, np.ndarray) and isinstance(torch_result, torch.Tensor)
        assert (numpy_result == 2).all() and (torch_result == 2).all()


def test_allreduce_in_several_groups_at_once(pair):
    groups = [Group(pair, keep=i > 0) for i in range(5)]
    for g in groups:
        g.__enter__()
    try:
        # Each allreduce doubles the buffer: after group i it holds 2 ** (i + 1).
        for i, g in enumerate(groups):
            for result in g.call("allreduce"):
                np.testing.assert_array_equal(result, np.full(10, 2 ** (i + 1), np.float32))
    finally:
        for g in groups:
            g.__exit__()


def test_a_group_leaves_no_key_in_rays_store(pair):
    with Group(pair) as g:
        namespace = ray.get_runtime_context().namespace
        assert RayStore("%s/%s" % (namespace, g.name)).empty()
        assert g.call("barrier") == [True, True]


def test_a_new_actor_joins_an_old_group_name_beside_an_actor_that_was_in_it(pair):
    name = "reused-%d" % next(_names)
    with Group(pair, name) as g:
        g.call("barrier")
    newcomer = _actors(1)[0]
    try:
        with Group([pair[0], newcomer], name) as g:
            for result in g.call("allreduce"):
                np.testing.assert_array_equal(result, np.full(10, 2, np.float32))
    finally:
        ray.kill(newcomer)


def test_destroy_then_a_new_group_of_the_same_name(pair):
    name = "again-%d" % next(_names)
    with Group(pair, name) as g:
        g.load([np.ones(10, np.float32)] * 2)
        g.call("allreduce")
    assert _get([a.is_initialized.remote(name) for a in pair]) == [False, False]
    with pytest.raises(RuntimeError, match="not initialized"):
        _get([a.allreduce.remote(name) for a in pair])
    with Group(pair, name, keep=True) as g:
        for result in g.call("allreduce"):
            np.testing.assert_array_equal(result, np.full(10, 4, np.float32))


def test_ranks_in_any_order_and_the_group_apis(actors):
    order = list(reversed(range(len(actors))))
    with Group(actors, ranks=order) as g:
        assert _get([a.rank.remote(g.name) for a in actors]) == order
        assert _get([a.world_size.remote(g.name) for a in actors]) == [len(actors)] * len(actors)
        assert _get([a.is_initialized.remote(g.name) for a in actors]) == [True] * len(actors)
        assert _get(actors[0].is_initialized.remote("never-made")) is False
        assert _get(actors[0].rank.remote("never-made")) == -1
        inputs = _inputs(g.size, 7, np.int64, seed=5)
        g.load(inputs)
        for result in g.call("allreduce"):
            np.testing.assert_array_equal(result, _reference(inputs, ReduceOp.SUM))


def test_destroying_on_one_actor_leaves_the_others_initialized(pair):
    g = Group(pair).__enter__()
    _get(pair[0].leave.remote(g.name))
    assert _get([a.is_initialized.remote(g.name) for a in pair]) == [False, True]
    _get(pair[1].leave.remote(g.name))
    _get(pair[1].leave.remote("never-made"))     # a group that does not exist: no error
    assert _get(pair[1].is_initialized.remote(g.name)) is False


@pytest.mark.parametrize("op", list(NUMPY_OPS), ids=lambda op: op.name)
def test_reduce_to_each_root(actors, op):
    with Group(actors) as g:
        inputs = _inputs(g.size, 1000, np.float32, seed=7)
        g.load(inputs)
        for root in range(g.size):
            results = g.call("reduce", dst_rank=root, op=op)
            expected = _reference(inputs, op)
            for rank, result in enumerate(results):
                np.testing.assert_array_equal(result, expected if rank == root
                                              else inputs[rank])
            inputs[root] = expected


@pytest.mark.parametrize("name", ["test", "123?34!"])
def test_reduce_and_broadcast_under_group_names(pair, name):
    with Group(pair, name) as g:
        results = g.call("reduce", dst_rank=1)
        assert (results[0] == 1).all() and (results[1] == 2).all()
        assert all((r == 2).all() for r in g.call("broadcast", src_rank=1))


@needs_torch
@pytest.mark.parametrize("root", [0, 1])
def test_reduce_and_broadcast_mixing_torch_and_numpy(pair, root):
    with Group(pair) as g:
        g.load([np.ones(10, np.float32), torch.ones(10) * 3])
        results = g.call("reduce", dst_rank=root)
        assert isinstance(results[1], torch.Tensor)
        assert (results[root] == 4).all() and (results[1 - root] == [1, 3][1 - root]).all()
        g.load([np.ones(10, np.float32), torch.ones(10) * 3])
        for result in g.call("broadcast", src_rank=root):
            assert (result == [1, 3][root]).all()


def test_ten_groups_in_the_same_actors(pair):
    groups = [Group(pair, keep=True) for _ in range(10)]
    try:
        for g in groups:
            g.__enter__()
        assert all(_get([a.is_initialized.remote(g.name) for a in pair]) == [True, True]
                   for g in groups)
        assert all(g.call("barrier") == [True, True] for g in groups)
    finally:
        for g in groups:
            g.__exit__()


def test_a_group_that_never_formed_leaves_its_name_usable(pair):
    """Like Ray's test of a failure while initializing: rank 1 never comes, rank 0 times out."""
    name = "unformed-%d" % next(_names)
    col.create_collective_group(pair, 2, [0, 1], backend="pycollect", group_name=name,
                                gloo_timeout=2000)
    try:
        with pytest.raises(pc.Timeout):
            _get(pair[0].barrier.remote(name))      # rank 0 alone makes the group
    finally:
        ray.kill(ray.get_actor("info_" + name))
    # Rank 0's keys of the attempt are still in the store; a new group of the name works.
    with Group(pair, name) as g:
        assert g.call("barrier") == [True, True]
        assert all((r == 2).all() for r in g.call("allreduce"))


@pytest.mark.parametrize("count", [1, 2 ** 10, 2 ** 20])
def test_broadcast_from_each_root(actors, count):
    with Group(actors) as g:
        for root in range(g.size):
            inputs = _inputs(g.size, count, np.float64, seed=root)
            g.load(inputs)
            for result in g.call("broadcast", src_rank=root):
                np.testing.assert_array_equal(result, inputs[root])


@pytest.mark.parametrize("method,kwargs", [("broadcast", {"src_rank": 3}),
                                           ("reduce", {"dst_rank": 3}),
                                           ("send", {"dst_rank": 3})])
def test_an_invalid_peer_rank_is_a_value_error(pair, method, kwargs):
    with Group(pair) as g:
        with pytest.raises(ValueError):
            g.call(method, **kwargs)


@pytest.mark.parametrize("shape", [[1], [2 ** 10], [2 ** 18], [2, 2], [5, 5, 5]],
                         ids=lambda s: "x".join(map(str, s)))
def test_allgather_shapes(actors, shape):
    with Group(actors) as g:
        inputs = [np.full(shape, r + 1, np.float32) for r in range(g.size)]
        g.load(inputs)
        g.load_lists([[np.zeros(shape, np.float32) for _ in range(g.size)]] * g.size)
        for result in g.call("allgather"):
            for j, block in enumerate(result):
                np.testing.assert_array_equal(block, inputs[j])


@pytest.mark.parametrize("dtype", [np.uint8, np.float16, np.float64, np.int16])
def test_allgather_dtypes(pair, dtype):
    with Group(pair) as g:
        inputs = _inputs(2, 10, dtype, seed=11)
        g.load(inputs)
        g.load_lists([[np.zeros(10, dtype) for _ in range(2)]] * 2)
        for result in g.call("allgather"):
            np.testing.assert_array_equal(np.stack(result), np.stack(inputs))


@pytest.mark.parametrize("length,shape", [(0, 10), (1, 10), (3, 10), (2, 20), (2, [4, 5])])
def test_allgather_refuses_a_list_that_does_not_fit(pair, length, shape):
    with Group(pair) as g:
        g.load_lists([[np.ones(shape, np.float32) for _ in range(length)]] * 2)
        with pytest.raises(RuntimeError):
            g.call("allgather")


@needs_torch
def test_allgather_mixing_torch_and_numpy(pair):
    with Group(pair) as g:
        g.load([torch.ones(4, 4) * (r + 1) for r in range(2)])
        mixed = [torch.zeros(4, 4), np.zeros((4, 4), np.float32)]
        g.load_lists([mixed, mixed])
        for result in g.call("allgather"):
            assert isinstance(result[0], torch.Tensor) and isinstance(result[1], np.ndarray)
            assert (result[0] == 1).all() and (result[1] == 2).all()


@pytest.mark.parametrize("shape", [[2], [2 ** 10], [2 ** 18], [5, 5, 5]],
                         ids=lambda s: "x".join(map(str, s)))
def test_reducescatter_shapes(actors, shape):
    with Group(actors) as g:
        rng = np.random.default_rng(13)
        lists = [[rng.integers(0, 5, shape).astype(np.float32) for _ in range(g.size)]
                 for _ in range(g.size)]
        g.load([np.zeros(shape, np.float32) for _ in range(g.size)])
        g.load_lists(lists)
        for rank, result in enumerate(g.call("reducescatter")):
            np.testing.assert_array_equal(result, sum(lists[r][rank] for r in range(g.size)))


@pytest.mark.parametrize("dtype", [np.uint8, np.float16, np.float32, np.float64])
def test_reducescatter_dtypes(pair, dtype):
    with Group(pair) as g:
        lists = [[np.full(10, r + 2 * j + 1, dtype) for j in range(2)] for r in range(2)]
        g.load([np.zeros(10, dtype)] * 2)
        g.load_lists(lists)
        for rank, result in enumerate(g.call("reducescatter")):
            assert result.dtype == dtype
            np.testing.assert_array_equal(result, lists[0][rank] + lists[1][rank])


@pytest.mark.parametrize("op", [ReduceOp.PRODUCT, ReduceOp.MAX], ids=lambda op: op.name)
def test_reducescatter_ops(pair, op):
    with Group(pair) as g:
        lists = [[np.full(6, 2 * r + j + 1, np.int32) for j in range(2)] for r in range(2)]
        g.load([np.zeros(6, np.int32)] * 2)
        g.load_lists(lists)
        for rank, result in enumerate(g.call("reducescatter", op=op)):
            np.testing.assert_array_equal(result, _reference([lists[0][rank], lists[1][rank]],
                                                             op))


@needs_torch
def test_reducescatter_mixing_torch_and_numpy(pair):
    with Group(pair) as g:
        g.load([torch.zeros(3, 3), np.zeros((3, 3), np.float32)])
        mixed = [np.ones((3, 3), np.float32), torch.ones(3, 3) * 2]
        g.load_lists([mixed, mixed])
        results = g.call("reducescatter")
        assert isinstance(results[0], torch.Tensor) and (results[0] == 2).all()
        assert isinstance(results[1], np.ndarray) and (results[1] == 4).all()


@pytest.mark.parametrize("name", ["default", "123?34!"])
@pytest.mark.parametrize("count", [2, 2 ** 15, 2 ** 20])
def test_send_recv_both_ways(pair, name, count):
    with Group(pair, name) as g:
        for dst in (0, 1):
            src = 1 - dst
            inputs = [np.full(count, r + 1, np.float32) for r in range(2)]
            g.load(inputs)
            refs = [pair[r].recv.remote(name, src) if r == dst else
                    pair[r].send.remote(name, dst) for r in range(2)]
            for result in _get(refs):
                np.testing.assert_array_equal(result, inputs[src])


@needs_torch
def test_send_from_torch_to_numpy(pair):
    with Group(pair) as g:
        g.load([np.zeros(10, np.float32), torch.ones(10) * 2])
        received, sent = _get([pair[0].recv.remote(g.name, 1), pair[1].send.remote(g.name, 0)])
        assert (received == 2).all() and (sent == 2).all()


def test_a_read_only_array_is_written_with_a_warning_at_the_callers_line(pair):
    with Group(pair) as g:
        for warned, total, gathered in g.call("read_only_warnings"):
            assert (total, gathered) == (2.0, [1.0, 1.0])
            # Each warning names the actor's line that called Ray (one per call site),
            # not a line of Ray's collective library or of pycollect.ray.
            # (one warning per read-only array: allgather's two blocks warn at one line)
            assert {name for name, _ in warned} == {"ray_worker.py"}, warned
            assert len(warned) == 3 and len({line for _, line in warned}) == 2, warned


def test_outputs_the_result_cannot_land_in_are_refused(pair):
    """A read-only array that is not Ray's (a bytes object: it was written, changing the
    bytes; a read-only memory map crashed the actor), and non-contiguous outputs of
    allgather and reducescatter (the result landed in a copy, and was lost silently)."""
    with Group(pair) as g:
        for messages, bytes_unchanged in g.call("refused_outputs"):
            assert bytes_unchanged
            assert "allreduce: the array is read-only (not memory of Ray's object store" \
                in messages[0], messages
            for message, what in zip(messages[1:], ("allgather", "reducescatter")):
                assert message is not None and message.startswith(
                    what + ": the array is not contiguous"), messages


def test_barrier(actors):
    with Group(actors) as g:
        assert g.call("barrier") == [True] * g.size


def test_the_declarative_path_and_its_timeout(pair, cluster):
    name = "declared-%d" % next(_names)
    col.create_collective_group(pair, 2, [1, 0], backend="pycollect", group_name=name,
                                gloo_timeout=45000)
    _get([a.reset.remote(2) for a in pair])
    try:
        # The first call makes the group, from what the driver declared.
        results = _get([a.allreduce.remote(name) for a in pair])
        assert all((r == 2).all() for r in results)
        assert _get([a.rank.remote(name) for a in pair]) == [1, 0]
        timeouts = _get([a.context_timeout.remote(name) for a in pair])
        assert timeouts == [45.0, 45.0]
    finally:
        _get([a.leave.remote(name) for a in pair])


def test_the_context_beyond_rays_api(actors):
    with Group(actors) as g:
        results = g.call("beyond_ray")
    size = g.size
    assert results[0][0] == [[r + 1] * 3 for r in range(size)]
    assert all(r[0] is None for r in results[1:])
    assert [r[1] for r in results] == [[2 * r, 2 * r + 1] for r in range(size)]
    assert [r[2] for r in results] == [list(range(size))] * size
    assert all(r[3] == [float(size)] * 4 for r in results)


def test_an_options_timeout_bounds_one_call(pair):
    options = col.types.AllReduceOptions()
    options.timeout_ms = __import__("datetime").timedelta(milliseconds=500)
    with Group(pair) as g:
        started = time.monotonic()
        with pytest.raises(pc.Timeout, match="timeout_ms of 0.5 s"):
            _get(pair[0].group_call.remote("allreduce", options, g.name))   # rank 1 never joins
        assert time.monotonic() - started < 10
        # The group has failed on rank 0: its next call raises at once.
        with pytest.raises(pc.Error, match="failed earlier"):
            _get(pair[0].allreduce.remote(g.name), timeout=10)


def test_a_data_parallel_training_loop(actors):
    with Group(actors) as g:
        weights = g.call("train", 200)
    for w in weights:
        np.testing.assert_array_equal(w, weights[0])
    np.testing.assert_allclose(weights[0], [1.0, -2.0, 0.5, 3.0], atol=1e-3)


# -- failures ----------------------------------------------------------------

def test_an_actor_killed_mid_collective_fails_the_others_naming_its_rank(cluster):
    victims = _actors(3)
    name = "killed-%d" % next(_names)
    # A long group deadline: the error must come from the death, not from the deadline.
    col.create_collective_group(victims, 3, [0, 1, 2], backend="pycollect", group_name=name,
                                gloo_timeout=120000)
    try:
        assert _get([a.barrier.remote(name) for a in victims]) == [True] * 3
        waiting = [a.allreduce_after.remote(0, name) for a in victims[:2]]
        time.sleep(1.0)             # ranks 0 and 1 are now inside the allreduce
        killed_at = time.monotonic()
        ray.kill(victims[2])
        for error, message, _ in _get(waiting, timeout=30):
            assert error == "PeerError", message
            assert "rank 2" in message, message
        assert time.monotonic() - killed_at < 15
    finally:
        for actor in victims[:2]:
            ray.kill(actor)



# -- past one machine ----------------------------------------------------------

CLUSTER_PORT = 6390
CLUSTER_START_S = 90
NODE_STOP_S = 5         # after SIGTERM, before SIGKILL of what is left


def _in_host(namespace, hostname, *command):
    """``command`` inside network namespace ``namespace``, with a UTS namespace of its own."""
    return ["ip", "netns", "exec", namespace, "unshare", "--uts", "sh", "-c",
            'hostname %s && exec "$@"' % hostname, "sh", *command]


@pytest.mark.timeout(300)
def test_a_two_node_cluster_in_network_namespaces(hosts):
    """A head and a worker raylet, each in its own namespace; four actors on both nodes."""
    # Short: Ray's socket paths under it must stay within the 107 bytes of a socket name.
    temp_dir = tempfile.mkdtemp(prefix="pcray")
    ray_command = os.path.join(os.path.dirname(sys.executable), "ray")
    head_ip, worker_ip = "%s.1" % SUBNET, "%s.2" % SUBNET
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYCOLLECT_", "RAY_"))}
    # No token: the machine's one token file may be rewritten by other local clusters
    # between the two nodes' starts, and nothing outside the namespaces reaches them.
    env.update(PYTHONPATH=TESTS_DIR, RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="disabled")
    common = ["--block", "--num-cpus=2", "--object-store-memory=100000000",
              "--disable-usage-stats"]
    head = _in_host(hosts[0], "ray-node1", ray_command, "start", "--head",
                    "--node-ip-address=" + head_ip, "--port=%d" % CLUSTER_PORT,
                    "--include-dashboard=false", "--temp-dir=" + temp_dir,
                    '--resources={"node1": 4}', *common)
    worker = _in_host(hosts[1], "ray-node2", ray_command, "start",
                      "--address=%s:%d" % (head_ip, CLUSTER_PORT),
                      "--node-ip-address=" + worker_ip, '--resources={"node2": 4}', *common)
    nodes = []
    try:
        for command in (head, worker):
            # The worker node retries until the head answers; so does the driver.
            nodes.append(subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.STDOUT, start_new_session=True))
        driver = subprocess.run(
            _in_host(hosts[0], "ray-node1", sys.executable,
                     os.path.join(TESTS_DIR, "ray_cluster_driver.py"),
                     "%s:%d" % (head_ip, CLUSTER_PORT)),
            env=env, capture_output=True, text=True, timeout=CLUSTER_START_S + 120)
    finally:
        # Each node is a process group of its own: its CLI, raylet, GCS and workers.
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for node in nodes:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(node.pid, sig)
            time.sleep(NODE_STOP_S if sig == signal.SIGTERM else 0)
        for node in nodes:
            node.wait(10)
        shutil.rmtree(temp_dir, ignore_errors=True)
    assert driver.returncode == 0, driver.stdout[-3000:] + driver.stderr[-3000:]
    report = json.loads(driver.stdout.strip().splitlines()[-1])
    assert report["hosts"] == ["ray-node1", "ray-node2", "ray-node1", "ray-node2"]
    assert len(set(report["nodes"])) == 2
    # Ranks 1 + 2 + 3 + 4; the large allreduce ran inside each host, then across them.
    assert report["large"] == [["hierarchical", 10.0, 10.0]] * 4
    assert all(row[1:] == [10.0, 10.0] for row in report["small"])
    assert report["ray_api"] == [[4.0 * i for i in range(8)]] * 4
