"""The shared-filesystem store: conformance suite plus many processes and cleanup."""

import multiprocessing
import os
import subprocess
import sys
import threading
import time

import pytest

import pycollect as pc
from pycollect.plugins import FileStore
from pycollect.plugins.stores.file_store import key_file_name, open_file_store
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


def _hold_lock(lock_path, held, release):
    """Run in a child process: hold a POSIX lock on ``lock_path`` until ``release`` is set."""
    import fcntl
    with open(lock_path, "w") as lock_file:
        fcntl.lockf(lock_file, fcntl.LOCK_EX)
        held.set()
        release.wait(20)


def test_a_lock_held_by_another_process_makes_add_time_out(tmp_path):
    context = multiprocessing.get_context(
        "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
    held, release = context.Event(), context.Event()
    holder = context.Process(target=_hold_lock, args=(str(tmp_path / ".lock"), held, release))
    holder.start()
    try:
        assert held.wait(20)
        store = FileStore(tmp_path, timeout=0.2)
        started = time.monotonic()
        with pytest.raises(pc.Timeout, match="lock"):
            store.add("counter", 1)
        assert time.monotonic() - started < 3
    finally:
        release.set()
        holder.join(20)
    assert store.add("counter", 1) == 1


def test_two_stores_of_one_process_take_turns_on_the_lock(tmp_path):
    first, second = FileStore(tmp_path, timeout=5), FileStore(tmp_path, timeout=5)
    with first._add_locked("counter"):
        blocked = threading.Thread(target=second.add, args=("counter", 1))
        blocked.start()
        blocked.join(0.2)
        assert blocked.is_alive(), "the second store did not wait for the first one's lock"
    blocked.join(5)
    assert second.get("counter") == b"1"


def _overwrite(directory, worker, done):
    """Run in a child process: set one key over and over to a large value of its own, until
    ``done`` is set (at most 20,000 times and 20 s)."""
    deadline = time.monotonic() + 20
    with FileStore(directory, timeout=20) as store:
        for index in range(20000):
            if done.is_set() or time.monotonic() > deadline:
                break
            store.set("contested", bytes([worker]) * (64 * 1024 + index % 4096))


def test_concurrent_writers_of_one_key_never_show_a_torn_value(tmp_path):
    directory = str(tmp_path / "shared")
    context = multiprocessing.get_context(
        "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
    done = context.Event()
    writers = [context.Process(target=_overwrite, args=(directory, worker, done))
               for worker in (1, 2, 3)]
    for writer in writers:
        writer.start()
    seen, reads = set(), 0
    try:
        with FileStore(directory, timeout=20) as reader:
            reader.get("contested")
            # The writers go on until the reader has read 300 times while they write.
            while reads < 300 and any(writer.is_alive() for writer in writers):
                value = reader.get("contested")
                assert len(set(value)) == 1 and len(value) >= 64 * 1024, "a torn value"
                seen.add(value[0])
                reads += 1
    finally:
        done.set()
        for writer in writers:
            writer.join(30)
    assert [writer.exitcode for writer in writers] == [0, 0, 0]
    assert reads == 300 and len(seen) >= 2, (reads, seen)   # reads raced several writers


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


WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rendezvous_worker.py")


def _start_ranks(directory, size, ranks, timeout):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYCOLLECT_")}
    return [subprocess.Popen([sys.executable, WORKER, "--timeout", str(timeout)],
                             env=dict(env, PYCOLLECT_RANK=str(rank), PYCOLLECT_SIZE=str(size),
                                      PYCOLLECT_STORE=f"file://{directory}"),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             stdin=subprocess.DEVNULL) for rank in ranks]


def _finish(procs, limit=45):
    deadline = time.monotonic() + limit
    outputs = []
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate(timeout=5)
        outputs.append((proc.returncode, out.decode(errors="replace")))
    return outputs


def test_a_directory_left_by_a_crashed_run_serves_the_next_run(tmp_path):
    directory = tmp_path / "rdv"
    # A run of three whose rank 2 never comes: ranks 0 and 1 time out and leave keys behind.
    crashed = _finish(_start_ranks(directory, 3, [0, 1], timeout=1))
    assert all(code != 0 and "Timeout" in out for code, out in crashed), crashed
    left = sorted(name for name in os.listdir(directory) if name.startswith("k."))
    assert any("run" in name for name in left) and any("join" in name for name in left)
    started = time.monotonic()
    outputs = _finish(_start_ranks(directory, 3, [2, 1, 0], timeout=20))
    assert all(code == 0 for code, _ in outputs), outputs
    assert time.monotonic() - started < 20
    # The new run removed its own keys; only the crashed run's may remain.
    now = {name for name in os.listdir(directory) if name.startswith("k.")}
    assert now <= set(left), (sorted(now - set(left)), left)


def test_stale_keys_of_an_earlier_run_are_never_read(tmp_path):
    """Everything a crashed run could leave: a run id, echoes, a token and dead addresses."""
    from jobs import allreduce_job
    stale = FileStore(tmp_path)
    for key, value in [("pycollect/ctx0/run", b"0123456789abcdef"),
                       ("pycollect/ctx0/0123456789abcdef/ack/1", b"old-nonce"),
                       ("pycollect/ctx0/0123456789abcdef/ack/2", b"old-nonce"),
                       ("pycollect/ctx0/0123456789abcdef/tcp/token", b"x" * 32),
                       ("pycollect/ctx0/0123456789abcdef/tcp/addr/0",
                        b'{"host": "127.0.0.1", "port": 9, "hostid": "gone", "pid": 1}'),
                       ("pycollect/ctx0/tcp/addr/1", b"not json")]:
        stale.set(key, value)
    allreduce_job(3, f"file://{tmp_path}", timeout=20)
    assert not stale.check(["pycollect/ctx0/run"])
    assert stale.get("pycollect/ctx0/0123456789abcdef/tcp/token") == b"x" * 32
