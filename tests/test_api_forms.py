"""The forms mpi4py and torch.distributed users reach for: out-of-place and value forms, object
reductions, a per-call timeout, outputs allocated consistently, local rank and size, torch
tensors taken directly, and the small slips that used to give wrong or confusing answers."""

import datetime
import pickle
import threading

import numpy as np
import pytest

import pycollect as pc
from group import ThreadGroup


@pytest.fixture(scope="module")
def trio():
    g = ThreadGroup(3, timeout=30)
    yield g
    g.close()


@pytest.fixture
def own_trio():
    """Three ranks of a test's own, for tests that need a context no earlier test touched."""
    g = ThreadGroup(3, timeout=30)
    yield g
    g.close()


# -- out-of-place and value forms ----------------------------------------------

def test_allreduce_out_of_place_leaves_the_send_buffer_alone(trio):
    def body(ctx):
        send = np.full(4, ctx.rank + 1.0)
        recv = np.zeros(4)
        positional = np.zeros(4)
        out = ctx.allreduce(send, recvbuf=recv)
        also = ctx.allreduce(send, positional, pc.MAX)     # mpi4py's Allreduce order
        return ctx.rank, send, recv, out is recv, positional, also is positional

    for rank, send, recv, same, positional, also in trio.run(body):
        assert np.array_equal(recv, np.full(4, 6.0)) and same and also
        assert np.array_equal(positional, np.full(4, 3.0))
        assert np.array_equal(send, np.full(4, rank + 1.0))      # untouched, every element


def test_the_mpi4py_order_beside_an_algorithm_and_ops_as_numpy_ints(trio):
    """``allreduce(send, recv, algorithm=NAME)`` runs NAME with SUM (it took NAME as the op);
    a NumPy integer op is the op it numbers (it was taken for a recvbuf: SUM, silently)."""
    def body(ctx):
        send, recv = np.full(4, ctx.rank + 1.0), np.zeros(4)
        ctx.allreduce(send, recv, algorithm="ring")
        work = ctx.allreduce(send, np.zeros(4), algorithm="ring", async_op=True)
        value = ctx.allreduce(ctx.rank, op=np.int64(int(pc.MAX)))
        a = np.full(2, ctx.rank + 5)
        ctx.allreduce(a, op=np.int32(int(pc.MIN)))
        return recv.tolist(), work.wait().tolist(), value, a.tolist()

    for recv, waited, value, a in trio.run(body):
        assert recv == waited == [6.0] * 4 and value == 2 and a == [5, 5]


def test_the_mpi4py_order_takes_any_buffer_as_the_recvbuf(trio):
    """``allreduce(send, recv)`` with an array.array or a ctypes array as ``recv`` (it was
    taken for the op: InvalidArgument, unknown reduction op)."""
    import array
    import ctypes

    def body(ctx):
        send = array.array("d", [ctx.rank + 1.0, 2.0])
        recv = array.array("d", [0.0, 0.0])
        ctx.allreduce(send, recv)
        crecv = (ctypes.c_double * 2)()
        ctx.allreduce(send, crecv, pc.MAX)
        return list(recv), list(crecv), list(send)

    for rank, (recv, crecv, send) in enumerate(trio.run(body)):
        assert recv == [6.0, 6.0] and crecv == [3.0, 2.0] and send == [rank + 1.0, 2.0]


def test_a_bool_is_refused_as_a_number(trio):
    """Python's sum of bools counts them; a bool array's is a logical or: a bool number is
    refused, naming what to pass (it met the buffer checks: 'read-only', or 'does not
    support the buffer protocol')."""
    def body(ctx):
        for value in (True, np.bool_(True)):
            for call in (lambda: ctx.allreduce(value), lambda: ctx.reduce(value, 0),
                         lambda: ctx.allreduce(value, op=pc.MAX, async_op=True)):
                with pytest.raises(pc.InvalidArgument, match="a bool is not taken as a "
                                                             "number.*pass int"):
                    call()
        return ctx.allreduce(int(True)), ctx.allreduce(np.ones(1, np.bool_), op=pc.MAX)[0]

    assert trio.run(body) == [(3, True)] * 3


