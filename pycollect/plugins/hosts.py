"""Host identity: which ranks share a kernel, a memory and a loopback; and the cores
of this host that local ranks are placed on.

Every rank publishes at rendezvous a machine identity (host name, kernel boot
id, network namespace) and a host identity, the machine identity unless
``PYCOLLECT_HOST_ID`` names another.  Stores (the MPI store) and transports
(the TCP mesh, shared memory) read them from here.  The launcher
(``pycollect-run --bind core``) and the benchmarks place ranks on the
physical cores that ``core_sets`` reads from the kernel's topology.
"""

import contextlib
import ipaddress
import os
import socket

from .. import settings
from ..errors import InvalidArgument

__all__ = ["boot_id", "check_host_table", "core_sets", "cores", "cpu_list", "cpu_mates",
           "host_identity", "machine_identity", "oversubscribed", "rank_cpus", "started_on"]

SYSFS_CPU = "/sys/devices/system/cpu"


def boot_id():
    """The running kernel's boot id: processes with the same one share the CPUs."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def _affinity():
    """The CPUs this process may run on, or None where the system does not say."""
    try:
        return os.sched_getaffinity(0)
    except (AttributeError, OSError):
        return None


def cores():
    """How many CPUs this process may run on (its affinity, where the system has one)."""
    cpus = _affinity()
    return len(cpus) if cpus is not None else os.cpu_count() or 1


def cpu_list():
    """The CPUs this process may run on in the kernel's list format ("0-3,8"; what a rank
    publishes at rendezvous, a few bytes on any machine), or None where the system does
    not say."""
    cpus = _affinity()
    if cpus is None:
        return None
    runs = []
    for cpu in sorted(cpus):
        if runs and runs[-1][1] == cpu - 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join("%d" % a if a == b else "%d-%d" % (a, b) for a, b in runs)


def oversubscribed(rank, addrs):
    """Whether rank ``rank`` shares its CPUs with more ranks than it has CPUs, counting the
    ranks of its kernel (same boot id) whose published CPUs (``cpus``) overlap its own, so
    that a waiting rank should yield the core to them.  Ranks bound to cores of their own
    (``pycollect-run --bind core``) are not, even though each may run on one CPU only; four
    unbound ranks on two CPUs are.  A rank that published no CPUs counts as sharing all."""
    mine = _published_cpus(addrs[rank])
    if not mine:
        return len(_same_kernel(rank, addrs)) > cores()
    return len(cpu_mates(rank, addrs)) + 1 > len(mine)


def cpu_mates(rank, addrs):
    """The other ranks of rank ``rank``'s kernel that may run on its CPUs (their published
    CPUs overlap its own; every one where either side published none or an unreadable
    list), as a set of ranks: while such a rank is waited for, a waiting rank should give
    it the core rather than spin."""
    mine = _published_cpus(addrs[rank])
    mates = set()
    for p in _same_kernel(rank, addrs):
        if p != rank:
            theirs = _published_cpus(addrs[p]) if mine else None
            if not mine or not theirs or mine & theirs:
                mates.add(p)
    return mates


def _same_kernel(rank, addrs):
    boot = addrs[rank].get("boot", addrs[rank]["hostid"])
    return [p for p, a in enumerate(addrs) if a.get("boot", a["hostid"]) == boot]


def _published_cpus(addr):
    """The CPUs a rank published, or None (none published, or a list that does not parse)."""
    try:
        return _parse_cpu_list(addr.get("cpus") or "") or None
    except ValueError:
        return None


def _parse_cpu_list(text):
    """Parse the kernel's CPU list format ("0-3,8,10-11") into a set of ints."""
    cpus = set()
    for part in text.strip().split(","):
        if not part:
            continue
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def core_sets(allowed=None, sysfs=SYSFS_CPU):
    """The physical cores this process may run on: one frozenset of CPU numbers (the
    core's hardware threads that ``allowed`` includes) per core, ordered by lowest CPU.

    ``allowed`` defaults to this process's affinity.  Where the kernel does not say which
    CPUs share a core (no ``topology/core_cpus_list`` or ``thread_siblings_list``), every
    CPU counts as a core of its own.
    """
    if allowed is None:
        allowed = _affinity()
        if allowed is None:
            allowed = range(os.cpu_count() or 1)
    allowed = set(allowed)
    found = set()
    for cpu in allowed:
        siblings = {cpu}
        for name in ("core_cpus_list", "thread_siblings_list"):
            try:
                with open(os.path.join(sysfs, "cpu%d" % cpu, "topology", name)) as f:
                    siblings = _parse_cpu_list(f.read()) & allowed or {cpu}
                break
            except (OSError, ValueError):
                continue
        found.add(frozenset(siblings))
    return sorted(found, key=min)


def rank_cpus(nranks, sets=None):
    """The CPUs each of ``nranks`` local ranks is bound to: rank r gets core ``r % cores``
    (``core_sets()``), so more ranks than cores share them evenly."""
    sets = core_sets() if sets is None else sets
    return [sets[r % len(sets)] for r in range(nranks)]


@contextlib.contextmanager
def started_on(cpus):
    """Children started (forked) by this thread inside the block run on ``cpus`` only.

    The calling thread takes the affinity for the block and gets its own back after, so
    the child holds it from its first instruction (its threads, an OpenBLAS pool started
    at import, inherit it) and the caller's other threads are untouched.  ``cpus`` None:
    no binding.
    """
    if cpus is None:
        yield
        return
    before = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, cpus)
    except OSError as exc:      # CPUs outside the cpuset, or binding forbidden here
        raise OSError(exc.errno, "cannot bind to CPUs %s: %s"
                      % (",".join(map(str, sorted(cpus))), exc.strerror)) from None
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


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
