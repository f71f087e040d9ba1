"""pycollect's compiled layers (Cython extension modules).

Importing this package checks that they are built, so that ``import pycollect`` from a source
tree without them explains what happened instead of failing on the first missing name.
"""

import importlib.machinery
import os

_HERE = os.path.dirname(os.path.abspath(__file__))
# One module every build compiles (the buffer gatekeeper); the TLS engine is optional.
_CORE = "_buffer"


def _built():
    return any(os.path.exists(os.path.join(_HERE, _CORE + suffix))
               for suffix in importlib.machinery.EXTENSION_SUFFIXES)


if not _built():
    _root = os.path.dirname(os.path.dirname(_HERE))
    raise ImportError(
        "pycollect's compiled extensions are not built in %s. This is pycollect's source "
        "tree, imported because the current directory (or PYTHONPATH) comes first on "
        "sys.path, not the pycollect you installed. Either build the tree in place "
        "(cd %s && pip install -e .), or run from outside the source tree (for example "
        "cd ~) so that Python imports the installed package." % (_HERE, _root),
        name=__name__, path=_HERE)
