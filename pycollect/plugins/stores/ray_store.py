"""A store in Ray's own key-value store (``ray://NAME``): rendezvous with no server of its own.

Every Ray cluster runs a key-value store in its control service (the GCS);
this store keeps its keys there, so the processes of a Ray job (the driver
and its actors, on any node) rendezvous with no address, port or extra
process to choose.  It needs a running Ray: ``ray.init()`` in the driver,
and nothing in actors, which are connected already.  Ray offers this
key-value store only through ``ray.experimental.internal_kv`` (the module
Ray's own collective groups rendezvous through).

That store has put, get, delete and "put unless present", but no atomic
increment, so a key is a chain of versions: every write (``set``, ``add``,
``delete``) claims version n + 1 with "put unless present", and a writer
that finds it taken reads the newer version and tries again.  ``add`` is
thereby atomic across processes.  A hint of the latest version number is
kept beside the chain, so that a read costs three round trips, not n.  The
chain is never shortened while the store is in use (the store is meant for
rendezvous, a few writes per key); ``cleanup()`` removes every key of the
store at once.  Waits poll, with a sleep that doubles up to ``POLL_CAP_S``.
"""

import time

from ...errors import InvalidArgument, PluginError, StoreError
from ..store import Deadline, Store, backoff_delays, parse_counter, split_store_url

__all__ = ["RayStore", "open_ray_store", "KV_NAMESPACE"]

KV_NAMESPACE = b"pycollect"
POLL_FIRST_S = 0.0005
POLL_CAP_S = 0.02
_PRESENT = b"="        # a version holding a value: b"=" + value
_DELETED = b"-"        # a version recording a delete


def _connected_ray():
    """(``ray``, its key-value module), once Ray is installed and this process is connected."""
    try:
        import ray
        from ray.experimental import internal_kv
    except ImportError as err:
        raise PluginError(f"the ray store needs Ray: pip install 'pycollect[ray]'; "
                          f"{type(err).__name__}: {err}") from err
    if not ray.is_initialized():
        raise StoreError("the ray store needs a running Ray: call ray.init() first (in the "
                         "driver; Ray actors and tasks are connected already)")
    return ray, internal_kv


class RayStore(Store):
    """The keys under ``name`` in the key-value store of the Ray cluster this process is in.

    ``label``, when given, is appended to the URL (``ray://NAME#label``):
    pycollect numbers the contexts made through one store URL in each
    process, and a labelled handle starts that count afresh.  ``host`` is
    the host of the cluster's control service, so that TCP listeners bind
    the interface that routes there (as for a ``tcp://`` store's host).
    """

    def __init__(self, name, timeout=None, *, label=None):
        super().__init__(timeout)
        if not isinstance(name, str) or not name:
            raise InvalidArgument(f"a RayStore name must be a non-empty str, got {name!r}")
        ray, self._kv = _connected_ray()
        self.name = name
        self.host = ray.get_runtime_context().gcs_address.rpartition(":")[0].strip("[]")
        self.url = f"ray://{name}" + ("" if label is None else f"#{label}")
        encoded = name.encode("utf-8")
        # Length first: no store's keys are a prefix of another store's.
        self._root = b"%d:%s/" % (len(encoded), encoded)

    # -- the version chain ------------------------------------------------

    def _call(self, what, fn, *args, **kwargs):
        try:
            return fn(*args, namespace=KV_NAMESPACE, **kwargs)
        except Exception as err:
            raise StoreError(f"store {self.url}: Ray's key-value store failed to {what}: "
                             f"{type(err).__name__}: {err}") from err

    def _version_key(self, key, number):
        return self._root + b"v%d/" % number + key.encode("utf-8")

    def _head_key(self, key):
        return self._root + b"h/" + key.encode("utf-8")

    def _read(self, raw_key):
        return self._call("read a key", self._kv._internal_kv_get, raw_key)

    def _latest(self, key, known=0):
        """(number, entry) of the newest version of ``key``; (0, None) if it has none."""
        head = self._read(self._head_key(key))
        number = max(known, int(head) if head else 0)
        entry = self._read(self._version_key(key, number)) if number else None
        while True:
            newer = self._read(self._version_key(key, number + 1))
            if newer is None:
                return number, entry
            number, entry = number + 1, newer

    def _append(self, key, make_entry):
        """Add the version ``make_entry(current value or None)``; return that value.

        ``make_entry`` returning None appends nothing (and None is returned).
        """
        deadline = Deadline(self.timeout)
        number = 0
        while True:
            number, entry = self._latest(key, number)
            new = make_entry(_value(entry))
            if new is None:
                return None
            claimed = not self._call("write a key", self._kv._internal_kv_put,
                                     self._version_key(key, number + 1), new, False)
            if claimed:
                self._call("write a key", self._kv._internal_kv_put, self._head_key(key),
                           b"%d" % (number + 1), True)
                return new
            # Another writer took version number + 1 (so the chain moved on): build on it.
            number += 1
            if deadline.expired():
                raise StoreError(f"store {self.url}: could not write key {key!r} within "
                                 f"{deadline.timeout:g} s: other writers kept taking each "
                                 f"version first")

    def _values(self, keys):
        """``{key: value}`` for the keys of ``keys`` that are set now."""
        found = {}
        for key in keys:
            value = _value(self._latest(key)[1])
            if value is not None:
                found[key] = value
        return found

    def _poll(self, keys, deadline):
        """Wait until every key is set; return their values."""
        found = {}
        delays = backoff_delays(POLL_FIRST_S, POLL_CAP_S)
        while True:
            found.update(self._values([key for key in keys if key not in found]))
            if not self._keep_waiting([key for key in keys if key not in found], deadline):
                return found
            time.sleep(min(next(delays), deadline.remaining()))

    # -- the Store hooks --------------------------------------------------

    def _set(self, key, value):
        self._append(key, lambda current: _PRESENT + value)

    def _get(self, key, deadline):
        return self._poll([key], deadline)[key]

    def _wait(self, keys, deadline):
        self._poll(keys, deadline)

    def _add(self, key, amount):
        def added(current):
            total = (0 if current is None else parse_counter(current, key, self.url)) + amount
            return _PRESENT + str(total).encode("ascii")
        return int(self._append(key, added)[1:])

    def _delete(self, key):
        return self._append(key, lambda current: None if current is None else _DELETED) \
            is not None

    def _check(self, keys):
        return len(self._values(keys)) == len(keys)

    def empty(self):
        """Whether no key of this store is left in Ray's key-value store (closed or not)."""
        return not self._call("list the store's keys", self._kv._internal_kv_list, self._root)

    def cleanup(self):
        """Close the store and remove every key under its name from Ray's key-value store."""
        self.close()
        self._call("delete the store's keys", self._kv._internal_kv_del, self._root,
                   del_by_prefix=True)


def _value(entry):
    """The value an entry holds, or None for no entry or a delete."""
    if entry is None or entry[:1] != _PRESENT:
        return None
    return entry[1:]


def open_ray_store(url, *, timeout=None, rank=None, size=None):
    """Open ``ray://NAME``: the keys under NAME in the key-value store of this Ray cluster."""
    parts = split_store_url(url, "ray")
    name = parts.netloc + parts.path
    if not name:
        raise InvalidArgument(f"{url!r} names no store; use ray://NAME so that the ranks share it")
    return RayStore(name, timeout=timeout)
