"""The Redis store against a real redis-server on a free loopback port, with and without a password."""

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import threading
import time

import pytest

import pycollect as pc
from pycollect.plugins import open_store
from pycollect.plugins.interfaces import choose_address
from abstract import StoreSuite
from jobs import allreduce_job
from conftest import ipv6_loopback_works

hiredis = pytest.importorskip("hiredis", reason="the redis store needs hiredis: "
                                                "pip install 'pycollect[redis]'")
from pycollect.plugins.stores.redis_store import (MAX_KEY_TTL_S, RedisStore,  # noqa: E402
                                                  parse_redis_url)

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(shutil.which("redis-server") is None,
                       reason="redis-server is not installed (apt-get install redis-server)"),
]

PASSWORD = "p@ss:w/rd"
SERVER_START_S = 10.0


def _free_port(below=65536, bus=False):
    """A free loopback port under ``below``; with ``bus``, port + 10000 is free too (a
    cluster node binds it for its bus)."""
    for _ in range(200):   # bounded: the kernel hands out ports all over its range
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        if port < below and (not bus or _bindable(port + 10000)):
            return port
    raise RuntimeError(f"found no free loopback port below {below}")


def _bindable(port):
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _command(port, *args, password=None, db=0, timeout=5.0):
    """One command on a fresh connection (an admin's view of the server); returns the reply."""
    reader = hiredis.Reader()
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        commands = ([("AUTH", password)] if password else []) + \
            ([("SELECT", db)] if db else []) + [args]
        sock.sendall(b"".join(hiredis.pack_command(c) for c in commands))
        replies = []
        while len(replies) < len(commands):   # bounded by the socket timeout
            reply = reader.gets()
            if reply is not False:
                replies.append(reply)
                continue
            data = sock.recv(65536)
            assert data, "redis-server closed the connection"
            reader.feed(data)
    return replies[-1]


