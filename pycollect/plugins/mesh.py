"""The rendezvous mesh: listener, address exchange, full mesh of sockets, hello.

Each rank binds a listener on the chosen interface, publishes its address and
host identity under the context's prefix, connects to every lower rank and
accepts every higher one.  A connection proves itself with a hello that
carries the run's random token (rank 0 creates it and shares it through the
store), both ranks and the context id; anything else that reaches the
listener (a port scanner, garbage, a rank of another run) is logged and
dropped while the job goes on.  All of it runs under one deadline.

Each rank's record also names its transport (``transport=``, what the factory
that calls ``connect_mesh`` is registered as), so that ranks started with
different transports refuse the run before connecting, every rank alike.
Before a rank raises such a refusal of the table (transports, TLS, host
identities) it waits, briefly, until every rank has read the table: a store
that its process hosts stays up until the others have what they need to say
the same.

A transport that encrypts its pairs passes a hook (``tls=``) that wraps each
socket right after the TCP connect, before the hello, so the token never
crosses a link between ranks in clear (it does pass through the store, whose
own traffic may be plain).  The mesh hands back plain file descriptors;
the transport factories (transports/) build their transport over them.
"""

import errno
import hashlib
import hmac
import json
import logging
import os
import secrets
import select
import selectors
import socket
import struct
import time

from ..errors import Error, InvalidArgument, MismatchError, PeerError, StoreError, Timeout
from . import hosts
from .interfaces import choose_address

__all__ = ["ACK", "HELLO", "Joined", "Mesh", "connect_mesh", "forget", "format_addr", "tune"]

log = logging.getLogger("pycollect.tcp")

HELLO = struct.Struct("<4sHHii32s32s")     # magic, version, flags, from, to, context, token
HELLO_MAGIC = b"PCH1"
ACK = struct.Struct("<4si")
ACK_MAGIC = b"PCA1"
VERSION = 1
SOCKET_BUFFER_BYTES = 4 << 20
# An incoming connection without a complete hello this long after its accept is dropped (a
# stranger holds no socket for long); a rank that stalled that long connects again.
STRANGER_GRACE_S = 5.0
# How long a dropped connection is drained, its sending side shut, before it is closed:
# closing with the caller's bytes unread resets it, and the reset discards what was sent
# last (the TLS alert that says why the caller was refused).
DRAIN_S = 0.3
# How long a rank that refuses the address table waits for every rank to have read it.
REFUSAL_LINGER_S = 5.0


class _NoTls(Exception):
    """Stands for the TLS error class where no pair is wrapped."""


def format_addr(host, port):
    return "[%s]:%d" % (host, port) if ":" in host else "%s:%d" % (host, port)


def tune(sock):
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER_BYTES)
        except OSError:
            pass


