"""A store on a standalone Redis server (``redis://[:password@]host:port[/db]``), via hiredis.

The client speaks RESP over one plain socket that it manages itself: hiredis
(``pip install 'pycollect[redis]'``) parses the replies.  Every command runs
under a deadline; a lost connection is re-opened (AUTH, SELECT, cluster
check) and the command retried with backoff until that deadline.  ``get`` and
``wait`` poll with backoff.  Each handle remembers the keys it wrote and
deletes them when it closes; every key also carries an expiry (24 h by
default) so that a crashed run's keys go away by themselves.  Redis Cluster
is refused with a ``StoreError``, whether ``INFO cluster`` reports it or a
``MOVED``/``ASK``/``CLUSTERDOWN`` reply shows it.
"""

import contextlib
import logging
import socket
import threading
import time
from urllib.parse import parse_qsl, quote, unquote

from ...errors import InvalidArgument, PluginError, StoreError, Timeout
from ..store import Deadline, Store, backoff_delays, parse_url, redact

try:
    import hiredis
except ImportError:         # the [redis] extra is not installed; said when a store is opened
    hiredis = None

__all__ = ["RedisStore", "open_redis_store"]

logger = logging.getLogger("pycollect.store")

DEFAULT_PORT = 6379
# Keys expire this long after their last write unless ttl=0 says otherwise.
DEFAULT_KEY_TTL_S = 24 * 3600.0
# Redis refuses an expiry whose absolute time, in ms since 1970, exceeds 2**63 - 1 ("invalid
# expire time"); this bound (about 146 million years) leaves room for any clock.
MAX_KEY_TTL_S = 2 ** 62 // 1000
# get and wait poll: the sleep between polls doubles up to the cap.
POLL_FIRST_S = 0.001
POLL_CAP_S = 0.025
# Reconnect attempts: the sleep between them doubles up to the cap.
RETRY_FIRST_S = 0.01
RETRY_CAP_S = 0.5
# Each attempt (connect, handshake, command) gets at least this long, however little of its
# deadline is left: the last poll of a get or wait starts with about 0 s left, and a Redis a
# few round trips of 100 ms away (another zone, a BGSAVE fork, many ranks polling) must
# still answer it, so that the wait ends in the Timeout naming its keys, not in a dropped
# connection.  A server that does not answer within it is taken for hung: the connection is
# dropped.  So an operation on a hung server fails at most this long after its deadline.
IO_FLOOR_S = 1.0
# A command whose deadline passes while Redis does not answer raises StoreError once Redis
# has been silent this long, or half the store's timeout if that is shorter (Timeout before:
# init's join polls again).  init's deadline is the store's timeout, so a tolerance shorter
# than it lets init report the outage rather than the rank it was waiting for; a fixed few
# seconds, not a share of a long timeout, keeps the last stretch of init in which Redis can
# fail with only a Timeout short, and still rides out a restart of the server.
OUTAGE_TOLERANCE_S = 5.0
# The most time close() spends deleting the handle's keys, while Redis answers; a server
# that does not (the connection lost, and one reconnect refused or timed out) is not waited
# for: the keys expire by their ttl.
CLOSE_BUDGET_S = 5.0
CLOSE_ATTEMPTS = 2
DELETE_BATCH = 512
RECV_CHUNK_BYTES = 256 * 1024
# Error replies that only a Redis Cluster node gives.
CLUSTER_REPLIES = ("MOVED", "ASK", "CLUSTERDOWN", "CROSSSLOT", "TRYAGAIN")
_INCOMPLETE = object()


class _Retry(Exception):
    """The connection failed or the server is not ready yet; reconnect and try again."""


class _Refused(Exception):
    """Redis answered a command with an error reply (the message is Redis's)."""


def redis_url(host, port, db=0, *, username=None, password=None):
    """``redis://HOST:PORT/DB`` for messages: an IPv6 host in brackets, any password hidden."""
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    who = "" if password is None else f"{quote(username or '', safe='')}:***@"
    return f"redis://{who}{where}/{db}"


def _text(reply):
    return reply.decode("utf-8", "replace") if isinstance(reply, bytes) else str(reply)


