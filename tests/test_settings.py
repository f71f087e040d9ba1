"""The settings table: one place for every PYCOLLECT_* variable, and the README that shows it."""

import os
import re
import signal
import socket
import threading
import time

import pytest

import pycollect as pc
from pycollect import settings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "pycollect")
# An environment read that names a PYCOLLECT_ variable in place.
ENV_READ = re.compile(r"""(environ\s*(\.get\s*\(|\[)|getenv\s*\()\s*["']PYCOLLECT_""")


def _readme_table():
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    start = text.index("| variable | effect |")
    return text[start:text.index("\n\n", start) + 1]


def test_the_readme_table_is_the_settings_table():
    assert _readme_table() == settings.markdown_table()


def test_every_variable_the_package_names_is_in_the_table():
    named = set()
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            path = os.path.join(folder, name)
            if name.endswith((".py", ".pyx")) and path != settings.__file__:
                with open(path) as f:
                    named.update(re.findall(r"PYCOLLECT_[A-Z_]*[A-Z]", f.read()))
    named -= {"PYCOLLECT_TLS"}          # "PYCOLLECT_TLS_*" in prose
    assert named <= set(settings.SETTINGS), sorted(named - set(settings.SETTINGS))


def test_only_the_settings_module_reads_the_environment():
    readers = []
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            path = os.path.join(folder, name)
            if name.endswith((".py", ".pyx")) and path != settings.__file__:
                with open(path) as f:
                    if ENV_READ.search(f.read()):
                        readers.append(os.path.relpath(path, ROOT))
    assert readers == []


def test_the_environment_scan_finds_a_direct_read():
    assert ENV_READ.search('spin = os.environ.get("PYCOLLECT_SPIN_US", "50")')
    assert ENV_READ.search("x = os.environ['PYCOLLECT_RANK']")
    assert not ENV_READ.search('env["OTHER"] = "PYCOLLECT_RANK"')


def test_an_empty_variable_is_the_default():
    assert settings.get("PYCOLLECT_SPIN_US", {"PYCOLLECT_SPIN_US": ""}) is None  # transport's
    assert settings.get("PYCOLLECT_TIMEOUT", {}) == 120.0
    assert settings.get("PYCOLLECT_HOST_ID", {}) is None


@pytest.mark.parametrize("name,raw,value", [
    ("PYCOLLECT_SPIN_US", "0", 0.0),
    ("PYCOLLECT_TIMEOUT", "2.5", 2.5),
    ("PYCOLLECT_CMA", "0", False),
    ("PYCOLLECT_CMA", "1", True),
    ("PYCOLLECT_CMA_MIN_BYTES", "4096", 4096),
    ("PYCOLLECT_DEBUG", "detail", "detail"),
    ("PYCOLLECT_DEBUG", "1", True),
    ("PYCOLLECT_DEBUG", "0", False),
    ("PYCOLLECT_DEBUG", "1,detail", "all"),
    ("PYCOLLECT_DEBUG", " Detail , 1 ", "all"),
    ("PYCOLLECT_HOST_ID", " rack3 ", "rack3"),
    ("PYCOLLECT_MAX_SEGMENT_BYTES", "256", 256),
    ("PYCOLLECT_POOL_BYTES", str(1 << 46), 1 << 46),
    ("PYCOLLECT_TRACE_SIGNAL", "usr1", signal.SIGUSR1),
    ("PYCOLLECT_TRACE_SIGNAL", "SIGHUP", signal.SIGHUP),
    ("PYCOLLECT_TRACE_SIGNAL", "10", signal.SIGUSR1),
])
def test_values_are_parsed(name, raw, value):
    assert settings.get(name, {name: raw}) == value


