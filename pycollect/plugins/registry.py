"""Store and transport plugins, found by name in entry points and imported on first use.

Stores are registered in the entry-point group ``pycollect.stores`` (name: the
URL scheme; object: a callable ``(url, *, timeout, rank, size) -> Store``),
transports in ``pycollect.transports`` (name: the transport name).  The
built-ins take the same road, through pycollect's own entry points.

Entry-point names are letters, digits, ``_``, ``.`` and ``-``, so a plugin name with ``+`` in it is registered with
``-`` in its place and found under either spelling: transport ``tcp+tls`` is the entry
point ``tcp-tls``.  Names are found whatever their case (URL schemes are case-insensitive):
entry point ``MyStore`` opens ``mystore://`` and ``MYSTORE://``, and is listed as ``mystore``.

Each installed distribution's entry points are read on their own: one whose
``entry_points.txt`` cannot be parsed is skipped, and named where a lookup fails.
"""

import importlib.metadata
import re
import threading
from urllib.parse import parse_qsl, urlencode, urlunsplit

from ..errors import Error, InvalidArgument, PluginError
from .store import PrefixStore, Store, parse_url, redact, redact_text

__all__ = ["STORE_GROUP", "TRANSPORT_GROUP", "available", "check_store_url", "get_store_opener",
           "get_transport", "open_store", "open_transport", "refresh", "transport_options",
           "with_prefix"]

STORE_GROUP = "pycollect.stores"
TRANSPORT_GROUP = "pycollect.transports"
PREFIX_QUERY = "prefix"


def _entry_points(group):
    """The installed entry points of ``group``, and ``{distribution: why}`` for the
    distributions whose entry points could not be read (tests replace this source).

    Each distribution is read on its own, the first of one name on the path winning (as
    ``importlib.metadata.entry_points`` does): one malformed ``entry_points.txt`` costs
    only its own distribution's plugins."""
    found, unreadable, seen = [], {}, set()
    for dist in importlib.metadata.distributions():
        where = getattr(dist, "_path", None)
        # Named by its path until its metadata is read: metadata that cannot be read (a
        # METADATA file that is not UTF-8, say) still names the right distribution.
        name = f"the distribution at {where}" if where else "an unnamed distribution"
        try:
            declared = dist.metadata.get("Name")
            if declared:
                name = f"{declared} ({where})" if where else declared
                normalized = re.sub(r"[-_.]+", "-", declared).lower()
                if normalized in seen:
                    continue
                seen.add(normalized)
            # A distribution without a Name is read on its own, never merged with another.
            found.extend(dist.entry_points.select(group=group))
        except Exception as err:    # malformed metadata of a package pycollect knows nothing of
            unreadable[name] = f"{type(err).__name__}: {err}"
    return found, unreadable


def _key(name):
    """The name a plugin is found under: lower case, ``+`` spelt ``-``."""
    return name.lower().replace("+", "-")


def _distribution_name(entry_point):
    dist = getattr(entry_point, "dist", None)
    return getattr(dist, "name", None) or "an unknown distribution"


