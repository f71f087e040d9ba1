"""The shared-filesystem store: conformance suite plus many processes and cleanup."""

import multiprocessing
import os
import threading
import time

import pytest

import pycollect as pc
from pycollect.plugins import FileStore
from pycollect.plugins.file_store import key_file_name, open_file_store
from abstract import StoreSuite

pytestmark = pytest.mark.timeout(60)

PROCESSES = 3
ADDS_PER_PROCESS = 20


class TestFileStore(StoreSuite):
    @pytest.fixture
    def store(self, tmp_path):
        with FileStore(tmp_path / "run") as store:
            yield store


def _add_and_publish(directory, worker):
    """Run in a child process: bump a shared counter and publish each result."""
    with FileStore(directory, timeout=20) as store:
        for _ in range(ADDS_PER_PROCESS):
            value = store.add("counter", 1)
            store.set(f"result/{value}", str(worker).encode())


def test_processes_adding_concurrently_get_exact_totals(tmp_path):
    directory = str(tmp_path / "shared")
    # fork starts in milliseconds where spawn re-imports pytest in every child.
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    context = multiprocessing.get_context(method)
    workers = [context.Process(target=_add_and_publish, args=(directory, index))
               for index in range(PROCESSES)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(30)
        if worker.exitcode is None:
            worker.kill()
    assert [worker.exitcode for worker in workers] == [0] * PROCESSES
    total = PROCESSES * ADDS_PER_PROCESS
    with FileStore(directory, timeout=1) as store:
        assert store.get("counter") == str(total).encode()
        store.wait([f"result/{value}" for value in range(1, total + 1)])
    leftovers = [name for name in os.listdir(directory) if name.startswith(".tmp-")]
    assert leftovers == []


def test_a_second_store_on_the_same_directory_sees_the_keys(tmp_path):
    with FileStore(tmp_path) as writer, FileStore(tmp_path) as reader:
        setter = threading.Timer(0.05, writer.set, ("late", b"value"))
        setter.start()
        assert reader.get("late", timeout=5) == b"value"
        setter.join()


def test_cleanup_removes_the_directory(tmp_path):
    store = FileStore(tmp_path / "run")
    store.set("key", b"value")
    store.add("counter", 1)
    store.cleanup()
    assert not (tmp_path / "run").exists()
    assert store.closed
    store.cleanup()


def test_keys_become_safe_file_names():
    for key in ["", ".", "..", "a/b", "../../etc/passwd", "x" * 10_000, "ünï"]:
        name = key_file_name(key)
        assert "/" not in name and name not in (".", "..") and len(name) <= 255
    assert key_file_name("a/b") != key_file_name("a%2Fb")
    assert key_file_name("x" * 10_000) != key_file_name("x" * 10_001)


def test_key_files_stay_inside_the_directory(tmp_path):
    with FileStore(tmp_path / "run") as store:
        store.set("../escape", b"x")
        store.set("/abs", b"y")
    assert sorted(os.listdir(tmp_path)) == ["run"]


def test_a_held_lock_makes_add_time_out(tmp_path):
    import fcntl
    store = FileStore(tmp_path, timeout=0.2)
    with open(tmp_path / ".lock", "w") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        started = time.monotonic()
        with pytest.raises(pc.Timeout, match="lock"):
            store.add("counter", 1)
        assert time.monotonic() - started < 3
    assert store.add("counter", 1) == 1


def test_unusable_directory_is_a_store_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_bytes(b"")
    with pytest.raises(pc.StoreError, match=str(blocker)):
        FileStore(blocker / "run")


def test_open_file_store_takes_an_absolute_file_url(tmp_path):
    with open_file_store(f"file://{tmp_path}/run%20one", timeout=3) as store:
        assert store.path == str(tmp_path / "run one")
        assert store.timeout == 3


@pytest.mark.parametrize("url", ["file://relative/dir", "file://otherhost/tmp/x", "file:",
                                 "file:///tmp/x?mode=1"])
def test_bad_file_urls_are_invalid_arguments(url):
    with pytest.raises(pc.InvalidArgument):
        open_file_store(url)
