"""An in-process store for ranks that run as threads of one process (``hash://NAME``)."""

import itertools
import threading

from ...errors import InvalidArgument
from ..store import Store, parse_counter, split_store_url

__all__ = ["HashStore", "open_hash_store"]


class _SharedTable:
    """The keys and values behind every ``HashStore`` opened under one name."""

    def __init__(self):
        self.values = {}
        self.changed = threading.Condition()
        self.open_handles = 0


_named_tables = {}
_named_tables_lock = threading.Lock()
_private_ids = itertools.count(1)


# Each HashStore is a handle with its own timeout and its own close; a named
# table is dropped when its last handle closes, so a later run under the same
# name starts empty.
class HashStore(Store):
    """A thread-safe in-memory store; handles opened with the same ``name`` share one table."""

    def __init__(self, name=None, timeout=None):
        super().__init__(timeout)
        if name is None:
            self.name = None
            self.url = f"hash://<private-{next(_private_ids)}>"
            self._table = _SharedTable()
            return
        if not isinstance(name, str) or not name:
            raise InvalidArgument(f"a HashStore name must be a non-empty str, got {name!r}")
        self.name = name
        self.url = f"hash://{name}"
        with _named_tables_lock:
            self._table = _named_tables.setdefault(name, _SharedTable())
            self._table.open_handles += 1

    def _set(self, key, value):
        with self._table.changed:
            self._table.values[key] = value
            self._table.changed.notify_all()

    def _get(self, key, deadline):
        with self._table.changed:
            self._wait_locked([key], deadline)
            return self._table.values[key]

    def _wait(self, keys, deadline):
        with self._table.changed:
            self._wait_locked(keys, deadline)

    def _wait_locked(self, keys, deadline):
        values = self._table.values
        while self._keep_waiting([key for key in keys if key not in values], deadline):
            self._table.changed.wait(deadline.remaining())

    def _add(self, key, amount):
        with self._table.changed:
            values = self._table.values
            current = parse_counter(values[key], key, self.url) if key in values else 0
            values[key] = str(current + amount).encode("ascii")
            self._table.changed.notify_all()
            return current + amount

    def _delete(self, key):
        with self._table.changed:
            return self._table.values.pop(key, None) is not None

    def _check(self, keys):
        with self._table.changed:
            return all(key in self._table.values for key in keys)

    def _close(self):
        with self._table.changed:
            self._table.changed.notify_all()
        if self.name is None:
            return
        with _named_tables_lock:
            self._table.open_handles -= 1
            if self._table.open_handles == 0 and _named_tables.get(self.name) is self._table:
                del _named_tables[self.name]


def open_hash_store(url, *, timeout=None, rank=None, size=None):
    """Open ``hash://NAME``: a handle on the process-wide table registered under NAME."""
    parts = split_store_url(url, "hash")
    name = parts.netloc + parts.path
    if not name:
        raise InvalidArgument(f"{url!r} names no table; use hash://NAME so that ranks share it")
    return HashStore(name, timeout=timeout)


open_hash_store.in_process = True      # its tables live in this process only
