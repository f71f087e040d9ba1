import socket

import pytest

from group import ThreadGroup
from netns import hosts  # noqa: F401  (the network-namespace hosts, a fixture)

WORLD_SIZES = [1, 2, 3, 4, 5, 7, 8]
# A tiny maximum segment, so that small counts already take the multi-segment
# paths of ring_chunked and the pipelined broadcast.
TINY_SEGMENT_BYTES = 64


# Every world size over shared memory (the default for ranks of one host),
# and the sizes that reach every algorithm's special cases over TCP.
GROUPS = [(n, "auto") for n in WORLD_SIZES] + [(n, "tcp") for n in (2, 3, 5, 8)]


@pytest.fixture(scope="module", params=GROUPS, ids=lambda p: "size%d-%s" % p)
def _groups(request):
    """One group per module and shape, made again after a test that failed with it."""
    size, transport = request.param
    holder = {"size": size, "transport": transport, "group": None}
    yield holder
    if holder["group"] is not None:
        holder["group"].close()


@pytest.fixture
def group(_groups, request):
    """Thread ranks of every world size (``group.transport``: "auto" or "tcp"), sharing one
    set of connections per module until a test fails with them: the next test gets a new
    group, so one failure (a failed context, a rank left hanging) stays one failure."""
    g = _groups["group"]
    if g is None or any(ctx.failed is not None for ctx in g.contexts):
        if g is not None:
            g.close()
        g = ThreadGroup(_groups["size"], segment_bytes=TINY_SEGMENT_BYTES,
                        transport=_groups["transport"])
        g.transport = _groups["transport"]
        _groups["group"] = g
    failed_before = request.session.testsfailed
    yield g
    if request.session.testsfailed != failed_before:
        g.close()
        _groups["group"] = None


def counts_for(size):
    """The element counts of the matrix, one of them not divisible by ``size``."""
    return [0, 1, 4, 100, 1000, 10000, 7 * size + 3]


def ipv6_loopback_works():
    """Whether this machine can bind ::1 (tests of IPv6 addresses skip without it)."""
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as probe:
            probe.bind(("::1", 0))
        return True
    except OSError:
        return False