@pytest.mark.parametrize("name,raw", [
    ("PYCOLLECT_SPIN_US", "fast"), ("PYCOLLECT_SPIN_US", "-1"), ("PYCOLLECT_SPIN_US", "2e6"),
    ("PYCOLLECT_TIMEOUT", "0"), ("PYCOLLECT_TIMEOUT", "inf"), ("PYCOLLECT_TIMEOUT", "soon"),
    ("PYCOLLECT_TIMEOUT", "1e10"),
    ("PYCOLLECT_CMA_MIN_BYTES", "-5"), ("PYCOLLECT_MAX_SEGMENT_BYTES", "0"),
    ("PYCOLLECT_RANK", "one"), ("PYCOLLECT_HOST_ID", "   "),
    ("PYCOLLECT_POOL_BYTES", "99999999999999999999999"), ("PYCOLLECT_POOL_BYTES", str(1 << 63)),
    # the largest that passed: its size rounded to pages wrapped off_t ("ftruncate to 2^63")
    ("PYCOLLECT_POOL_BYTES", str((1 << 63) - 1)), ("PYCOLLECT_POOL_BYTES", str((1 << 46) + 1)),
    ("PYCOLLECT_TRACE_SIGNAL", "KILL"), ("PYCOLLECT_TRACE_SIGNAL", "sigstop"),
    ("PYCOLLECT_TRACE_SIGNAL", str(int(signal.SIGKILL))), ("PYCOLLECT_TRACE_SIGNAL", "0"),
    ("PYCOLLECT_DEBUG", "false"), ("PYCOLLECT_DEBUG", "off"), ("PYCOLLECT_DEBUG", "1,yes"),
])
def test_a_bad_value_names_the_variable_and_the_value(name, raw):
    with pytest.raises(pc.InvalidArgument, match="^%s=%r is not " % (name, raw)):
        settings.get(name, {name: raw})


def test_the_messages_say_what_a_value_must_be():
    """Which words PYCOLLECT_DEBUG takes, which signals cannot be caught, the pool's bound."""
    for name, raw, what in (("PYCOLLECT_DEBUG", "false", "0, 1, detail or 1,detail"),
                            ("PYCOLLECT_TRACE_SIGNAL", "KILL", "not KILL or STOP"),
                            ("PYCOLLECT_POOL_BYTES", "1e3", "from 1048576 to 2**46")):
        with pytest.raises(pc.InvalidArgument, match=re.escape(what)):
            settings.get(name, {name: raw})


def test_an_uncatchable_trace_signal_is_refused_by_init(monkeypatch, tmp_path):
    """It was refused only by the kernel, once the ranks had joined: a bare OSError."""
    monkeypatch.setenv("PYCOLLECT_TRACE_DIR", str(tmp_path))
    monkeypatch.setenv("PYCOLLECT_TRACE_SIGNAL", "KILL")
    with pytest.raises(pc.InvalidArgument, match="^PYCOLLECT_TRACE_SIGNAL='KILL' is not "):
        pc.init(rank=0, size=1, store="hash://settings-kill-%d" % os.getpid())


