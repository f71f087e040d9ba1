"""Transports "shm" and "auto": shared memory between the ranks of one host, set up at rendezvous.

The TCP mesh is connected first (its sockets stay as the wake-up and
end-of-stream channel); then the ranks of each host share one segment in
/dev/shm holding a ring per ordered pair, and test whether they may read each
other's memory (cross-memory attach) for single-copy large messages.  The
lowest rank of the host creates the segment under a name derived from the
run's secret token; it is unlinked as soon as every local rank has mapped it,
so nothing is left behind, even after a crash.

Where every rank of the transport is on this host, the segment also holds the
flag area of the small-message path (``pycollect/_ext/_flags.pyx``), after the
rings; the transport's ``flag_area`` is then set (None elsewhere).
"""

import hashlib
import json
import logging
import os
import secrets
import time

import numpy as np

from ... import leftovers, settings
from ...errors import InvalidArgument, StoreError
from ..hosts import cpu_mates
from ..mesh import forget
from .tcp import open_tcp

log = logging.getLogger("pycollect.shm")

RING_MAX_BYTES = 1 << 20
RING_MIN_BYTES = 64 << 10
SEGMENT_BUDGET_BYTES = 64 << 20


def ring_bytes_for(nlocal):
    """A power-of-two ring size that keeps the host's segment within budget."""
    size = RING_MAX_BYTES
    while size > RING_MIN_BYTES and nlocal * nlocal * size > SEGMENT_BUDGET_BYTES:
        size //= 2
    return size


def attach_shared_memory(transport, rank, addrs, store, secret, deadline, required=False):
    """Give ``transport`` rings (and memory reads where allowed) to its same-host peers.

    When the host's first rank cannot create the segment (no /dev/shm, say),
    every rank of the host stays on TCP, unless ``required``.
    """
    from ..._ext._flags import FlagArea, area_bytes
    from ..._ext._shm import RING_HEADER_BYTES, RingChannel, Segment, cma_probe

    def left():
        return max(deadline - time.monotonic(), 0.001)

    hostid = addrs[rank]["hostid"]
    local = [p for p, a in enumerate(addrs) if a["hostid"] == hostid]
    if len(local) < 2:
        return
    nlocal = len(local)
    local_of = [local.index(p) if p in local else -1 for p in range(len(addrs))]
    ring_bytes = ring_bytes_for(nlocal)
    rings = nlocal * nlocal * (RING_HEADER_BYTES + ring_bytes)
    # The flag area: only where the whole transport is on this host (every rank maps it).
    flags_at = (rings + 4095) & ~4095 if nlocal == len(addrs) else rings
    length = flags_at + (area_bytes(nlocal) if nlocal == len(addrs) else 0)
    tag = hashlib.sha256(secret + hostid.encode()).hexdigest()[:24]
    path = "/dev/shm/pycollect-%s" % tag
    leader = local[0]
    created = rank == leader
    noted = None
    if created:
        noted = leftovers.note(path)        # for pycollect-run, should this rank die now
        try:
            segment = Segment(path, length, True)
        except OSError as exc:
            leftovers.drop(noted)
            if required:
                raise InvalidArgument("rank %d: cannot create the shared segment %s: %s"
                                      % (rank, path, exc)) from None
            log.info("rank %d: no shared memory (%s); this host's ranks use TCP", rank, exc)
            store.set("shm/segment/%s" % tag, b"")
            return
        store.set("shm/segment/%s" % tag, path.encode())
    try:
        if not created:
            if not store.get("shm/segment/%s" % tag, timeout=left()):
                return      # the host's first rank found no shared memory
            segment = Segment(path, length, False)
        # Who may read whose memory: each rank shows a random token and reads its peers'.
        probe = np.frombuffer(secrets.token_bytes(16), np.uint8).copy()
        store.set("shm/probe/%d" % rank, json.dumps(
            {"pid": os.getpid(), "addr": int(probe.ctypes.data),
             "bytes": probe.tobytes().hex()}).encode())
        readable = []
        if settings.get("PYCOLLECT_CMA"):
            for p in local:
                if p == rank:
                    continue
                info = json.loads(store.get("shm/probe/%d" % p, timeout=left()))
                if cma_probe(info["pid"], info["addr"], bytes.fromhex(info["bytes"])):
                    readable.append(p)
        store.set("shm/readable/%d" % rank, json.dumps(readable).encode())
        readers = set()
        for p in local:
            if p != rank and rank in json.loads(store.get("shm/readable/%d" % p,
                                                          timeout=left())):
                readers.add(p)
    finally:
        if created:
            segment.unlink()        # every local rank has mapped it (or failed)
            leftovers.drop(noted)
    cma_min = settings.get("PYCOLLECT_CMA_MIN_BYTES")
    me = local_of[rank]
    for p in local:
        if p != rank:
            transport.set_channel(p, RingChannel(
                transport.channel(p), segment, me, local_of[p], nlocal, ring_bytes,
                addrs[p].get("pid", 0), p in readers, p in readable, cma_min))
    if nlocal == len(addrs):
        transport.flag_area = FlagArea(segment, segment.address + flags_at, me, nlocal,
                                       transport.spin_us, transport.yields_spin,
                                       [local_of[p] for p in cpu_mates(rank, addrs)])
    log.debug("rank %d: shared memory with ranks %s (%d KiB rings), single-copy reads by %s%s",
              rank, [p for p in local if p != rank], ring_bytes >> 10, sorted(readers),
              ", flag area for small messages" if nlocal == len(addrs) else "")
    # Every local rank has read every probe once all 'readable' lists exist.
    try:
        count = store.add("shm/attached/%s" % tag, 1)
    except StoreError:
        return      # the store's host already finished: nothing left to tidy there
    if count == nlocal:
        forget(store, ["shm/probe/%d" % p for p in local] +
                ["shm/readable/%d" % p for p in local] +
                ["shm/segment/%s" % tag, "shm/attached/%s" % tag])


def _with_shared_memory(rank, size, store, required, options):
    transport, joined = open_tcp(rank, size, store, transport="shm" if required else "auto",
                                 **options)
    try:
        if required:
            local = sum(1 for a in joined.addrs if a["hostid"] == joined.addrs[rank]["hostid"])
            if local < size:
                raise InvalidArgument("rank %d: transport 'shm' needs every rank on this host, "
                                      "but only %d of %d are; use transport='auto'"
                                      % (rank, local, size))
        attach_shared_memory(transport, rank, joined.addrs, store, joined.token + joined.context,
                             joined.deadline, required=required)
    except BaseException:
        transport.close()
        raise
    return transport


def create_shm_transport(rank, size, store, **options):
    """Every rank on this host: shared memory between all pairs."""
    return _with_shared_memory(rank, size, store, True, options)


def create_auto_transport(rank, size, store, **options):
    """Shared memory between ranks of one host, TCP between hosts."""
    return _with_shared_memory(rank, size, store, False, options)
