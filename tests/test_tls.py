"""Transport "tcp+tls": collectives over TLS, and every way a peer is refused without a hang."""

import logging
import os
import socket
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

pytest.importorskip("pycollect._ext._tls", reason="built only where OpenSSL's headers exist")

import pycollect as pc                                          # noqa: E402
from group import outcomes, run_ranks                           # noqa: E402
from pycollect.context import ALLREDUCE_ALGORITHMS             # noqa: E402
from pycollect.plugins.mesh import Mesh                        # noqa: E402
from pycollect.plugins.transports.tls import TlsHook, load_tls  # noqa: E402
from tls_certs import MISSING, Authority                        # noqa: E402

if MISSING:
    pytest.skip("cannot make test certificates: " + MISSING, allow_module_level=True)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Refusals must end well inside this: a rank that waits for a peer that never
# comes fails at its own deadline, the refused rank at once.
REFUSAL_TIMEOUT_S = 3.0

_stores = iter(range(1 << 30))


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A CA, four rank certificates for 127.0.0.1, and a second, unrelated CA."""
    directory = str(tmp_path_factory.mktemp("pki"))
    ca = Authority(directory)
    return {"ca": ca, "dir": directory, "other": Authority(directory, "another CA"),
            "certs": [ca.issue("rank%d" % r) for r in range(4)]}


def _tls(pki, rank, cert=None, ca=None):
    cert_file, key_file = cert or pki["certs"][rank]
    return {"transport": "tcp+tls", "tls_cert": cert_file, "tls_key": key_file,
            "tls_ca": ca or pki["ca"].ca_file}


def _store():
    return "hash://tls-%d" % next(_stores)


@pytest.fixture(scope="module")
def tls_group(pki):
    size = 3
    store = _store()
    contexts = run_ranks(size, lambda r: pc.init(rank=r, size=size, store=store, timeout=30,
                                                 segment_bytes=4096, **_tls(pki, r)))
    yield contexts
    for ctx in contexts:
        ctx.close()


def _on_all(contexts, fn):
    return run_ranks(len(contexts), lambda r: fn(contexts[r]), timeout=60)


def test_every_pair_is_tls(tls_group):
    """Also between ranks of one host: no shared memory, and auto never takes "direct"."""
    for rank, ctx in enumerate(tls_group):
        assert ctx._transport.pair_kinds() == ["self" if p == rank else "tcp" for p in range(3)]
        assert ctx._transport.tls_pairs() == [p != rank for p in range(3)]


@pytest.mark.parametrize("algorithm", [a for a in ALLREDUCE_ALGORITHMS if a != "hierarchical"])
@pytest.mark.parametrize("count", [1, 1000, 70001])
def test_allreduce_every_algorithm(tls_group, algorithm, count):
    size = len(tls_group)
    inputs = [np.arange(count, dtype=np.float64) * (r + 1) for r in range(size)]
    results = _on_all(tls_group, lambda c: c.allreduce(inputs[c.rank].copy(),
                                                       algorithm=algorithm))
    expected = np.arange(count, dtype=np.float64) * (size * (size + 1) // 2)
    for got in results:
        np.testing.assert_array_equal(got, expected)


def test_broadcast_allgather_and_send_recv(tls_group):
    size = len(tls_group)
    root_data = np.random.default_rng(7).integers(0, 255, 100003, dtype=np.uint8)

    def job(ctx):
        buf = root_data.copy() if ctx.rank == 1 else np.zeros_like(root_data)
        ctx.broadcast(buf, root=1)
        gathered = np.zeros(size * 5, np.int32)
        ctx.allgather(np.full(5, ctx.rank + 10, np.int32), gathered)
        right, left = (ctx.rank + 1) % size, (ctx.rank - 1) % size
        got = np.zeros(3, np.int64)
        if ctx.rank % 2 == 0:
            ctx.send(np.full(3, ctx.rank, np.int64), right, tag=5)
            ctx.recv(got, left, tag=5)
        else:
            ctx.recv(got, left, tag=5)
            ctx.send(np.full(3, ctx.rank, np.int64), right, tag=5)
        return buf, gathered, got

    for rank, (buf, gathered, got) in enumerate(_on_all(tls_group, job)):
        np.testing.assert_array_equal(buf, root_data)
        np.testing.assert_array_equal(gathered, np.repeat(np.arange(size) + 10, 5))
        np.testing.assert_array_equal(got, np.full(3, (rank - 1) % size))


def test_a_sub_group_runs_over_the_same_tls_pairs(tls_group):
    def job(ctx):
        group = ctx.new_group([0, 2])
        if group is None:
            return None
        return group.allreduce(np.full(1000, ctx.rank + 1, np.int64))

    results = _on_all(tls_group, job)
    assert results[1] is None
    for rank in (0, 2):
        np.testing.assert_array_equal(results[rank], np.full(1000, 4))


def test_large_message(tls_group):
    """6 MiB per rank: many TLS records per message, partial writes, full socket buffers."""
    size = len(tls_group)
    n = (6 << 20) // 4
    results = _on_all(tls_group, lambda c: c.allreduce(
        np.full(n, c.rank + 1, np.float32), algorithm="ring_chunked"))
    for got in results:
        assert got.shape == (n,) and np.all(got == size * (size + 1) / 2)


def test_messages_that_wait_inside_openssl(tls_group):
    """A peer far ahead: its messages sit decrypted in OpenSSL, where poll() cannot see them."""
    sizes = [10, 100000, 1, 3 << 20, 7]
    sent = [np.random.default_rng(n).integers(0, 255, n, dtype=np.uint8) for n in sizes]

    def job(ctx):
        if ctx.rank == 1:
            for msg in sent:
                ctx.send(msg, 0, tag=9, async_op=True)
            ctx.barrier()
            return None
        if ctx.rank == 0:
            time.sleep(0.3)     # everything is on the wire or in OpenSSL's buffers by now
            got = []
            for msg in sent:
                buf = np.zeros_like(msg)
                ctx.recv(buf, 1, tag=9)
                got.append(buf)
        ctx.barrier()
        return got if ctx.rank == 0 else None

    for want, got in zip(sent, _on_all(tls_group, job)[0]):
        np.testing.assert_array_equal(got, want)


def _fresh_pair(pki):
    store = _store()
    return run_ranks(2, lambda r: pc.init(rank=r, size=2, store=store, timeout=20,
                                          **_tls(pki, r)))


def test_async_calls_of_two_ranks_begin_their_exchange_over_tls(pki):
    """At 2 ranks an async allreduce and barrier send their message in the call
    (tests/test_posted_exchange.py checks that they do); over TLS too, every value
    arrives, beside a blocking call."""
    contexts = _fresh_pair(pki)
    try:
        def job(r):
            ctx = contexts[r]
            works = [ctx.allreduce(np.full(300, r + 1.0 + i), async_op=True) for i in range(5)]
            works.append(ctx.barrier(async_op=True))
            blocking = ctx.allreduce(np.full(3, 10.0))
            return ([w.wait(timeout=20)[0] for w in works[:5]], works[0].algorithm,
                    works[5].wait(timeout=20), blocking.tolist())

        assert run_ranks(2, job) == [([3.0 + 2 * i for i in range(5)], "recursive_doubling",
                                      None, [20.0] * 3)] * 2
    finally:
        for ctx in contexts:
            ctx.close()


def test_disagreeing_ranks_fail_over_tls(pki):
    """The abort frame crosses TLS: both ranks name the disagreement, at once."""
    contexts = _fresh_pair(pki)
    try:
        start = time.monotonic()
        results = outcomes(2, lambda r: contexts[r].allreduce(np.ones(10 + 10 * r)), timeout=30)
        assert time.monotonic() - start < 5
        assert all(isinstance(x, pc.MismatchError) for x in results), results
    finally:
        for ctx in contexts:
            ctx.close()


def test_a_peer_that_leaves_is_named_over_tls(pki):
    contexts = _fresh_pair(pki)
    try:
        contexts[1].close()
        start = time.monotonic()
        with pytest.raises(pc.PeerError, match=r"rank 0: allreduce.* #1 failed: rank 1 "
                           r"\(127.0.0.1:\d+\) (closed its connection|connection lost)"):
            contexts[0].allreduce(np.ones(1 << 20))
        assert time.monotonic() - start < 5
    finally:
        contexts[0].close()


def test_processes_take_the_settings_from_the_environment(pki, tmp_path):
    """Two processes, TLS files from PYCOLLECT_TLS_*, over a file store."""
    script = textwrap.dedent("""
        import numpy as np, pycollect as pc
        with pc.init(transport="tcp+tls", timeout=20) as ctx:
            got = ctx.allreduce(np.full(300000, ctx.rank + 1.0))
            assert ctx._transport.tls_pairs()[1 - ctx.rank]
            assert np.all(got == 3.0), got[:4]
            print("rank", ctx.rank, "ok")
    """)
    procs = _start_tls_ranks(script, pki, tmp_path)
    for rank, proc in enumerate(procs):
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err.decode()
        assert out.decode().strip() == "rank %d ok" % rank


def _start_tls_ranks(script, pki, tmp_path):
    """Two processes running ``script``, TLS files from PYCOLLECT_TLS_*, over a file store."""
    procs = []
    for rank in range(2):
        cert, key = pki["certs"][rank]
        env = dict(os.environ, PYCOLLECT_RANK=str(rank), PYCOLLECT_SIZE="2",
                   PYCOLLECT_STORE="file://%s" % (tmp_path / "store"),
                   PYCOLLECT_TLS_CERT=cert, PYCOLLECT_TLS_KEY=key,
                   PYCOLLECT_TLS_CA=pki["ca"].ca_file,
                   PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
        procs.append(subprocess.Popen([sys.executable, "-c", script], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    return procs


def test_a_killed_rank_is_named_over_tls(pki, tmp_path):
    """SIGKILL in the middle of large allreduces: the survivor's PeerError names the dead rank
    within seconds, far inside its 30 s deadline."""
    script = textwrap.dedent("""
        import os, signal, sys, time
        import numpy as np, pycollect as pc
        with pc.init(transport="tcp+tls", timeout=30) as ctx:
            buf = np.ones(1 << 20, np.float32)
            for i in range(1000):
                if ctx.rank == 1 and i == 3:
                    os.kill(os.getpid(), signal.SIGKILL)
                t0 = time.monotonic()
                try:
                    ctx.allreduce(buf)
                except pc.PeerError as exc:
                    print("%.2f %s" % (time.monotonic() - t0, exc))
                    sys.exit(0)
            sys.exit("no error")
    """)
    procs = _start_tls_ranks(script, pki, tmp_path)
    out, err = procs[0].communicate(timeout=60)
    procs[1].wait(timeout=60)
    assert procs[1].returncode == -9
    assert procs[0].returncode == 0, err.decode()
    took, message = out.decode().strip().split(" ", 1)
    assert float(took) < 5, message
    assert message.startswith("rank 0: allreduce(") and "rank 1 (" in message, message


def _refused(pki, settings, caplog=None):
    """Start two ranks with per-rank init settings; return (outcomes, seconds taken)."""
    store = _store()
    start = time.monotonic()
    results = outcomes(2, lambda r: pc.init(rank=r, size=2, store=store,
                                            timeout=REFUSAL_TIMEOUT_S, **settings[r]),
                       timeout=30)
    took = time.monotonic() - start
    for result in results:
        if isinstance(result, pc.Context):
            result.close()
    return results, took


def test_a_certificate_from_another_ca_is_refused(pki, caplog):
    """Rank 1 trusts the right CA but holds a certificate of another: rank 0 refuses it."""
    stranger = pki["other"].issue("stranger")
    with caplog.at_level(logging.WARNING, logger="pycollect.tcp"):
        (r0, r1), took = _refused(pki, [_tls(pki, 0), _tls(pki, 1, cert=stranger)])
    assert isinstance(r1, pc.PeerError), r1
    assert "rank 1: rank 0 at 127.0.0.1:" in str(r1)
    assert "refused this rank's TLS certificate" in str(r1)
    assert isinstance(r0, pc.Timeout) and "rank(s) [1]" in str(r0), r0
    assert "TLS handshake failed" in caplog.text and "certificate" in caplog.text
    assert took < REFUSAL_TIMEOUT_S + 5


def test_a_rank_that_trusts_another_ca_refuses_its_peer(pki):
    (r0, r1), took = _refused(pki, [_tls(pki, 0), _tls(pki, 1, ca=pki["other"].ca_file)])
    assert isinstance(r1, pc.PeerError), r1
    assert "TLS handshake with rank 0 at 127.0.0.1:" in str(r1)
    assert "certificate verify failed" in str(r1)
    assert isinstance(r0, (pc.Timeout, pc.PeerError)), r0
    assert took < REFUSAL_TIMEOUT_S + 5


def test_a_certificate_for_another_address_is_refused(pki):
    """Rank 0's certificate is valid but names another host: rank 1 will not send it the hello."""
    elsewhere = pki["ca"].issue("elsewhere", names=("198.18.7.7", "not-this-host.invalid"))
    (r0, r1), took = _refused(pki, [_tls(pki, 0, cert=elsewhere), _tls(pki, 1)])
    assert isinstance(r1, pc.PeerError), r1
    assert "the TLS certificate of rank 0 at 127.0.0.1:" in str(r1)
    assert "names neither 127.0.0.1" in str(r1)
    assert isinstance(r0, (pc.Timeout, pc.PeerError)), r0
    assert took < REFUSAL_TIMEOUT_S + 5


