"""Transport "tcp": the full mesh of sockets (plugins/mesh.py), each a socket channel of the engine.

``open_tcp`` is the step every socket-based factory shares (``shm`` and
``auto`` add rings to same-host pairs, ``tcp+tls`` wraps every pair);
``create_tcp_transport`` is the ``tcp`` entry point itself.
"""

import time

from ... import settings
from ..hosts import oversubscribed
from ..mesh import connect_mesh, format_addr

__all__ = ["create_tcp_transport", "open_tcp"]


# PYCOLLECT_SPIN_US's defaults (pycollect/settings.py): ranks with a core each, and not.
SPIN_US_DEDICATED = 1000.0
SPIN_US_SHARED = 50.0


def open_tcp(rank, size, store, *, timeout, interface=None, context_id="", spin_us=None,
             tls=None, transport=None):
    """Connect the full mesh and build an ``Engine`` with a socket channel per peer:
    ``(transport, joined)``.

    ``joined`` is the mesh's ``Joined`` record (addresses, token, deadline) for
    a factory that goes on setting up (shared memory); ``tls`` is the mesh's
    wrapping hook; ``transport`` is the name the calling factory is registered
    as, which the ranks compare before connecting (``connect_mesh``).
    """
    from ..._ext._engine import Engine
    from ..._ext._socket import SocketChannel

    deadline = time.monotonic() + timeout
    if spin_us is None:
        spin_us = settings.get("PYCOLLECT_SPIN_US")
    joined = connect_mesh(rank, size, store, deadline=deadline, interface=interface,
                          context_id=context_id, tls=tls, transport=transport)
    addrs = joined.addrs
    shared = oversubscribed(rank, addrs)
    if spin_us is None:
        # A core of its own: spin long enough to ride out a peer's preemption on a busy
        # host (a sleep and its wake-up cost ~100 us there). Sharing cores: spin briefly,
        # yielding, so that the peer that holds the data gets the core.
        spin_us = SPIN_US_SHARED if shared else SPIN_US_DEDICATED
    channels = [None if fd < 0 else SocketChannel(fd) for fd in joined.fds]
    transport = Engine(rank, size, channels, [format_addr(a["host"], a["port"]) for a in addrs],
                       spin_us=spin_us, yield_spin=shared)
    transport.host_ids = [a["hostid"] for a in addrs]
    return transport, joined


def create_tcp_transport(rank, size, store, *, timeout, interface=None, context_id="",
                         spin_us=None):
    """Connect the full mesh for ``rank`` of ``size`` through ``store``; return an engine
    that reaches every peer over TCP."""
    return open_tcp(rank, size, store, timeout=timeout, interface=interface,
                    context_id=context_id, spin_us=spin_us, transport="tcp")[0]
