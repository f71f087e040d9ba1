"""What the object collectives may unpickle: anything, or only the globals of an allow-list.

Unpickling runs code the sender chose: a pickle may name any importable function and call
it (``os.system`` among them).  By default the object collectives unpickle anything, and
are for trusted peers only.  With an allow-list (``PYCOLLECT_UNPICKLE_ALLOW``, or
``Context.unpickle_allow``) a restricted unpickler loads only the globals it names, besides
the plain values pickle builds without any (None, bools, numbers, strings, bytes, tuples,
lists, dicts) and ``SAFE``: the standard library's containers and values, and what NumPy
arrays, scalars and dtypes are rebuilt with, none of which runs code of the sender's
choosing.  A pickle that reaches any other global is refused there, before that global is
loaded; what it built until then is dropped.

An entry is ``module.name``, one global exactly (``myapp.config.Config``; a nested class as
``myapp.config.Outer.Inner``), or ``module.*``: the classes that module and its submodules
define, by a plain public name (no dots, no leading underscore).  A wildcard admits no
function: a module's functions are reached only by naming each one.
"""

import _compat_pickle
import io
import pickle
import re
import sys

from .errors import InvalidArgument, UnpicklingRefused

__all__ = ["SAFE", "parse", "loads_for"]

# Globals that build plain values and run nothing of the sender's choosing.
SAFE = frozenset({
    "builtins.set", "builtins.frozenset", "builtins.complex", "builtins.bytearray",
    "builtins.slice", "builtins.range", "collections.OrderedDict", "collections.deque",
    "collections.Counter", "datetime.date", "datetime.time", "datetime.datetime",
    "datetime.timedelta", "datetime.timezone", "decimal.Decimal", "fractions.Fraction",
    "uuid.UUID",
    # NumPy's arrays, scalars and dtypes (the names of NumPy 2, and of NumPy 1 before them).
    "numpy.ndarray", "numpy.dtype",
    "numpy._core.multiarray._reconstruct", "numpy._core.multiarray.scalar",
    "numpy._core.numeric._frombuffer",
    "numpy.core.multiarray._reconstruct", "numpy.core.multiarray.scalar",
    "numpy.core.numeric._frombuffer",
})

_ENTRY = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*(\.\*)?")


def parse(entries):
    """The allow-list ``entries`` (an iterable of names, or one comma-separated string)
    as a sorted tuple; ``InvalidArgument`` names a malformed entry."""
    if isinstance(entries, str):
        entries = entries.split(",")
    try:
        names = [e.strip() if isinstance(e, str) else e for e in entries]
    except TypeError:
        raise InvalidArgument("unpickle allow-list: expected names such as 'myapp.Config' or "
                              "'numpy.*', got %r" % (entries,)) from None
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
    found = getattr(sys.modules.get(module), name, None)
    if isinstance(found, type) and under(getattr(found, "__module__", None)):
        return found
    return None


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
            found = super().find_class(module, name)
        else:
            found = _wildcard_class(module, name, self._under)
            if found is None:
                raise UnpicklingRefused("%s.%s is not in the unpickle allow-list"
                                        % (module, name))
        self._globals.add(id(found))
        return found

    def _changes(self, target):
        if id(target) in self._globals:
            raise UnpicklingRefused("the pickle changes the global %r in place"
                                    % (getattr(target, "__qualname__", None) or target,))

    def load_build(self):
        self._changes(self.stack[-2])
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