class RedisStore(Store):
    """Store on a standalone Redis server; every handle deletes the keys it wrote when it closes."""

    def __init__(self, host="127.0.0.1", port=DEFAULT_PORT, *, db=0, password=None,
                 username=None, timeout=None, key_ttl=DEFAULT_KEY_TTL_S):
        super().__init__(timeout)
        if hiredis is None:
            raise PluginError("the redis store needs the hiredis package: "
                              "pip install 'pycollect[redis]'")
        if not isinstance(host, str) or not host:
            raise InvalidArgument(f"a Redis host must be a non-empty str, got {host!r}")
        if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
            raise InvalidArgument(f"a Redis port must be an int from 1 to 65535, got {port!r}")
        if isinstance(db, bool) or not isinstance(db, int) or db < 0:
            raise InvalidArgument(f"a Redis database must be an int >= 0, got {db!r}")
        if isinstance(key_ttl, bool) or not isinstance(key_ttl, (int, float)) \
                or not 0 <= key_ttl <= MAX_KEY_TTL_S:
            raise InvalidArgument(f"key_ttl must be a number of seconds from 0 (keys never "
                                  f"expire) to {MAX_KEY_TTL_S}, got {key_ttl!r}")
        if username is not None and password is None:
            # Redis 6 ACLs: AUTH USER PASSWORD; a user alone would be dropped without a word.
            raise InvalidArgument(f"Redis user {username!r} needs a password: "
                                  f"redis://USER:PASSWORD@HOST (a user with nopass takes any)")
        self.host, self.port, self.db = host, port, db
        self.username, self._password = username, password
        self.key_ttl = float(key_ttl)
        self.url = redis_url(host, port, db, username=username, password=password)
        self._io_lock = threading.Lock()
        self._sock = None
        self._reader = None
        self._written_lock = threading.Lock()
        self._written = set()
        self._down_since = None         # when the server stopped answering, while it does not
        self._execute([], Deadline(self.timeout))     # connect now: a bad URL fails here

    # ---- connection -------------------------------------------------------------------

    def _connect(self, attempt):
        """Open the socket and run AUTH, SELECT and the cluster check (io lock held)."""
        try:
            sock = socket.create_connection((self.host, self.port),
                                            timeout=_socket_timeout(attempt))
        except OSError as err:
            raise _Retry(f"cannot connect: {err}") from err
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._sock, self._reader = sock, hiredis.Reader(notEnoughData=_INCOMPLETE)
            handshake = []
            if self._password is not None:
                credentials = [self._password] if self.username is None else \
                    [self.username, self._password]
                handshake.append(("AUTH", *credentials))
            if self.db:
                handshake.append(("SELECT", self.db))
            handshake.append(("INFO", "cluster"))
            replies = self._exchange(handshake, attempt)
        except BaseException:
            self._disconnect()
            raise
        for command, reply in zip(handshake, replies):
            if not isinstance(reply, hiredis.ReplyError):
                continue
            message = str(reply)
            if command[0] == "AUTH":
                self._disconnect()
                raise StoreError(f"Redis at {self.url} refused the password: {message}")
            if command[0] == "SELECT":
                self._disconnect()
                raise StoreError(f"Redis at {self.url} refused database {self.db}: {message}")
            if message.startswith(("NOAUTH", "WRONGPASS")):
                self._disconnect()
                raise StoreError(f"Redis at {self.url} needs a password: use "
                                 f"redis://:PASSWORD@{self.url[len('redis://'):]} ({message})")
            if message.startswith("LOADING"):
                self._disconnect()
                raise _Retry(message)
            # INFO may be disabled (renamed) on managed servers: MOVED replies still tell.
        info = replies[-1]
        if isinstance(info, bytes) and b"cluster_enabled:1" in info:
            self._disconnect()
            raise self._cluster_error("INFO cluster reports cluster_enabled:1")

    def _disconnect(self):
        sock, self._sock, self._reader = self._sock, None, None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.close()

    def _cluster_error(self, evidence):
        return StoreError(f"Redis at {self.url} is a Redis Cluster node ({evidence}); the redis "
                          f"store needs a standalone server (or a single primary): point "
                          f"PYCOLLECT_STORE at one, or use tcp:// or file://")

    def _exchange(self, commands, attempt):
        """Send ``commands`` in one write and read one reply each (io lock held)."""
        sock, reader = self._sock, self._reader
        sock.settimeout(_socket_timeout(attempt))
        try:
            sock.sendall(b"".join(hiredis.pack_command(command) for command in commands))
            replies = []
            buffer = bytearray(RECV_CHUNK_BYTES)
            while len(replies) < len(commands):   # bounded: the socket timeout ends a stall
                reply = reader.gets()
                if reply is not _INCOMPLETE:
                    replies.append(reply)
                    continue
                count = sock.recv_into(buffer)
                if count == 0:
                    raise ConnectionError("connection closed by the Redis server")
                reader.feed(buffer, 0, count)
            return replies
        except (OSError, hiredis.ProtocolError) as err:
            self._disconnect()
            raise _Retry(f"{type(err).__name__}: {err}") from err

    def _execute(self, commands, deadline, *, idempotent=True, closing=False):
        """Run ``commands`` as one pipeline; reconnect and retry until ``deadline`` (for
        ``closing``, at most CLOSE_ATTEMPTS times)."""
        attempts, last, started = 0, None, time.monotonic()
        for delay in backoff_delays(RETRY_FIRST_S, RETRY_CAP_S):
            if self._closed and not closing:
                raise self.closed_error()
            attempts += 1
            sent = False
            if not self._io_lock.acquire(timeout=deadline.remaining()):
                raise Timeout(f"timed out after {deadline.timeout:g} s waiting for this "
                              f"handle's connection to Redis at {self.url} (another thread "
                              f"holds it)")
            attempt = Deadline(max(deadline.remaining(), IO_FLOOR_S))
            try:
                if self._sock is None:
                    if self._closed and not closing:
                        raise self.closed_error()
                    self._connect(attempt)
                sent = True
                replies = self._exchange(commands, attempt)
                self._down_since = None
                return [self._check_reply(reply) for reply in replies]
            except _Retry as err:
                last = err
                if self._down_since is None:
                    self._down_since = time.monotonic()
                if sent and not idempotent:
                    raise StoreError(
                        f"lost the connection to Redis at {self.url} after sending "
                        f"{commands[0][0]} (the command may or may not have taken effect, "
                        f"so it is not retried): {err}") from None
            finally:
                self._io_lock.release()
            if deadline.expired() or (closing and attempts >= CLOSE_ATTEMPTS):
                raise self._unreachable(started, attempts, last, deadline, closing)
            time.sleep(min(delay, deadline.remaining()))

    def _outage_tolerance(self):
        """How long Redis may be silent before a command raises StoreError at its deadline."""
        return min(OUTAGE_TOLERANCE_S, self.timeout / 2)

    def _unreachable(self, started, attempts, last, deadline, closing):
        """The error of a command whose deadline passed while Redis did not answer: a
        ``StoreError`` once the server has been silent for ``_outage_tolerance()`` (or for a
        command given the store's whole timeout, or ``close``), else a ``Timeout`` (a poll of
        ``init``'s join, which polls again: a brief restart is ridden out)."""
        now = time.monotonic()
        down = now - (self._down_since or started)
        tried = (f"silent for {down:.2g} s; tried for {now - started:.2g} s ({attempts} "
                 f"attempts); last error: {last}")
        if closing or deadline.timeout >= self.timeout or down >= self._outage_tolerance():
            return StoreError(f"cannot reach Redis at {self.url}: {tried}")
        return Timeout(f"timed out after {deadline.timeout:g} s: Redis at {self.url} has not "
                       f"answered (a command fails with StoreError once Redis has been silent "
                       f"for {self._outage_tolerance():g} s); {tried}")

    def _check_reply(self, reply):
        """Return ``reply``, or raise for an error reply that ends the command."""
        if not isinstance(reply, hiredis.ReplyError):
            return reply
        message = str(reply)
        if message.startswith(CLUSTER_REPLIES):
            self._disconnect()
            raise self._cluster_error(f"it replied {message!r}")
        if message.startswith("LOADING"):
            raise _Retry(message)
        if message.startswith(("NOAUTH", "WRONGPASS")):
            raise StoreError(f"Redis at {self.url} needs a password: use "
                             f"redis://:PASSWORD@{self.url[len('redis://'):]} ({message})")
        if message.startswith("READONLY"):
            raise StoreError(f"Redis at {self.url} is a read-only replica ({message}); point "
                             f"the store at the primary")
        raise _Refused(message)

    def _expiring(self, command):
        """``command`` followed by an expiry when keys expire."""
        if self.key_ttl:
            return (*command, "PX", max(1, int(self.key_ttl * 1000)))
        return command

    def _remember(self, key):
        with self._written_lock:
            self._written.add(key)

    def _refused(self, err, action, key):
        return StoreError(f"Redis at {self.url} refused {action} of key {key!r}: {err}")

    # ---- Store hooks ------------------------------------------------------------------

    def _set(self, key, value):
        self._remember(key)
        try:
            self._execute([self._expiring(("SET", key, value))], Deadline(self.timeout))
        except _Refused as err:
            raise self._refused(err, "SET", key) from None

    def _get(self, key, deadline):
        for delay in backoff_delays(POLL_FIRST_S, POLL_CAP_S):
            try:
                (value,) = self._execute([("GET", key)], deadline)
            except _Refused as err:
                raise self._refused(err, "GET", key) from None
            if value is not None:
                return value
            self._keep_waiting([key], deadline)
            time.sleep(min(delay, deadline.remaining()))

    def _missing(self, keys, deadline):
        try:
            counts = self._execute([("EXISTS", key) for key in keys], deadline)
        except _Refused as err:
            raise StoreError(f"Redis at {self.url} refused EXISTS: {err}") from None
        return [key for key, count in zip(keys, counts) if not count]

    def _wait(self, keys, deadline):
        for delay in backoff_delays(POLL_FIRST_S, POLL_CAP_S):
            if not self._keep_waiting(self._missing(keys, deadline), deadline):
                return
            time.sleep(min(delay, deadline.remaining()))

    def _add(self, key, amount):
        self._remember(key)
        commands = [("INCRBY", key, amount)]
        if self.key_ttl:
            commands.append(("PEXPIRE", key, max(1, int(self.key_ttl * 1000))))
        try:
            replies = self._execute(commands, Deadline(self.timeout), idempotent=False)
        except _Refused as err:
            raise InvalidArgument(f"add() on key {key!r} in store {self.url}: Redis refused "
                                  f"INCRBY {amount}: {err} (the key must hold a decimal "
                                  f"counter within 64-bit range)") from None
        return int(replies[0])

    def _delete(self, key):
        try:
            (count,) = self._execute([("DEL", key)], Deadline(self.timeout))
        except _Refused as err:
            raise self._refused(err, "DEL", key) from None
        with self._written_lock:
            self._written.discard(key)
        return bool(count)

    def _check(self, keys):
        return not self._missing(keys, Deadline(self.timeout))

    def _close(self):
        with self._written_lock:
            written, self._written = sorted(self._written), set()
        deadline = Deadline(min(self.timeout, CLOSE_BUDGET_S))
        try:
            for start in range(0, len(written), DELETE_BATCH):
                batch = written[start:start + DELETE_BATCH]
                self._execute([("DEL", *batch)], deadline, closing=True)
        except (StoreError, Timeout, _Refused) as err:
            expiry = (f"they expire within {self.key_ttl:g} s" if self.key_ttl
                      else "they never expire (ttl=0)")
            logger.warning("redis store %s: could not delete %d key(s) this handle wrote; "
                           "%s: %s", self.url, len(written), expiry, err)
        finally:
            if self._io_lock.acquire(timeout=CLOSE_BUDGET_S):
                try:
                    self._disconnect()
                finally:
                    self._io_lock.release()
            elif self._sock is not None:
                # A thread is stuck in a reply: wake it; it sees the store closed.
                with contextlib.suppress(OSError):
                    self._sock.shutdown(socket.SHUT_RDWR)


