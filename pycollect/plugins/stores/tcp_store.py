"""The embedded TCP store (``tcp://host:port``): a server any rank can host, and its client."""

import collections
import contextlib
import enum
import errno
import heapq
import hmac
import ipaddress
import itertools
import logging
import math
import selectors
import socket
import struct
import threading
import time

from ... import settings
from ...errors import InvalidArgument, StoreError
from ..store import Deadline, Store, backoff_delays, parse_counter, split_store_url

__all__ = ["TCPStore", "TCPStoreServer", "open_tcp_store", "is_local_address"]

logger = logging.getLogger("pycollect.store")

# Wire format, network byte order.  A request is a header (operation: u8, key
# length: u32, value length: u32, longest server-side wait in ms: u32), then
# the key, then the value.  A reply is a header (status: u8, payload length:
# u32), then the payload.  WAIT and CHECK carry their keys in the value as a
# key list: each key preceded by its u32 length.  Each connection carries one
# request at a time; the client keeps a pool of connections for concurrency.
REQUEST_HEADER = struct.Struct("!BIII")
REPLY_HEADER = struct.Struct("!BI")
KEY_LENGTH = struct.Struct("!I")

MAX_KEY_BYTES = 64 * 1024
MAX_VALUE_BYTES = 64 * 1024 * 1024
MAX_AUTH_BYTES = 4096
MAX_WAIT_MS = 2**32 - 1
PING_REPLY = b"pycollect-tcp-store/1"
PING_LINE = b"\r\n"       # a PING's value, ignored by the server (see TCPStore._greet)

# Client timing.  Replies may arrive this long after the server's own deadline
# before the connection is declared broken.
IO_GRACE_S = 5.0
CONNECT_FIRST_RETRY_S = 0.01
CONNECT_RETRY_CAP_S = 0.5
PROBE_TIMEOUT_S = 0.5
MAX_IDLE_CONNECTIONS = 8
# Requests with values up to this size go out in one send.
SMALL_SEND_BYTES = 64 * 1024

# Server tuning.
LISTEN_BACKLOG = 512
RECV_CHUNK_BYTES = 256 * 1024
ACCEPTS_PER_WAKEUP = 64
ACCEPT_ERROR_PAUSE_S = 0.05
SERVER_JOIN_S = 5.0


class Op(enum.IntEnum):
    """Request operations."""

    PING = 1
    AUTH = 2
    SET = 3
    GET = 4
    WAIT = 5
    ADD = 6
    DELETE = 7
    CHECK = 8


class Status(enum.IntEnum):
    """Reply statuses."""

    OK = 0
    TIMEOUT = 1
    INVALID = 2
    ERROR = 3


class _ProtocolError(Exception):
    """A peer broke the wire format; the connection cannot continue."""

    def __init__(self, message, status=Status.ERROR):
        super().__init__(message)
        self.status = status


def tcp_url(host, port):
    """``tcp://HOST:PORT``, with an IPv6 host in brackets."""
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def _check_host(host):
    if not isinstance(host, str) or not host:
        raise InvalidArgument(f"a host must be a non-empty str, got {host!r}")
    return host


def _check_port(port, *, allow_zero):
    lowest = 0 if allow_zero else 1
    if isinstance(port, bool) or not isinstance(port, int) or not lowest <= port <= 65535:
        raise InvalidArgument(f"a TCP port must be an int from {lowest} to 65535, got {port!r}")
    return port


def _check_auth(auth):
    """Return the authentication token as bytes (None for no authentication)."""
    if auth is None:
        return None
    if isinstance(auth, str):
        auth = auth.encode("utf-8")
    if not isinstance(auth, (bytes, bytearray)):
        raise InvalidArgument(f"an auth token must be bytes, got {type(auth).__name__}")
    if not 0 < len(auth) <= MAX_AUTH_BYTES:
        raise InvalidArgument(
            f"an auth token must hold 1 to {MAX_AUTH_BYTES} bytes, got {len(auth)}")
    return bytes(auth)


def _encode_key(key):
    encoded = key.encode("utf-8")
    if len(encoded) > MAX_KEY_BYTES:
        raise InvalidArgument(f"store key of {len(encoded)} bytes exceeds the TCP store's "
                              f"limit of {MAX_KEY_BYTES} bytes")
    return encoded


