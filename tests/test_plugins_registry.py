"""The plugin registry: built-ins via entry points, URL dispatch, prefixes, broken plugins."""

import importlib.metadata
import time

import pytest

import pycollect as pc
from pycollect.plugins import (FileStore, HashStore, PrefixStore, TCPStore, TCPStoreServer,
                               available, get_transport, open_store)
from pycollect.plugins import registry

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def fake_entry_points(monkeypatch):
    """Replace the registry's entry-point source with the given {group: [EntryPoint]}."""
    def install(by_group):
        monkeypatch.setattr(registry, "_entry_points",
                            lambda group: (by_group.get(group, []), {}))
        registry.refresh()
    yield install
    monkeypatch.undo()
    registry.refresh()


def _entry_point(name, value, group=registry.STORE_GROUP):
    return importlib.metadata.EntryPoint(name=name, value=value, group=group)


class _LoadedEntryPoint:
    """An entry point of a made-up distribution whose object is given, not imported."""

    def __init__(self, name, plugin):
        self.name, self.value, self.plugin = name, f"fake_plugins:{name}", plugin
        self.dist = type("Distribution", (), {"name": "fake-plugins"})()

    def load(self):
        return self.plugin


class _ExitingEntryPoint(_LoadedEntryPoint):
    """An entry point whose module calls sys.exit() when imported."""

    def load(self):
        raise SystemExit("plugin module exits at import")


def test_builtins_are_listed_from_the_pycollect_distribution():
    plugins = available()
    for scheme in ("hash", "file", "tcp"):
        assert plugins["stores"][scheme] == "pycollect"
    assert plugins["transports"]["tcp"] == "pycollect"


def test_available_returns_a_copy():
    available()["stores"]["bogus"] = "x"
    assert "bogus" not in available()["stores"]


def test_a_store_instance_is_returned_as_is():
    store = HashStore()
    assert open_store(store) is store


@pytest.mark.parametrize("spec", [None, "", b"hash://x", 42])
def test_missing_or_non_url_specs_are_invalid_arguments(spec):
    with pytest.raises(pc.InvalidArgument):
        open_store(spec)


def test_a_url_without_scheme_is_an_invalid_argument():
    with pytest.raises(pc.InvalidArgument, match="no scheme.*hash"):
        open_store("/tmp/run")


def test_unknown_scheme_lists_what_is_available():
    with pytest.raises(pc.PluginError, match="redisx.*available: ") as caught:
        open_store("redisx://localhost:6379")
    assert all(scheme in str(caught.value) for scheme in ("file", "hash", "tcp"))


def test_urls_dispatch_by_scheme(tmp_path):
    with open_store("hash://registry-dispatch", timeout=3, rank=0, size=1) as store:
        assert isinstance(store, HashStore) and store.timeout == 3
    with open_store(f"file://{tmp_path}") as store:
        assert isinstance(store, FileStore) and store.path == str(tmp_path)
    with TCPStoreServer() as server, open_store(server.url, timeout=5) as store:
        assert isinstance(store, TCPStore)
        store.set("key", b"value")
    with open_store("HASH://upper-case-scheme") as store:
        assert isinstance(store, HashStore)


def test_prefix_query_wraps_the_store(tmp_path):
    with open_store(f"file://{tmp_path}?prefix=job7") as store:
        assert isinstance(store, PrefixStore) and store.prefix == "job7"
        assert isinstance(store.store, FileStore) and store.store.path == str(tmp_path)
        store.set("rank0", b"x")
        assert store.store.get("job7/rank0") == b"x"
    assert store.store.closed


@pytest.mark.parametrize("query", ["?prefix=", "?prefix=a&prefix=b"])
def test_bad_prefix_queries_are_invalid_arguments(query):
    with pytest.raises(pc.InvalidArgument, match="prefix"):
        open_store(f"hash://bad-prefix{query}")


def test_other_query_parameters_reach_the_plugin():
    with pytest.raises(pc.InvalidArgument, match="query"):
        open_store("hash://name?prefix=p&mode=fast")


def test_unknown_transport_lists_what_is_available():
    with pytest.raises(pc.PluginError, match="verbsx.*available: .*tcp"):
        get_transport("verbsx")


