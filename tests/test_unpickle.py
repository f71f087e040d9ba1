"""The unpickle allow-list of the object collectives (pycollect/unpickle.py): with it, a
pickle that reaches a global outside the list is refused before that global loads, on
every object collective; plain values, the standard library's containers, NumPy arrays and
the globals named load; a module wildcard admits its classes only; the list comes from
PYCOLLECT_UNPICKLE_ALLOW or Context.unpickle_allow and passes to sub-groups."""

import collections
import copyreg
import datetime
import fractions
import os
import pickle
import sys

import numpy as np
import pytest

import pycollect as pc
from group import ThreadGroup
from pycollect import unpickle


class Point:
    def __init__(self, x, y):
        self.x, self.y = x, y

    def __eq__(self, other):
        return (self.x, self.y) == (other.x, other.y)


class Planted:
    """Unpickling it creates ``path``: the payload a hostile peer would send."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (os.makedirs, (self.path, 0o777, True))     # exist_ok: every receiver runs it


@pytest.fixture(scope="module")
def trio():
    g = ThreadGroup(3, timeout=30)
    yield g
    g.close()


@pytest.fixture
def allowed(trio):
    for ctx in trio.contexts:
        ctx.unpickle_allow = ["test_unpickle.Point"]
    yield trio
    for ctx in trio.contexts:
        ctx.unpickle_allow = None


PLAIN = {"n": None, "b": True, "i": 2**70, "f": 1.5, "c": 1j, "s": "x", "by": b"\0",
         "t": (1, [2, {3: 4}]), "set": {1, 2}, "fs": frozenset({3}), "ba": bytearray(b"ab"),
         "od": collections.OrderedDict(a=1), "dq": collections.deque([1]),
         "when": datetime.datetime(2026, 12, 6, 5, 0), "frac": fractions.Fraction(1, 3),
         "r": range(3), "sl": slice(1, 2)}


def test_plain_values_the_standard_containers_and_the_globals_named_load(allowed):
    def body(ctx):
        values = dict(PLAIN, arr=np.arange(4.0), point=Point(ctx.rank, 1))
        got = ctx.allgather_object(values)
        return got, ctx.broadcast_object(values if ctx.rank == 1 else None, root=1)

    for got, from_one in allowed.run(body):
        for rank, values in enumerate(got):
            assert values["point"] == Point(rank, 1)
            assert np.array_equal(values["arr"], np.arange(4.0))
            assert {k: values[k] for k in PLAIN} == PLAIN
        assert from_one["point"] == Point(1, 1)


CALLS = {
    "broadcast_object": (lambda ctx, bad: ctx.broadcast_object(
        bad if ctx.rank == 0 else None, root=0), {0: "ok"}),
    "allgather_object": (lambda ctx, bad: ctx.allgather_object(
        bad if ctx.rank == 2 else ctx.rank), {}),
    "gather_object": (lambda ctx, bad: ctx.gather_object(
        bad if ctx.rank == 1 else ctx.rank, root=2), {0: None, 1: None}),
    "scatter_object": (lambda ctx, bad: ctx.scatter_object(
        [0, bad, 2] if ctx.rank == 0 else None, root=0), {0: 0, 2: 2}),
    "allreduce_object": (lambda ctx, bad: ctx.allreduce_object(
        bad if ctx.rank == 1 else [ctx.rank]), {}),
    "reduce_object": (lambda ctx, bad: ctx.reduce_object(
        bad if ctx.rank == 0 else [ctx.rank], root=1), {0: None, 2: None}),
}


@pytest.mark.parametrize("what", sorted(CALLS))
def test_a_global_outside_the_list_is_refused_before_it_runs(allowed, what, tmp_path):
    call, others = CALLS[what]
    target = str(tmp_path / "planted")
    out = allowed.outcomes(lambda ctx: call(ctx, Planted(target)))
    assert not os.path.exists(target)           # the payload never ran
    sender = {"broadcast_object": 0, "allgather_object": 2, "gather_object": 1,
              "scatter_object": 0, "allreduce_object": 1, "reduce_object": 0}[what]
    for rank, outcome in enumerate(out):
        if rank in others:
            if others[rank] != "ok":
                assert outcome == others[rank], out
            continue
        assert isinstance(outcome, pc.UnpicklingRefused), out
        assert isinstance(outcome, pc.Error)
        assert str(outcome) == ("%s: rank %d did not unpickle the object from rank %d: "
                                "os.makedirs is not in the unpickle allow-list"
                                % (what, rank, sender)), outcome
    # Every rank finished the collective: the group goes on.
    assert allowed.run(lambda ctx: ctx.allreduce_object(ctx.rank)) == [3, 3, 3]


def test_without_a_list_anything_unpickles(trio, tmp_path):
    target = str(tmp_path / "ran")
    assert trio.contexts[0].unpickle_allow is None
    trio.run(lambda ctx: ctx.broadcast_object(Planted(target) if ctx.rank == 0 else None))
    assert os.path.isdir(target)                # trusted peers only: the default's contract


def test_the_variable_sets_the_list_and_sub_groups_take_it(monkeypatch, tmp_path):
    monkeypatch.setenv("PYCOLLECT_UNPICKLE_ALLOW", " myapp.* , test_unpickle.Point,")
    g = ThreadGroup(2, timeout=30)
    try:
        assert [ctx.unpickle_allow for ctx in g.contexts] == \
            [("myapp.*", "test_unpickle.Point")] * 2
        monkeypatch.delenv("PYCOLLECT_UNPICKLE_ALLOW")
        subs = g.run(lambda ctx: ctx.new_group([1, 0]))
        assert [s.unpickle_allow for s in subs] == [("myapp.*", "test_unpickle.Point")] * 2
        target = str(tmp_path / "planted")
        out = g.outcomes(lambda ctx: subs[ctx.rank].broadcast_object(
            Planted(target) if ctx.rank == 1 else Point(0, 0), root=0))
        assert isinstance(out[0], pc.UnpicklingRefused) and not os.path.exists(target), out
        assert g.run(lambda ctx: subs[ctx.rank].broadcast_object(
            Point(ctx.rank, 2), root=0)) == [Point(1, 2)] * 2
    finally:
        g.close()
    monkeypatch.setenv("PYCOLLECT_UNPICKLE_ALLOW", "os.")
    with pytest.raises(pc.InvalidArgument, match="PYCOLLECT_UNPICKLE_ALLOW='os.' is not"):
        pc.init(rank=0, size=1, store="hash://unpickle-bad")


def test_entries_are_checked_and_a_module_entry_covers_its_submodules():
    assert unpickle.parse("b.c, a.*,,b.c") == ("a.*", "b.c")
    assert unpickle.parse(["x.Y.Inner"]) == ("x.Y.Inner",)
    for bad in ("os", "os.", "*.x", "a.b*", "a b.c", "1a.b", [3], 5):
        with pytest.raises(pc.InvalidArgument, match="unpickle allow-list"):
            unpickle.parse(bad)
    loads = unpickle.loads_for(("collections.*",))
    assert loads(pickle.dumps(collections.ChainMap({1: 2}))) == collections.ChainMap({1: 2})
    with pytest.raises(pc.UnpicklingRefused, match="collections.ChainMap"):
        unpickle.loads_for(("collection.*",))(pickle.dumps(collections.ChainMap({1: 2})))
    with pytest.raises(pc.UnpicklingRefused, match="builtins.eval"):
        loads(b"cbuiltins\neval\n(S'1'\ntR.")                 # protocol 0: eval('1')


class RunString:
    """A NumPy function that execs its argument: a wildcard must not reach it."""

    def __reduce__(self):
        from numpy.testing._private import utils
        return (utils.runstring, ("import os; os.makedirs(%r)" % PLANTED, {}))


PLANTED = os.path.join(os.path.dirname(os.path.abspath(__file__)), ".never-made")


@pytest.mark.parametrize("payload, allow", [
    # A dotted name walks attributes: every Python module's __builtins__ reaches eval.
    (b"\x80\x04\x8c\x04json\x8c\x10__builtins__.get\x93\x8c\x04eval\x85R"
     b"\x8c\x1b__import__('os').makedirs(%r)\x85R." % PLANTED.encode(), "json.*"),
    (pickle.dumps(RunString(), protocol=2), "numpy.*"),
    (pickle.dumps(RunString(), protocol=5), "numpy.testing.*"),
])
def test_a_wildcard_admits_classes_and_no_way_to_a_function(payload, allow):
    loads = unpickle.loads_for(unpickle.parse(allow))
    with pytest.raises(pc.UnpicklingRefused, match="is not in the unpickle allow-list"):
        loads(payload)
    assert not os.path.exists(PLANTED)
    # What a wildcard is for: the module's classes; NumPy's arrays load without one.
    assert unpickle.loads_for(("test_unpickle.*",))(pickle.dumps(Point(1, 2), protocol=5)) \
        == Point(1, 2)
    assert unpickle.loads_for(())(unpickle.dumps(np.float32(2))) == 2


def test_a_pickle_may_not_change_a_global_it_loaded():
    """BUILD on a class set its attributes for the whole process (Counter.most_common =
    None, with no allow-list at all); the opcodes that change an object in place refuse a
    target that is a global, and still fill the pickle's own objects."""
    loads = unpickle.loads_for(())
    attacks = [
        b"ccollections\nCounter\n(N}S'most_common'\nNtb.",           # BUILD, slot state
        b"ccollections\nCounter\n}S'most_common'\nNsb.",             # SETITEM on a class
        b"ccollections\nOrderedDict\n(S'k'\nI1\nu.",                # SETITEMS
        b"ccollections\ndeque\nI1\na.",                              # APPEND
    ]
    for attack in attacks:
        with pytest.raises(pc.UnpicklingRefused, match="changes the global"):
            loads(attack)
    assert collections.Counter("aab").most_common() == [("a", 2), ("b", 1)]
    filled = {"od": collections.OrderedDict(a=[1, 2]), "c": collections.Counter("ab"),
              "dq": collections.deque([1]), "s": {frozenset({1})}, "p": Point(1, 2)}
    assert unpickle.loads_for(("test_unpickle.Point",))(pickle.dumps(filled, protocol=5)) \
        == filled
    assert unpickle.loads_for(("test_unpickle.Point",))(pickle.dumps(filled, protocol=2)) \
        == filled