def _encode_value(value):
    if len(value) > MAX_VALUE_BYTES:
        raise InvalidArgument(f"store value of {len(value)} bytes exceeds the TCP store's "
                              f"limit of {MAX_VALUE_BYTES} bytes")
    return value


def encode_key_list(keys):
    """Pack encoded keys, each preceded by its length."""
    return b"".join(KEY_LENGTH.pack(len(key)) + key for key in keys)


def decode_key_list(blob):
    """Unpack a key list, checking every length against the bounds."""
    keys = []
    offset = 0
    while offset < len(blob):  # bounded: offset grows every turn
        if offset + KEY_LENGTH.size > len(blob):
            raise _ProtocolError("truncated key list", Status.INVALID)
        (length,) = KEY_LENGTH.unpack_from(blob, offset)
        offset += KEY_LENGTH.size
        if length > MAX_KEY_BYTES or offset + length > len(blob):
            raise _ProtocolError(f"bad key length {length} in key list", Status.INVALID)
        keys.append(bytes(blob[offset:offset + length]))
        offset += length
    return keys


def _recv_exact(sock, size):
    """Read exactly ``size`` bytes (already checked against a bound) from a blocking socket."""
    buffer = bytearray(size)
    view = memoryview(buffer)
    received = 0
    while received < size:  # bounded: the socket timeout ends a stalled read
        count = sock.recv_into(view[received:])
        if count == 0:
            raise ConnectionError("connection closed by the TCP store server")
        received += count
    return buffer


class _Connection:
    """Server-side state of one client connection."""

    __slots__ = ("sock", "peer", "inbox", "outbox", "sent_of_first", "authenticated",
                 "waiter", "closing", "events")

    def __init__(self, sock, peer, authenticated):
        self.sock = sock
        self.peer = peer
        self.inbox = bytearray()
        self.outbox = collections.deque()
        self.sent_of_first = 0
        self.authenticated = authenticated
        self.waiter = None
        self.closing = False
        self.events = selectors.EVENT_READ


class _Waiter:
    """A GET or WAIT parked on the server until its keys are set or its deadline passes."""

    __slots__ = ("conn", "op", "keys", "missing", "expires_at", "done")

    def __init__(self, conn, op, keys, missing, expires_at):
        self.conn = conn
        self.op = op
        self.keys = keys
        self.missing = set(missing)
        self.expires_at = expires_at
        self.done = False