def test_a_number_with_a_recvbuf_is_refused(trio):
    """A number reduces to the number returned; a recvbuf beside it was left unwritten."""
    def body(ctx):
        rb = np.zeros(1)
        for call in (lambda: ctx.allreduce(2.0, rb), lambda: ctx.allreduce(2.0, recvbuf=rb),
                     lambda: ctx.reduce(2.0, 0, recvbuf=rb)):
            with pytest.raises(pc.InvalidArgument, match="a number's result is returned"):
                call()
        return ctx.allreduce(2.0), rb[0]

    assert trio.run(body) == [(6.0, 0.0)] * 3


def test_out_of_place_refuses_a_recvbuf_of_another_shape(trio):
    def body(ctx):
        with pytest.raises(pc.InvalidArgument, match="recvbuf .float64 x 3. must have buf's"):
            ctx.allreduce(np.ones(4), recvbuf=np.zeros(3))
        ctx.barrier()
    trio.run(body)


def test_reduce_out_of_place_on_root(trio):
    def body(ctx):
        send = np.full(2, ctx.rank + 1.0)
        recv = np.zeros(2)
        out = ctx.reduce(send, root=1, recvbuf=recv)
        return ctx.rank, send, out
    for rank, send, out in trio.run(body):
        assert np.array_equal(send, np.full(2, rank + 1.0))
        if rank == 1:
            assert np.array_equal(out, [6.0, 6.0])


def test_numbers_reduce_to_numbers_of_their_type(trio):
    def body(ctx):
        return (ctx.allreduce(3.5), ctx.allreduce(ctx.rank + 1, op=pc.MAX),
                ctx.allreduce(np.float32(0.5)), ctx.reduce(2, root=0),
                ctx.allreduce(1.0, async_op=True).result(timeout=20))

    for rank, (f, i, n, r, w) in enumerate(trio.run(body)):
        assert f == 10.5 and type(f) is float
        assert i == 3 and type(i) is int
        assert n == np.float32(1.5) and type(n) is np.float32
        assert w == 3.0
        if rank == 0:
            assert r == 6 and type(r) is int
        else:
            assert r is None            # not this rank's own number, which it returned


def test_python_ints_sum_exactly_and_a_product_that_may_wrap_is_refused(trio):
    """A Python int travelled as an int64, so 2**62 on each of 3 ranks summed to
    -4611686018427387904 (NumPy's wrap); the sum is now exact, as Python's, and a PRODUCT
    that may not fit raises on every rank that gets it instead of wrapping."""
    big = [2**62, 2**62, -5]
    want = sum(big)                                          # beyond int64
    lows = [-2**63, 2**63 - 1, -2**63]

    def body(ctx):
        return (ctx.allreduce(big[ctx.rank]), ctx.allreduce(lows[ctx.rank]),
                ctx.allreduce(big[ctx.rank], async_op=True).result(timeout=20),
                ctx.reduce(big[ctx.rank], root=2),
                ctx.allreduce([2**20, -2**20, 3][ctx.rank], op=pc.PRODUCT))

    for rank, (total, low, later, rooted, product) in enumerate(trio.run(body)):
        assert total == later == want and type(total) is int
        assert low == sum(lows)
        assert rooted == (want if rank == 2 else None)
        assert product == -3 * 2**40 and type(product) is int

    words = "the PRODUCT of the ranks' Python ints may not fit in an int64"
    factors = [2**31, 2**31, 3]                              # 2**62 * 3 does not fit
    for call in (lambda ctx: ctx.allreduce(factors[ctx.rank], op=pc.PRODUCT),
                 lambda ctx: ctx.allreduce(factors[ctx.rank], op=pc.PRODUCT,
                                           async_op=True).wait(timeout=20)):
        out = trio.outcomes(call)
        assert all(isinstance(o, pc.Error) and words in str(o) for o in out), out
    out = trio.outcomes(lambda ctx: ctx.reduce(factors[ctx.rank], root=0, op=pc.PRODUCT))
    assert isinstance(out[0], pc.Error) and "reduce: " + words in str(out[0]), out
    # Every rank took part: the context goes on.
    assert trio.run(lambda ctx: ctx.allreduce(ctx.rank, op=pc.PRODUCT)) == [0, 0, 0]
    # Products that fit are exact, however close to the edge (a factor of 1 cost a bit, and
    # magnitudes below a power of two were rounded up past it: these were refused).
    for values in ([2**61, 1, 1], [2**31, 2**31 - 1, 1], [2**62, 1, -1], [-2**20, 2**21, 2**21]):
        want = values[0] * values[1] * values[2]
        assert trio.run(lambda ctx: ctx.allreduce(values[ctx.rank], op=pc.PRODUCT)) == \
            [want] * 3, values
    # A NumPy int64 travels as a Python int does, so ranks may pass one each; it keeps
    # NumPy's arithmetic (2**62 three times wraps, as np.int64's sum would).
    for op in (pc.SUM, pc.PRODUCT, pc.MAX):
        got = trio.run(lambda ctx: ctx.allreduce(np.int64(ctx.rank + 2) if ctx.rank else 2,
                                                 op=op))
        assert got == [{pc.SUM: 9, pc.PRODUCT: 24, pc.MAX: 4}[op]] * 3, (op, got)
        assert type(got[0]) is int and all(type(g) is np.int64 for g in got[1:])
    wrapped = trio.run(lambda ctx: ctx.allreduce(np.int64(2**62)))
    assert wrapped == [np.int64(2**62 * 3 - 2**64)] * 3      # what np.int64's sum gives


