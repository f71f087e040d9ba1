"""The store interface every rendezvous store implements, and ``PrefixStore``.

A store maps ``str`` keys to ``bytes`` values.  The public methods of
``Store`` validate their arguments, turn a timeout into a ``Deadline`` and
then call one protected hook (``_set``, ``_get``, ``_wait``, ``_add``,
``_delete``, ``_check``, ``_close``) that a concrete store implements; a
third-party store subclasses ``Store`` the same way.
"""

import abc
import datetime
import numbers
import operator
import re
import time
from urllib.parse import unquote, urlsplit

from .. import settings
from ..errors import InvalidArgument, StoreError, Timeout

__all__ = [
    "DEFAULT_TIMEOUT",
    "Deadline",
    "PrefixStore",
    "Store",
    "backoff_delays",
    "parse_counter",
    "parse_url",
    "redact",
    "redact_text",
    "resolve_timeout",
    "split_store_url",
]

DEFAULT_TIMEOUT = settings.SETTINGS["PYCOLLECT_TIMEOUT"].default
# A Timeout message lists at most this many missing keys, then a count.
MISSING_KEYS_SHOWN = 8


def _seconds(timeout, what):
    """Validate a timeout (number or ``timedelta``) and return it as float seconds."""
    if isinstance(timeout, datetime.timedelta):
        timeout = timeout.total_seconds()
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
        raise InvalidArgument(f"{what} must be a number of seconds, got {timeout!r}")
    seconds = float(timeout)
    if not 0 <= seconds <= settings.MAX_TIMEOUT_S:
        raise InvalidArgument(f"{what} must be a number of seconds >= 0, at most "
                              f"{settings.MAX_TIMEOUT_S:.0f} (about 23 days), got {timeout!r}")
    return seconds


def resolve_timeout(timeout=None):
    """Return ``timeout`` validated, or the default (``PYCOLLECT_TIMEOUT``, else 120 s)."""
    if timeout is not None:
        return _seconds(timeout, "timeout")
    return settings.get("PYCOLLECT_TIMEOUT")


class Deadline:
    """A point in monotonic time, remembering the timeout it was made from."""

    __slots__ = ("timeout", "expires_at")

    def __init__(self, timeout):
        self.timeout = timeout
        self.expires_at = time.monotonic() + timeout

    def remaining(self):
        """Seconds left, never negative."""
        return max(0.0, self.expires_at - time.monotonic())

    def expired(self):
        """Whether the deadline has passed."""
        return time.monotonic() >= self.expires_at


def backoff_delays(first=0.001, cap=0.05):
    """Yield sleep lengths that double from ``first`` up to ``cap``; callers stop at a deadline."""
    delay = first
    while True:
        yield delay
        delay = min(delay * 2, cap)


def check_key(key):
    """Return ``key`` if it is a ``str`` that UTF-8 can encode."""
    if not isinstance(key, str):
        raise InvalidArgument(f"store keys must be str, got {type(key).__name__}: {key!r}")
    try:
        key.encode("utf-8")
    except UnicodeEncodeError as err:
        raise InvalidArgument(f"store key {key!r} cannot be encoded as UTF-8: {err}") from None
    return key


def check_keys(keys):
    """Return ``keys`` as a list of distinct valid keys, in their first order."""
    if isinstance(keys, (str, bytes)):
        raise InvalidArgument(f"expected a list of keys, got the single key {keys!r}; pass [key]")
    try:
        keys = list(keys)
    except TypeError:
        raise InvalidArgument(f"expected a list of keys, got {type(keys).__name__}") from None
    return list(dict.fromkeys(check_key(key) for key in keys))


def check_value(value):
    """Return ``value`` as ``bytes``: bytearray and memoryview are copied, others rejected."""
    if isinstance(value, bytes):
        return value
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    raise InvalidArgument(f"store values must be bytes, got {type(value).__name__}")


def check_amount(amount):
    """Return ``amount`` as an ``int``; bools and non-integers are rejected."""
    if isinstance(amount, bool):
        raise InvalidArgument(f"add() needs an integer amount, got {amount!r}")
    try:
        return operator.index(amount)
    except TypeError:
        raise InvalidArgument(
            f"add() needs an integer amount, got {type(amount).__name__}") from None


def parse_counter(value, key, where):
    """Read a counter written by ``add`` (ASCII decimal); anything else is invalid."""
    try:
        return int(value.decode("ascii"), 10)
    except (UnicodeDecodeError, ValueError):
        shown = value[:32] + (b"..." if len(value) > 32 else b"")
        raise InvalidArgument(
            f"add() on key {key!r} in store {where}: the key holds {shown!r}, "
            f"not an ASCII decimal counter") from None