class _PluginGroup:
    """One entry-point group: names read once, each plugin imported on first use and cached."""

    def __init__(self, group, kind):
        self.group = group
        self.kind = kind
        self._lock = threading.Lock()
        self._entries = None
        self._conflicts = None
        self._unreadable = {}
        self._loaded = {}

    def _read(self):
        with self._lock:
            if self._entries is None:
                entries, conflicts = {}, {}
                found, self._unreadable = _entry_points(self.group)
                for entry_point in found:
                    key = _key(entry_point.name)
                    first = entries.setdefault(key, entry_point)
                    if first.value != entry_point.value:
                        conflicts.setdefault(key, [first]).append(entry_point)
                self._entries, self._conflicts = entries, conflicts
            return self._entries, self._conflicts

    def distributions(self):
        """Map each plugin name to the distribution that registers it."""
        entries, _ = self._read()
        return {name: _distribution_name(entry) for name, entry in sorted(entries.items())}

    def load(self, name):
        """The plugin object registered as ``name``, imported on first use."""
        name = _key(name)
        with self._lock:
            if name in self._loaded:
                return self._loaded[name]
        entries, conflicts = self._read()
        if name not in entries:
            known = ", ".join(sorted(entries)) or "none"
            skipped = "".join(f"; skipped {dist}, whose entry points could not be read ({why})"
                              for dist, why in sorted(self._unreadable.items()))
            raise PluginError(f"no {self.kind} plugin named {name!r} (entry-point group "
                              f"{self.group}); available: {known}{skipped}")
        if name in conflicts:
            sources = "; ".join(f"{entry.value} from {_distribution_name(entry)}"
                                for entry in conflicts[name])
            raise PluginError(f"{self.kind} plugin {name!r} is registered more than once "
                              f"({sources}); uninstall all but one")
        entry_point = entries[name]
        try:
            plugin = entry_point.load()
        except (Exception, SystemExit) as err:     # a plugin's sys.exit() must not end the job
            dist = _distribution_name(entry_point)
            raise PluginError(
                f"{self.kind} plugin {name!r} (entry point '{entry_point.name} = "
                f"{entry_point.value}' in group {self.group}, from {dist}) failed to import: "
                f"{type(err).__name__}: {err}; reinstall it or what it needs, for example "
                f"pip install --force-reinstall {dist}") from err
        with self._lock:
            return self._loaded.setdefault(name, plugin)

    def forget(self):
        """Drop what was read and loaded, so that the next use reads the entry points again."""
        with self._lock:
            self._entries = self._conflicts = None
            self._loaded = {}


_stores = _PluginGroup(STORE_GROUP, "store")
_transports = _PluginGroup(TRANSPORT_GROUP, "transport")


def refresh():
    """Read the entry points again on next use (after installing a plugin in a running process)."""
    _stores.forget()
    _transports.forget()


def available():
    """The registered plugins: ``{"stores": {name: distribution}, "transports": {...}}``."""
    return {"stores": _stores.distributions(), "transports": _transports.distributions()}


def get_transport(name):
    """The transport plugin registered as ``name``: a callable factory (checked now, before
    any rendezvous)."""
    if not isinstance(name, str) or not name:
        raise InvalidArgument(f"a transport name must be a non-empty str, got {name!r}")
    return _callable(_transports.load(name), "transport", name)


def _callable(plugin, kind, name):
    if not callable(plugin):
        raise PluginError(f"{kind} plugin {name!r} is a {type(plugin).__name__}, not a callable")
    return plugin


def _call_plugin(kind, name, what, url, call):
    """``call()``'s result; an error of a plugin that is not a pycollect Error (SystemExit
    included) becomes a PluginError naming it (``url``'s password redacted)."""
    try:
        return call()
    except Error:
        raise
    except (Exception, SystemExit) as err:
        raise PluginError(f"{kind} plugin {name!r} failed to {what}: "
                          + redact_text(f"{type(err).__name__}: {err}", url)) from err


def open_transport(name, factory, rank, size, store, **options):
    """``factory(rank, size, store, **options)``, the factory of transport plugin ``name``:
    a Transport, else a PluginError naming the plugin (for an error of the factory that is
    not a pycollect Error, and for a result that is not a Transport)."""
    from .._ext._transport import Transport     # the compiled layer: imported when first used
    transport = _call_plugin("transport", name, "connect", None,
                             lambda: factory(rank, size, store, **options))
    # A wrapper that can be closed passes here (the Context refuses it then, and init closes
    # it); anything else could not even be closed.
    if not isinstance(transport, Transport) and not callable(getattr(transport, "close", None)):
        raise PluginError(f"transport plugin {name!r} returned a {type(transport).__name__}, "
                          f"not a pycollect Transport")
    return transport


def get_store_opener(scheme):
    """The store plugin object registered for the URL scheme ``scheme``, imported on first use."""
    if not isinstance(scheme, str) or not scheme:
        raise InvalidArgument(f"a store scheme must be a non-empty str, got {scheme!r}")
    return _stores.load(scheme.lower())