def test_object_reductions_as_mpi4py_does(trio):
    def body(ctx):
        return (ctx.allreduce_object(0.5 * (ctx.rank + 1)),
                ctx.allreduce_object([ctx.rank]),
                ctx.allreduce_object({"r": ctx.rank}, op=lambda a, b: {"r": a["r"] + b["r"]}),
                ctx.allreduce_object(ctx.rank, op=pc.MIN),
                ctx.reduce_object(2 ** 70 + ctx.rank, root=2))

    for rank, (loss, joined, merged, low, big) in enumerate(trio.run(body)):
        assert loss == 3.0 and joined == [0, 1, 2] and merged == {"r": 3} and low == 0
        assert big == (3 * 2 ** 70 + 3 if rank == 2 else None)


def _merge(a, b):
    return a + b


# Each rank reduced or kept the values itself, so ranks that passed different ops or roots
# each went on with an answer of its own (allreduce_object: 6 on SUM's ranks, 3 on MAX's),
# and no later call noticed.
DISAGREEMENTS = {
    "allreduce_object op": (
        lambda ctx: ctx.allreduce_object(ctx.rank + 1, pc.MAX if ctx.rank == 0 else pc.SUM),
        "allreduce_object: ranks passed different arguments: rank 0 op MAX; rank 1 op SUM; "
        "rank 2 op SUM"),
    "allreduce_object function": (
        lambda ctx: ctx.allreduce_object(ctx.rank, _merge if ctx.rank != 1 else pc.SUM),
        "rank 0 op test_api_forms._merge; rank 1 op SUM; rank 2 op test_api_forms._merge"),
    "reduce_object root": (
        lambda ctx: ctx.reduce_object(ctx.rank, root=1 if ctx.rank == 2 else 0),
        "reduce_object: ranks passed different arguments: rank 0 root 0, op SUM; rank 1 "
        "root 0, op SUM; rank 2 root 1, op SUM"),
    "broadcast_object root": (
        lambda ctx: ctx.broadcast_object("from %d" % ctx.rank, root=2 if ctx.rank == 2 else 0),
        "broadcast_object: ranks passed different arguments: rank 0 root 0; rank 1 root 0; "
        "rank 2 root 2"),
    "gather_object root": (
        lambda ctx: ctx.gather_object(ctx.rank, root=ctx.rank),
        "gather_object: ranks passed different arguments: rank 0 root 0; rank 1 root 1; "
        "rank 2 root 2"),
    "different calls": (
        lambda ctx: ctx.gather_object(1) if ctx.rank == 0 else ctx.broadcast_object(1),
        "ranks made different calls: rank 0 gather_object (root 0); rank 1 broadcast_object "
        "(root 0); rank 2 broadcast_object (root 0)"),
    "scatter_object beside gather_object": (
        lambda ctx: ctx.gather_object(1) if ctx.rank == 2 else ctx.scatter_object([1, 2, 3]),
        "rank 0 scatter_object (root 0); rank 1 scatter_object (root 0); rank 2 gather_object"),
    "allgather_object beside allreduce_object": (
        lambda ctx: ctx.allgather_object(1) if ctx.rank == 1 else ctx.allreduce_object(1),
        "rank 0 allreduce_object (op SUM); rank 1 allgather_object; rank 2 allreduce_object"),
    "scatter_object root": (
        lambda ctx: ctx.scatter_object(["a", "b", "c"], root=1 if ctx.rank == 1 else 0),
        "scatter_object: ranks passed different arguments: rank 0 root 0; rank 1 root 1; "
        "rank 2 root 0"),
}


