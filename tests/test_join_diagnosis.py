"""A job started wrong ends, on every rank, with the real cause: ranks missing, started twice,
with different sizes or different transports, and a store address where something else answers.

Real processes over the embedded TCP store (rank 0 hosts it) and real sockets; each scenario is
bounded in time, and the ones that can be seen early must be seen well before the deadline.
"""

import os
import socket
import subprocess
import sys
import threading
import time

import pytest

import pycollect as pc
from jobs import collect

JOIN_TIMEOUT = 8.0      # every rank's init timeout; "early" means well inside it
# Well before the deadline, with room for rank 0's 1.5 s linger and a loaded 2-core machine.
EARLY_S = JOIN_TIMEOUT * 0.75

RANK = """
import os, sys, time
import pycollect as pc
rank, size, url, timeout = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], float(sys.argv[4])
gate = sys.argv[5] if len(sys.argv) > 5 else None
for _ in range(2000):       # bounded: at most 20 s for the test to open the gate
    if gate is None or os.path.exists(gate):
        break
    time.sleep(0.01)
start = time.monotonic()
try:
    ctx = pc.init(rank=rank, size=size, store=url, timeout=timeout)
except pc.Error as exc:
    print("%s after %.2f s: %s" % (type(exc).__name__, time.monotonic() - start, exc))
    sys.exit(3)
ctx.barrier()
ctx.close()
print("ok")
"""


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(tmp_path, rank, size, url, timeout=JOIN_TIMEOUT, gate=None, transport=None):
    """Start a rank; with ``gate`` (a path), it imports pycollect, then waits for the file;
    ``transport``: its PYCOLLECT_TRANSPORT."""
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    env = {k: v for k, v in os.environ.items() if k != "PYCOLLECT_TRANSPORT"}
    if transport is not None:
        env["PYCOLLECT_TRANSPORT"] = transport
    return subprocess.Popen([sys.executable, str(script), str(rank), str(size), url,
                             str(timeout)] + ([str(gate)] if gate else []),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)


def _published_runs(url, count):
    """Wait (bounded) until rank 0 processes have published ``count`` different runs."""
    host, port = url[len("tcp://"):].rsplit(":", 1)
    seen = set()
    with pc.TCPStore(host, int(port), timeout=JOIN_TIMEOUT) as store:
        for _ in range(1000):       # bounded: 10 s
            if store.check(["pycollect/ctx0/run"]):
                seen.add(store.get("pycollect/ctx0/run", timeout=1))
            if len(seen) >= count:
                return
            time.sleep(0.01)
    raise AssertionError("saw runs %r, wanted %d" % (seen, count))


def _outcomes(procs):
    """Each process's (error name, seconds, message), all within the join timeout and a margin."""
    results = collect(procs, time.monotonic() + JOIN_TIMEOUT + 20)
    parsed = []
    for code, out in results:
        assert code == 3, (code, out)
        line = out.strip().splitlines()[-1]
        name, _, rest = line.partition(" after ")
        seconds, _, message = rest.partition(" s: ")
        parsed.append((name, float(seconds), message))
    return parsed


def test_a_rank_that_never_started_is_named_on_every_rank(tmp_path):
    url = "tcp://127.0.0.1:%d" % _free_port()
    procs = [_start(tmp_path, 0, 3, url)]
    time.sleep(0.3)          # rank 0 hosts the store
    procs.append(_start(tmp_path, 1, 3, url))
    for rank, (name, seconds, message) in enumerate(_outcomes(procs)):
        assert name == "Timeout", message
        assert "rank(s) 2 never joined (joined: 0, 1)" in message, message
        assert message.startswith("rank %d:" % rank), message
        assert seconds < JOIN_TIMEOUT + 3, seconds


@pytest.mark.parametrize("sizes, other", [((2, 3), 1), ((3, 2), 1), ((2, 3), 2)])
def test_ranks_started_with_different_sizes_say_so_at_once(tmp_path, sizes, other):
    """Rank 0 first (it hosts the store), then rank ``other``; rank 2 of size 3 is beyond the
    size-2 rank 0's ranks."""
    url = "tcp://127.0.0.1:%d" % _free_port()
    procs = [_start(tmp_path, 0, sizes[0], url)]
    time.sleep(0.3)
    procs.append(_start(tmp_path, other, sizes[1], url))
    for name, seconds, message in _outcomes(procs):
        assert name == "MismatchError", message
        assert ("started with different sizes: rank 0 with size %d, rank %d"
                % (sizes[0], other)) in message and \
            message.endswith("with size %d" % sizes[1]), message
        assert seconds < EARLY_S, (seconds, message)