def test_the_acceptor_checks_the_name_too(pki, caplog):
    elsewhere = pki["ca"].issue("elsewhere1", names=("198.18.7.8",))
    with caplog.at_level(logging.WARNING, logger="pycollect.tcp"):
        (r0, r1), _ = _refused(pki, [_tls(pki, 0), _tls(pki, 1, cert=elsewhere)])
    assert isinstance(r1, pc.PeerError), r1
    assert "rank 1: rank 0 at 127.0.0.1:" in str(r1)
    assert "refused this rank's TLS certificate or dropped the connection" in str(r1)
    assert isinstance(r0, pc.Timeout), r0
    assert "its TLS certificate (/CN=elsewhere1) names neither 127.0.0.1" in caplog.text


def test_a_refused_rank_reads_the_reason_every_time(pki):
    """The acceptor that refuses a certificate has the caller's hello record unread: it shuts
    its side and drains before it closes, so the caller reads the alert, not a reset.  Ten
    refused callers against one acceptor's mesh (the race lost about one time in three),
    then a valid one completes it."""
    token, context = os.urandom(32), os.urandom(32)
    listeners = [socket.create_server(("127.0.0.1", 0)) for _ in range(2)]
    addrs = [{"host": "127.0.0.1", "port": sock.getsockname()[1],
              "tls": {"name": socket.gethostname()}} for sock in listeners]
    hooks = [TlsHook(load_tls(*pki["certs"][r], pki["ca"].ca_file)) for r in range(2)]
    stranger = TlsHook(load_tls(*pki["other"].issue("stranger"), pki["ca"].ca_file))
    deadline = time.monotonic() + 30
    acceptor = ThreadPoolExecutor(1).submit(
        Mesh(0, 2, token, context, deadline, tls=hooks[0]).run, listeners[0], addrs)
    try:
        reasons = []
        for _ in range(10):
            with pytest.raises(pc.PeerError) as refused:
                Mesh(1, 2, token, context, deadline, tls=stranger).run(listeners[1], addrs)
            reasons.append(str(refused.value))
        socks = Mesh(1, 2, token, context, deadline, tls=hooks[1]).run(listeners[1], addrs)
        socks += acceptor.result(timeout=30)
    finally:
        for sock in listeners:
            sock.close()
    for sock in socks:
        if sock is not None:
            sock.close()
    assert all(reason.endswith("dropped the connection: tlsv1 alert unknown ca")
               for reason in reasons), reasons


