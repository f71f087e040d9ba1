import socket

import pytest

from group import ThreadGroup

WORLD_SIZES = [1, 2, 3, 4, 5, 7, 8]
# A tiny maximum segment, so that small counts already take the multi-segment
# paths of ring_chunked and the pipelined broadcast.
TINY_SEGMENT_BYTES = 64


# Every world size over shared memory (the default for ranks of one host),
# and the sizes that reach every algorithm's special cases over TCP.
GROUPS = [(n, "auto") for n in WORLD_SIZES] + [(n, "tcp") for n in (2, 3, 5, 8)]


@pytest.fixture(scope="module", params=GROUPS, ids=lambda p: "size%d-%s" % p)
def group(request):
    """Thread ranks of every world size, sharing one set of connections per module."""
    size, transport = request.param
    g = ThreadGroup(size, segment_bytes=TINY_SEGMENT_BYTES, transport=transport)
    yield g
    g.close()


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