class Mesh:
    """One rank's side of the full-mesh setup, driven by a selector."""

    def __init__(self, rank, size, token, context, deadline, tls=None):
        """``tls``: None, or the hook that wraps every socket before the hello (``TlsHook``
        of transports/tls.py: ``stream(sock, server)`` and the exception class ``error``)."""
        self.rank = rank
        self.size = size
        self.token = token
        self.context = context
        self.deadline = deadline
        self.socks = [None] * size
        self.sel = selectors.DefaultSelector()
        self.tls = tls                      # wraps every pair before the hello, or None
        self.tls_error = _NoTls if tls is None else tls.error
        self.streams = [None] * size        # ... and each pair's TlsStream
        self.addrs = None
        self.dropped = []                   # why strangers were dropped, for a timeout

    def remaining(self):
        return self.deadline - time.monotonic()

    def hello(self, peer):
        return HELLO.pack(HELLO_MAGIC, VERSION, 0, self.rank, peer, self.context, self.token)

    def run(self, listener, addrs):
        """Connect to lower ranks, accept higher ones, return one socket per peer."""
        listener.setblocking(False)
        self.addrs = addrs
        self.sel.register(listener, selectors.EVENT_READ, ("listen", None))
        for peer in range(self.rank):
            self._start_connect(peer, addrs[peer])
        try:
            while any(self.socks[p] is None for p in range(self.size) if p != self.rank):
                left = self.remaining()
                if left <= 0:
                    missing = [p for p in range(self.size)
                               if p != self.rank and self.socks[p] is None]
                    raise Timeout("rank %d: connecting the TCP mesh timed out; no connection "
                                  "with rank(s) %s (%s)%s" % (self.rank, missing, ", ".join(
                                      format_addr(addrs[p]["host"], addrs[p]["port"])
                                      for p in missing), "; dropped meanwhile: " + "; ".join(
                                          self.dropped[-3:]) if self.dropped else ""))
                for key, events in self.sel.select(timeout=min(left, 0.5)):
                    kind, state = key.data
                    if kind == "listen":
                        self._accept(listener)
                    elif kind == "connect":
                        self._on_connect(key.fileobj, state, addrs)
                    elif kind == "draining":
                        self._drain(key.fileobj)
                    else:
                        self._on_incoming(key.fileobj, state)
                self._expire_strangers()
        finally:
            for key in list(self.sel.get_map().values()):
                if key.data[0] in ("incoming", "draining"):
                    key.fileobj.close()
            self.sel.close()
        return self.socks

    # outgoing: connect, send hello, read the ack
    def _start_connect(self, peer, addr, state=None):
        host, port = addr["host"], addr["port"]
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setblocking(False)
        err = sock.connect_ex((host, port))
        if err not in (0, errno.EINPROGRESS):
            sock.close()
            raise PeerError("rank %d: cannot connect to rank %d at %s: %s"
                            % (self.rank, peer, format_addr(host, port), os.strerror(err)))
        state = state or {"peer": peer, "tries": 0}
        state.update(stage="connecting", buf=b"", sent=0, since=time.monotonic())
        state.pop("stream", None)
        self.sel.register(sock, selectors.EVENT_WRITE, ("connect", state))

    def _on_connect(self, sock, state, addrs):
        peer = state["peer"]
        if state["stage"] == "connecting":
            err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if err:
                self.sel.unregister(sock)
                sock.close()
                if err in (errno.ECONNREFUSED, errno.ECONNRESET) and self.remaining() > 0:
                    state["tries"] += 1
                    time.sleep(min(0.05 * state["tries"], 0.5, max(self.remaining(), 0)))
                    self._start_connect(peer, addrs[peer], state)
                    return
                raise PeerError("rank %d: cannot connect to rank %d at %s: %s" % (
                    self.rank, peer, format_addr(addrs[peer]["host"], addrs[peer]["port"]),
                    os.strerror(err)))
            if self.tls is not None:
                state["stage"] = "tls"
                state["stream"] = self.tls.stream(sock, server=False)
        if state["stage"] == "tls":
            if not self._connect_tls(sock, state, addrs):
                return
        if state["stage"] in ("connecting", "tls"):
            try:
                self._send_small(sock, state.get("stream"), self.hello(peer), addrs, peer)
            except (OSError, PeerError) as exc:
                if self._connect_again(sock, state, addrs, exc):
                    return
                if isinstance(exc, PeerError):
                    raise
                raise PeerError("rank %d: cannot send the hello to rank %d at %s: %s" % (
                    self.rank, peer, format_addr(addrs[peer]["host"], addrs[peer]["port"]),
                    exc)) from None
            state["stage"] = "ack"
            self.sel.modify(sock, selectors.EVENT_READ, ("connect", state))
            return
        try:
            data = _recv(sock, state.get("stream"), ACK.size - len(state["buf"]))
            if data is None:
                return
        except (BlockingIOError, InterruptedError):
            return
        except self.tls_error as exc:
            if self._connect_again(sock, state, addrs, exc):
                return
            raise self._refused(peer, addrs, exc)
        except OSError as exc:
            data = b""
            state["error"] = exc
        if not data and self._connect_again(sock, state, addrs, state.get("error")
                                            or "closed"):
            return
        if not data and state.get("stream") is not None:
            raise self._refused(peer, addrs, "it closed the connection after the hello (does "
                                "this rank's certificate name its address or host name?)")
        if not data:
            raise PeerError("rank %d: rank %d at %s refused the handshake (closed the "
                            "connection); is it another run, or a rank with another token?"
                            % (self.rank, peer, format_addr(addrs[peer]["host"],
                                                             addrs[peer]["port"])))
        state["buf"] += data
        if len(state["buf"]) == ACK.size:
            magic, their_rank = ACK.unpack(state["buf"])
            if magic != ACK_MAGIC or their_rank != peer:
                raise PeerError("rank %d: the process at %s answered as rank %d, not rank %d"
                                % (self.rank, format_addr(addrs[peer]["host"],
                                                            addrs[peer]["port"]),
                                   their_rank, peer))
            self.sel.unregister(sock)
            self.socks[peer] = sock

    def _connect_again(self, sock, state, addrs, why):
        """Connect to the peer again, and say True, where it dropped this connection before
        its ack as a stranger's: after this rank took over ``STRANGER_GRACE_S`` since the
        connect (a stall: a stopped process, swapping, a debugger) and within the deadline.
        A refusal that comes sooner is the peer's answer, which the caller raises."""
        peer = state["peer"]
        took = time.monotonic() - state["since"]
        if took <= STRANGER_GRACE_S or self.remaining() <= 0:
            return False
        log.warning("rank %d: rank %d at %s dropped this rank's connection (%s) %.1f s after "
                    "the connect, past the %g s it gives a hello; connecting again", self.rank,
                    peer, format_addr(addrs[peer]["host"], addrs[peer]["port"]), why, took,
                    STRANGER_GRACE_S)
        self.sel.unregister(sock)
        sock.close()
        self._start_connect(peer, addrs[peer], state)
        return True

    def _connect_tls(self, sock, state, addrs):
        """Drive the client side of the TLS handshake; True once done and the peer checked."""
        peer = state["peer"]
        where = format_addr(addrs[peer]["host"], addrs[peer]["port"])
        try:
            wants = state["stream"].handshake()
        except self.tls_error as exc:
            if self._connect_again(sock, state, addrs, exc):
                return False
            raise PeerError("rank %d: TLS handshake with rank %d at %s failed: %s%s" % (
                self.rank, peer, where, exc, "" if addrs[peer].get("tls") else
                " (that rank runs without TLS)"))
        if wants:
            self.sel.modify(sock, selectors.EVENT_READ if wants == "read"
                            else selectors.EVENT_WRITE, ("connect", state))
            return False
        names = _peer_names(addrs[peer])
        if not state["stream"].peer_matches(names):
            raise PeerError("rank %d: the TLS certificate of rank %d at %s (%s) names neither "
                            "%s; it must name the address the rank listens on or its host name"
                            % (self.rank, peer, where, state["stream"].peer_subject(),
                               " nor ".join(names)))
        self.streams[peer] = state["stream"]
        return True

    def _refused(self, peer, addrs, exc):
        return PeerError("rank %d: rank %d at %s refused this rank's TLS certificate or "
                         "dropped the connection: %s" % (
                             self.rank, peer,
                             format_addr(addrs[peer]["host"], addrs[peer]["port"]), exc))

    def _send_small(self, sock, stream, data, addrs, peer):
        """Send a handshake message (a few bytes) to ``peer`` within the deadline."""
        if stream is None:
            sock.sendall(data)      # into an empty socket buffer
            return
        while data:
            try:
                n = stream.send(data)
            except self.tls_error as exc:
                raise self._refused(peer, addrs, exc)
            data = data[n:]
            if data:
                if self.remaining() <= 0:
                    raise Timeout("rank %d: the TLS handshake timed out" % self.rank)
                select.select([], [sock], [], min(self.remaining(), 0.5))

    # incoming: accept, read and check the hello, send the ack
    def _accept(self, listener):
        for _ in range(64):
            try:
                sock, addr = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            sock.setblocking(False)
            state = {"buf": b"", "addr": addr, "since": time.monotonic()}
            if self.tls is not None:
                state["stream"] = self.tls.stream(sock, server=True)
            self.sel.register(sock, selectors.EVENT_READ, ("incoming", state))

    def _drop(self, sock, state, why):
        self.dropped.append("%s (%s)" % (format_addr(state["addr"][0], state["addr"][1]), why))
        log.warning("rank %d: dropped a connection from %s: %s", self.rank,
                    format_addr(state["addr"][0], state["addr"][1]), why)
        try:
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            self._close(sock)
            return
        # Closed once the caller closes, or after DRAIN_S (never past the deadline).
        state["drain_until"] = time.monotonic() + min(DRAIN_S, max(self.remaining(), 0))
        self.sel.modify(sock, selectors.EVENT_READ, ("draining", state))

    def _drain(self, sock):
        """Read and discard what a dropped connection sends; close it at its end."""
        try:
            if sock.recv(65536):
                return      # one read per wakeup: a flood cannot hold the loop
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            pass
        self._close(sock)

    def _close(self, sock):
        self.sel.unregister(sock)
        sock.close()

    def _on_incoming(self, sock, state):
        stream = state.get("stream")
        if stream is not None and not state.get("secure"):
            try:
                wants = stream.handshake()
            except self.tls_error as exc:
                return self._drop(sock, state, "TLS handshake failed: %s" % exc)
            if wants:
                self.sel.modify(sock, selectors.EVENT_READ if wants == "read"
                                else selectors.EVENT_WRITE, ("incoming", state))
                return
            state["secure"] = True
            self.sel.modify(sock, selectors.EVENT_READ, ("incoming", state))
        try:
            data = _recv(sock, stream, HELLO.size - len(state["buf"]))
            if data is None:
                return
        except (BlockingIOError, InterruptedError):
            return
        except self.tls_error as exc:
            return self._drop(sock, state, "TLS failed: %s" % exc)
        except OSError as exc:
            return self._drop(sock, state, "receive failed: %s" % exc)
        if not data:
            return self._drop(sock, state, "closed before completing the handshake")
        state["buf"] += data
        if len(state["buf"]) < HELLO.size:
            return
        magic, version, _, src, dst, context, token = HELLO.unpack(state["buf"])
        if magic != HELLO_MAGIC:
            return self._drop(sock, state, "not a pycollect hello")
        if version != VERSION:
            return self._drop(sock, state, "protocol version %d, expected %d" % (version, VERSION))
        if not hmac.compare_digest(token, self.token):
            return self._drop(sock, state, "wrong run token")
        if context != self.context:
            return self._drop(sock, state, "hello for another context")
        if dst != self.rank or not self.rank < src < self.size:
            return self._drop(sock, state, "claims to be rank %d calling rank %d" % (src, dst))
        if self.socks[src] is not None:
            return self._drop(sock, state, "rank %d is already connected" % src)
        if stream is not None and not stream.peer_matches(_peer_names(self.addrs[src])):
            return self._drop(sock, state, "its TLS certificate (%s) names neither %s, the "
                              "address and host name of rank %d" % (
                                  stream.peer_subject(),
                                  " nor ".join(_peer_names(self.addrs[src])), src))
        self.sel.unregister(sock)
        if stream is None:
            sock.setblocking(True)
            sock.settimeout(max(self.remaining(), 0.001))
        self._send_small(sock, stream, ACK.pack(ACK_MAGIC, self.rank), self.addrs, src)
        self.socks[src] = sock
        self.streams[src] = stream

    def _expire_strangers(self):
        now = time.monotonic()
        for key in list(self.sel.get_map().values()):
            kind, state = key.data
            if kind == "incoming" and now - state["since"] > STRANGER_GRACE_S:
                self._drop(key.fileobj, state, "no hello within %g s" % STRANGER_GRACE_S)
            elif kind == "draining" and now > state["drain_until"]:
                self._close(key.fileobj)


