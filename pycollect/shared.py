"""Arrays in shared memory: ``pycollect.empty`` and ``pycollect.zeros``.

An array from ``empty`` lies in this process's pool of shared buffers
(``pycollect._ext._pool``): memory that the other ranks of the host may map.
A direct collective (allreduce, allgather, broadcast between ranks of one
host) on such arrays works on the peers' buffers with plain loads and
stores, as one process would, instead of copying every byte through the
kernel with cross-memory attach.  Any array works with every collective;
these are only faster.  The pool is made on first use (``PYCOLLECT_POOL_BYTES``
of address space, sparse); a freed array's pages go back to the kernel.  After
``fork()`` a child makes a pool of its own for new arrays, and the arrays it
inherited still share their pages with the parent.
"""

import math

import numpy as np

from ._ext._pool import made_pool, process_pool, view_stats
from .errors import InvalidArgument

__all__ = ["empty", "zeros", "pool_used", "view_stats"]


def _current():
    """This process's pool (made on first use and after a fork)."""
    try:
        return process_pool()
    except OSError as exc:
        raise InvalidArgument("pycollect.empty: the pool of shared arrays cannot be made "
                              "(%s); PYCOLLECT_POOL_BYTES sets its size" % exc) from None


def empty(shape, dtype=np.float32):
    """A new array of ``shape`` and ``dtype`` in shared memory, its contents undefined.

    Direct collectives between ranks of one host reduce and copy such arrays in place
    (module notes).  Raises ``InvalidArgument`` for a bad shape or dtype, or an array
    larger than the pool's room.
    """
    try:
        dt = np.dtype(dtype)
    except TypeError as exc:
        raise InvalidArgument("pycollect.empty: dtype %r is not a NumPy dtype (%s)"
                              % (dtype, exc)) from None
    if dt.hasobject:
        raise InvalidArgument("pycollect.empty: dtype %s holds Python objects, which no other "
                              "process can read" % dt)
    if dt.itemsize == 0 or dt.subdtype is not None:
        raise InvalidArgument("pycollect.empty: dtype %s is not one element of a fixed size "
                              "(give the element's dtype and put its shape in the shape)" % dt)
    try:
        dims = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
    except TypeError:
        dims = None
    if dims is None or not all(isinstance(d, (int, np.integer)) and not isinstance(d, bool)
                               and d >= 0 for d in dims):
        raise InvalidArgument("pycollect.empty: shape %r is not a tuple of ints >= 0"
                              % (shape,))
    count = math.prod(int(d) for d in dims)
    # NumPy refuses a shape whose nonzero sides multiply past intp, even with a zero side (a
    # larger array of elements does not fit the pool, below)
    if not count and math.prod(int(d) for d in dims if d) * dt.itemsize > np.iinfo(np.intp).max:
        raise InvalidArgument("pycollect.empty: shape %r holds more than an array may"
                              % (shape,))
    nbytes = count * dt.itemsize
    pool = _current()
    block = pool.block(nbytes) if nbytes <= pool.nbytes else None
    if block is None:
        raise InvalidArgument(
            "pycollect.empty: %d bytes do not fit the pool of shared arrays (%d of its %d "
            "bytes in use; PYCOLLECT_POOL_BYTES sets its size)" % (nbytes, pool.used,
                                                                   pool.nbytes))
    return np.frombuffer(block, dtype=dt, count=count).reshape(dims)


def zeros(shape, dtype=np.float32):
    """``empty`` filled with zero bytes (every dtype's zero, a void dtype's too)."""
    out = empty(shape, dtype)
    out.reshape(-1).view(np.uint8).fill(0)
    return out


def pool_used():
    """Bytes of this process's pool held by live arrays and by the direct allreduce's
    staging blocks (whole pages); 0 before the first."""
    pool = made_pool()
    return pool.used if pool is not None else 0