def _listen(host, port):
    """A non-blocking socket listening on ``host:port``; OSError when that fails."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(LISTEN_BACKLOG)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


class TCPStoreServer:
    """The embedded store server: listens once built, serves from a daemon thread once started."""

    def __init__(self, host="127.0.0.1", port=0, auth=None):
        self.host = _check_host(host)
        self.auth = _check_auth(auth)
        try:
            self._listener = _listen(host, _check_port(port, allow_zero=True))
        except OSError as err:
            raise StoreError(f"cannot listen on {tcp_url(host, port)}: {err}") from err
        self.port = self._listener.getsockname()[1]
        self._selector = selectors.DefaultSelector()
        self._wakeup_receiver, self._wakeup_sender = socket.socketpair()
        self._values = {}
        self._waiters_by_key = {}
        self._expiries = []
        self._expiry_order = itertools.count()
        self._resumable = collections.deque()
        self._connections = set()
        self._thread = None
        self._stopping = False
        self._closed = False

    @property
    def url(self):
        """The URL clients open: ``tcp://HOST:PORT``."""
        return tcp_url(self.host, self.port)

    def __repr__(self):
        return f"<TCPStoreServer {self.url}{' closed' if self._closed else ''}>"

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc_info):
        self.close()

    def start(self):
        """Start serving from a daemon thread; return self."""
        if self._closed:
            raise StoreError(f"TCP store server {self.url} is closed")
        if self._thread is None:
            self._selector.register(self._listener, selectors.EVENT_READ, "listener")
            self._wakeup_receiver.setblocking(False)
            self._selector.register(self._wakeup_receiver, selectors.EVENT_READ, "wakeup")
            self._thread = threading.Thread(
                target=self._serve, name=f"pycollect-tcp-store-{self.port}", daemon=True)
            self._thread.start()
        return self

    def close(self):
        """Stop serving and close every connection; calling it again does nothing."""
        if self._closed:
            return
        self._closed = True
        if self._thread is None:
            self._release_sockets()
        else:
            self._stopping = True
            with contextlib.suppress(OSError):
                self._wakeup_sender.send(b"\0")
            self._thread.join(SERVER_JOIN_S)
        self._wakeup_sender.close()

    def _release_sockets(self):
        for conn in list(self._connections):
            self._drop(conn)
        self._selector.close()
        self._listener.close()
        self._wakeup_receiver.close()

    def _serve(self):
        try:
            while not self._stopping:
                for selector_key, mask in self._selector.select(self._seconds_to_next_event()):
                    owner = selector_key.data
                    if owner == "listener":
                        self._accept()
                    elif owner == "wakeup":
                        with contextlib.suppress(OSError):
                            self._wakeup_receiver.recv(64)
                    else:
                        self._guarded(owner, self._service, owner, mask)
                self._expire_waiters()
                while self._resumable:
                    conn = self._resumable.popleft()
                    self._guarded(conn, self._process_requests, conn)
        except Exception:
            logger.exception("TCP store server %s stopped on an unexpected error", self.url)
        finally:
            self._release_sockets()

    def _seconds_to_next_event(self):
        if self._resumable:
            return 0
        while self._expiries and self._expiries[0][2].done:
            heapq.heappop(self._expiries)
        if not self._expiries:
            return None
        return max(0.0, self._expiries[0][0] - time.monotonic())

    def _accept(self):
        for _ in range(ACCEPTS_PER_WAKEUP):
            try:
                sock, peer = self._listener.accept()
            except BlockingIOError:
                return
            except OSError as err:
                logger.warning("TCP store server %s cannot accept: %s", self.url, err)
                if err.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    time.sleep(ACCEPT_ERROR_PAUSE_S)
                return
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = _Connection(sock, peer, authenticated=self.auth is None)
            self._connections.add(conn)
            self._selector.register(sock, conn.events, conn)

    def _guarded(self, conn, action, *args):
        """Run ``action``: a protocol error is answered and closes, a socket error drops."""
        if conn not in self._connections:
            return
        try:
            action(*args)
        except _ProtocolError as err:
            logger.warning("TCP store server %s: dropping client %s: %s", self.url, conn.peer, err)
            conn.closing = True
            with contextlib.suppress(OSError):
                self._reply(conn, err.status, str(err).encode("utf-8"))
            if conn.outbox:
                return
            self._drop(conn)
        except OSError as err:
            logger.debug("TCP store server %s: client %s gone: %s", self.url, conn.peer, err)
            self._drop(conn)
        except Exception:
            logger.exception("TCP store server %s: dropping client %s after an unexpected error",
                             self.url, conn.peer)
            self._drop(conn)

    def _service(self, conn, mask):
        if mask & selectors.EVENT_WRITE:
            self._flush(conn)
        if mask & selectors.EVENT_READ and conn in self._connections and not conn.closing:
            data = conn.sock.recv(RECV_CHUNK_BYTES)
            if not data:
                self._drop(conn)
                return
            conn.inbox += data
            if len(conn.inbox) > REQUEST_HEADER.size + MAX_KEY_BYTES + MAX_VALUE_BYTES:
                raise _ProtocolError(
                    "client sent more than one request without waiting for replies")
            self._process_requests(conn)

    def _process_requests(self, conn):
        while conn.waiter is None and not conn.closing and conn in self._connections:
            request = self._next_request(conn)
            if request is None:
                return
            self._handle(conn, *request)

    def _next_request(self, conn):
        """Take one complete request from the connection's inbox, checking its sizes first."""
        inbox = conn.inbox
        if len(inbox) < REQUEST_HEADER.size:
            return None
        op, key_length, value_length, wait_ms = REQUEST_HEADER.unpack_from(inbox)
        if not conn.authenticated:
            if op != Op.AUTH:
                raise _ProtocolError("authentication required: this store was started with a token")
            if key_length or value_length > MAX_AUTH_BYTES:
                raise _ProtocolError("authentication request too large")
        if key_length > MAX_KEY_BYTES:
            raise _ProtocolError(f"key of {key_length} bytes exceeds the limit of "
                                 f"{MAX_KEY_BYTES} bytes", Status.INVALID)
        if value_length > MAX_VALUE_BYTES:
            raise _ProtocolError(f"value of {value_length} bytes exceeds the limit of "
                                 f"{MAX_VALUE_BYTES} bytes", Status.INVALID)
        end = REQUEST_HEADER.size + key_length + value_length
        if len(inbox) < end:
            return None
        key = bytes(inbox[REQUEST_HEADER.size:REQUEST_HEADER.size + key_length])
        value = bytes(inbox[REQUEST_HEADER.size + key_length:end])
        del inbox[:end]
        return op, key, value, wait_ms

    def _handle(self, conn, op, key, value, wait_ms):
        values = self._values
        if op == Op.PING:
            self._reply(conn, Status.OK, PING_REPLY)
        elif op == Op.AUTH:
            if self.auth is not None and not hmac.compare_digest(value, self.auth):
                raise _ProtocolError("authentication failed: wrong token")
            conn.authenticated = True
            self._reply(conn, Status.OK)
        elif op == Op.SET:
            values[key] = value
            self._reply(conn, Status.OK)
            self._key_was_set(key)
        elif op == Op.GET:
            if key in values:
                self._reply(conn, Status.OK, values[key])
            else:
                self._park(conn, Op.GET, [key], wait_ms)
        elif op == Op.WAIT:
            self._park(conn, Op.WAIT, decode_key_list(value), wait_ms)
        elif op == Op.CHECK:
            present = all(each in values for each in decode_key_list(value))
            self._reply(conn, Status.OK, b"\1" if present else b"\0")
        elif op == Op.ADD:
            self._add(conn, key, value)
        elif op == Op.DELETE:
            self._reply(conn, Status.OK, b"\1" if values.pop(key, None) is not None else b"\0")
        else:
            raise _ProtocolError(f"unknown operation {op}")

    def _add(self, conn, key, amount_text):
        try:
            amount = int(amount_text.decode("ascii"), 10)
        except (UnicodeDecodeError, ValueError):
            self._reply(conn, Status.INVALID, b"add() amount is not an ASCII decimal integer")
            return
        stored = self._values.get(key)
        try:
            current = 0 if stored is None else parse_counter(
                stored, key.decode("utf-8", "replace"), self.url)
        except InvalidArgument as err:
            self._reply(conn, Status.INVALID, str(err).encode("utf-8"))
            return
        total = str(current + amount).encode("ascii")
        self._values[key] = total
        self._reply(conn, Status.OK, total)
        self._key_was_set(key)

    def _park(self, conn, op, keys, wait_ms):
        """Answer now if every key is set, else wait server-side until they are or time runs out."""
        missing = [key for key in keys if key not in self._values]
        if not missing:
            self._reply(conn, Status.OK, self._values[keys[0]] if op == Op.GET else b"")
            return
        if wait_ms == 0:
            self._reply(conn, Status.TIMEOUT, encode_key_list(missing))
            return
        waiter = _Waiter(conn, op, keys, missing, time.monotonic() + wait_ms / 1000)
        conn.waiter = waiter
        for key in missing:
            self._waiters_by_key.setdefault(key, set()).add(waiter)
        heapq.heappush(self._expiries, (waiter.expires_at, next(self._expiry_order), waiter))

    def _key_was_set(self, key):
        for waiter in self._waiters_by_key.pop(key, ()):
            waiter.missing.discard(key)
            if not waiter.missing and not waiter.done:
                payload = self._values[waiter.keys[0]] if waiter.op == Op.GET else b""
                self._finish(waiter, Status.OK, payload)

    def _expire_waiters(self):
        now = time.monotonic()
        while self._expiries and self._expiries[0][0] <= now:
            waiter = heapq.heappop(self._expiries)[2]
            if not waiter.done:
                still_missing = [key for key in waiter.keys if key in waiter.missing]
                self._finish(waiter, Status.TIMEOUT, encode_key_list(still_missing))

    def _forget(self, waiter):
        waiter.done = True
        waiter.conn.waiter = None
        for key in waiter.missing:
            parked = self._waiters_by_key.get(key)
            if parked is not None:
                parked.discard(waiter)
                if not parked:
                    del self._waiters_by_key[key]

    def _finish(self, waiter, status, payload):
        self._forget(waiter)
        conn = waiter.conn
        if conn in self._connections:
            self._resumable.append(conn)
            with contextlib.suppress(OSError):
                self._reply(conn, status, payload)

    def _reply(self, conn, status, payload=b""):
        header = REPLY_HEADER.pack(status, len(payload))
        if len(payload) <= SMALL_SEND_BYTES:
            conn.outbox.append(header + payload)
        else:
            conn.outbox.extend((header, payload))
        self._flush(conn)

    def _flush(self, conn):
        """Send what the socket takes now; watch for writability while anything is left."""
        while conn.outbox:  # bounded: ends when the outbox empties or the socket is full
            first = conn.outbox[0]
            try:
                sent = conn.sock.send(memoryview(first)[conn.sent_of_first:])
            except BlockingIOError:
                break
            conn.sent_of_first += sent
            if conn.sent_of_first == len(first):
                conn.outbox.popleft()
                conn.sent_of_first = 0
        if conn.closing and not conn.outbox:
            self._drop(conn)
            return
        events = (0 if conn.closing else selectors.EVENT_READ) | (
            selectors.EVENT_WRITE if conn.outbox else 0)
        if events != conn.events:
            conn.events = events
            self._selector.modify(conn.sock, events, conn)

    def _drop(self, conn):
        if conn not in self._connections:
            return
        self._connections.discard(conn)
        if conn.waiter is not None:
            self._forget(conn.waiter)
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(conn.sock)
        conn.sock.close()


