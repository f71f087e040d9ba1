"""PrefixStore: conformance suite over an in-process store, plus namespacing and composition."""

import pytest

import pycollect as pc
from pycollect.plugins import HashStore, PrefixStore
from abstract import StoreSuite

pytestmark = pytest.mark.timeout(30)


class TestPrefixStore(StoreSuite):
    @pytest.fixture
    def store(self):
        with PrefixStore("run", HashStore(), owns_store=True) as store:
            yield store


class TestNestedPrefixStore(StoreSuite):
    @pytest.fixture
    def store(self):
        outer = PrefixStore("outer", HashStore(), owns_store=True)
        with PrefixStore("inner", outer, owns_store=True) as store:
            yield store


def test_keys_are_namespaced_with_a_slash():
    inner = HashStore()
    PrefixStore("job", inner).set("rank0", b"x")
    assert inner.get("job/rank0") == b"x"
    assert not inner.check(["rank0"])


def test_prefixes_compose():
    inner = HashStore()
    group = PrefixStore("group1", PrefixStore("job", inner))
    group.set("rank0", b"x")
    assert inner.get("job/group1/rank0") == b"x"
    assert group.url == f"{inner.url}?prefix=job/group1"
    assert group.add("count", 2) == 2
    assert inner.get("job/group1/count") == b"2"
    assert group.delete("rank0") and not inner.check(["job/group1/rank0"])


def test_timeout_defaults_to_the_inner_store_and_names_the_full_key():
    inner = HashStore(timeout=0.1)
    store = PrefixStore("job", inner)
    assert store.timeout == 0.1
    with pytest.raises(pc.Timeout, match="job/missing"):
        store.get("missing")


def test_closing_a_prefix_view_leaves_the_inner_store_open():
    inner = HashStore()
    PrefixStore("job", inner).close()
    assert not inner.closed
    inner.set("still", b"open")


def test_a_view_that_owns_its_store_closes_it():
    inner = HashStore()
    PrefixStore("job", inner, owns_store=True).close()
    assert inner.closed


@pytest.mark.parametrize("prefix", ["", None, 3])
def test_bad_prefixes_are_invalid_arguments(prefix):
    with pytest.raises(pc.InvalidArgument):
        PrefixStore(prefix, HashStore())


def test_wrapping_something_other_than_a_store_is_invalid():
    with pytest.raises(pc.InvalidArgument, match="Store"):
        PrefixStore("job", {"not": "a store"})