@pytest.mark.parametrize("plain_rank", [0, 1])
def test_a_plaintext_rank_fails_cleanly(pki, plain_rank):
    settings = [_tls(pki, 0), _tls(pki, 1)]
    settings[plain_rank] = {"transport": "tcp"}
    results, took = _refused(pki, settings)
    for rank, result in enumerate(results):
        assert isinstance(result, pc.PeerError), result
        assert "rank(s) [%d] run %s TLS" % (1 - rank, "with" if rank == plain_rank
                                            else "without") in str(result)
    assert took < REFUSAL_TIMEOUT_S


def test_plaintext_bytes_at_a_tls_listener_are_dropped_and_logged(pki, caplog):
    """A stranger speaking pycollect's plaintext hello is dropped; the run goes on."""
    import socket
    import threading

    from pycollect.plugins import mesh

    real_run = mesh.Mesh.run
    poked = threading.Event()

    def poke(address):
        with socket.create_connection(address, timeout=5) as s:
            s.sendall(b"PCH1" + b"\0" * 76)
            try:
                while s.recv(64):
                    pass        # perhaps an alert; then the end of the stream
            except ConnectionResetError:
                pass
            poked.set()         # (a listener that kept it would time this recv out)

    def run_and_poke(mesh, listener, addrs):
        if mesh.rank == 0:
            threading.Thread(target=poke, args=(listener.getsockname()[:2],),
                             daemon=True).start()
            time.sleep(0.2)     # the stranger comes first, before rank 1's connection
        return real_run(mesh, listener, addrs)

    mesh.Mesh.run = run_and_poke
    try:
        with caplog.at_level(logging.WARNING, logger="pycollect.tcp"):
            store = _store()
            contexts = run_ranks(2, lambda r: pc.init(rank=r, size=2, store=store, timeout=10,
                                                      **_tls(pki, r)))
    finally:
        mesh.Mesh.run = real_run
    try:
        assert poked.wait(5)
        got = run_ranks(2, lambda r: contexts[r].allreduce(np.full(4, r + 1.0)))
        assert all(np.all(g == 3.0) for g in got)
    finally:
        for ctx in contexts:
            ctx.close()
    assert "dropped a connection" in caplog.text and "TLS handshake failed" in caplog.text


