"""The embedded TCP store: conformance suite plus connection, auth, limits and self-hosting."""

import socket
import struct
import threading
import time

import pytest

import pycollect as pc
from pycollect.plugins import TCPStore, TCPStoreServer, open_store
from pycollect.plugins.store import redact, redact_text
from pycollect.plugins.stores.tcp_store import (MAX_KEY_BYTES, MAX_VALUE_BYTES, REPLY_HEADER,
                                         REQUEST_HEADER, Op, Status, is_local_address,
                                         open_tcp_store, parse_tcp_url)
from abstract import StoreSuite
from conftest import ipv6_loopback_works

pytestmark = pytest.mark.timeout(30)


def _free_port(host="127.0.0.1"):
    """A port on ``host`` that nothing listens on (bound, then released)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def _raw_request(sock, op, key=b"", value=b"", wait_ms=0):
    sock.sendall(REQUEST_HEADER.pack(op, len(key), len(value), wait_ms) + key + value)


def _raw_reply(sock):
    """Read one reply from a blocking socket: (status, payload)."""
    data = b""
    while len(data) < REPLY_HEADER.size:  # bounded by the socket timeout
        chunk = sock.recv(REPLY_HEADER.size - len(data))
        assert chunk, "server closed without replying"
        data += chunk
    status, length = REPLY_HEADER.unpack(data)
    payload = b""
    while len(payload) < length:  # bounded by the socket timeout
        chunk = sock.recv(length - len(payload))
        assert chunk, "server closed mid-reply"
        payload += chunk
    return status, payload


def _closed_by_peer(sock):
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


@pytest.fixture
def server():
    with TCPStoreServer() as server:
        yield server


def test_an_at_sign_in_the_prefix_hides_neither_port_nor_prefix(server):
    """An "@" after the address is no password's end: redact() showed tcp://HOST:***@2."""
    with open_store(f"tcp://{server.host}:{server.port}?prefix=job@2", timeout=5) as store:
        assert redact(store.url) == store.url == f"tcp://{server.host}:{server.port}?prefix=job@2"
        message = f"cannot reach {store.url}: port {server.port} refused"
        assert redact_text(message, store.url) == message
    assert redact("tcp://10.0.0.1:29500/x?prefix=job@2#a@b") == \
        "tcp://10.0.0.1:29500/x?prefix=job@2#a@b"


class TestTCPStore(StoreSuite):
    @pytest.fixture
    def store(self, server):
        with TCPStore(server.host, server.port, timeout=10) as store:
            yield store


class TestAuthenticatedTCPStore(StoreSuite):
    @pytest.fixture
    def store(self):
        with TCPStoreServer(auth=b"s3cret") as server, \
                TCPStore(server.host, server.port, timeout=10, auth=b"s3cret") as store:
            yield store


class TestSelfHostedTCPStore(StoreSuite):
    @pytest.fixture
    def store(self):
        with open_tcp_store(f"tcp://127.0.0.1:{_free_port()}", timeout=10, rank=0) as store:
            assert store.server is not None
            yield store


def test_server_on_port_zero_gets_a_port_and_url():
    with TCPStoreServer(port=0) as server:
        assert server.port > 0
        assert server.url == f"tcp://127.0.0.1:{server.port}"
        assert parse_tcp_url(server.url) == ("127.0.0.1", server.port)


@pytest.mark.skipif(not ipv6_loopback_works(), reason="no IPv6 loopback")
def test_ipv6_server_url_is_bracketed_and_served():
    with TCPStoreServer(host="::1") as server:
        assert server.url == f"tcp://[::1]:{server.port}"
        assert parse_tcp_url(server.url) == ("::1", server.port)
        with TCPStore("::1", server.port, timeout=5) as store:
            store.set("key", b"v6")
            assert store.get("key") == b"v6"


def test_unreachable_server_is_a_store_error_within_the_deadline():
    port = _free_port()
    started = time.monotonic()
    with pytest.raises(pc.StoreError) as caught:
        TCPStore("127.0.0.1", port, timeout=0.5)
    elapsed = time.monotonic() - started
    assert 0.45 <= elapsed < 3
    assert f"127.0.0.1:{port}" in str(caught.value)
    assert "0.5 s" in str(caught.value)


