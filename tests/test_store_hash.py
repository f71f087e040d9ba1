"""The in-process store: conformance suite plus sharing between handles of one name."""

import datetime
import itertools
import threading

import pytest

import pycollect as pc
from pycollect.plugins import HashStore
from pycollect.plugins.stores.hash_store import open_hash_store
from abstract import StoreSuite

pytestmark = pytest.mark.timeout(30)

_table_names = itertools.count()


class TestPrivateHashStore(StoreSuite):
    @pytest.fixture
    def store(self):
        with HashStore() as store:
            yield store


class TestNamedHashStore(StoreSuite):
    @pytest.fixture
    def store(self):
        with open_hash_store(f"hash://suite-{next(_table_names)}") as store:
            yield store


def test_handles_of_one_name_share_keys_but_not_timeouts():
    first = open_hash_store("hash://shared", timeout=1)
    second = open_hash_store("hash://shared", timeout=2)
    first.set("key", b"value")
    assert second.get("key") == b"value"
    assert (first.timeout, second.timeout) == (1, 2)
    first.close()
    assert second.get("key") == b"value"
    second.close()


def test_table_is_dropped_when_its_last_handle_closes():
    with open_hash_store("hash://dropped") as store:
        store.set("key", b"value")
    with open_hash_store("hash://dropped") as store:
        assert not store.check(["key"])


def test_different_names_do_not_share():
    with open_hash_store("hash://one") as one, open_hash_store("hash://two") as two:
        one.set("key", b"1")
        assert not two.check(["key"])


def test_ranks_as_threads_rendezvous_through_one_name():
    world = 4
    seen = {}

    def rank_main(rank):
        with open_hash_store("hash://threads", timeout=5, rank=rank, size=world) as store:
            store.set(f"address/{rank}", f"rank-{rank}".encode())
            seen[rank] = [store.get(f"address/{peer}") for peer in range(world)]
            if store.add("arrived", 1) == world:
                store.set("all-arrived", b"")
            store.wait(["all-arrived"])

    threads = [threading.Thread(target=rank_main, args=(rank,)) for rank in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    expected = [f"rank-{peer}".encode() for peer in range(world)]
    assert seen == {rank: expected for rank in range(world)}


@pytest.mark.parametrize("url", ["hash://", "hash://name?x=1", "file:///tmp/x"])
def test_bad_hash_urls_are_invalid_arguments(url):
    with pytest.raises(pc.InvalidArgument):
        open_hash_store(url)


def test_default_timeout_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("PYCOLLECT_TIMEOUT", "7.5")
    assert HashStore().timeout == 7.5
    monkeypatch.setenv("PYCOLLECT_TIMEOUT", "soon")
    with pytest.raises(pc.InvalidArgument, match="PYCOLLECT_TIMEOUT"):
        HashStore()
    monkeypatch.delenv("PYCOLLECT_TIMEOUT")
    assert HashStore().timeout == 120.0


@pytest.mark.parametrize("timeout", [1e10, 2_000_001, datetime.timedelta(days=24)])
def test_a_store_timeout_longer_than_the_limit_is_refused(timeout):
    with pytest.raises(pc.InvalidArgument, match="at most 2000000 .about 23 days"):
        HashStore(timeout=timeout)
    store = HashStore(timeout=2_000_000)
    with pytest.raises(pc.InvalidArgument, match="at most 2000000"):
        store.get("k", timeout=timeout)