# -- bad settings: InvalidArgument before anything is sent --------------------

def _init_alone(**kwargs):
    return pc.init(rank=0, size=2, store=_store(), timeout=2, transport="tcp+tls", **kwargs)


def test_a_missing_key_file_is_named(pki):
    cert, _ = pki["certs"][0]
    missing = os.path.join(pki["dir"], "no-such-key.pem")
    with pytest.raises(pc.InvalidArgument, match="tls_key '%s' cannot be read: No such file"
                       % missing):
        _init_alone(tls_cert=cert, tls_key=missing, tls_ca=pki["ca"].ca_file)


def test_a_key_of_another_certificate_is_named(pki):
    cert, _ = pki["certs"][0]
    _, other_key = pki["certs"][1]
    with pytest.raises(pc.InvalidArgument, match="tls_key '%s' is not the key of the "
                       "certificate in tls_cert '%s'" % (other_key, cert)):
        _init_alone(tls_cert=cert, tls_key=other_key, tls_ca=pki["ca"].ca_file)


def test_a_file_that_is_not_pem_is_named(pki, tmp_path):
    junk = tmp_path / "junk.pem"
    junk.write_bytes(b"not a certificate\n")
    cert, key = pki["certs"][0]
    with pytest.raises(pc.InvalidArgument, match="tls_key '%s' is not an unencrypted PEM "
                       "private key" % junk):
        _init_alone(tls_cert=cert, tls_key=str(junk), tls_ca=pki["ca"].ca_file)
    with pytest.raises(pc.InvalidArgument, match="tls_ca '%s' holds no PEM CA" % junk):
        _init_alone(tls_cert=cert, tls_key=key, tls_ca=str(junk))


