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

import io
import pickle
import re

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
        return module is not None and any(module == m or module.startswith(m + ".")
                                          for m in modules)

    class _Restricted(pickle.Unpickler):
        def find_class(self, module, name):
            if "%s.%s" % (module, name) in exact:
                return super().find_class(module, name)
            # A wildcard: a class by a plain public name (a dotted one walks attributes,
            # through a module's __builtins__ to eval), defined under the module.
            if "." not in name and not name.startswith("_") and under(module):
                found = super().find_class(module, name)
                if isinstance(found, type) and under(getattr(found, "__module__", None)):
                    return found
            raise UnpicklingRefused("%s.%s is not in the unpickle allow-list"
                                    % (module, name))

    def loads(data, buffers=None):
        return _Restricted(io.BytesIO(data), buffers=buffers).load()
    return loads
