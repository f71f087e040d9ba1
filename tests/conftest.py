import pytest

from group import ThreadGroup

WORLD_SIZES = [1, 2, 3, 4, 5, 7, 8]
# A tiny maximum segment, so that small counts already take the multi-segment
# paths of ring_chunked and the pipelined broadcast.
TINY_SEGMENT_BYTES = 64


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda n: "size%d" % n)
def group(request):
    """Thread ranks of every world size, sharing one set of connections per module."""
    g = ThreadGroup(request.param, segment_bytes=TINY_SEGMENT_BYTES)
    yield g
    g.close()


def counts_for(size):
    """The element counts of the matrix, one of them not divisible by ``size``."""
    return [0, 1, 4, 100, 1000, 10000, 7 * size + 3]