def test_a_fifo_or_device_is_refused_before_it_is_opened(pki, tmp_path):
    """Opening a FIFO with no writer blocks (past every deadline): refused unopened, in a
    process of its own so that a hang ends with the test's own timeout."""
    fifo = tmp_path / "fifo.pem"
    os.mkfifo(fifo)
    cert, key = pki["certs"][0]
    script = textwrap.dedent("""
        import sys, pycollect as pc
        try:
            pc.init(rank=0, size=2, store="hash://fifo", timeout=2, transport="tcp+tls",
                    tls_cert=sys.argv[1], tls_key=sys.argv[2], tls_ca=sys.argv[3])
        except pc.InvalidArgument as exc:
            print(exc)
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    try:
        proc = subprocess.run([sys.executable, "-c", script, cert, key, str(fifo)], env=env,
                              capture_output=True, timeout=20)
    except subprocess.TimeoutExpired:
        pytest.fail("init blocked on a FIFO as tls_ca")
    assert proc.stdout.decode().strip() == (
        "tls_ca '%s' is not a regular file (a FIFO, device, socket or directory): it must be "
        "a PEM file" % fifo), proc.stderr.decode()
    with pytest.raises(pc.InvalidArgument, match="tls_cert '/dev/null' is not a regular file"):
        _init_alone(tls_cert="/dev/null", tls_key=key, tls_ca=pki["ca"].ca_file)


def test_a_path_that_is_not_utf8_loads(pki, tmp_path):
    """A path is the file system's bytes: one that is not UTF-8 (decoded with surrogate
    escapes) is handed to OpenSSL as those bytes."""
    odd = os.fsdecode(os.path.join(os.fsencode(str(tmp_path)), b"cert\xff"))
    try:
        os.mkdir(odd)
    except (OSError, UnicodeEncodeError) as exc:
        pytest.skip("this file system takes no such name: %s" % exc)
    files = []
    for path in pki["certs"][0] + (pki["ca"].ca_file,):
        files.append(os.path.join(odd, os.path.basename(path)))
        with open(path, "rb") as src, open(files[-1], "wb") as dst:
            dst.write(src.read())
    store = _store()
    settings = [dict(_tls(pki, 0), tls_cert=files[0], tls_key=files[1], tls_ca=files[2]),
                _tls(pki, 1)]
    contexts = run_ranks(2, lambda r: pc.init(rank=r, size=2, store=store, timeout=20,
                                              **settings[r]))
    try:
        assert run_ranks(2, lambda r: contexts[r].allreduce(np.ones(3)).tolist()) == [[2.0] * 3] * 2
    finally:
        for ctx in contexts:
            ctx.close()


def test_settings_come_from_the_environment_and_arguments_win(pki, monkeypatch, tmp_path):
    cert, key = pki["certs"][0]
    missing = str(tmp_path / "gone.pem")
    monkeypatch.setenv("PYCOLLECT_TLS_CERT", cert)
    monkeypatch.setenv("PYCOLLECT_TLS_KEY", missing)
    monkeypatch.setenv("PYCOLLECT_TLS_CA", pki["ca"].ca_file)
    with pytest.raises(pc.InvalidArgument, match="PYCOLLECT_TLS_KEY '%s' cannot be read"
                       % missing):
        _init_alone()
    # The argument wins over the variable: the rank gets as far as waiting for rank 1.
    with pytest.raises(pc.Timeout):
        _init_alone(tls_key=key)


def test_missing_settings_say_what_to_set(monkeypatch):
    for var in ("PYCOLLECT_TLS_CERT", "PYCOLLECT_TLS_KEY", "PYCOLLECT_TLS_CA"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(pc.InvalidArgument, match="pass tls_cert= or set PYCOLLECT_TLS_CERT"):
        _init_alone()


def test_tls_settings_without_tls_transport_are_refused(pki):
    cert, key = pki["certs"][0]
    with pytest.raises(pc.InvalidArgument,
                       match="transport 'tcp' takes no option tls_cert, tls_key"):
        pc.init(rank=0, size=1, transport="tcp", tls_cert=cert, tls_key=key)


# -- the engine itself, against a peer that stalls in the middle of a TLS record ----------

def _pump(a, b):
    """Move whatever is readable between two non-blocking sockets, both ways."""
    for src, dst in ((a, b), (b, a)):
        try:
            data = src.recv(1 << 16)
        except BlockingIOError:
            continue
        if data:
            dst.sendall(data)


def test_a_peer_stalled_inside_a_record_meets_the_deadline_without_spinning(pki):
    """Half a TLS record is in the kernel: the engine sleeps in poll() until the deadline."""
    import socket

    from pycollect._ext import _allreduce, _tls
    from pycollect._ext._engine import Engine
    from pycollect._ext._socket import SocketChannel

    config = _tls.TlsConfig(pki["certs"][0][0], pki["certs"][0][1], pki["ca"].ca_file)
    ours, relay_in = socket.socketpair()
    peer, relay_out = socket.socketpair()
    for s in (ours, relay_in, peer, relay_out):
        s.setblocking(False)
    mine = _tls.TlsStream(config, ours.fileno(), True)
    theirs = _tls.TlsStream(config, peer.fileno(), False)
    deadline = time.monotonic() + 5
    done = [False, False]
    while not all(done):
        assert time.monotonic() < deadline, "the handshake did not finish"
        for i, stream in enumerate((mine, theirs)):
            if not done[i]:
                done[i] = stream.handshake() is None
        _pump(relay_in, relay_out)
    assert theirs.send(b"x" * 1000) == 1000
    time.sleep(0.05)
    record = relay_out.recv(1 << 16)
    relay_in.sendall(record[:len(record) // 2])     # the rest never comes
    channel = _tls.TlsChannel(SocketChannel(ours.detach()), mine)
    t = Engine(0, 2, [None, channel], ["self", "stalled"], spin_us=0)
    try:
        cpu, start = time.thread_time(), time.monotonic()
        with pytest.raises(pc.Timeout, match="rank 1"):
            _allreduce.allreduce(t, np.ones(4, np.float32), 0,
                                 _allreduce.ALGORITHMS["recursive_doubling"], 1, 1.0, 1 << 20)
        assert 0.9 < time.monotonic() - start < 3
        assert time.thread_time() - cpu < 0.25, "the engine spun instead of sleeping in poll()"
    finally:
        t.close()
        for s in (relay_in, peer, relay_out):
            s.close()


def test_tls_contexts_in_a_loop_leak_no_descriptors_or_sessions(pki):
    """Every SSL session goes with its context: no descriptor, thread or TlsStream is left."""
    import gc
    import threading

    def sessions():
        gc.collect()
        return sum(1 for o in gc.get_objects() if type(o).__name__ == "TlsStream")

    def cycle():
        contexts = _fresh_pair(pki)
        got = run_ranks(2, lambda r: contexts[r].allreduce(np.ones(5000)))
        assert all(np.all(g == 2) for g in got)
        for ctx in contexts:
            ctx.close()

    cycle()
    fds, threads, base = len(os.listdir("/proc/self/fd")), threading.active_count(), sessions()
    contexts = _fresh_pair(pki)
    assert sessions() == base + 2     # one per rank and pair: what the count can see
    for ctx in contexts:
        ctx.close()
    del contexts, ctx
    for _ in range(10):
        cycle()
    deadline = time.monotonic() + 5
    while threading.active_count() > threads and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sessions() == base
    assert len(os.listdir("/proc/self/fd")) <= fds
    assert threading.active_count() <= threads
