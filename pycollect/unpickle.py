"""The object collectives' pickles: how they are made, and what may be unpickled.

Unpickling runs code the sender chose: a pickle may name any importable function and call
it (``os.system`` among them).  By default the object collectives unpickle anything, and
are for trusted peers only.  With an allow-list (``PYCOLLECT_UNPICKLE_ALLOW``, or
``Context.unpickle_allow``) a restricted unpickler loads only the globals it names, besides
the plain values pickle builds without any (None, bools, numbers, strings, bytes, tuples,
lists, dicts) and ``SAFE``: the standard library's containers and values, and this module's
rebuilders of NumPy arrays, scalars and dtypes, none of which runs code of the sender's
choosing.  A pickle that reaches any other global is refused there, before that global is
loaded; what it built until then is dropped.

An entry is ``module.name``, one global exactly (``myapp.config.Config``; a nested class as
``myapp.config.Outer.Inner``), or ``module.*``: the classes that module and its submodules
define, by a plain public name (no dots, no leading underscore).  A wildcard admits no
function: a module's functions are reached only by naming each one.

``dumps`` pickles NumPy arrays, scalars and dtypes (of every dtype but ``object``) as their
bytes and a description of their dtype in plain values (``rebuild_array`` and kin), not
through NumPy's own reduction: that one rebuilds a dtype with ``__setstate__`` from the
sender's state, which NumPy trusts (a forged state crashed the receiver, or made an array
whose elements NumPy read as object pointers).  Arrays' bytes travel out of band where the
caller takes buffers (``buffer_callback``), as NumPy's own protocol-5 reduction does.
"""

import _compat_pickle
import collections
import copyreg
import importlib
import io
import pickle
import re
import sys
import types

import numpy as np

from .errors import InvalidArgument, UnpicklingRefused

__all__ = ["SAFE", "parse", "loads_for", "dumps", "rebuild_array", "rebuild_scalar",
           "rebuild_dtype"]

# Globals that build plain values and run nothing of the sender's choosing.
SAFE = frozenset({
    "builtins.set", "builtins.frozenset", "builtins.complex", "builtins.bytearray",
    "builtins.slice", "builtins.range", "collections.OrderedDict", "collections.deque",
    "collections.Counter", "datetime.date", "datetime.time", "datetime.datetime",
    "datetime.timedelta", "datetime.timezone", "decimal.Decimal", "fractions.Fraction",
    "uuid.UUID",
    # NumPy's arrays, scalars and dtypes, as ``dumps`` writes them.
    "pycollect.unpickle.rebuild_array", "pycollect.unpickle.rebuild_scalar",
    "pycollect.unpickle.rebuild_dtype",
})

_ENTRY = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*(\.\*)?")


# -- NumPy values as plain values -----------------------------------------------------------


def _description(dtype):
    """``dtype`` in plain values (strings, ints, tuples, lists and dicts of them): its string
    (``<f8``, ``<M8[ns]``; with NumPy's character where the string names another type, as
    ``<q`` for ``longlong``), a sub-array as (its base, its shape), a structured dtype in
    NumPy's dict form (names, formats, offsets, itemsize, titles, aligned), recursively."""
    if dtype.subdtype is not None:
        base, shape = dtype.subdtype
        return (_description(base), list(shape))
    if dtype.fields is None:
        return dtype.str if np.dtype(dtype.str).type is dtype.type else \
            dtype.str[0] + dtype.char
    fields = [dtype.fields[name] for name in dtype.names]
    return {"names": list(dtype.names), "formats": [_description(f[0]) for f in fields],
            "offsets": [f[1] for f in fields], "itemsize": dtype.itemsize,
            "titles": [f[2] if len(f) > 2 else None for f in fields],
            "aligned": bool(dtype.isalignedstruct)}