class TCPStore(Store):
    """Client of a ``TCPStoreServer``; thread-safe, one pooled connection per concurrent call."""

    def __init__(self, host, port, timeout=None, auth=None):
        super().__init__(timeout)
        self.host = _check_host(host)
        self.port = _check_port(port, allow_zero=False)
        self.auth = _check_auth(auth)
        self.url = tcp_url(host, port)
        # The server this client hosts (rank 0 of open_tcp_store); closed with the client.
        self.server = None
        self._pool_lock = threading.Lock()
        self._idle = []
        self._busy = set()
        self._give_back(self._connect(Deadline(self.timeout)))

    def _connect(self, deadline):
        """Connect, authenticate and ping, retrying with backoff until the deadline."""
        attempts = 0
        for delay in backoff_delays(CONNECT_FIRST_RETRY_S, CONNECT_RETRY_CAP_S):
            attempts += 1
            try:
                sock = socket.create_connection(
                    (self.host, self.port), timeout=max(deadline.remaining(), 0.01))
            except OSError as err:
                last_error = err
            else:
                try:
                    self._greet(sock, deadline)
                    return sock
                except OSError as err:
                    sock.close()
                    last_error = err
                except BaseException:
                    sock.close()
                    raise
            if self._closed:
                raise self.closed_error()
            if deadline.expired():
                raise StoreError(
                    f"cannot reach the TCP store at {self.host}:{self.port}: tried for "
                    f"{deadline.timeout:g} s ({attempts} attempts); last error: {last_error}")
            time.sleep(min(delay, deadline.remaining()))

    def _greet(self, sock, deadline):
        """Authenticate when a token is set, then check that a pycollect TCP store answers.

        The greeting is bounded by the deadline (at least ``PROBE_TIMEOUT_S``), and
        ends in a line break so that line-based servers (Redis, HTTP) answer it at
        once: whatever else listens at the address is named, not retried.
        """
        if sock.getsockname() == sock.getpeername():
            # Linux can pair a connect to a free local port with itself (TCP
            # simultaneous open); treat it as nothing listening yet.
            raise ConnectionRefusedError(errno.ECONNREFUSED, "connected to itself")
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        wait_s = max(deadline.remaining(), PROBE_TIMEOUT_S)
        sock.settimeout(wait_s)
        try:
            if self.auth is not None:
                self._expect_ok(sock, Op.AUTH, self.auth)
            sock.sendall(REQUEST_HEADER.pack(Op.PING, 0, len(PING_LINE), 0) + PING_LINE)
            reply = _recv_exact(sock, REPLY_HEADER.size)
            status, length = REPLY_HEADER.unpack(reply)
            if status == Status.OK and length == len(PING_REPLY):
                reply += _recv_exact(sock, length)
        except socket.timeout:
            raise StoreError(f"{self.host}:{self.port} accepts connections but did not answer "
                             f"a pycollect TCP store's greeting within {wait_s:g} s: is "
                             f"something else listening there?") from None
        if status in (Status.INVALID, Status.ERROR) and length <= MAX_AUTH_BYTES:
            # A pycollect store that turns this client away (a token is missing).
            raise StoreError(f"the TCP store at {self.host}:{self.port} refused this client: "
                             f"{_recv_exact(sock, length)[:500].decode('utf-8', 'replace')}")
        if reply[REPLY_HEADER.size:] != PING_REPLY:
            with contextlib.suppress(OSError):
                sock.settimeout(PROBE_TIMEOUT_S)
                reply += sock.recv(64)
            raise StoreError(f"something other than a pycollect TCP store answers at "
                             f"{self.host}:{self.port}: it replied {bytes(reply[:64])!r}")

    def _expect_ok(self, sock, op, value):
        try:
            status, payload = self._exchange(sock, op, b"", value, 0)
        except _ProtocolError as err:
            raise StoreError(f"{self.host}:{self.port} did not answer as a pycollect "
                             f"TCP store: {err}") from None
        if status != Status.OK:
            raise StoreError(f"the TCP store at {self.host}:{self.port} refused this client: "
                             f"{payload[:500].decode('utf-8', 'replace')}")
        return payload

    @staticmethod
    def _exchange(sock, op, key, value, wait_ms):
        """Send one request and read its reply on a blocking socket."""
        header = REQUEST_HEADER.pack(op, len(key), len(value), wait_ms)
        if len(value) <= SMALL_SEND_BYTES:
            sock.sendall(header + key + value)
        else:
            sock.sendall(header + key)
            sock.sendall(value)
        status, length = REPLY_HEADER.unpack(_recv_exact(sock, REPLY_HEADER.size))
        if length > MAX_VALUE_BYTES:
            raise _ProtocolError(f"reply of {length} bytes exceeds the limit of {MAX_VALUE_BYTES}")
        return status, bytes(_recv_exact(sock, length))

    def _take(self, deadline):
        with self._pool_lock:
            if self._closed:
                raise self.closed_error()
            if self._idle:
                sock = self._idle.pop()
                self._busy.add(sock)
                return sock
        sock = self._connect(deadline)
        with self._pool_lock:
            if self._closed:
                sock.close()
                raise self.closed_error()
            self._busy.add(sock)
        return sock

    def _give_back(self, sock):
        with self._pool_lock:
            self._busy.discard(sock)
            if not self._closed and len(self._idle) < MAX_IDLE_CONNECTIONS:
                self._idle.append(sock)
                return
        sock.close()

    def _discard(self, sock):
        with self._pool_lock:
            self._busy.discard(sock)
        sock.close()

    def _call(self, op, key=b"", value=b"", deadline=None):
        """One request on a pooled connection; returns (status, payload) for OK and TIMEOUT."""
        if deadline is None:
            wait_ms, io_timeout = 0, self.timeout + IO_GRACE_S
            sock = self._take(Deadline(self.timeout))
        else:
            wait_ms = min(MAX_WAIT_MS, math.ceil(deadline.remaining() * 1000))
            io_timeout = deadline.remaining() + IO_GRACE_S
            sock = self._take(deadline)
        try:
            sock.settimeout(io_timeout)
            status, payload = self._exchange(sock, op, key, value, wait_ms)
        except (OSError, _ProtocolError) as err:
            self._discard(sock)
            if self._closed:
                raise self.closed_error() from None
            raise StoreError(f"TCP store at {self.host}:{self.port} failed during "
                             f"{op.name}: {err}") from err
        if status not in (Status.OK, Status.TIMEOUT):
            self._discard(sock)
            message = payload.decode("utf-8", "replace")
            if status == Status.INVALID:
                raise InvalidArgument(f"{message} (store {self.url})")
            raise StoreError(f"TCP store at {self.host}:{self.port} refused {op.name}: {message}")
        self._give_back(sock)
        return status, payload

    def _timeout_from_reply(self, payload, deadline):
        try:
            missing = [key.decode("utf-8", "replace") for key in decode_key_list(payload)]
        except _ProtocolError as err:
            raise StoreError(
                f"TCP store at {self.host}:{self.port} sent a bad reply: {err}") from None
        return self.timeout_error(missing, deadline)

    def _set(self, key, value):
        self._call(Op.SET, _encode_key(key), _encode_value(value))

    def _get(self, key, deadline):
        status, payload = self._call(Op.GET, _encode_key(key), deadline=deadline)
        if status == Status.TIMEOUT:
            raise self.timeout_error([key], deadline)
        return payload

    def _wait(self, keys, deadline):
        key_list = _encode_value(encode_key_list([_encode_key(key) for key in keys]))
        status, payload = self._call(Op.WAIT, value=key_list, deadline=deadline)
        if status == Status.TIMEOUT:
            raise self._timeout_from_reply(payload, deadline)

    def _add(self, key, amount):
        _, payload = self._call(Op.ADD, _encode_key(key), str(amount).encode("ascii"))
        return parse_counter(payload, key, self.url)

    def _delete(self, key):
        return self._call(Op.DELETE, _encode_key(key))[1] == b"\1"

    def _check(self, keys):
        key_list = _encode_value(encode_key_list([_encode_key(key) for key in keys]))
        return self._call(Op.CHECK, value=key_list)[1] == b"\1"

    def _close(self):
        with self._pool_lock:
            idle, self._idle = self._idle, []
            busy = list(self._busy)
        for sock in idle:
            sock.close()
        # Wake threads blocked on a reply; they see the store closed.
        for sock in busy:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        if self.server is not None:
            self.server.close()