@pytest.mark.parametrize("case", sorted(DISAGREEMENTS))
def test_object_collectives_fail_every_rank_where_ranks_disagree(trio, case):
    call, words = DISAGREEMENTS[case]
    out = trio.outcomes(call, timeout=30)
    for outcome in out:
        assert isinstance(outcome, pc.MismatchError), out
        assert words in str(outcome), outcome
    # Every rank failed in the same step: the context goes on.
    assert trio.run(lambda ctx: ctx.allreduce_object(ctx.rank + 1)) == [6, 6, 6]
    # The same op named two ways agrees (pc.SUM and its number).
    assert trio.run(lambda ctx: ctx.allreduce_object(1, pc.SUM if ctx.rank else 0)) == [3] * 3


def test_per_call_timeout_bounds_that_call_only(trio):
    gate = threading.Event()

    def body(ctx):
        if ctx.rank == 0:
            with pytest.raises(pc.Timeout, match="timed out after 0.3 s"):
                ctx.barrier(timeout=0.3)
            gate.set()
            return None
        gate.wait(20)
        return None

    g = ThreadGroup(2, timeout=30)
    try:
        g.run(body)
    finally:
        g.close()
    def refused(ctx):   # on every rank: a call refused on one rank only fails the others
        with pytest.raises(pc.InvalidArgument, match="timeout must be a positive"):
            ctx.allreduce(np.ones(1), timeout=-1)
    trio.run(refused)
    trio.run(lambda ctx: ctx.allreduce(np.ones(1), timeout=datetime.timedelta(seconds=20)))


# -- outputs allocated consistently (item 3) ------------------------------------

def test_gatherv_allocates_on_root_as_gather_does(trio):
    counts = [1, 2, 3]

    def body(ctx):
        mine = np.full(counts[ctx.rank], float(ctx.rank))
        out = ctx.gatherv(mine, None, counts, root=0)
        ctx.barrier()       # still in step everywhere
        return out

    out = trio.run(body)
    assert np.array_equal(out[0], [0, 1, 1, 2, 2, 2]) and out[1] is None and out[2] is None


def test_v_collectives_allocate_their_outputs(trio):
    counts = [1, 2, 3]

    def body(ctx):
        mine = np.full(counts[ctx.rank], float(ctx.rank))
        everywhere = ctx.allgatherv(mine, None, counts)
        part = ctx.reduce_scatterv(np.ones(6), None, counts)
        swapped = ctx.alltoallv(np.full(6, float(ctx.rank)), [2, 2, 2], None, [2, 2, 2])
        block = ctx.scatterv(np.arange(6.0), counts, None, root=0)
        rows = ctx.scatter(np.arange(6.0).reshape(3, 2), None, root=0)
        return everywhere, part, swapped, block, rows

    for rank, (everywhere, part, swapped, block, rows) in enumerate(trio.run(body)):
        assert np.array_equal(everywhere, [0, 1, 1, 2, 2, 2])
        assert np.array_equal(part, np.full(counts[rank], 3.0))
        assert np.array_equal(swapped, [0, 0, 1, 1, 2, 2])
        assert np.array_equal(block, np.arange(6.0)[sum(counts[:rank]):sum(counts[:rank + 1])])
        assert np.array_equal(rows, [2 * rank, 2 * rank + 1])


