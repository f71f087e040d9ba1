"""Build the compiled layers of pycollect.

Every build switch lives in BUILD below: Cython directives, compiler flags and
the list of extensions.  ``PYCOLLECT_NATIVE=1`` adds ``-march=native`` for a
build that will only run on the machine that compiles it; ``PYCOLLECT_DEBUG_BUILD=1``
turns optimisation off and bounds checks on.
"""

import glob
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile

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
    # Optional extensions that link more than libc: (pkg-config package, libraries, a C
    # program that must compile and link against them). Where it does not, the extension is
    # skipped and everything else is built (pycollect._ext._tls, transport "tcp+tls":
    # Debian's libssl-dev).
    "optional": {
        "pycollect._ext._tls": ("openssl", ["ssl", "crypto"],
                                "#include <openssl/ssl.h>\n"
                                "int main(void) { return SSL_CTX_new(TLS_method()) == 0; }\n"),
    },
}


def _pkg_config(package):
    """(include dirs, library dirs) that pkg-config gives for ``package``, or empty lists."""
    if shutil.which("pkg-config") is None:
        return [], []
    try:
        flags = subprocess.run(["pkg-config", "--cflags-only-I", "--libs-only-L", package],
                               capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return [], []
    words = shlex.split(flags)
    return ([w[2:] for w in words if w.startswith("-I")],
            [w[2:] for w in words if w.startswith("-L")])


def _links(program, include_dirs, library_dirs, libraries):
    """Whether the C compiler Python was built with compiles and links ``program``.

    The compiler searches its own include path (and CPATH, conda's sysroot, ...), so this
    finds headers wherever the toolchain finds them, not in a fixed list of directories.
    """
    compiler = shlex.split(os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc")
    with tempfile.TemporaryDirectory() as tmp:
        source = os.path.join(tmp, "probe.c")
        with open(source, "w") as f:
            f.write(program)
        argv = (compiler + [source, "-o", os.path.join(tmp, "probe")]
                + ["-I" + d for d in include_dirs] + ["-L" + d for d in library_dirs]
                + ["-l" + lib for lib in libraries])
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.SubprocessError) as exc:
            return False, str(exc)
        return done.returncode == 0, (done.stderr.strip().splitlines() or [""])[0]


def extensions():
    mods = []
    for path in sorted(glob.glob("pycollect/_ext/*.pyx")):
        name = path[:-4].replace(os.sep, ".")
        include_dirs, library_dirs, libraries = list(BUILD["include_dirs"]), [], []
        if name in BUILD["optional"]:
            package, libraries, program = BUILD["optional"][name]
            extra_include, library_dirs = _pkg_config(package)
            include_dirs += extra_include
            ok, why = _links(program, extra_include, library_dirs, libraries)
            if not ok:
                sys.stderr.write("pycollect: %s not built: the C compiler cannot build and link "
                                 "a program against %s (%s)\n"
                                 % (name, " ".join("-l" + lib for lib in libraries), why))
                continue
        mods.append(Extension(
            name,
            [path],
            include_dirs=include_dirs,
            library_dirs=library_dirs,
            define_macros=BUILD["define_macros"],
            extra_compile_args=BUILD["cflags"],
            libraries=libraries,
        ))
    built = cythonize(
        mods,
        compiler_directives=BUILD["directives"],
        nthreads=int(os.environ.get("PYCOLLECT_BUILD_JOBS", os.cpu_count() or 1)),
        quiet=True,
    )
    for ext in built:
        # Cython lists NumPy's headers by absolute path; an sdist only carries relative ones.
        ext.depends = [d for d in ext.depends if not os.path.isabs(d)]
    return built


if sys.platform != "linux":
    sys.stderr.write("pycollect: only Linux is tested; building anyway\n")

setup(ext_modules=extensions())