class RedisServer:
    """A redis-server child process on a free loopback port, in memory only."""

    def __init__(self, directory, password=None, extra=(), port_below=65536, bus=False):
        self.directory, self.password, self.extra = directory, password, list(extra)
        self.proc = None
        for attempt in range(3):   # bounded: a port found free may be taken before the bind
            self.port = _free_port(port_below, bus)
            try:
                self.start()
                return
            except RuntimeError as exc:
                if "Address already in use" not in str(exc) or attempt == 2:
                    raise

    def start(self):
        args = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
                "--save", "", "--appendonly", "no", "--dir", str(self.directory),
                "--daemonize", "no", "--loglevel", "warning", *self.extra]
        if self.password:
            args += ["--requirepass", self.password]
        self.log = self.directory / "redis.log"
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + SERVER_START_S
        while True:   # bounded by the deadline
            with contextlib.suppress(OSError):
                if _command(self.port, "PING", password=self.password, timeout=1) == b"PONG":
                    return
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("redis-server did not start: "
                                   + self.log.read_text(errors="replace")[-2000:])
            time.sleep(0.02)

    def stop(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def command(self, *args, db=0):
        return _command(self.port, *args, password=self.password, db=db)

    def url(self, db=0, query=""):
        auth = ":" + PASSWORD.replace("@", "%40").replace(":", "%3A").replace("/", "%2F") \
            + "@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/{db}{query}"

    def keys(self, db=0):
        return sorted(self.command("KEYS", "*", db=db))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    redis = RedisServer(tmp_path_factory.mktemp("redis"))
    yield redis
    redis.stop()


@pytest.fixture(scope="module")
def password_server(tmp_path_factory):
    redis = RedisServer(tmp_path_factory.mktemp("redis-auth"), password=PASSWORD)
    yield redis
    redis.stop()


class TestRedisStore(StoreSuite):
    @pytest.fixture
    def store(self, server):
        with RedisStore("127.0.0.1", server.port, timeout=10) as store:
            yield store
        assert server.keys() == [], "the handle left keys behind"


class TestPasswordRedisStore(StoreSuite):
    @pytest.fixture
    def store(self, password_server):
        with open_store(password_server.url(db=2), timeout=10) as store:
            yield store
        assert password_server.keys(db=2) == [], "the handle left keys behind"


def test_url_forms_parse():
    assert parse_redis_url("redis://h:1/3?ttl=5") == {
        "host": "h", "port": 1, "db": 3, "password": None, "username": None, "key_ttl": 5.0}
    parsed = parse_redis_url("redis://:p%40ss@[::1]:6380")
    assert (parsed["host"], parsed["port"], parsed["db"], parsed["password"]) == \
        ("::1", 6380, 0, "p@ss")
    assert parse_redis_url("redis://user:pw@host/")["username"] == "user"
    assert parse_redis_url("redis://host")["port"] == 6379


@pytest.mark.parametrize("url", ["redis://", "redis://h:0x/", "redis://h:1/db2",
                                 "redis://h:1/?mode=x", "redis://h:1/?ttl=-1",
                                 "redis://h:1/#frag", "redis://h:0", "redis://h:0/1",
                                 "redis://h:1/\u00b2", "redis://h:1/\uff11",
                                 "redis://h:1/?ttl=1e30", "redis://h:1/?ttl=nan"])
def test_bad_urls_are_invalid_arguments(url):
    with pytest.raises(pc.InvalidArgument):
        parse_redis_url(url)


def test_an_out_of_range_ttl_is_refused_up_front_and_the_largest_one_works(server):
    with pytest.raises(pc.InvalidArgument, match="ttl must be .* to %d" % MAX_KEY_TTL_S):
        open_store(server.url(query="?ttl=1e30"), timeout=5)
    with pytest.raises(pc.InvalidArgument, match="key_ttl"):
        RedisStore("127.0.0.1", server.port, timeout=5, key_ttl=MAX_KEY_TTL_S + 1)
    with open_store(server.url(query=f"?ttl={MAX_KEY_TTL_S}"), timeout=5) as store:
        store.set("a", b"1")                  # Redis accepts the expiry
        assert store.add("n", 1) == 1
        assert server.command("PTTL", "a") > 0 and server.command("PTTL", "n") > 0


def test_a_user_without_a_password_is_refused():
    with pytest.raises(pc.InvalidArgument, match="user 'alice' needs a password"):
        open_store("redis://alice@127.0.0.1:1", timeout=1)


@pytest.mark.parametrize("password", ["hunter2/secret", "s3c:r@t/x", "a?b#c", "x:y/z@w"])
def test_a_password_with_unescaped_marks_never_shows(password):
    url = f"redis://:{password}@127.0.0.1:1/?prefix=job"
    assert pc.plugins.store.redact(url) == "redis://:***@127.0.0.1:1/?prefix=job"
    with pytest.raises(pc.Error) as refused:
        open_store(url, timeout=0.2)
    pieces = [piece for piece in password.replace("?", "/").replace("#", "/").replace(
        ":", "/").replace("@", "/").split("/") if len(piece) > 1]
    assert not [piece for piece in pieces if piece in str(refused.value)], str(refused.value)


@pytest.mark.parametrize("url, shown", [
    ("redis://host:6379/0?prefix=a@b", "redis://host:6379/0?prefix=a@b"),
    ("redis://[::1]:6379/0?prefix=a@b#c@d", "redis://[::1]:6379/0?prefix=a@b#c@d"),
    ("redis://:s3cret@host:6379/0?prefix=a@b", "redis://:***@host:6379/0?prefix=a@b"),
    ("redis://u:s3cret@host:1?prefix=a@b", "redis://u:***@host:1?prefix=a@b"),
    ("redis://:s3c@ret?x@host:6379/0?prefix=a@b", "redis://:***@host:6379/0?prefix=a@b"),
    ("redis://:s3c/ret#x@host:6379/0?prefix=a@b", "redis://:***@host:6379/0?prefix=a@b")])
def test_an_at_sign_in_the_query_is_not_taken_for_a_passwords_end(url, shown):
    """redact() showed redis://host:***@b: the port and database hidden, the password not
    found (or found too long)."""
    assert pc.plugins.store.redact(url) == shown
    assert pc.plugins.store.redact_text(f"at {url}: no", url) == f"at {shown}: no"


@pytest.mark.parametrize("url", [
    "redis://:s3cret@h:1/db2", "redis://u:s3cret@h:1/?ttl=-1", "redis://:s3cret@h:1/?mode=x",
    "redis://:s3cret@h:0x/", "redis://:s3cret@h:1/#frag", "redis://:s3cret@[h:1",
    "redis://:s3cret@h:1/?prefix=a&prefix=b",
    # a host name the resolver refuses: the opener's own exception, wrapped by the registry
    "redis://:s3cret@" + "a" * 64 + ".example:6379"])
def test_a_bad_url_is_refused_without_its_password(url):
    with pytest.raises((pc.InvalidArgument, pc.PluginError)) as refused:
        open_store(url, timeout=1)
    assert "s3cret" not in str(refused.value) and ":***@" in str(refused.value)


def test_prefix_query_and_registry(server):
    assert pc.plugins.available()["stores"]["redis"] == "pycollect"
    with open_store(server.url(query="?prefix=job7"), timeout=5) as store:
        assert isinstance(store.store, RedisStore)
        store.set("rank0", b"x")
        assert server.keys() == [b"job7/rank0"]
        assert store.url.endswith("?prefix=job7")
    assert server.keys() == []


def test_keys_expire_unless_ttl_is_zero(server):
    with RedisStore("127.0.0.1", server.port, timeout=5, key_ttl=60) as store:
        store.set("a", b"1")
        store.add("n", 1)
        assert 0 < server.command("PTTL", "a") <= 60_000
        assert 0 < server.command("PTTL", "n") <= 60_000
    with open_store(server.url(query="?ttl=0"), timeout=5) as store:
        store.set("a", b"1")
        assert server.command("PTTL", "a") == -1


def test_a_handle_deletes_only_what_it_wrote(server):
    with RedisStore("127.0.0.1", server.port, timeout=5) as mine, \
            RedisStore("127.0.0.1", server.port, timeout=5) as theirs:
        theirs.set("theirs", b"1")
        mine.set("mine", b"1")
        mine.add("counter", 1)
        mine.set("gone", b"1")
        mine.delete("gone")
        mine.close()
        assert server.keys() == [b"theirs"]
    assert server.keys() == []


def test_password_is_required_and_never_shown(password_server):
    port = password_server.port
    with pytest.raises(pc.StoreError, match="needs a password"):
        RedisStore("127.0.0.1", port, timeout=2)
    with pytest.raises(pc.StoreError, match="refused the password") as caught:
        RedisStore("127.0.0.1", port, password="wrong-secret", timeout=2)
    assert "wrong-secret" not in str(caught.value)
    with open_store(password_server.url(), timeout=5) as store:
        assert PASSWORD not in store.url and PASSWORD not in repr(store)
        assert store.url == f"redis://:***@127.0.0.1:{port}/0"


def test_databases_are_separate(server):
    with open_store(server.url(db=3), timeout=5) as three, \
            open_store(server.url(db=0), timeout=5) as zero:
        three.set("k", b"3")
        assert not zero.check(["k"])
        assert server.keys(db=3) == [b"k"]


def test_a_dropped_connection_is_reopened(server):
    with RedisStore("127.0.0.1", server.port, timeout=5) as store:
        store.set("before", b"1")
        assert server.command("CLIENT", "KILL", "TYPE", "normal") >= 1
        assert store.get("before") == b"1"
        store.set("after", b"2")
        assert store.add("counter", 2) == 2


def test_a_restarted_server_is_reached_within_the_deadline(tmp_path):
    redis = RedisServer(tmp_path)
    try:
        store = RedisStore("127.0.0.1", redis.port, timeout=10)
        store.set("key", b"v")
        redis.stop()
        restarter = threading.Timer(0.3, redis.start)
        restarter.start()
        started = time.monotonic()
        store.set("key", b"again")            # retried until the server is back
        restarter.join()
        assert time.monotonic() - started < 8
        assert store.get("key") == b"again"
        store.close()
        assert redis.keys() == []
    finally:
        redis.stop()


def test_close_does_not_wait_for_a_server_that_is_gone(tmp_path, caplog):
    """Redis killed mid-job: close() tries the stale connection and one reconnect, warns
    that the keys it wrote were not deleted (they expire by their ttl), and returns at once
    (it retried for its whole 5 s budget)."""
    redis = RedisServer(tmp_path)
    try:
        store = RedisStore("127.0.0.1", redis.port, timeout=10)
        store.set("key", b"v")
    finally:
        redis.stop()
    started = time.monotonic()
    with caplog.at_level("WARNING", logger="pycollect.store"):
        store.close()
    assert time.monotonic() - started < 1.5
    assert "could not delete 1 key(s)" in caplog.text and "expire within" in caplog.text


def test_an_unreachable_server_is_a_store_error_within_the_deadline():
    port = _free_port()
    started = time.monotonic()
    with pytest.raises(pc.StoreError, match=f"127.0.0.1:{port}.*tried for 0.5 s"):
        RedisStore("127.0.0.1", port, timeout=0.5)
    assert time.monotonic() - started < 3


def test_redis_cluster_is_refused(tmp_path):
    redis = RedisServer(tmp_path, extra=["--cluster-enabled", "yes", "--cluster-config-file",
                                         str(tmp_path / "nodes.conf")], port_below=55000,
                        bus=True)
    try:
        started = time.monotonic()
        with pytest.raises(pc.StoreError, match="Redis Cluster.*cluster_enabled"):
            RedisStore("127.0.0.1", redis.port, timeout=5)
        assert time.monotonic() - started < 3
    finally:
        redis.stop()


class _FakeRedis:
    """A loopback server speaking just enough RESP: INFO says standalone, ``answer`` the rest."""

    def __init__(self, answer):
        self.answer = answer
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        self.listener.settimeout(10)
        with contextlib.suppress(OSError):
            while True:   # bounded: accept times out, close ends it
                conn, _ = self.listener.accept()
                with conn:
                    conn.settimeout(10)
                    self._answer_all(conn)

    def _answer_all(self, conn):
        """Answer commands until the client leaves or ``answer`` says to hang up (None)."""
        reader = hiredis.Reader()
        while True:   # bounded by the socket timeout
            data = conn.recv(65536)
            if not data:
                return
            reader.feed(data)
            command = reader.gets()
            while command is not False:
                if command[0].upper() == b"INFO":
                    reply = b"$17\r\ncluster_enabled:0\r\n"
                else:
                    reply = self.answer(command)
                if reply is None:
                    return
                conn.sendall(reply)
                command = reader.gets()

    def close(self):
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)   # wakes the blocked accept
        self.listener.close()
        self.thread.join(5)