def test_outputs_allocated_from_bytes_are_uint8(trio):
    """``bytes`` and ``'c'`` memoryviews count as uint8 (api.md); an output allocated from one
    is uint8 too (it was refused: "recvbuf has unsupported dtype |S18", a recvbuf never
    passed, and reduce_scatter counted bytes(18) as 1 element)."""
    def body(ctx):
        data = bytes(range(6 * ctx.size))
        chars = memoryview(bytearray(data)).cast("c")
        return [ctx.allgather(data), ctx.allgather(chars), ctx.reduce_scatter(data),
                ctx.alltoall(data), ctx.allgatherv(data, None, [len(data)] * ctx.size),
                ctx.reduce_scatterv(data, None, [6] * ctx.size),
                ctx.alltoallv(data, [6] * ctx.size, None, [6] * ctx.size),
                ctx.gather(data, root=0)]

    for rank, out in enumerate(trio.run(body)):
        everyone = np.tile(np.arange(18, dtype=np.uint8), (3, 1))
        assert all(a is None or a.dtype == np.uint8 for a in out)
        assert np.array_equal(out[0], everyone) and np.array_equal(out[1], everyone)
        assert np.array_equal(out[2], 3 * np.arange(6 * rank, 6 * rank + 6))
        assert np.array_equal(out[3], np.tile(np.arange(6 * rank, 6 * rank + 6), 3))
        assert np.array_equal(out[4], everyone.ravel())
        assert np.array_equal(out[5], out[2]) and np.array_equal(out[6], out[3])
        assert np.array_equal(out[7], everyone) if rank == 0 else out[7] is None


def test_reduce_scatter_keeps_the_shape_of_a_block(trio):
    shapes = trio.run(lambda ctx: ctx.reduce_scatter(np.ones((6, 2))).shape)
    assert shapes == [(2, 2)] * 3


@pytest.mark.parametrize("objs, words", [
    (lambda ctx: [1, 2], "rank 0 refused its arguments: root passed 2 objects for 3 ranks"),
    (lambda ctx: [1, threading.Lock(), 3], "rank 0 refused its arguments: TypeError"),
])
def test_scatter_object_refused_on_root_fails_every_rank_naming_the_call(trio, objs, words):
    def body(ctx):
        with pytest.raises(pc.InvalidArgument) as info:
            ctx.scatter_object(objs(ctx) if ctx.rank == 0 else None)
        assert str(info.value).startswith("scatter_object: ") and words in str(info.value)
        assert info.value.caused_elsewhere is (ctx.rank != 0)     # the root's own refusal
        return ctx.scatter_object(["a", "b", "c"] if ctx.rank == 0 else None)

    assert trio.run(body) == ["a", "b", "c"]


def test_an_object_one_rank_cannot_pickle_fails_every_rank(trio):
    def body(ctx):
        for call in (ctx.allgather_object, ctx.gather_object):
            with pytest.raises(pc.InvalidArgument, match="rank 1 refused its arguments: "
                                                         "TypeError: cannot pickle") as info:
                call(threading.Lock() if ctx.rank == 1 else ctx.rank)
            assert info.value.caused_elsewhere is (ctx.rank != 1)
        with pytest.raises(pc.InvalidArgument, match="broadcast_object: rank 2 refused"):
            ctx.broadcast_object(threading.Lock() if ctx.rank == 2 else None, root=2)
        return ctx.allgather_object(ctx.rank)

    assert trio.run(body) == [[0, 1, 2]] * 3


def test_errors_inside_an_object_collective_name_the_users_call():
    g = ThreadGroup(2, timeout=30)
    try:
        def body(ctx):
            if ctx.rank == 0:
                with pytest.raises(pc.Timeout) as info:
                    ctx.broadcast_object(root=1, timeout=0.3)
                return str(info.value)
            return None
        message = g.run(body)[0]
        assert message.startswith("broadcast_object: rank 0: "), message
    finally:
        g.close()


# -- conveniences (item 8) ------------------------------------------------------