def _socket_timeout(attempt):
    """What is left of ``attempt``, never 0 (which would make the socket non-blocking)."""
    return max(attempt.remaining(), 0.001)


def _parse_ttl(shown, query):
    """``?ttl=SECONDS`` of a redis:// URL (``shown``: the URL as messages show it)."""
    if not query:
        return DEFAULT_KEY_TTL_S
    names = [name for name, _ in query]
    if names != ["ttl"]:
        raise InvalidArgument(f"redis store URL {shown!r}: unknown query {names!r}; it takes "
                              f"?prefix=NAME and ?ttl=SECONDS only")
    try:
        ttl = float(query[0][1])
    except ValueError:
        ttl = -1.0
    if not 0 <= ttl <= MAX_KEY_TTL_S:       # nan too
        raise InvalidArgument(f"redis store URL {shown!r}: ttl must be a number of seconds "
                              f"from 0 (keys never expire) to {MAX_KEY_TTL_S}")
    return ttl


def parse_redis_url(url):
    """The keyword arguments of ``RedisStore`` that ``redis://...`` describes."""
    parts = parse_url(url)
    shown = redact(url)
    if parts.scheme.lower() != "redis":
        raise InvalidArgument(f"expected a redis:// URL, got {shown!r}")
    if parts.fragment:
        raise InvalidArgument(f"redis store URL {shown!r} takes no fragment")
    if not parts.hostname:
        raise InvalidArgument(f"redis store URL {shown!r} names no host: "
                              f"redis://[[user]:password@]host:port[/db] (percent-encode a '/', "
                              f"'?', '#' or '@' in the password: %2F, %3F, %23, %40)")
    try:
        port = parts.port
    except ValueError:
        port = 0
    if port == 0:
        raise InvalidArgument(f"redis store URL {shown!r} has an invalid port: give one from "
                              f"1 to 65535, or none for {DEFAULT_PORT}")
    path = parts.path.strip("/")
    if path and not (path.isascii() and path.isdigit()):
        raise InvalidArgument(f"redis store URL {shown!r}: the path must be a database number, "
                              f"as in redis://host:6379/2")
    password = None if parts.password is None else unquote(parts.password)
    username = unquote(parts.username) if parts.username else None
    return {"host": parts.hostname, "port": port or DEFAULT_PORT, "db": int(path or 0),
            "password": password,
            "username": username,
            "key_ttl": _parse_ttl(shown, parse_qsl(parts.query, keep_blank_values=True))}


def open_redis_store(url, *, timeout=None, rank=None, size=None):
    """Open ``redis://[[user:]password@]host[:port][/db][?ttl=SECONDS]``."""
    return RedisStore(timeout=timeout, **parse_redis_url(url))