def _dtype_of(description):
    """The dtype ``_description`` described: built from plain values only."""
    if isinstance(description, str):
        return np.dtype(description)
    if isinstance(description, (tuple, list)) and len(description) == 2:
        base, shape = description
        if not (isinstance(shape, (tuple, list)) and all(type(n) is int for n in shape)):
            raise TypeError("a sub-array's shape must be ints")
        return np.dtype((_dtype_of(base), tuple(shape)))
    if isinstance(description, dict):
        names, formats = list(description["names"]), description["formats"]
        titles = description.get("titles") or [None] * len(names)
        if not (all(type(n) is str for n in names) and all(
                t is None or type(t) is str for t in titles)
                and all(type(o) is int for o in description["offsets"])
                and type(description["itemsize"]) is int):
            raise TypeError("a structured dtype's names, titles, offsets and itemsize must "
                            "be strings and ints")
        spec = {"names": names, "formats": [_dtype_of(f) for f in formats],
                "offsets": list(description["offsets"]),
                "itemsize": description["itemsize"]}
        if any(t is not None for t in titles):
            spec["titles"] = list(titles)
        return np.dtype(spec, align=description.get("aligned") is True)
    raise TypeError("not a dtype's description")


def _plain_dtype(description):
    """The dtype a sender described; one that holds objects is refused (its bytes would be
    pointers)."""
    try:
        dtype = _dtype_of(description)
    except (TypeError, ValueError, KeyError, RecursionError) as exc:
        raise UnpicklingRefused("%r does not describe a NumPy dtype: %s"
                                % (description, exc)) from None
    if dtype.hasobject:
        raise UnpicklingRefused("a NumPy dtype that holds objects does not travel as bytes")
    return dtype


def rebuild_array(description, shape, order, data):
    """A NumPy array of the described dtype over ``data`` (a buffer), in ``shape`` and
    ``order`` ("C" or "F"), as ``dumps`` wrote it."""
    dtype = _plain_dtype(description)
    if order not in ("C", "F"):
        raise UnpicklingRefused("an array's order must be 'C' or 'F', not %r" % (order,))
    if not isinstance(shape, (tuple, list)) or not all(type(n) is int and n >= 0
                                                       for n in shape):
        raise UnpicklingRefused("an array's shape must be ints >= 0, not %r" % (shape,))
    try:
        return np.ndarray(tuple(shape), dtype, buffer=data, order=order)
    except (TypeError, ValueError) as exc:      # a bad shape, or too few bytes for it
        raise UnpicklingRefused("no array of shape %r and dtype %s over %d bytes: %s"
                                % (shape, dtype, len(memoryview(data)), exc)) from None


def rebuild_scalar(description, data):
    """A NumPy scalar of the described dtype from its bytes (writable: a copy)."""
    return rebuild_array(description, (), "C", data)[()].copy()


def rebuild_dtype(description):
    """A NumPy dtype from its description (``object`` too: a dtype holds no objects)."""
    if description == "|O":
        return np.dtype(object)
    return _plain_dtype(description)


def _metadata(dtype):
    """Whether ``dtype``, or a dtype inside it, carries metadata (any Python objects)."""
    if dtype.metadata:
        return True
    if dtype.subdtype is not None:
        return _metadata(dtype.subdtype[0])
    return any(_metadata(dtype.fields[name][0]) for name in dtype.names or ())


def _plain_description(dtype):
    """``dtype``'s description where it travels as one, else None: it holds no objects nor
    metadata, and the description rebuilds it, its scalar type and alignment too (a
    StringDType, a record dtype or a user-defined one does not)."""
    if dtype.hasobject or _metadata(dtype):
        return None
    try:
        description = _description(dtype)
        rebuilt = _dtype_of(description)
    except (TypeError, ValueError, KeyError):
        return None
    if (rebuilt == dtype and rebuilt.type is dtype.type
            and rebuilt.isalignedstruct == dtype.isalignedstruct):
        return description
    return None