class Joined:
    """What the mesh leaves a transport factory: one fd per peer and what every rank published."""

    def __init__(self, fds, addrs, token, context, streams, deadline):
        self.fds = fds              # one connected socket's fd per peer, -1 for this rank
        self.addrs = addrs          # every rank's published record (host, port, hostid, ...)
        self.token = token          # the run's secret (32 bytes)
        self.context = context      # sha256 of the context id
        self.streams = streams      # each pair's TLS stream, where the tls hook wrapped it
        self.deadline = deadline    # time.monotonic() deadline of the whole rendezvous


def connect_mesh(rank, size, store, *, deadline, interface=None, context_id="", tls=None,
                 transport=None):
    """Listen, publish this rank's address, connect the full mesh; return a ``Joined``.

    ``deadline`` is a ``time.monotonic()`` value that bounds all of it; ``tls``
    wraps every socket before the hello (``Mesh``); ``transport`` is the name of
    the transport this rank was started with, which every rank must share
    (``MismatchError`` naming each rank's otherwise).
    """
    host, why = choose_address(interface, store)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.bind((host, 0))
    except OSError as exc:
        listener.close()
        raise InvalidArgument("rank %d: cannot listen on %s (%s): %s" % (rank, host, why, exc))
    listener.listen(max(size, 16))
    port = listener.getsockname()[1]
    log.debug("rank %d: listening on %s (%s)", rank, format_addr(host, port), why)
    machine = hosts.machine_identity()
    me = {"host": host, "port": port, "hostid": hosts.host_identity(machine), "machine": machine,
          "boot": hosts.boot_id(), "pid": os.getpid(), "cpus": hosts.cpu_list(),
          "transport": transport}
    if tls is not None:
        me["tls"] = {"name": socket.gethostname()}
    try:
        if rank == 0:
            token = secrets.token_bytes(32)
            store.set("tcp/token", token)
        store.set("tcp/addr/%d" % rank, json.dumps(me).encode())
        if size > 1 and rank > 0:
            token = store.get("tcp/token", timeout=max(deadline - time.monotonic(), 0.001))
        addrs = []
        for peer in range(size):
            if peer == rank:
                addrs.append(me)
            else:
                raw = store.get("tcp/addr/%d" % peer,
                                timeout=max(deadline - time.monotonic(), 0.001))
                addrs.append(json.loads(raw.decode()))
        try:    # every rank reads the same table, so each refuses it alike
            hosts.check_host_table(rank, addrs)
            _check_same_security(rank, addrs)
            _check_same_transport(rank, addrs)
        except Error:
            _read_by_all(store, rank, size, deadline)
            raise
        context = hashlib.sha256(context_id.encode()).digest()
        mesh = Mesh(rank, size, token, context, deadline, tls=tls)
        socks = mesh.run(listener, addrs)
    finally:
        listener.close()
    fds = []
    for sock in socks:
        if sock is None:
            fds.append(-1)
            continue
        tune(sock)
        fds.append(sock.detach())
    # Everyone has read every address once the mesh stands: leave the store clean
    # (best effort: a store hosted by a rank that already finished may be gone).
    forget(store, ["tcp/addr/%d" % rank] + (["tcp/token"] if rank == 0 else []))
    return Joined(fds, addrs, token, context, mesh.streams, deadline)