def transport_options(name, factory, given):
    """The keyword arguments ``init`` passes to transport ``name``'s ``factory``.

    ``given``: the transport options of ``init`` that the caller set (not None).
    A factory declares the ones it takes as ``factory.options`` (names) and
    may check them before the rendezvous with ``factory.prepare(**given)``,
    which returns its keyword arguments.
    """
    declared = getattr(factory, "options", ())
    unknown = [option for option in given if option not in declared]
    if unknown:
        raise InvalidArgument("init: transport %r takes no option %s (it takes %s)" % (
            name, ", ".join(unknown), ", ".join(declared) or "none"))
    prepare = getattr(factory, "prepare", None)
    return dict(given) if prepare is None else prepare(**given)


def _split_prefix(spec):
    """Return (URL without ``prefix`` in its query, the prefix or None)."""
    parts = parse_url(spec)
    query = parse_qsl(parts.query, keep_blank_values=True)
    prefixes = [value for name, value in query if name == PREFIX_QUERY]
    if not prefixes:
        return spec, None
    if len(prefixes) > 1 or not prefixes[0]:
        raise InvalidArgument(f"store URL {redact(spec)!r} must have at most one non-empty "
                              f"?{PREFIX_QUERY}=NAME")
    rest = urlencode([(name, value) for name, value in query if name != PREFIX_QUERY])
    return urlunsplit(parts._replace(query=rest)), prefixes[0]


def with_prefix(url, name):
    """The store URL ``url`` with ``name`` added to its ``?prefix=`` (``name`` alone where it
    has none, else after the one it has: ``?prefix=a`` and ``b`` give ``?prefix=a/b``)."""
    parts = parse_url(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    existing = [value for key, value in query if key == PREFIX_QUERY]
    prefix = f"{existing[-1].rstrip('/')}/{name}" if existing and existing[-1] else name
    query = [(key, value) for key, value in query if key != PREFIX_QUERY] + \
        [(PREFIX_QUERY, prefix)]
    return urlunsplit(parts._replace(query=urlencode(query, safe="/")))


def check_store_url(spec, *, across_processes=False):
    """Check the store URL ``spec`` without opening the store: a URL str whose scheme names a
    registered store plugin (imported now), with at most one ``?prefix=``; with
    ``across_processes``, also a store that ranks in separate processes can share (a plugin
    whose store lives inside one process, as ``hash://``'s does, marks its opener
    ``in_process = True``).  Returns the plugin's opener."""
    return _checked(spec, across_processes)[0]


def _checked(spec, across_processes):
    """check_store_url's checks; returns (opener, scheme, URL without its prefix, prefix)."""
    if not spec:
        raise InvalidArgument("a store is required: a Store, or a URL such as "
                              "tcp://HOST:PORT, file:///shared/dir or hash://NAME")
    if not isinstance(spec, str):
        raise InvalidArgument(f"a store must be a Store or a URL str, got {type(spec).__name__}")
    scheme = parse_url(spec).scheme.lower()
    if not scheme:
        raise InvalidArgument(f"store URL {redact(spec)!r} has no scheme; available: "
                              f"{', '.join(_stores.distributions()) or 'none'}")
    url, prefix = _split_prefix(spec)
    opener = _stores.load(scheme)
    if across_processes and getattr(opener, "in_process", False):
        raise InvalidArgument(f"store {redact(spec)!r} lives inside one process, and the ranks "
                              f"are separate processes: use tcp://, file:// or redis://")
    return opener, scheme, url, prefix


def open_store(spec, *, timeout=None, rank=None, size=None):
    """Return a Store as is, else open the store a URL names (``?prefix=NAME`` wraps it)."""
    if isinstance(spec, Store):
        return spec
    opener, scheme, url, prefix = _checked(spec, False)
    opener = _callable(opener, "store", scheme)
    store = _call_plugin("store", scheme, f"open {redact(url)!r}", url,
                         lambda: opener(url, timeout=timeout, rank=rank, size=size))
    if not isinstance(store, Store):
        raise PluginError(f"store plugin {scheme!r} returned a {type(store).__name__}, "
                          f"not a pycollect Store")
    return store if prefix is None else PrefixStore(prefix, store, owns_store=True)