def _bindable(family, address):
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((address[0], 0) + tuple(address[2:]))
            return True
        except OSError:
            return False


def is_local_address(host):
    """Whether ``host`` resolves to a loopback address or to an address of this machine."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    for family, _, _, _, address in infos:
        if ipaddress.ip_address(address[0].partition("%")[0]).is_loopback:
            return True
        if _bindable(family, address):
            return True
    return False


def _accepts_connections(host, port):
    try:
        with socket.create_connection((host, port), timeout=PROBE_TIMEOUT_S):
            return True
    except OSError:
        return False


def parse_tcp_url(url):
    """Return (host, port) from ``tcp://HOST:PORT`` (IPv6 hosts in brackets)."""
    parts = split_store_url(url, "tcp")
    if not parts.hostname:
        raise InvalidArgument(f"TCP store URL {url!r} names no host: use tcp://HOST:PORT")
    try:
        port = parts.port
    except ValueError:
        raise InvalidArgument(f"TCP store URL {url!r} has an invalid port") from None
    if not port:
        raise InvalidArgument(
            f"TCP store URL {url!r} needs a port from 1 to 65535: tcp://HOST:PORT")
    if parts.path not in ("", "/"):
        raise InvalidArgument(f"TCP store URL {url!r} takes no path")
    return parts.hostname, port


def _start_server_unless_taken(host, port, auth):
    """Start a server on ``host:port``, or return None when another process bound it first."""
    try:
        return TCPStoreServer(host, port, auth).start()
    except StoreError as err:
        if isinstance(err.__cause__, OSError) and err.__cause__.errno == errno.EADDRINUSE:
            return None
        raise


def open_tcp_store(url, *, timeout=None, rank=None, size=None):
    """Open ``tcp://host:port``; rank 0 hosts the server when none runs at a local address."""
    host, port = parse_tcp_url(url)
    auth = settings.get("PYCOLLECT_AUTH")
    server = None
    if rank == 0 and is_local_address(host) and not _accepts_connections(host, port):
        server = _start_server_unless_taken(host, port, auth)
    try:
        store = TCPStore(host, port, timeout=timeout, auth=auth)
    except BaseException:
        if server is not None:
            server.close()
        raise
    store.server = server
    return store