def forget(store, keys):
    """Delete rendezvous keys nobody needs any more, if the store is still there."""
    try:
        for key in keys:
            store.delete(key)
    except StoreError as exc:
        log.debug("rendezvous keys left in the store: %s", exc)


def _check_same_security(rank, addrs):
    """Refuse a run whose ranks disagree on TLS, naming the ranks on the other side."""
    mine = bool(addrs[rank].get("tls"))
    others = [p for p, a in enumerate(addrs) if bool(a.get("tls")) != mine]
    if others:
        raise PeerError("rank %d: rank(s) %s run %s TLS but this rank runs %s it; every rank "
                        "must use transport 'tcp+tls' or none" % (
                            rank, others, "without" if mine else "with",
                            "with" if mine else "without"))


def _check_same_transport(rank, addrs):
    """Refuse a run whose ranks were started with different transports, naming each one's."""
    names = {}
    for peer, addr in enumerate(addrs):
        names.setdefault(addr.get("transport"), []).append(peer)
    if len(names) > 1:
        raise MismatchError(
            "rank %d: the ranks were started with different transports: %s; start every rank "
            "with the same one (init(transport=...) or PYCOLLECT_TRANSPORT)" % (rank, "; ".join(
                "rank(s) %s with %s" % (", ".join(map(str, peers)),
                                        "%r" % name if name is not None else
                                        "a transport that does not name itself (a plugin's)")
                for name, peers in names.items())))


def _read_by_all(store, rank, size, deadline):
    """Before this rank refuses the table: wait (at most ``REFUSAL_LINGER_S``, within the
    deadline) until every rank has read it, each of which refuses it too; best effort."""
    try:
        store.set("tcp/refused/%d" % rank, b"")
        store.wait(["tcp/refused/%d" % peer for peer in range(size)],
                   timeout=max(min(deadline - time.monotonic(), REFUSAL_LINGER_S), 0.001))
    except (StoreError, Timeout) as exc:
        log.debug("rank %d: not every rank read the address table: %s", rank, exc)


def _peer_names(addr):
    """The names a peer's certificate may carry: its listening address, its host name."""
    return [n for n in (addr["host"], (addr.get("tls") or {}).get("name")) if n]


def _recv(sock, stream, n):
    """Up to ``n`` handshake bytes: b"" at the end of the stream, None when none are there."""
    if stream is None:
        return sock.recv(n)
    return stream.recv(n)