def test_a_wildcard_imports_nothing_and_skips_private_modules(tmp_path, monkeypatch):
    """A wildcard found its class by importing the module first: numpy.* ran
    numpy.f2py.__main__ (it exited the process)."""
    runs_main = b"\x80\x04\x8c\x13numpy.f2py.__main__\x94\x8c\x01X\x94\x93\x94."
    (tmp_path / "planted_mod.py").write_text(
        "import pathlib\npathlib.Path(%r).touch()\nclass Thing:\n    pass\n"
        % str(tmp_path / "imported"))
    monkeypatch.syspath_prepend(str(tmp_path))
    thing = b"cplanted_mod\nThing\n)\x81."                       # Thing() by NEWOBJ
    for allow, payload in (("numpy.*", runs_main), ("planted_mod.*", thing),
                           ("numpy.*", b"cnumpy._core.records\nrecarray\n.")):
        with pytest.raises(pc.UnpicklingRefused, match="is not in the unpickle allow-list"):
            unpickle.loads_for((allow,))(payload)
    assert not (tmp_path / "imported").exists()             # nothing ran on import
    # Once the program has imported the module, its classes load by their plain names.
    __import__("planted_mod")
    try:
        assert type(unpickle.loads_for(("planted_mod.*",))(thing)).__name__ == "Thing"
    finally:
        del sys.modules["planted_mod"]


