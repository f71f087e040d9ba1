"""Build the test plugin's Cython channel against the installed pycollect's .pxd files."""

import os

import pycollect
from Cython.Build import cythonize
from setuptools import Extension, setup

# The folder that holds the pycollect package: cimport pycollect._ext._channel finds its
# .pxd there, as it would in any site-packages.
PXD_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(pycollect.__file__)))

setup(ext_modules=cythonize(
    [Extension("pycollect_testplugin._sockets", ["pycollect_testplugin/_sockets.pyx"])],
    include_path=[PXD_ROOT], compiler_directives={"language_level": 3}, quiet=True))
