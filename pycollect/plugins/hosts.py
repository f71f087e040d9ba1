"""Host identity: which ranks share a kernel, a memory and a loopback.

Every rank publishes at rendezvous a machine identity (host name, kernel boot
id, network namespace) and a host identity, the machine identity unless
``PYCOLLECT_HOST_ID`` names another.  Stores (the MPI store) and transports
(the TCP mesh, shared memory) read them from here.
"""

import ipaddress
import os
import socket

from .. import settings
from ..errors import InvalidArgument

__all__ = ["boot_id", "check_host_table", "cores", "host_identity", "machine_identity"]


def boot_id():
    """The running kernel's boot id: processes with the same one share the CPUs."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def cores():
    """How many CPUs this process may run on (its affinity, where the system has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def machine_identity():
    """Host name, kernel boot id and network namespace: ranks that share memory and a loopback.

    Ranks in different network namespaces of one kernel (containers, the
    tests' namespace "hosts") reach each other only through the network, so
    they count as different hosts.
    """
    try:
        netns = "net:%d" % os.stat("/proc/self/ns/net").st_ino
    except OSError:
        netns = ""
    return "%s/%s/%s" % (socket.gethostname(), boot_id(), netns)


def host_identity(machine):
    """The host ranks are grouped by: ``PYCOLLECT_HOST_ID`` if set, else the machine identity."""
    override = settings.get("PYCOLLECT_HOST_ID")
    return machine if override is None else "id:" + override


def check_host_table(rank, addrs):
    """Refuse a loopback listener in a job whose ranks sit on several machines, and one
    host identity (``PYCOLLECT_HOST_ID``) given to ranks of different kernels.

    ``addrs``: one published record per rank (``host``, ``hostid``, ``machine``, ``boot``).
    """
    kernels = {}
    for peer, a in enumerate(addrs):
        first = kernels.setdefault(a["hostid"], (peer, a.get("boot")))
        if first[1] != a.get("boot"):
            raise InvalidArgument(
                "rank %d: ranks %d and %d run on different machines but share the host "
                "identity %r; PYCOLLECT_HOST_ID must differ between machines"
                % (rank, first[0], peer, a["hostid"]))
    hosts = {a.get("machine", a["hostid"]) for a in addrs}
    if len(hosts) < 2:
        return
    for peer, a in enumerate(addrs):
        if ipaddress.ip_address(a["host"]).is_loopback:
            raise InvalidArgument(
                "rank %d: the job spans %d hosts but rank %d listens on loopback %s; set "
                "PYCOLLECT_SOCKET_IFNAME (or init(interface=...)) to a routable interface"
                % (rank, len(hosts), peer, a["host"]))