def test_transports_are_loaded_once_and_cached(fake_entry_points):
    fake_entry_points({registry.TRANSPORT_GROUP: [
        _entry_point("loopback", "json:dumps", registry.TRANSPORT_GROUP)]})
    import json
    assert get_transport("loopback") is json.dumps
    assert get_transport("loopback") is get_transport("loopback")


def test_a_broken_plugin_fails_when_used_naming_it(fake_entry_points):
    fake_entry_points({registry.STORE_GROUP: [
        _entry_point("broken", "pycollect_no_such_module.stores:open_broken")]})
    assert available()["stores"] == {"broken": "an unknown distribution"}
    with pytest.raises(pc.PluginError) as caught:
        open_store("broken://anything")
    message = str(caught.value)
    assert "broken" in message and "pycollect_no_such_module.stores:open_broken" in message
    assert "pip install" in message and "ModuleNotFoundError" in message
    assert isinstance(caught.value.__cause__, ImportError)


def test_a_plugin_returning_a_non_store_is_a_plugin_error(fake_entry_points):
    fake_entry_points({registry.STORE_GROUP: [
        _LoadedEntryPoint("odd", lambda url, **options: {"url": url})]})
    with pytest.raises(pc.PluginError, match="odd.*not a pycollect Store"):
        open_store("odd://x")


def test_a_plugin_that_crashes_while_opening_is_a_plugin_error(fake_entry_points):
    fake_entry_points({registry.STORE_GROUP: [_LoadedEntryPoint("rigid", lambda url: None)]})
    with pytest.raises(pc.PluginError, match="rigid.*TypeError"):
        open_store("rigid://x")


def test_pycollect_errors_from_a_plugin_pass_through(fake_entry_points):
    def refuse(url, **options):
        raise pc.StoreError(f"{url} is down")

    fake_entry_points({registry.STORE_GROUP: [_LoadedEntryPoint("down", refuse)]})
    with pytest.raises(pc.StoreError, match="down://x is down"):
        open_store("down://x")


def test_one_name_from_two_places_is_a_plugin_error(fake_entry_points):
    fake_entry_points({registry.STORE_GROUP: [
        _entry_point("twice", "pycollect.plugins.stores.hash_store:open_hash_store"),
        _entry_point("twice", "pycollect.plugins.stores.file_store:open_file_store")]})
    with pytest.raises(pc.PluginError, match="more than once"):
        open_store("twice://x")


def test_a_third_party_store_is_opened_with_the_callers_arguments(fake_entry_points):
    calls = []

    def open_memory_store(url, *, timeout, rank, size):
        calls.append((url, timeout, rank, size))
        return HashStore(timeout=timeout)

    fake_entry_points({registry.STORE_GROUP: [_LoadedEntryPoint("mem", open_memory_store)]})
    assert available()["stores"] == {"mem": "fake-plugins"}
    with open_store("mem://host/db?prefix=job", timeout=4, rank=1, size=2) as store:
        assert isinstance(store, PrefixStore) and store.timeout == 4
    assert calls == [("mem://host/db", 4, 1, 2)]


def test_a_malformed_entry_points_file_costs_only_its_distribution(tmp_path, monkeypatch):
    info = tmp_path / "unrelated_pkg-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: unrelated-pkg\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[console_scripts]\nbroken-line-without-equals\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    registry.refresh()
    try:
        assert available()["stores"]["file"] == "pycollect"
        with open_store(f"file://{tmp_path}/store") as store:
            assert isinstance(store, FileStore)
        with pc.init(rank=0, size=1, timeout=5, store="hash://malformed-entry-points") as ctx:
            assert ctx.size == 1
        with pytest.raises(pc.PluginError, match="no store plugin named 'nosuch'.*skipped "
                                                 "unrelated-pkg.*could not be read"):
            open_store("nosuch://x")
    finally:
        monkeypatch.undo()
        registry.refresh()


def _dist_info(root, name, metadata, entry_points=""):
    """``root/NAME.dist-info`` with the given METADATA (bytes) and entry_points.txt."""
    info = root / f"{name}.dist-info"
    info.mkdir()
    (info / "METADATA").write_bytes(metadata)
    (info / "entry_points.txt").write_text(entry_points)
    return info