def test_moved_replies_are_a_clear_error_not_a_hang():
    fake = _FakeRedis(lambda command: b"-MOVED 3999 127.0.0.1:6381\r\n")
    try:
        store = RedisStore("127.0.0.1", fake.port, timeout=5)
        started = time.monotonic()
        with pytest.raises(pc.StoreError, match="Redis Cluster.*MOVED"):
            store.get("key", timeout=5)
        assert time.monotonic() - started < 2
        store.close()
    finally:
        fake.close()


def test_an_increment_whose_reply_is_lost_is_not_repeated():
    fake = _FakeRedis(lambda command: None if command[0] == b"INCRBY" else b":0\r\n")
    try:
        store = RedisStore("127.0.0.1", fake.port, timeout=5, key_ttl=0)
        with pytest.raises(pc.StoreError, match="INCRBY.*not retried"):
            store.add("counter", 1)
        store.close()
    finally:
        fake.close()


def test_missing_hiredis_names_the_extra(monkeypatch):
    from pycollect.plugins.stores import redis_store
    monkeypatch.setattr(redis_store, "hiredis", None)
    with pytest.raises(pc.PluginError, match=r"pycollect\[redis\]"):
        open_store("redis://127.0.0.1:1/")


@pytest.mark.parametrize("fixture", ["server", "password_server"])
def test_init_rendezvous_through_redis_leaves_no_keys(request, fixture):
    redis = request.getfixturevalue(fixture)
    allreduce_job(3, redis.url(query="?prefix=job-%d" % os.getpid()), timeout=20)
    assert redis.keys() == []


