"""Build the compiled layers of pycollect.

Every build switch lives in BUILD below: Cython directives, compiler flags and
the list of extensions.  ``PYCOLLECT_NATIVE=1`` adds ``-march=native`` for a
build that will only run on the machine that compiles it; ``PYCOLLECT_DEBUG_BUILD=1``
turns optimisation off and bounds checks on.
"""

import glob
import os
import sys

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup

DEBUG_BUILD = os.environ.get("PYCOLLECT_DEBUG_BUILD") == "1"

BUILD = {
    "directives": {
        "language_level": 3,
        "boundscheck": DEBUG_BUILD,
        "wraparound": False,
        "initializedcheck": DEBUG_BUILD,
        "cdivision": True,
        "embedsignature": True,
    },
    "cflags": (
        ["-O0", "-g"] if DEBUG_BUILD else ["-O3"]
    ) + [
        # Integer reductions must wrap like NumPy's, which C only promises
        # for signed types under -fwrapv.
        "-fwrapv",
        "-fno-strict-aliasing",
        "-Wno-unused-function",
        "-Wno-unreachable-code",
    ] + (["-march=native"] if os.environ.get("PYCOLLECT_NATIVE") == "1" else []),
    "define_macros": [("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
    "include_dirs": [numpy.get_include(), "pycollect/_ext"],
    # Extensions that link more than libc, and the header each needs: skipped where it is
    # missing (pycollect._ext._tls, transport "tcp+tls": Debian's libssl-dev).
    "libraries": {"pycollect._ext._tls": (["ssl", "crypto"], "openssl/ssl.h")},
}


def _has_header(header):
    return any(os.path.exists(os.path.join(d, header)) for d in ("/usr/include",
                                                                "/usr/local/include"))


def extensions():
    mods = []
    for path in sorted(glob.glob("pycollect/_ext/*.pyx")):
        name = path[:-4].replace(os.sep, ".")
        libraries, header = BUILD["libraries"].get(name, ([], None))
        if header and not _has_header(header):
            sys.stderr.write("pycollect: %s not found, %s not built\n" % (header, name))
            continue
        mods.append(Extension(
            name,
            [path],
            include_dirs=BUILD["include_dirs"],
            define_macros=BUILD["define_macros"],
            extra_compile_args=BUILD["cflags"],
            libraries=libraries,
        ))
    return cythonize(
        mods,
        compiler_directives=BUILD["directives"],
        nthreads=int(os.environ.get("PYCOLLECT_BUILD_JOBS", os.cpu_count() or 1)),
        quiet=True,
    )


if sys.platform != "linux":
    sys.stderr.write("pycollect: only Linux is tested; building anyway\n")

setup(ext_modules=extensions())