NUMPY_VALUES = [np.arange(6.0).reshape(2, 3), np.asfortranarray(np.arange(6.0).reshape(2, 3)),
                np.arange(10)[::-2], np.zeros(0, "f4"), np.zeros((0, 3)), np.zeros(()),
                np.array(["ab", "c"]), np.zeros(2, dtype=[("a", "<f4"), ("b", "i8", (2,))]),
                np.array([1, 2], ">i4"), np.array([np.datetime64("2026-01-01")]),
                np.zeros(2, np.dtype([("a", "u1"), ("b", "f8")], align=True)),
                np.zeros(2, [("a", "i4"), ("b", "f8")])[["b", "a"]],        # out of order
                np.zeros(3, [("a", "i4"), ("b", "i4"), ("c", "i4")])[["a", "c"]],  # a gap
                np.zeros(2, np.dtype(("i4", (2,)))), np.zeros(2, np.dtype(
                    {"names": ["x"], "formats": ["f4"], "titles": ["T"]})),
                np.zeros(2, [("n", [("p", "u1"), ("q", "<f2")]), ("r", "S3")]),
                np.zeros(2, "V8"), np.float32(1.5), np.int64(-3), np.longlong(5),
                np.bool_(True), np.complex128(1 + 2j), np.datetime64("2026-01-01T00:00"),
                np.str_(""), np.bytes_(b""), np.zeros(1, "U3")[0], np.zeros(1, [("a", "i4")])[0],
                np.dtype("f4"), np.dtype("q"), np.dtype([("x", "u1")], align=True),
                np.dtype(object)]


@pytest.mark.parametrize("value", NUMPY_VALUES, ids=lambda v: "%s-%s" % (
    type(v).__name__, getattr(v, "dtype", v)))