def test_client_retries_until_a_late_server_comes_up():
    port = _free_port()
    servers = []
    starter = threading.Timer(0.3, lambda: servers.append(TCPStoreServer(port=port).start()))
    starter.start()
    try:
        with TCPStore("127.0.0.1", port, timeout=10) as store:
            store.set("key", b"value")
            assert store.get("key") == b"value"
    finally:
        starter.join()
        for late_server in servers:
            late_server.close()


@pytest.mark.parametrize("client_auth", [b"wrong", None])
def test_clients_without_the_right_token_are_refused(client_auth):
    with TCPStoreServer(auth=b"right") as server:
        with pytest.raises(pc.StoreError, match="refused|authentication"):
            TCPStore(server.host, server.port, timeout=2, auth=client_auth)
        with TCPStore(server.host, server.port, timeout=2, auth=b"right") as store:
            store.set("still", b"serving")
            assert store.get("still") == b"serving"


@pytest.mark.parametrize("op", [op for op in Op if op != Op.AUTH])
def test_unauthenticated_raw_requests_are_dropped(op):
    """Every request but AUTH, before it: refused, the connection closed, nothing read or
    changed (a GET must not leak a value, an ADD must not move a counter)."""
    with TCPStoreServer(auth=b"right") as server:
        with TCPStore(server.host, server.port, timeout=5, auth=b"right") as store:
            store.set("key", b"secret")
            store.add("count", 5)
        with socket.create_connection((server.host, server.port), timeout=5) as raw:
            value = struct.pack("!q", 1) if op == Op.ADD else b"value"
            _raw_request(raw, op, b"count" if op == Op.ADD else b"key", value)
            status, payload = _raw_reply(raw)
            assert status == Status.ERROR and b"authentication" in payload
            assert b"secret" not in payload and b"pycollect-tcp-store" not in payload
            assert _closed_by_peer(raw)
        with TCPStore(server.host, server.port, timeout=5, auth=b"right") as store:
            assert store.get("key") == b"secret" and store.add("count", 0) == 5


@pytest.mark.parametrize("key_length, value_length", [
    (MAX_KEY_BYTES + 1, 0), (0, MAX_VALUE_BYTES + 1), (2**32 - 1, 2**32 - 1)])
def test_oversized_requests_are_rejected_and_the_server_keeps_serving(
        server, key_length, value_length):
    with socket.create_connection((server.host, server.port), timeout=5) as raw:
        raw.sendall(REQUEST_HEADER.pack(Op.SET, key_length, value_length, 0))
        status, payload = _raw_reply(raw)
        assert status == Status.INVALID
        assert b"exceeds the limit" in payload
        assert _closed_by_peer(raw)
    with TCPStore(server.host, server.port, timeout=5) as store:
        store.set("after", b"ok")
        assert store.get("after") == b"ok"


def test_client_rejects_oversized_keys_and_values_before_sending(server):
    with TCPStore(server.host, server.port, timeout=5) as store:
        with pytest.raises(pc.InvalidArgument, match="key of"):
            store.set("k" * (MAX_KEY_BYTES + 1), b"")
        with pytest.raises(pc.InvalidArgument, match="value of"):
            store.set("key", bytes(MAX_VALUE_BYTES + 1))
        store.set("key", b"fine")
        assert store.get("key") == b"fine"


@pytest.mark.parametrize("garbage", [b"\xff" * 13, struct.pack("!BIII", Op.WAIT, 0, 3, 0) + b"abc"])
def test_garbage_is_dropped_and_the_server_keeps_serving(server, garbage):
    with socket.create_connection((server.host, server.port), timeout=5) as raw:
        raw.sendall(garbage)
        status, _ = _raw_reply(raw)
        assert status in (Status.ERROR, Status.INVALID)
        assert _closed_by_peer(raw)
    with TCPStore(server.host, server.port, timeout=5) as store:
        assert store.add("count", 1) == 1


def test_a_waiting_client_that_disconnects_is_forgotten(server):
    with socket.create_connection((server.host, server.port), timeout=5) as raw:
        _raw_request(raw, Op.GET, b"later", wait_ms=60_000)
    with TCPStore(server.host, server.port, timeout=5) as store:
        store.set("later", b"value")
        assert store.get("later") == b"value"