@pytest.mark.skipif(not ipv6_loopback_works(), reason="no IPv6 loopback")
def test_an_ipv6_url_in_brackets_reaches_the_server_and_the_ranks_listen_on_ipv6(tmp_path):
    redis = RedisServer(tmp_path, extra=["--bind", "127.0.0.1", "::1"])
    try:
        url = f"redis://[::1]:{redis.port}/0"
        with open_store(url, timeout=5) as store:
            assert store.host == "::1" and store.url == url
            store.set("v6", b"yes")
            assert redis.keys() == [b"v6"]
        allreduce_job(2, url, timeout=20)
        assert redis.keys() == []
        with RedisStore("::1", redis.port, timeout=5) as store:
            assert choose_address(None, store) == ("::1", "route to store host ::1")
    finally:
        redis.stop()


def test_a_brief_restart_is_ridden_out_by_short_polls_until_the_stores_timeout(tmp_path):
    redis = RedisServer(tmp_path)
    try:
        with RedisStore("127.0.0.1", redis.port, timeout=10) as poller:
            redis.stop()
            restarter = threading.Timer(0.5, redis.start)
            restarter.start()
            started, timeouts = time.monotonic(), 0
            while True:     # as init's join polls: short slices, each one's Timeout retried
                assert time.monotonic() - started < 8, "the restart was not ridden out"
                try:
                    poller.get("key", timeout=0.05)
                    break
                except pc.Timeout:
                    timeouts += 1
                    if restarter.finished.is_set() and not restarter.is_alive():
                        with contextlib.suppress(OSError, AssertionError):
                            redis.command("SET", "key", b"v")
            restarter.join()
            assert timeouts > 1
        # Silent for half the store's timeout: the polls end in a StoreError saying how long.
        with RedisStore("127.0.0.1", redis.port, timeout=1) as poller:
            redis.stop()
            started = time.monotonic()
            with pytest.raises(pc.StoreError, match=r"cannot reach Redis.*silent for 0\.[56]"):
                while time.monotonic() - started < 5:
                    with contextlib.suppress(pc.Timeout):
                        poller.get("key", timeout=0.05)
            assert 0.45 < time.monotonic() - started < 1
    finally:
        redis.stop()