def test_local_rank_and_size_count_the_ranks_of_this_host(trio):
    assert trio.run(lambda ctx: (ctx.local_rank, ctx.local_size)) == [(0, 3), (1, 3), (2, 3)]


def test_the_transport_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("PYCOLLECT_TRANSPORT", "no-such-transport")
    with pytest.raises(pc.PluginError, match="no-such-transport"):
        pc.init(rank=0, size=1)
    monkeypatch.setenv("PYCOLLECT_TRANSPORT", "tcp")
    with pc.init(rank=0, size=1) as ctx:
        assert ctx.allreduce(2.0) == 2.0


def test_torch_tensors_are_taken_directly(trio):
    torch = pytest.importorskip("torch")

    def body(ctx):
        t = torch.full((4,), float(ctx.rank + 1))
        ctx.allreduce(t)
        strided = torch.zeros(4, 2)[:, 0]           # not contiguous: staged, copied back
        strided += ctx.rank + 1
        ctx.allreduce(strided, async_op=True).wait(20)
        gathered = ctx.allgather(torch.tensor([ctx.rank], dtype=torch.int32))
        half = torch.ones(2, dtype=torch.bfloat16)
        ctx.allreduce(half)
        return t, strided, gathered, half

    for t, strided, gathered, half in trio.run(body):
        assert torch.equal(t, torch.full((4,), 6.0))
        assert torch.equal(strided, torch.full((4,), 6.0))
        assert isinstance(gathered, torch.Tensor)
        assert gathered.reshape(-1).tolist() == [0, 1, 2]
        assert half.dtype == torch.bfloat16 and half.tolist() == [3.0, 3.0]


def test_a_tensor_whose_elements_share_memory_is_refused_as_an_output(trio):
    """``expand`` makes a tensor whose elements share memory: refused before anything goes
    out where the collective would write it (torch's copy back raised a bare RuntimeError
    after the collective had run); read only, it is taken."""
    torch = pytest.importorskip("torch")

    def body(ctx):
        wide = torch.ones(1, 4).expand(3, 4)
        for call in (lambda: ctx.allreduce(wide), lambda: ctx.broadcast(wide, root=0),
                     lambda: ctx.allreduce(torch.ones(3, 4), recvbuf=wide)):
            with pytest.raises(pc.InvalidArgument, match="elements share memory .strides "
                                                         r"\(0, 1\)\)"):
                call()
        return ctx.allgather(wide).shape, ctx.allreduce(wide.clone()).tolist()

    for shape, summed in trio.run(body):
        assert tuple(shape) == (3, 3, 4) and summed == [[3.0] * 4] * 3


# -- smaller slips (item 4) -----------------------------------------------------

def test_unknown_algorithms_list_every_choice(trio):
    ctx = trio.contexts[0]
    with pytest.raises(pc.InvalidArgument, match="ring_chunked.*hierarchical"):
        ctx.allreduce(np.ones(2), algorithm="tree")
    with pytest.raises(pc.InvalidArgument, match="pipelined.*hierarchical"):
        ctx.broadcast(np.ones(2), algorithm="tree")


def test_group_and_split_arguments_are_named(trio):
    ctx = trio.contexts[0]
    with pytest.raises(pc.InvalidArgument, match="new_group: rank 5 is not a rank"):
        ctx.new_group([5])
    with pytest.raises(pc.InvalidArgument, match="split: color must be an int or None, "
                                                 "got 'a'"):
        ctx.split("a")
    with pytest.raises(pc.InvalidArgument, match="split: key must be an int, got 1.5"):
        ctx.split(0, key=1.5)


def test_a_closed_context_refuses_with():
    ctx = pc.init(rank=0, size=1)
    ctx.close()
    with pytest.raises(pc.Error, match="the context is closed"):
        with ctx:
            pass