def _reduce_array(arr):
    description = _plain_description(arr.dtype)
    if description is None:
        return arr.__reduce_ex__(5)         # NumPy's own: objects travel as objects
    if arr.flags.c_contiguous:
        order = "C"
    elif arr.flags.f_contiguous:
        order = "F"
    else:
        arr, order = np.ascontiguousarray(arr), "C"
    # Its bytes as uint8 (every dtype exports so; datetimes do not otherwise), in order.
    data = (arr if order == "C" else arr.T).reshape(-1).view(np.uint8)
    return rebuild_array, (description, arr.shape, order, pickle.PickleBuffer(data))


def _reduce_scalar(value):
    description = _plain_description(value.dtype)
    if description is None:
        return value.__reduce_ex__(5)
    return rebuild_scalar, (description, value.tobytes())


def _reduce_dtype(dtype):
    description = "|O" if dtype == np.dtype(object) else _plain_description(dtype)
    if description is None:
        return dtype.__reduce_ex__(5)
    return rebuild_dtype, (description,)


def _numpy_reducers():
    table = {np.ndarray: _reduce_array}
    for kind in set(np.sctypeDict.values()):
        if issubclass(kind, np.generic) and kind is not np.object_:
            table[kind] = _reduce_scalar
    table[type(np.dtype("f8"))] = _reduce_dtype
    for name in dir(getattr(np, "dtypes", None) or ()):
        kind = getattr(np.dtypes, name)
        if isinstance(kind, type) and issubclass(kind, np.dtype):
            table[kind] = _reduce_dtype
    return table


class _Pickler(pickle.Pickler):
    # Exact types only (a subclass of ndarray keeps its own reduction), looked up in C.
    dispatch_table = collections.ChainMap(_numpy_reducers(), copyreg.dispatch_table)


def dumps(obj, buffer_callback=None):
    """``obj`` pickled (protocol 5) as the object collectives send it: NumPy values in
    plain values (``rebuild_array``...), arrays' bytes out of band where the caller takes
    buffers."""
    out = io.BytesIO()
    _Pickler(out, protocol=5, buffer_callback=buffer_callback).dump(obj)
    return out.getvalue()


# -- the allow-list ------------------------------------------------------------------------


def parse(entries):
    """The allow-list ``entries`` (an iterable of names, or one comma-separated string)
    as a sorted tuple; ``InvalidArgument`` names a malformed entry."""
    if isinstance(entries, str):
        entries = entries.split(",")
    try:
        names = [e.strip() if isinstance(e, str) else e for e in entries]
    except TypeError:
        raise InvalidArgument("unpickle allow-list: expected names such as 'myapp.Config' or "
                              "'myapp.*', got %r" % (entries,)) from None
    names = [n for n in names if n != ""]
    for name in names:
        if not isinstance(name, str) or not _ENTRY.fullmatch(name) or "." not in name:
            raise InvalidArgument("unpickle allow-list: %r is not a global's name "
                                  "('module.name') or a module's ('module.*')" % (name,))
    return tuple(sorted(set(names)))


def loads_for(allowed):
    """The function the object collectives unpickle with: ``pickle.loads`` where
    ``allowed`` is None, else one that loads only the globals ``allowed`` (``parse``'s
    tuple) and ``SAFE`` name."""
    if allowed is None:
        return pickle.loads
    exact = SAFE | {n for n in allowed if not n.endswith(".*")}
    modules = tuple(n[:-2] for n in allowed if n.endswith(".*"))

    def under(module):
        return isinstance(module, str) and any(module == m or module.startswith(m + ".")
                                               for m in modules)

    def loads(data, buffers=None):
        return _Restricted(io.BytesIO(data), exact, under, buffers=buffers).load()
    return loads


def _wildcard_class(module, name, under):
    """The class ``module.name`` that a wildcard admits, or None: a plain public name, in
    a module already imported (importing one runs its code: a package's ``__main__``)
    whose every part is public, and a class defined under the wildcard's module."""
    if "." in name or name.startswith("_") or not under(module) or any(
            part.startswith("_") for part in module.split(".")):
        return None
    loaded = sys.modules.get(module)
    if not isinstance(loaded, types.ModuleType):
        return None
    found = vars(loaded).get(name)      # not getattr: a module's __getattr__ may import
    if isinstance(found, type) and under(getattr(found, "__module__", None)):
        return found
    return None