def test_unreadable_metadata_names_its_path_and_unnamed_distributions_count_apart(
        tmp_path, monkeypatch):
    """A distribution whose METADATA is not UTF-8 is skipped and named by its path (it
    raised UnboundLocalError, or took the name of the distribution read before it); two
    distributions without a Name are both read (only the first one was)."""
    bad = _dist_info(tmp_path, "bad_pkg-0.1", b"Metadata-Version: 2.1\nName: b\xffd\n")
    for index in (1, 2):
        _dist_info(tmp_path, f"nameless{index}-0.1", b"Metadata-Version: 2.1\n",
                   f"[{registry.STORE_GROUP}]\nnameless{index} = builtins:print\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    registry.refresh()
    try:
        found, unreadable = registry._entry_points(registry.STORE_GROUP)
        assert list(unreadable) == [f"the distribution at {bad}"]
        with pytest.raises(pc.PluginError, match=f"skipped the distribution at {bad}, "
                                                 f"whose entry points could not be read "
                                                 f"\\(UnicodeDecodeError"):
            open_store("nosuch://x")
        assert {"nameless1", "nameless2", "file"} <= set(available()["stores"])
        only_bad = [importlib.metadata.PathDistribution(bad)]
        monkeypatch.setattr(importlib.metadata, "distributions", lambda: iter(only_bad))
        assert list(registry._entry_points(registry.STORE_GROUP)[1]) == [
            f"the distribution at {bad}"]
    finally:
        monkeypatch.undo()
        registry.refresh()


def test_store_names_with_capitals_open_under_any_case(fake_entry_points):
    fake_entry_points({registry.STORE_GROUP: [
        _LoadedEntryPoint("MemUpper", lambda url, **options: HashStore())]})
    assert available()["stores"] == {"memupper": "fake-plugins"}
    for url in ("memupper://x", "MemUpper://x", "MEMUPPER://x"):
        with open_store(url) as store:
            assert isinstance(store, HashStore)


def test_a_plugin_calling_sys_exit_is_a_plugin_error(fake_entry_points):
    def exit_now(url, **options):
        raise SystemExit(7)

    fake_entry_points({registry.STORE_GROUP: [_LoadedEntryPoint("quits", exit_now),
                                              _ExitingEntryPoint("exits", None)],
                       registry.TRANSPORT_GROUP: [_ExitingEntryPoint("exits", None)]})
    with pytest.raises(pc.PluginError, match="store plugin 'quits' failed to open.*SystemExit"):
        open_store("quits://x")
    with pytest.raises(pc.PluginError, match="store plugin 'exits'.*failed to import.*SystemExit"):
        open_store("exits://x")
    with pytest.raises(pc.PluginError, match="transport plugin 'exits'.*SystemExit"):
        pc.init(rank=0, size=1, timeout=5, transport="exits")


def _raising_transport(rank, size, store, **options):
    raise ValueError("transport exploded")


@pytest.mark.parametrize("factory, message", [
    (42, "transport plugin 'odd' is a int, not a callable"),
    (_raising_transport, "transport plugin 'odd' failed to connect: ValueError: transport "
                         "exploded"),
    (lambda rank, size, store, **options: object(),
     "transport plugin 'odd' returned a object, not a pycollect Transport")])
def test_a_misbehaving_transport_plugin_is_a_plugin_error_naming_it(fake_entry_points, factory,
                                                                     message):
    fake_entry_points({registry.TRANSPORT_GROUP: [_LoadedEntryPoint("odd", factory)]})
    with pytest.raises(pc.PluginError) as caught:
        pc.init(rank=0, size=1, timeout=5, transport="odd", store=HashStore())
    assert message in str(caught.value)


def test_a_non_callable_transport_is_refused_before_the_rendezvous(fake_entry_points):
    fake_entry_points({registry.TRANSPORT_GROUP: [_LoadedEntryPoint("odd", 42)]})
    started = time.monotonic()
    with pytest.raises(pc.PluginError, match="not a callable"):
        pc.init(rank=0, size=2, timeout=10, transport="odd", store="hash://refused-early")
    assert time.monotonic() - started < 5       # rank 1 never comes: no join was waited on