def parse_url(url):
    """``urlsplit(url)``, with a malformed URL reported as ``InvalidArgument``."""
    if not isinstance(url, str):
        raise InvalidArgument(f"a store URL must be str, got {type(url).__name__}")
    try:
        return urlsplit(url)
    except ValueError as err:
        raise InvalidArgument(f"malformed store URL {redact(url)!r}: {err}") from None


# The authority of a URL without userinfo: host (or [IPv6]) and port.
_HOST_PORT = re.compile(r"(?:\[[^\]]*\]|[^\[\]:@]+):\d*")
# What follows a password's "@" in a URL this project reads: a host (or [IPv6]), then a
# port or a database number or both, or nothing else at all, then any query or fragment
# (where an "@" may stand).  A host followed at once by "?" or "#" is not taken for one:
# in "redis://:p@ss?x@h:1" the password is "p@ss?x".
_AFTER_PASSWORD = re.compile(r"(?:\[[^\]/?#@]*\]|[^\[\]/?#@:]+)(?:\Z|(?=[:/])(?::\d*)?(?:/\d*)?"
                             r"(?:[?#].*)?)", re.DOTALL)


def _password_span(url):
    """Where ``url``'s password is: ``(start, end)``, else None.  It starts after ``//USER:``.
    An unescaped ``/``, ``?``, ``#``, ``:`` or ``@`` in it must not show the rest of it, and
    an ``@`` in a query must not hide the host and port: it ends at the first ``@`` that
    ``_AFTER_PASSWORD`` follows, else at the last ``@``.  A URL whose text up to its first
    ``/``, ``?`` or ``#`` is ``host:port``, with every ``@`` after a ``?`` or ``#``, has none
    (``tcp://h:1?prefix=job@2``).  Only a password that itself reads as that (``1?x``
    after a user, or ``a@b:1/2?c``) shows its tail."""
    if not isinstance(url, str):
        return None
    begin = url.find("//")
    last = url.rfind("@")
    if begin < 0 or last < begin:
        return None
    colon = url.find(":", begin + 2, last)
    if colon < 0 or any(mark in url[begin + 2:colon] for mark in "/?#"):
        return None         # no password, or a colon after the authority (a path's)
    head = re.match(r"[^/?#]*", url[begin + 2:]).group()
    query = re.search(r"[?#]", url[begin + 2:])
    if _HOST_PORT.fullmatch(head) and query and begin + 2 + query.start() < url.find("@", begin):
        return None         # every "@" is in the query or fragment
    for at in range(colon + 1, last):
        if url[at] == "@" and _AFTER_PASSWORD.fullmatch(url, at + 1):
            return colon + 1, at
    return colon + 1, last


def redact(url):
    """``url`` with any password replaced by ``***``, for logs and messages."""
    if not isinstance(url, str):
        return getattr(url, "url", repr(url))
    span = _password_span(url)
    return url if span is None else url[:span[0]] + "***" + url[span[1]:]


def redact_text(text, url):
    """``text`` (an error's message, say) with the password of ``url``, as written in it
    or percent-decoded, replaced by ``***``."""
    span = _password_span(url)
    if span is not None:
        password = url[span[0]:span[1]]
        for secret in sorted({password, unquote(password)}, key=len, reverse=True):
            if secret:
                text = text.replace(secret, "***")
    return text


def split_store_url(url, scheme):
    """Split a store URL, checking its scheme and that it has no query or fragment."""
    parts = parse_url(url)
    if parts.scheme.lower() != scheme:
        raise InvalidArgument(f"expected a {scheme}:// URL, got {redact(url)!r}")
    if parts.query or parts.fragment:
        raise InvalidArgument(f"{scheme}:// store URL {redact(url)!r} takes no query or fragment "
                              f"(only ?prefix=NAME, which open_store handles)")
    return parts


def _format_keys(keys):
    """Keys for a message: the first few quoted, then how many more."""
    shown = ", ".join(repr(key) for key in keys[:MISSING_KEYS_SHOWN])
    hidden = len(keys) - MISSING_KEYS_SHOWN
    return shown + (f" and {hidden} more" if hidden > 0 else "")