def test_a_hung_server_fails_operations_at_their_deadline(tmp_path):
    redis = RedisServer(tmp_path)
    store = RedisStore("127.0.0.1", redis.port, timeout=1)
    try:
        os.kill(redis.proc.pid, signal.SIGSTOP)
        for operation in (lambda: store.get("key", timeout=1), lambda: store.set("key", b"v")):
            started = time.monotonic()
            with pytest.raises(pc.StoreError, match=r"tried for (0\.9|1|1\.1) s"):
                operation()
            assert time.monotonic() - started < 1.5
        # A poll that starts as its deadline runs out waits for the 1 s floor, no longer.
        started = time.monotonic()
        with pytest.raises(pc.StoreError, match="cannot reach Redis"):
            store.get("key", timeout=0.05)
        assert 0.9 < time.monotonic() - started < 1.5
    finally:
        os.kill(redis.proc.pid, signal.SIGCONT)
        store.close()
        redis.stop()


def test_an_outage_during_init_is_reported_as_one(tmp_path):
    """Redis gone 0.3 s into init: rank 1 (whose every wait is shorter than the store's
    timeout, init's own) fails with the StoreError naming Redis, not with "rank 0 never
    published a run"; a get just shorter than the store's timeout does too."""
    redis = RedisServer(tmp_path)
    try:
        killer = threading.Timer(0.3, redis.stop)
        killer.start()
        started = time.monotonic()
        with pytest.raises(pc.StoreError, match=r"cannot reach Redis at .*silent for 1\.[5-9]"):
            pc.init(1, 2, redis.url(), transport="tcp", timeout=2)
        assert time.monotonic() - started < 3
        killer.join()
        redis.start()
        store = RedisStore("127.0.0.1", redis.port, timeout=2)
        redis.stop()
        with pytest.raises(pc.StoreError, match=r"silent for 1\.[89]"):
            store.get("key", timeout=1.9)
        store.close()
    finally:
        redis.stop()


class _DelayingProxy:
    """A loopback TCP proxy to ``port`` that holds every reply ``delay`` seconds."""

    def __init__(self, port, delay):
        self.port_to, self.delay, self.connections = port, delay, 0
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(10)
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        with contextlib.suppress(OSError):
            while True:     # bounded: accept times out, close ends it
                client, _ = self.listener.accept()
                self.connections += 1
                upstream = socket.create_connection(("127.0.0.1", self.port_to), timeout=10)
                for source, sink, delay in ((client, upstream, 0), (upstream, client, self.delay)):
                    threading.Thread(target=self._pipe, args=(source, sink, delay),
                                     daemon=True).start()

    @staticmethod
    def _pipe(source, sink, delay):
        with contextlib.suppress(OSError):
            source.settimeout(10)
            while data := source.recv(65536):   # bounded by the socket timeout
                time.sleep(delay)
                sink.sendall(data)
        for end in (source, sink):
            with contextlib.suppress(OSError):
                end.shutdown(socket.SHUT_RDWR)

    def close(self):
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()


def test_slow_replies_end_a_wait_in_a_timeout_naming_the_key(server):
    """Replies 80 ms late: a get or wait whose last poll starts as its deadline runs out
    still gets its answer and raises Timeout naming the key, on the same connection (the
    poll had 50 ms, and the store dropped the connection and raised "cannot reach Redis")."""
    proxy = _DelayingProxy(server.port, 0.08)
    try:
        with RedisStore("127.0.0.1", proxy.port, timeout=1) as store:
            store.set("here", b"v")
            for wait in (lambda: store.get("missing"), lambda: store.wait(["here", "missing"]),
                         lambda: store.get("missing", timeout=0.05)):
                started = time.monotonic()
                with pytest.raises(pc.Timeout, match="waiting for key 'missing' in store"):
                    wait()
                assert time.monotonic() - started < 1.5
            assert store.get("here") == b"v"
        assert proxy.connections == 1
    finally:
        proxy.close()