def test_a_huge_pool_size_is_refused_naming_the_variable(tmp_path):
    """Beyond 64 bits it was a bare OverflowError from the first pc.empty (a fresh process:
    this one's pool may be made already)."""
    import subprocess
    import sys
    env = dict(os.environ, PYCOLLECT_POOL_BYTES="99999999999999999999999")
    done = subprocess.run([sys.executable, "-c", "import numpy as np, pycollect as pc\n"
                           "try:\n    pc.empty(10, np.float32)\n"
                           "except pc.InvalidArgument as exc:\n    print(exc)\n"],
                          env=env, cwd=tmp_path, capture_output=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.decode().startswith(
        "PYCOLLECT_POOL_BYTES='99999999999999999999999' is not a byte count"), done


def test_debug_off_words_are_refused_not_taken_as_on(monkeypatch):
    monkeypatch.setenv("PYCOLLECT_DEBUG", "false")
    with pytest.raises(pc.InvalidArgument, match="^PYCOLLECT_DEBUG='false' is not "):
        pc.init(rank=0, size=1, store="hash://settings-debug-%d" % os.getpid())


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# A malformed value of each variable that the context reads.
CONTEXT_VARIABLES = [("PYCOLLECT_TRACE_SIZE", "-1"), ("PYCOLLECT_TRACE_DIR", "  "),
                     ("PYCOLLECT_TRACE_SIGNAL", "NOPE"), ("PYCOLLECT_UNPICKLE_ALLOW", "a b")]


@pytest.mark.parametrize("name,raw", CONTEXT_VARIABLES)
def test_a_bad_context_variable_fails_init_before_the_rendezvous(monkeypatch, name, raw):
    """Rank 0 of 2 alone: refused at once, not after waiting for a peer that never comes."""
    monkeypatch.setenv(name, raw)
    url = "tcp://127.0.0.1:%d" % _free_port()
    start = time.monotonic()
    with pytest.raises(pc.InvalidArgument, match="^%s=%r is not " % (name, raw)):
        pc.init(rank=0, size=2, store=url, timeout=10)
    assert time.monotonic() - start < 5


@pytest.mark.parametrize("name,raw", CONTEXT_VARIABLES)
def test_a_bad_context_variable_leaves_no_store_open(monkeypatch, name, raw):
    """Both ranks refuse it, and the TCP store that rank 0 would host is not left listening
    (it was opened, joined, and never closed)."""
    monkeypatch.setenv(name, raw)
    port = _free_port()
    errors = {}

    def run(rank):
        try:
            pc.init(rank=rank, size=2, store="tcp://127.0.0.1:%d" % port, timeout=10)
        except Exception as exc:        # noqa: BLE001 - recorded for the assertions
            errors[rank] = exc

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    assert sorted(errors) == [0, 1]
    assert all(isinstance(e, pc.InvalidArgument) and name in str(e) for e in errors.values())
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0


def test_a_context_that_cannot_be_made_closes_the_store_and_transport(monkeypatch):
    """Whatever fails in the Context itself, init closes what it opened."""
    from pycollect import rendezvous
    closed = []
    real_factory = rendezvous.get_transport("tcp")

    class Recorded:
        def __init__(self, *args, **kwargs):
            self.transport = real_factory(*args, **kwargs)

        def close(self):
            closed.append("transport")
            self.transport.close()

    def refuse(rank, size, transport, **kwargs):
        raise RuntimeError("no context")

    monkeypatch.setattr(rendezvous, "get_transport", lambda name: Recorded)
    monkeypatch.setattr(rendezvous, "Context", refuse)
    port = _free_port()
    with pytest.raises(RuntimeError, match="no context"):
        pc.init(rank=0, size=1, store="tcp://127.0.0.1:%d" % port, timeout=10)
    assert closed == ["transport"]
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0


def test_init_reads_a_bad_variable_through_the_table(monkeypatch):
    monkeypatch.setenv("PYCOLLECT_SPIN_US", "fast")
    with pytest.raises(pc.InvalidArgument, match="PYCOLLECT_SPIN_US='fast' is not a number"):
        pc.init(rank=0, size=1, transport="tcp", store="hash://settings-spin-%d" % os.getpid())


def test_the_spin_defaults_to_long_with_a_core_per_rank_and_short_when_sharing(monkeypatch):
    """PYCOLLECT_SPIN_US unset: 1000 us where the host's ranks have a core each, 50 us (and
    yielding) where they share; set, it wins either way."""
    from group import ThreadGroup
    cores = len(os.sched_getaffinity(0))
    monkeypatch.delenv("PYCOLLECT_SPIN_US", raising=False)
    for size, spin, yields in ((1, 1000.0, False), (cores + 1, 50.0, True)):
        group = ThreadGroup(size, timeout=30, transport="tcp")
        try:
            for ctx in group.contexts:
                assert (ctx._transport.spin_us, ctx._transport.yields_spin) == (spin, yields)
        finally:
            group.close()
    monkeypatch.setenv("PYCOLLECT_SPIN_US", "7")
    group = ThreadGroup(cores + 1, timeout=30, transport="tcp")
    try:
        assert {ctx._transport.spin_us for ctx in group.contexts} == {7.0}
    finally:
        group.close()