class Store(abc.ABC):
    """Base of every rendezvous store: ``str`` keys, ``bytes`` values, waits with deadlines."""

    url = "store"

    def __init__(self, timeout=None):
        self.timeout = timeout
        self._closed = False

    @property
    def timeout(self):
        """Default deadline in seconds for ``get`` and ``wait``."""
        return self._timeout

    @timeout.setter
    def timeout(self, timeout):
        self._timeout = resolve_timeout(timeout)

    @property
    def closed(self):
        """Whether ``close`` has been called."""
        return self._closed

    def set(self, key, value):
        """Store ``value`` under ``key``, replacing any previous value."""
        key, value = check_key(key), check_value(value)
        self._ensure_open()
        self._set(key, value)

    def get(self, key, timeout=None):
        """Return the value of ``key``, waiting until it is set or the deadline passes."""
        key = check_key(key)
        deadline = self._deadline(timeout)
        self._ensure_open()
        return self._get(key, deadline)

    def wait(self, keys, timeout=None):
        """Wait until every key in ``keys`` is set or the deadline passes."""
        keys = check_keys(keys)
        deadline = self._deadline(timeout)
        self._ensure_open()
        if keys:
            self._wait(keys, deadline)

    def add(self, key, amount):
        """Atomically add ``amount`` to counter ``key`` (created at 0); return the new value."""
        key, amount = check_key(key), check_amount(amount)
        self._ensure_open()
        return self._add(key, amount)

    def delete(self, key):
        """Remove ``key``; return whether it existed."""
        key = check_key(key)
        self._ensure_open()
        return self._delete(key)

    def check(self, keys):
        """Return whether every key in ``keys`` is set now, without waiting."""
        keys = check_keys(keys)
        self._ensure_open()
        return self._check(keys) if keys else True

    def close(self):
        """Release the store's resources; calling it again does nothing."""
        if self._closed:
            return
        self._closed = True
        self._close()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()

    def __repr__(self):
        state = " closed" if self._closed else ""
        return f"<{type(self).__name__} {self.url}{state}>"

    def timeout_error(self, missing_keys, deadline):
        """The ``Timeout`` for a wait on ``missing_keys`` that reached ``deadline``."""
        noun = "key" if len(missing_keys) == 1 else f"{len(missing_keys)} keys"
        return Timeout(f"timed out after {deadline.timeout:g} s waiting for {noun} "
                       f"{_format_keys(list(missing_keys))} in store {self.url}")

    def closed_error(self):
        """The ``StoreError`` for an operation on a closed store."""
        return StoreError(f"store {self.url} is closed")

    def _keep_waiting(self, missing_keys, deadline):
        """Whether keys are still missing; raises once the store is closed or time is up."""
        if not missing_keys:
            return False
        if self._closed:
            raise self.closed_error()
        if deadline.expired():
            raise self.timeout_error(missing_keys, deadline)
        return True

    def _ensure_open(self):
        if self._closed:
            raise self.closed_error()

    def _deadline(self, timeout):
        return Deadline(self._timeout if timeout is None else _seconds(timeout, "timeout"))

    @abc.abstractmethod
    def _set(self, key, value):
        """Implement set: the arguments are already validated."""

    @abc.abstractmethod
    def _get(self, key, deadline):
        """Implement get: the arguments are already validated."""

    @abc.abstractmethod
    def _wait(self, keys, deadline):
        """Implement wait: the arguments are already validated."""

    @abc.abstractmethod
    def _add(self, key, amount):
        """Implement add: the arguments are already validated."""

    @abc.abstractmethod
    def _delete(self, key):
        """Implement delete: the arguments are already validated."""

    @abc.abstractmethod
    def _check(self, keys):
        """Implement check: the arguments are already validated."""

    def _close(self):
        """Release resources; called once, by the first ``close``."""


class PrefixStore(Store):
    """A view of ``store`` whose keys are namespaced as ``prefix + "/" + key``; prefixes compose."""

    def __init__(self, prefix, store, *, owns_store=False):
        if not isinstance(prefix, str) or not prefix:
            raise InvalidArgument(f"a store prefix must be a non-empty str, got {prefix!r}")
        if not isinstance(store, Store):
            raise InvalidArgument(f"PrefixStore wraps a Store, got {type(store).__name__}")
        check_key(prefix)
        super().__init__(store.timeout)
        self.prefix = prefix
        self.store = store
        self.owns_store = owns_store
        if isinstance(store, PrefixStore):
            self.url = f"{store.url}/{prefix}"
        else:
            self.url = f"{store.url}?prefix={prefix}"

    def _full_key(self, key):
        return f"{self.prefix}/{key}"

    def _set(self, key, value):
        self.store.set(self._full_key(key), value)

    def _get(self, key, deadline):
        return self.store.get(self._full_key(key), deadline.timeout)

    def _wait(self, keys, deadline):
        self.store.wait([self._full_key(key) for key in keys], deadline.timeout)

    def _add(self, key, amount):
        return self.store.add(self._full_key(key), amount)

    def _delete(self, key):
        return self.store.delete(self._full_key(key))

    def _check(self, keys):
        return self.store.check([self._full_key(key) for key in keys])

    def _close(self):
        if self.owns_store:
            self.store.close()
