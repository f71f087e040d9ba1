"""The store conformance suite: subclass ``StoreSuite`` and provide a ``store`` fixture."""

import threading
import time

import pytest

import pycollect as pc
from pycollect.plugins import PrefixStore

# Deadlines are short so that the suite stays fast; the upper bounds on
# elapsed time are loose so that a loaded CI machine does not fail them.
SHORT_TIMEOUT = 0.1
SLACK = 2.0
ADD_THREADS = 4
ADDS_PER_THREAD = 25


def _later(delay, action):
    """Run ``action`` on a thread after ``delay`` seconds; return the started thread."""
    def run():
        time.sleep(delay)
        action()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _expect_timeout(call, timeout):
    """Run ``call``, which must raise ``pc.Timeout`` within its deadline; return the error."""
    started = time.monotonic()
    with pytest.raises(pc.Timeout) as caught:
        call()
    elapsed = time.monotonic() - started
    assert timeout * 0.9 <= elapsed < timeout + SLACK, f"gave up after {elapsed:.3f} s"
    return caught.value


class StoreSuite:
    """Behaviour every ``pycollect`` store must show; subclasses provide the ``store`` fixture."""

    @pytest.fixture
    def store(self):
        raise NotImplementedError("a StoreSuite subclass provides the store fixture")

    def test_set_then_get_returns_the_value(self, store):
        store.set("alpha", b"one")
        assert store.get("alpha") == b"one"

    def test_set_replaces_the_value(self, store):
        store.set("alpha", b"one")
        store.set("alpha", b"two")
        assert store.get("alpha") == b"two"

    @pytest.mark.parametrize("value", [b"", b"\0\xff\0", bytes(range(256)) * 4096],
                             ids=["empty", "nul-and-high-bytes", "1MiB"])
    def test_binary_values_round_trip(self, store, value):
        store.set("binary", value)
        assert store.get("binary") == value

    def test_bytearray_and_memoryview_values_are_accepted(self, store):
        store.set("from-bytearray", bytearray(b"ba"))
        store.set("from-memoryview", memoryview(b"mv"))
        assert store.get("from-bytearray") == b"ba"
        assert store.get("from-memoryview") == b"mv"

    def test_unusual_keys_round_trip(self, store):
        keys = ["", ".", "..", "a/b/../c", "sp ace", "ünïcødé", "%2F", "x" * 1000]
        for index, key in enumerate(keys):
            store.set(key, str(index).encode())
        assert [store.get(key) for key in keys] == [str(i).encode() for i in range(len(keys))]

    def test_get_waits_for_a_key_set_later_by_another_thread(self, store):
        setter = _later(0.05, lambda: store.set("late", b"here"))
        assert store.get("late", timeout=5) == b"here"
        setter.join(5)

    def test_get_of_a_missing_key_times_out_naming_it(self, store):
        error = _expect_timeout(lambda: store.get("never-set", timeout=SHORT_TIMEOUT),
                                SHORT_TIMEOUT)
        assert "never-set" in str(error)
        assert f"{SHORT_TIMEOUT:g}" in str(error)
        assert isinstance(error, TimeoutError)

    def test_default_timeout_applies_when_none_is_given(self, store):
        store.timeout = SHORT_TIMEOUT
        _expect_timeout(lambda: store.get("never-set"), SHORT_TIMEOUT)

    def test_wait_returns_once_every_key_is_set(self, store):
        store.set("first", b"1")
        setter = _later(0.05, lambda: (store.set("second", b"2"), store.set("third", b"3")))
        store.wait(["first", "second", "third"], timeout=5)
        assert store.check(["first", "second", "third"])
        setter.join(5)

    def test_wait_times_out_naming_only_the_missing_keys(self, store):
        store.set("present", b"1")
        error = _expect_timeout(
            lambda: store.wait(["present", "absent-1", "absent-2"], timeout=SHORT_TIMEOUT),
            SHORT_TIMEOUT)
        assert "absent-1" in str(error) and "absent-2" in str(error)
        assert "'present'" not in str(error)

    def test_wait_on_no_keys_returns_at_once(self, store):
        store.wait([], timeout=0)

    def test_add_creates_a_counter_readable_as_decimal(self, store):
        assert store.add("counter", 5) == 5
        assert store.add("counter", -7) == -2
        assert store.get("counter") == b"-2"

    def test_add_continues_a_decimal_value_set_by_set(self, store):
        store.set("counter", b"40")
        assert store.add("counter", 2) == 42

    def test_add_on_a_non_counter_value_is_rejected(self, store):
        store.set("text", b"not a number")
        with pytest.raises(pc.InvalidArgument, match="text"):
            store.add("text", 1)

    def test_concurrent_adds_from_threads_give_exact_totals(self, store):
        results = []
        lock = threading.Lock()

        def add_many():
            mine = [store.add("shared-counter", 1) for _ in range(ADDS_PER_THREAD)]
            with lock:
                results.extend(mine)

        threads = [threading.Thread(target=add_many) for _ in range(ADD_THREADS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(20)
        total = ADD_THREADS * ADDS_PER_THREAD
        assert sorted(results) == list(range(1, total + 1))
        assert store.get("shared-counter") == str(total).encode()

    def test_delete_reports_whether_the_key_existed(self, store):
        store.set("doomed", b"x")
        assert store.delete("doomed") is True
        assert store.delete("doomed") is False
        assert store.check(["doomed"]) is False

    def test_check_does_not_wait(self, store):
        store.set("here", b"x")
        started = time.monotonic()
        assert store.check(["here"]) is True
        assert store.check(["here", "not-here"]) is False
        assert store.check([]) is True
        assert time.monotonic() - started < SLACK

    def test_prefixes_isolate_namespaces(self, store):
        run_a, run_b = PrefixStore("run-a", store), PrefixStore("run-b", store)
        run_a.set("rank0", b"a")
        run_b.set("rank0", b"b")
        assert run_a.get("rank0") == b"a"
        assert run_b.get("rank0") == b"b"
        assert store.get("run-a/rank0") == b"a"
        assert not store.check(["rank0"])
        assert run_a.add("count", 1) == 1 and run_b.add("count", 10) == 10

    @pytest.mark.parametrize("bad_key", [b"bytes", 3, None, "\ud800"])
    def test_bad_keys_are_invalid_arguments(self, store, bad_key):
        with pytest.raises(pc.InvalidArgument):
            store.set(bad_key, b"x")

    @pytest.mark.parametrize("bad_value", ["text", 3, None, [1]])
    def test_non_bytes_values_are_invalid_arguments(self, store, bad_value):
        with pytest.raises(pc.InvalidArgument, match="bytes"):
            store.set("key", bad_value)

    @pytest.mark.parametrize("bad_timeout", [-1, float("nan"), float("inf"), "1", True])
    def test_bad_timeouts_are_invalid_arguments(self, store, bad_timeout):
        with pytest.raises(pc.InvalidArgument, match="timeout"):
            store.get("key", timeout=bad_timeout)

    def test_a_single_str_passed_as_keys_is_rejected(self, store):
        with pytest.raises(pc.InvalidArgument, match=r"\[key\]"):
            store.wait("key", timeout=0)

    @pytest.mark.parametrize("bad_amount", [1.5, "1", True, None])
    def test_non_integer_amounts_are_invalid_arguments(self, store, bad_amount):
        with pytest.raises(pc.InvalidArgument):
            store.add("counter", bad_amount)

    def test_close_is_idempotent_and_later_use_fails(self, store):
        store.close()
        store.close()
        assert store.closed
        with pytest.raises(pc.StoreError, match="closed"):
            store.set("key", b"x")

    def test_closing_from_another_thread_ends_a_pending_get(self, store):
        closer = _later(0.05, store.close)
        started = time.monotonic()
        with pytest.raises(pc.StoreError, match="closed"):
            store.get("never-set", timeout=10)
        assert time.monotonic() - started < SLACK
        closer.join(5)

    def test_context_manager_closes(self, store):
        with store as entered:
            assert entered is store
            store.set("key", b"x")
        assert store.closed
