"""What the object collectives may unpickle: anything, or only the globals of an allow-list.

Unpickling runs code the sender chose: a pickle may name any importable function and call
it (``os.system`` among them).  By default the object collectives unpickle anything, and
are for trusted peers only.  With an allow-list (``PYCOLLECT_UNPICKLE_ALLOW``, or
``Context.unpickle_allow``) a restricted unpickler loads only the globals it names, besides
the plain values pickle builds without any (None, bools, numbers, strings, bytes, tuples,
lists, dicts) and ``SAFE``, the containers and values of the standard library that run no
code of the sender's choosing.  Any other global refuses the object before anything of it
runs.

An entry is ``module.name`` (``myapp.config.Config``; a nested class as
``module.Outer.Inner``) or ``module.*``, every global of that module and its submodules
(``numpy.*`` lets NumPy arrays through).
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

    def permitted(module, name):
        if "%s.%s" % (module, name) in exact:
            return True
        return any(module == m or module.startswith(m + ".") for m in modules)

    class _Restricted(pickle.Unpickler):
        def find_class(self, module, name):
            if not permitted(module, name):
                raise UnpicklingRefused("%s.%s is not in the unpickle allow-list"
                                        % (module, name))
            return super().find_class(module, name)

    def loads(data, buffers=None):
        return _Restricted(io.BytesIO(data), buffers=buffers).load()
    return loads