@pytest.mark.parametrize("sizes", [(2, 3), (3, 2)])
def test_a_rank_of_another_size_that_came_first_is_named_at_once(tmp_path, sizes):
    """Rank 1 starts first (a file store), answers rank 0's run of another size once it
    appears, and rank 0 names both sizes on both ranks at once."""
    url = "file://%s" % (tmp_path / "rdv")
    procs = [_start(tmp_path, 1, sizes[1], url)]
    time.sleep(0.5)
    procs.append(_start(tmp_path, 0, sizes[0], url))
    for name, seconds, message in _outcomes(procs):
        assert name == "MismatchError", message
        assert ("started with different sizes: rank 0 with size %d, rank 1" % sizes[0]) \
            in message and message.endswith("with size %d" % sizes[1]), message
        assert seconds < EARLY_S, (seconds, message)


@pytest.mark.parametrize("transports", [("auto", "tcp"), ("tcp", "shm"), ("shm", "auto"),
                                        ("tcp", "tcp", "auto")])
def test_ranks_started_with_different_transports_say_so_at_once(tmp_path, transports):
    """Every rank names every rank's transport before connecting, also where rank 0 hosts the
    store (it stays up until the others have read the addresses)."""
    url = "tcp://127.0.0.1:%d" % _free_port()
    size = len(transports)
    procs = [_start(tmp_path, 0, size, url, transport=transports[0])]
    time.sleep(0.3)
    procs += [_start(tmp_path, rank, size, url, transport=transports[rank])
              for rank in range(1, size)]
    names = {}
    for rank, name in enumerate(transports):
        names.setdefault(name, []).append(rank)
    expected = "; ".join("rank(s) %s with %r" % (", ".join(map(str, ranks)), name)
                         for name, ranks in names.items())
    for rank, (name, seconds, message) in enumerate(_outcomes(procs)):
        assert name == "MismatchError", message
        assert message == ("rank %d: the ranks were started with different transports: %s; "
                           "start every rank with the same one (init(transport=...) or "
                           "PYCOLLECT_TRANSPORT)" % (rank, expected)), message
        assert seconds < EARLY_S, (seconds, message)


def test_two_processes_started_as_rank_zero_are_named_on_both(tmp_path):
    """Both rank 0s publish a run before rank 1 comes (gates order the starts)."""
    url = "tcp://127.0.0.1:%d" % _free_port()
    second, third = tmp_path / "second", tmp_path / "third"
    procs = [_start(tmp_path, 0, 2, url), _start(tmp_path, 0, 2, url, gate=second),
             _start(tmp_path, 1, 2, url, gate=third)]
    _published_runs(url, 1)
    second.touch()
    _published_runs(url, 2)
    third.touch()
    outcomes = _outcomes(procs)
    for name, seconds, message in outcomes:
        assert name == "MismatchError", message
        assert "two processes were started as rank 0" in message, message
        assert seconds < EARLY_S, (seconds, message)


def test_a_rank_started_twice_is_named_on_every_rank(tmp_path):
    url = "tcp://127.0.0.1:%d" % _free_port()
    procs = [_start(tmp_path, 0, 3, url)]
    time.sleep(0.3)
    procs += [_start(tmp_path, 1, 3, url), _start(tmp_path, 1, 3, url)]
    time.sleep(1.0)
    procs.append(_start(tmp_path, 2, 3, url))
    for name, seconds, message in _outcomes(procs):
        assert name == "MismatchError", message
        assert "rank 1 was started twice" in message, message
        assert seconds < EARLY_S, (seconds, message)


class _LineServer:
    """Something that is not a pycollect store: answers every line with an error, as Redis's
    inline protocol does, or (``silent``) accepts connections and never answers."""

    def __init__(self, silent):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.silent, self.clients = silent, []
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        for _ in range(1000):       # bounded: each turn accepts one client
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.clients.append(conn)
            if not self.silent:
                threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    @staticmethod
    def _answer(conn):
        data = b""
        conn.settimeout(10)
        try:
            while b"\n" not in data:
                chunk = conn.recv(4096)
                if not chunk:
                    return
                data += chunk
            conn.sendall(b"-ERR unknown command\r\n")
        except OSError:
            pass

    def close(self):
        self.sock.close()
        for conn in self.clients:
            conn.close()


@pytest.mark.parametrize("silent, words", [
    (False, "something other than a pycollect TCP store answers at 127.0.0.1:%d: it replied "
            "b'-ERR unknown command"),
    (True, "127.0.0.1:%d accepts connections but did not answer a pycollect TCP store's "
           "greeting"),
])
@pytest.mark.parametrize("rank", [0, 1])
def test_a_store_address_where_something_else_answers_is_named(silent, words, rank):
    server = _LineServer(silent)
    try:
        start = time.monotonic()
        with pytest.raises(pc.StoreError) as info:
            pc.init(rank=rank, size=2, store="tcp://127.0.0.1:%d" % server.port, timeout=3)
        elapsed = time.monotonic() - start
    finally:
        server.close()
    assert words % server.port in str(info.value)
    assert elapsed < (1.0 if not silent else 3.0 + 1.0), elapsed