def test_get_waits_server_side_without_polling(server):
    with socket.create_connection((server.host, server.port), timeout=5) as raw:
        _raw_request(raw, Op.GET, b"slow", wait_ms=5_000)
        with TCPStore(server.host, server.port, timeout=5) as store:
            time.sleep(0.05)
            store.set("slow", b"arrived")
        assert _raw_reply(raw) == (Status.OK, b"arrived")


def test_server_going_away_fails_a_waiting_client_fast():
    server = TCPStoreServer().start()
    store = TCPStore(server.host, server.port, timeout=20)
    closer = threading.Timer(0.1, server.close)
    closer.start()
    started = time.monotonic()
    with pytest.raises(pc.StoreError, match=f"127.0.0.1:{server.port}"):
        store.get("never")
    assert time.monotonic() - started < 5
    closer.join()
    store.close()


def test_a_port_taken_by_another_server_is_a_store_error(server):
    with pytest.raises(pc.StoreError, match=str(server.port)):
        TCPStoreServer(port=server.port)


def test_rank_zero_hosts_the_store_and_other_ranks_connect():
    url = f"tcp://127.0.0.1:{_free_port()}"
    world = 3
    stores, errors = {}, []

    def rank_main(rank):
        try:
            store = open_tcp_store(url, timeout=10, rank=rank, size=world)
            stores[rank] = store
            store.set(f"address/{rank}", str(rank).encode())
            store.wait([f"address/{peer}" for peer in range(world)])
            store.add("arrived", 1)
        except Exception as err:  # reported by the assertion below
            errors.append(err)

    # Ranks 1 and 2 start first: they must retry until rank 0 is up.
    threads = [threading.Thread(target=rank_main, args=(rank,)) for rank in (1, 2, 0)]
    for thread in threads:
        thread.start()
        time.sleep(0.05)
    for thread in threads:
        thread.join(15)
    assert errors == []
    assert stores[0].server is not None and stores[0].server.url == url
    assert stores[1].server is None and stores[2].server is None
    assert stores[1].get("arrived") == b"3"
    for rank in (1, 2):
        stores[rank].close()
    stores[0].close()
    with pytest.raises(pc.StoreError):
        TCPStore("127.0.0.1", parse_tcp_url(url)[1], timeout=0.2)


def test_rank_zero_joins_a_server_that_is_already_running(server):
    with open_tcp_store(server.url, timeout=5, rank=0) as store:
        assert store.server is None
        store.set("key", b"value")


def test_other_ranks_never_host():
    url = f"tcp://127.0.0.1:{_free_port()}"
    with pytest.raises(pc.StoreError, match="cannot reach"):
        open_tcp_store(url, timeout=0.3, rank=1)


def test_auth_token_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("PYCOLLECT_AUTH", "from-env")
    port = _free_port()
    with open_tcp_store(f"tcp://127.0.0.1:{port}", timeout=5, rank=0) as host:
        assert host.server.auth == b"from-env"
        with pytest.raises(pc.StoreError, match="refused"):
            TCPStore("127.0.0.1", port, timeout=2)
        with open_tcp_store(f"tcp://127.0.0.1:{port}", timeout=5, rank=1) as peer:
            host.set("key", b"value")
            assert peer.get("key") == b"value"


def test_local_addresses_are_recognised():
    assert is_local_address("127.0.0.1")
    assert is_local_address("127.3.4.5")
    assert is_local_address("localhost")
    assert not is_local_address("192.0.2.1")  # TEST-NET-1, never assigned to a host
    assert not is_local_address("no-such-host.invalid")


@pytest.mark.parametrize("url", ["tcp://127.0.0.1", "tcp://127.0.0.1:0", "tcp://:80",
                                 "tcp://127.0.0.1:99999", "tcp://127.0.0.1:80/path",
                                 "tcp://127.0.0.1:80?x=1", "http://127.0.0.1:80"])
def test_bad_tcp_urls_are_invalid_arguments(url):
    with pytest.raises(pc.InvalidArgument):
        parse_tcp_url(url)


@pytest.mark.parametrize("kwargs", [{"port": -1}, {"port": 70000}, {"host": ""},
                                    {"auth": b""}, {"auth": 5}])
def test_bad_server_arguments_are_invalid_arguments(kwargs):
    with pytest.raises(pc.InvalidArgument):
        TCPStoreServer(**kwargs)
