"""Rendezvous under ``mpirun`` (``mpi://``): MPI carries only the store's address, once.

Every rank of ``MPI_COMM_WORLD`` opens the store together (``pycollect.init``
does).  The ranks allgather their host identities; rank 0 then hosts an
embedded TCP store (``TCPStoreServer``) on loopback when every rank shares
its host, else on a routable address (``PYCOLLECT_SOCKET_IFNAME``, or the
address the host name resolves to), with a fresh random token, and
broadcasts address and token.  From then on the store is an ordinary
authenticated ``TCPStore`` client: MPI is not used after setup, and every
store pattern (waits, counters, per-host steps) works as over ``tcp://``.
The MPI calls are non-blocking ones polled against the store's deadline, so
a rank that never joins ends in ``Timeout``, not in a hang.
"""

import json
import secrets
import time

import numpy as np

from ...errors import InvalidArgument, PluginError, StoreError, Timeout
from ..store import Deadline, backoff_delays, resolve_timeout, split_store_url
from .tcp_store import TCPStore, TCPStoreServer, tcp_url

__all__ = ["MPIStore", "open_mpi_store", "world"]

# Fixed-size MPI messages: a host identity, and rank 0's answer (address and token, or why not).
HOST_ID_BYTES = 256
ANSWER_BYTES = 1024
POLL_FIRST_S = 0.0002
POLL_CAP_S = 0.01


def world():
    """``(MPI, MPI.COMM_WORLD)``; PluginError naming the extra when mpi4py is missing."""
    try:
        from mpi4py import MPI
    except ImportError as err:
        raise PluginError(f"the mpi store needs mpi4py and an MPI library: pip install "
                          f"'pycollect[mpi]' (Debian: apt-get install openmpi-bin "
                          f"libopenmpi-dev); {type(err).__name__}: {err}") from err
    return MPI, MPI.COMM_WORLD


def _fixed(text, length, what):
    data = text.encode("utf-8")
    if len(data) > length:
        raise InvalidArgument(f"{what} of {len(data)} bytes exceeds {length} bytes")
    return np.frombuffer(data.ljust(length, b"\0"), np.uint8).copy()


def _unfixed(array):
    return array.tobytes().rstrip(b"\0").decode("utf-8", "replace")


def _complete(request, deadline, rank, what):
    """Poll a non-blocking MPI request until it completes or ``deadline`` passes."""
    for delay in backoff_delays(POLL_FIRST_S, POLL_CAP_S):
        if request.Test():
            return
        if deadline.expired():
            raise Timeout(f"rank {rank}: the MPI store's {what} did not complete within "
                          f"{deadline.timeout:g} s; every rank of MPI_COMM_WORLD must call "
                          f"pycollect.init() (or open mpi://) together")
        time.sleep(min(delay, deadline.remaining()))


def _host_address(hostids, interface):
    """Where rank 0 hosts the store: loopback on one host, else a routable address."""
    from ..interfaces import choose_address
    if len(set(hostids)) == 1:
        return "127.0.0.1"
    host, why = choose_address(interface, None)
    if host.startswith("127.") or host == "::1":
        raise InvalidArgument(f"the MPI job spans {len(set(hostids))} hosts but rank 0 found "
                              f"only a loopback address ({why}) to host the store on; set "
                              f"PYCOLLECT_SOCKET_IFNAME to a routable interface")
    return host


class MPIStore(TCPStore):
    """A ``TCPStore`` whose server rank 0 hosts, found through one MPI exchange at open."""

    def __init__(self, timeout=None, *, interface=None):
        from ..hosts import machine_identity
        _, comm = world()
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        deadline = Deadline(resolve_timeout(timeout))
        hostids = np.zeros((self.size, HOST_ID_BYTES), np.uint8)
        request = comm.Iallgather(_fixed(machine_identity(), HOST_ID_BYTES, "host identity"),
                                  hostids)
        _complete(request, deadline, self.rank, "allgather of host identities")
        hostids = [_unfixed(row) for row in hostids]
        server, answer = None, None
        if self.rank == 0:
            try:
                token = secrets.token_hex(32)
                server = TCPStoreServer(_host_address(hostids, interface), 0,
                                        auth=token).start()
                answer = {"host": server.host, "port": server.port, "token": token}
            except Exception as err:  # told to every rank, so that none waits in vain
                answer = {"error": f"{type(err).__name__}: {err}"}
        try:
            buffer = _fixed(json.dumps(answer) if answer else "", ANSWER_BYTES, "answer")
            _complete(comm.Ibcast(buffer, root=0), deadline, self.rank,
                      "broadcast of rank 0's store address")
            answer = json.loads(_unfixed(buffer))
            if "error" in answer:
                raise StoreError(f"rank {self.rank}: rank 0 could not host the MPI store: "
                                 f"{answer['error']}")
            super().__init__(answer["host"], answer["port"], timeout=deadline.remaining(),
                             auth=answer["token"])
        except BaseException:
            if server is not None:
                server.close()
            raise
        self.timeout = deadline.timeout
        self.server = server
        self.hosts = len(set(hostids))
        self.url = f"mpi://(rank 0 at {tcp_url(answer['host'], answer['port'])[6:]})"


def open_mpi_store(url, *, timeout=None, rank=None, size=None):
    """Open ``mpi://``: every rank of ``MPI_COMM_WORLD`` must open it at the same time."""
    parts = split_store_url(url, "mpi")
    if parts.netloc or parts.path not in ("", "/"):
        raise InvalidArgument(f"mpi store URL {url!r} takes no host or path: use mpi://")
    _, comm = world()
    for name, given, actual in (("rank", rank, comm.Get_rank()),
                                ("size", size, comm.Get_size())):
        if given is not None and given != actual:
            raise InvalidArgument(f"mpi://: {name} {given} was given but MPI_COMM_WORLD says "
                                  f"{actual}; leave {name} out under mpirun")
    return MPIStore(timeout=timeout)