def _named(module, name):
    """The global ``module.name`` that an entry names exactly (a dotted name walks the
    attributes, as pickle does); the module is imported if it is not yet: its name is
    trusted."""
    found = importlib.import_module(module)
    for part in name.split("."):
        if part == "<locals>":
            raise UnpicklingRefused("%s.%s is a local object" % (module, name))
        found = getattr(found, part)
    return found


class _Restricted(pickle._Unpickler):
    """The restricted unpickler.  Its globals: ``find_class``.  The pure-Python unpickler,
    not the C one, so that the opcodes that change an object in place (BUILD, SETITEM(S),
    APPEND(S), ADDITEMS) can refuse a target that is a global it loaded: BUILD on a class
    sets the class's attributes for the whole process (``collections.Counter`` with
    ``most_common = None``), where it should only ever fill the pickle's own new objects."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def __init__(self, file, exact, under, buffers=None):
        super().__init__(file, buffers=buffers)
        self._exact, self._under = exact, under
        self._globals = set()       # the ids of the globals loaded (alive: module-level)

    def find_class(self, module, name):
        if self.proto < 3 and self.fix_imports:     # Python 2's names, as pickle maps them
            if (module, name) in _compat_pickle.NAME_MAPPING:
                module, name = _compat_pickle.NAME_MAPPING[(module, name)]
            elif module in _compat_pickle.IMPORT_MAPPING:
                module = _compat_pickle.IMPORT_MAPPING[module]
        if "%s.%s" % (module, name) in self._exact:
            found = _named(module, name)        # mapped once, above (not again)
        else:
            found = _wildcard_class(module, name, self._under)
            if found is None:
                raise UnpicklingRefused("%s.%s is not in the unpickle allow-list"
                                        % (module, name))
        self._globals.add(id(found))
        return found

    def get_extension(self, code):
        # A copyreg extension code names a global too: it goes through find_class (the
        # cache that pickle.loads fills would hand it over unchecked).
        key = copyreg._inverted_registry.get(code)
        if not key:
            raise UnpicklingRefused("extension code %d is not registered" % code)
        self.append(self.find_class(*key))

    def _changes(self, target):
        if id(target) in self._globals:
            raise UnpicklingRefused("the pickle changes the global %r in place"
                                    % (getattr(target, "__qualname__", None) or target,))

    def load_build(self):
        target = self.stack[-2]
        self._changes(target)
        if isinstance(target, (np.dtype, np.ndarray, np.generic)):
            # NumPy trusts the state it is handed: a forged dtype state crashes the process
            # or makes an array read bytes as object pointers, and an array's state sizes
            # it past the list it holds.  ``dumps`` never sends either.
            raise UnpicklingRefused("the pickle sets the state of a NumPy %s, which NumPy "
                                    "does not check" % type(target).__name__)
        super().load_build()
    dispatch[pickle.BUILD[0]] = load_build

    def load_setitem(self):
        self._changes(self.stack[-3])
        super().load_setitem()
    dispatch[pickle.SETITEM[0]] = load_setitem

    def load_append(self):
        self._changes(self.stack[-2])
        super().load_append()
    dispatch[pickle.APPEND[0]] = load_append

    def _marked(self):
        """The object under the innermost mark: what SETITEMS, APPENDS, ADDITEMS change."""
        return self.metastack[-1][-1] if self.metastack and self.metastack[-1] else None

    def load_setitems(self):
        self._changes(self._marked())
        super().load_setitems()
    dispatch[pickle.SETITEMS[0]] = load_setitems

    def load_appends(self):
        self._changes(self._marked())
        super().load_appends()
    dispatch[pickle.APPENDS[0]] = load_appends

    def load_additems(self):
        self._changes(self._marked())
        super().load_additems()
    dispatch[pickle.ADDITEMS[0]] = load_additems
