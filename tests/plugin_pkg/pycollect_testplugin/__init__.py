"""A store (``memo://NAME``) and a transport (``counted-tcp``) for pycollect, from another package.

The store keeps a process-wide table per name and counts how often it was
opened; the transport is pycollect's TCP transport with a call counter.
Both are what a real plugin would register in its own pyproject.toml.
"""

import threading

import pycollect as pc
from pycollect.plugins.store import split_store_url

__all__ = ["MemoStore", "open_memo_store", "create_counted_transport", "calls"]

calls = {"memo": 0, "counted-tcp": 0}
_calls_lock = threading.Lock()


def _count(name):
    with _calls_lock:
        calls[name] += 1


class MemoStore(pc.HashStore):
    """A named in-process table, reached through the ``memo://`` scheme."""

    def __init__(self, name, timeout=None):
        super().__init__("memo:" + name, timeout=timeout)
        self.url = "memo://" + name


def open_memo_store(url, *, timeout=None, rank=None, size=None):
    """Open ``memo://NAME``."""
    parts = split_store_url(url, "memo")
    name = parts.netloc + parts.path
    if not name:
        raise pc.InvalidArgument(f"{url!r} names no table: use memo://NAME")
    _count("memo")
    return MemoStore(name, timeout=timeout)


def create_counted_transport(rank, size, store, **options):
    """pycollect's TCP transport, counting the calls."""
    from pycollect.plugins.transports.tcp import create_tcp_transport
    _count("counted-tcp")
    return create_tcp_transport(rank, size, store, **options)