def test_numpy_values_travel_as_plain_values_and_load_under_any_list(value):
    """dumps writes NumPy arrays, scalars and dtypes as bytes and a dtype described in
    plain values, which every allow-list loads, NumPy's own reduction left out."""
    for loads in (pickle.loads, unpickle.loads_for(())):
        got = loads(unpickle.dumps(value))
        assert type(got) is type(value)
        if isinstance(value, (np.ndarray, np.dtype, np.generic)):
            kind = value if isinstance(value, np.dtype) else value.dtype
            assert (got if isinstance(got, np.dtype) else got.dtype) == kind
            assert (got if isinstance(got, np.dtype) else got.dtype).type is kind.type
            assert (got if isinstance(got, np.dtype) else got.dtype).isalignedstruct == \
                kind.isalignedstruct
        if isinstance(value, np.void):
            assert got.tobytes() == value.tobytes()
            if value.dtype.names:
                got[value.dtype.names[0]] = 1   # writable, as NumPy's own gives it
        elif isinstance(value, np.ndarray):
            assert got.dtype == value.dtype and got.shape == value.shape
            assert np.array_equal(got, value) and got.flags.writeable
            if value.flags.c_contiguous or value.flags.f_contiguous:
                assert got.flags.f_contiguous == value.flags.f_contiguous
        else:
            assert got == value
    buffers = []
    data = unpickle.dumps(np.arange(1000.0), buffer_callback=buffers.append)
    assert len(buffers) == 1 and len(data) < 400            # the bytes went out of band
    assert np.array_equal(unpickle.loads_for(())(data, buffers=[b.raw() for b in buffers]),
                          np.arange(1000.0))
    objects = np.array([1, "a"], dtype=object)              # objects travel as objects
    assert list(pickle.loads(unpickle.dumps(objects))) == [1, "a"]
    with pytest.raises(pc.UnpicklingRefused, match="_reconstruct"):
        unpickle.loads_for(())(unpickle.dumps(objects))
    if hasattr(np, "dtypes") and hasattr(np.dtypes, "StringDType"):   # NumPy's own form
        strings = np.array(["ab", "c"], dtype=np.dtypes.StringDType())
        assert list(pickle.loads(unpickle.dumps(strings))) == ["ab", "c"]
        assert pickle.loads(unpickle.dumps(strings.dtype)) == strings.dtype


def test_numpy_internals_and_extension_codes_are_not_a_way_around():
    """NumPy's own dtype reduction trusts the sender's state: this 53-byte pickle crashed
    the receiving process (a datetime dtype's state without its metadata), and a forged
    object dtype made NumPy read bytes as object pointers.  A copyreg extension code
    reached a global without find_class once pickle.loads had cached it.  A wildcard
    fetched its class with getattr, whose module __getattr__ imports (numpy.f2py)."""
    loads = unpickle.loads_for(("numpy.*",))
    crash = (b"\x80\x03cnumpy\ndtype\nX\x02\x00\x00\x00m8\x89\x88\x87R(K\x03X\x01\x00\x00"
             b"\x00<NNNJ\xff\xff\xff\xffJ\xff\xff\xff\xffK\x00tb.")
    with pytest.raises(pc.UnpicklingRefused, match="numpy.dtype is not in"):
        unpickle.loads_for(())(crash)
    with pytest.raises(pc.UnpicklingRefused, match="sets the state of a NumPy"):
        loads(crash)                            # numpy.* admits numpy.dtype, not its state

    class Oversized:
        """A SAFE rebuilder's array, then BUILD with an object dtype sized past its list:
        NumPy read pointers beyond it (a segfault at 100 elements)."""

        def __reduce__(self):
            return (unpickle.rebuild_array, ("|u1", (1,), "C", b"\0"),
                    (1, (100,), np.dtype(object), False, [1]))

    with pytest.raises(pc.UnpicklingRefused, match="sets the state of a NumPy ndarray"):
        unpickle.loads_for(())(unpickle.dumps(Oversized()))
    for shape in ((-1,), (10**12,), 5, (True,)):
        with pytest.raises(pc.UnpicklingRefused):
            unpickle.rebuild_array("<f8", shape, "C", b"\0" * 8)
    for forged in (["|O"], [("a", "|O")], "no such dtype"):
        with pytest.raises(pc.UnpicklingRefused):
            unpickle.rebuild_array(forged, (1,), "C", b"AAAAAAAA")
    before = "numpy.f2py" in sys.modules
    with pytest.raises(pc.UnpicklingRefused, match="numpy.f2py is not in"):
        loads(b"\x80\x03cnumpy\nf2py\n.")
    assert ("numpy.f2py" in sys.modules) == before
    copyreg.add_extension("os", "getcwd", 0x7ff1)
    try:
        pickle.loads(b"\x80\x02\x83\xf1\x7f)R.")     # fills copyreg's cache of the code
        with pytest.raises(pc.UnpicklingRefused, match="os.getcwd is not in"):
            unpickle.loads_for(())(b"\x80\x02\x83\xf1\x7f)R.")
    finally:
        copyreg.remove_extension("os", "getcwd", 0x7ff1)