def test_number_forms_and_objects_do_not_pickle_numbers(monkeypatch):
    # Numbers travel as one-element arrays, never pickled: with pickle out of order, the
    # number forms still work on 2 ranks (the object forms, which pickle by name, do not).
    import pickle
    import pycollect.unpickle
    from group import ThreadGroup

    def no_pickle(*args, **kwargs):
        raise AssertionError("pickle used")

    g = ThreadGroup(2, timeout=20)
    try:
        # The object collectives pickle through pycollect.unpickle.dumps (a pickle.Pickler).
        monkeypatch.setattr(pycollect.unpickle, "dumps", no_pickle)
        monkeypatch.setattr(pickle, "Pickler", no_pickle)
        monkeypatch.setattr(pickle, "loads", no_pickle)
        got = g.run(lambda ctx: (ctx.allreduce(3.5), ctx.reduce(ctx.rank + 2, root=0)))
        assert got[0] == (7.0, 5) and got[1][0] == 7.0, got
        with pytest.raises(pc.InvalidArgument, match="pickle used"):
            g.run(lambda ctx: ctx.allreduce_object(3.5))
    finally:
        monkeypatch.undo()
        g.close()
    with pc.init(rank=0, size=1) as ctx:
        with pytest.raises(pc.InvalidArgument, match="does not fit in an int64; use "
                                                     "allreduce_object"):
            ctx.allreduce(2 ** 70)


@pytest.mark.parametrize("call, words", [
    (lambda ctx, bad: ctx.broadcast_object("x", root=7 if bad else 0),
     "broadcast_object: rank 1 refused its arguments: root 7 is not a rank"),
    (lambda ctx, bad: ctx.gather_object("x", root=-1 if bad else 0),
     "gather_object: rank 1 refused its arguments: root -1 is not a rank"),
    (lambda ctx, bad: ctx.scatter_object(["x"] * 3 if ctx.rank == 0 else None,
                                         root=3 if bad else 0),
     "scatter_object: rank 1 refused its arguments: root 3 is not a rank"),
    (lambda ctx, bad: ctx.reduce_object(1, root=None if bad else 0),
     "reduce_object: rank 1 refused its arguments: root None is not a rank"),
    (lambda ctx, bad: ctx.allreduce_object(1, op=pc.AVG if bad else pc.SUM),
     "allreduce_object: rank 1 refused its arguments: op .*AVG.* has no meaning"),
    (lambda ctx, bad: ctx.reduce_object(1, op=None if bad else pc.SUM),
     "reduce_object: rank 1 refused its arguments: .*op"),
    (lambda ctx, bad: ctx.allgather_object(1, timeout=-1 if bad else None),
     "allgather_object: rank 1 refused its arguments: timeout must be a positive"),
    (lambda ctx, bad: ctx.broadcast_object(1, timeout="soon" if bad else 30),
     "broadcast_object: rank 1 refused its arguments: .*timeout"),
])
def test_a_root_op_or_timeout_one_rank_refuses_fails_every_rank_alike(own_trio, call, words):
    """One rank's root, op or timeout out of place travels in the first exchange: every
    rank raises its InvalidArgument and the next object collective is in step (the refusing
    rank raised alone, and the others' call met its next one: wrong data, or ranks out of
    step for good)."""
    def body(ctx):
        with pytest.raises(pc.InvalidArgument, match=words) as info:
            call(ctx, ctx.rank == 1)
        assert info.value.caused_elsewhere is (ctx.rank != 1)
        return ctx.allgather_object("after %d" % ctx.rank)

    assert own_trio.run(body) == [["after 0", "after 1", "after 2"]] * 3


def test_an_op_that_fails_on_the_values_raises_invalid_argument_on_every_rank(own_trio):
    def fails(a, b):
        raise KeyError("no")

    def body(ctx):
        with pytest.raises(pc.InvalidArgument, match="allreduce_object: the op failed on the "
                                                     "ranks' values: TypeError: unsupported"):
            ctx.allreduce_object({"k": ctx.rank})
        with pytest.raises(pc.InvalidArgument, match="KeyError") as info:
            ctx.allreduce_object(1, op=fails)
        assert isinstance(info.value.__cause__, KeyError)
        if ctx.rank == 0:
            with pytest.raises(pc.InvalidArgument, match="reduce_object: the op failed"):
                ctx.reduce_object({"k": 1})
        else:
            assert ctx.reduce_object({"k": 1}) is None
        return ctx.allreduce_object(ctx.rank)

    assert own_trio.run(body) == [3] * 3
