"""A third-party plugin package, really installed: found, listed with its package, used, and broken.

``tests/plugin_pkg`` is installed with pip into a temporary folder (``--target``),
which this process and its children put on their path: the interpreter's own
site-packages are never touched, so nothing outside these tests sees the plugin.
"""

import importlib
import itertools
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import pycollect as pc
from pycollect.plugins import available, get_transport, open_store, registry
from abstract import StoreSuite, TransportSuite
from jobs import allreduce_job

pytestmark = pytest.mark.timeout(300)

PACKAGE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "plugin_pkg")
DISTRIBUTION = "pycollect-testplugin"
INSTALL_TIMEOUT_S = 240     # the build compiles the plugin's Cython channel
_suite_tables = itertools.count()


@pytest.fixture(scope="module")
def plugin_path(tmp_path_factory):
    """Install the plugin package into a fresh folder and put that folder on sys.path."""
    work = tmp_path_factory.mktemp("plugin")
    source, target = work / "source", work / "site"
    shutil.copytree(PACKAGE, source)    # the build writes beside the sources: not in the repo
    try:
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                        "--no-build-isolation", "--no-index", "--disable-pip-version-check",
                        "--target", str(target), str(source)],
                       check=True, capture_output=True, timeout=INSTALL_TIMEOUT_S, text=True)
    except subprocess.CalledProcessError as err:
        pytest.fail(f"pip could not install the test plugin: {err.stderr[-2000:]}")
    sys.path.insert(0, str(target))
    importlib.invalidate_caches()
    registry.refresh()
    yield str(target)
    sys.path.remove(str(target))
    for name in [name for name in sys.modules if name.startswith("pycollect_testplugin")]:
        del sys.modules[name]
    importlib.invalidate_caches()
    registry.refresh()


def _python(plugin_path, code):
    """Run ``code`` in a fresh interpreter that sees the plugin; return its stdout."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [plugin_path, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=30, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_available_lists_the_plugins_with_their_package(plugin_path):
    plugins = available()
    assert plugins["stores"]["memo"] == DISTRIBUTION
    assert plugins["stores"]["broken"] == DISTRIBUTION
    assert plugins["transports"]["counted-tcp"] == DISTRIBUTION
    assert plugins["stores"]["file"] == "pycollect"


def test_a_broken_plugin_never_breaks_import(plugin_path):
    out = _python(plugin_path, "import pycollect as pc\n"
                               "print(sorted(pc.plugins.available()['stores'].items()))")
    assert f"('broken', '{DISTRIBUTION}')" in out and f"('memo', '{DISTRIBUTION}')" in out


def test_a_broken_plugin_names_its_package_when_used(plugin_path):
    with pytest.raises(pc.PluginError) as caught:
        open_store("broken://x")
    message = str(caught.value)
    assert DISTRIBUTION in message and "pycollect_testplugin_missing_dependency" in message
    assert isinstance(caught.value.__cause__, ImportError)
    with pytest.raises(pc.PluginError, match=f"broken-transport.*{DISTRIBUTION}"):
        get_transport("broken-transport")
    with pytest.raises(pc.PluginError, match=DISTRIBUTION):
        pc.init(rank=0, size=1, transport="broken-transport")


def test_a_job_runs_on_the_plugin_store_and_transport(plugin_path):
    plugin = importlib.import_module("pycollect_testplugin")
    before = dict(plugin.calls)
    allreduce_job(3, "memo://job", transport="counted-tcp", timeout=20)
    assert plugin.calls["memo"] == before["memo"] + 3
    assert plugin.calls["counted-tcp"] == before["counted-tcp"] + 3


def test_a_fresh_process_finds_the_plugins_at_run_time(plugin_path):
    out = _python(plugin_path, "import numpy as np, pycollect as pc, pycollect_testplugin as p\n"
                               "with pc.init(rank=0, size=1, store='memo://solo',\n"
                               "             transport='counted-tcp') as ctx:\n"
                               "    x = np.ones(3); ctx.allreduce(x)\n"
                               "print(p.calls, x.tolist())")
    assert "{'memo': 1, 'counted-tcp': 1} [1.0, 1.0, 1.0]" in out


class TestPluginStore(StoreSuite):
    @pytest.fixture
    def store(self, plugin_path):
        with open_store(f"memo://suite-{next(_suite_tables)}", timeout=10) as store:
            assert type(store).__module__ == "pycollect_testplugin"
            yield store


# -- a transport another package writes in Cython ---------------------------------


class TestThirdPartyChannel(TransportSuite):
    """The plugin's channel (pycollect_testplugin/_sockets.pyx, compiled against the
    installed .pxd files) passes the suite every built-in channel passes."""

    transport = "testplugin-sockets"

    @pytest.fixture(autouse=True)
    def _installed(self, plugin_path):
        pass


def _carried(ctx):
    """Bytes the plugin's channels of this rank wrote and read."""
    channels = [ctx._transport.channel(p) for p in range(ctx.size) if p != ctx.rank]
    return sum(c.bytes_sent for c in channels), sum(c.bytes_received for c in channels)


@pytest.mark.parametrize("size", [2, 3, 5])
def test_the_collective_matrix_runs_on_the_plugin_channel(plugin_path, size):
    """Every allreduce algorithm, broadcast and reduce algorithm, over counts and ops,
    checked against NumPy, with the plugin's channel carrying every byte."""
    from reference import assert_matches, make_input, ops_for, reduce_reference

    from conftest import counts_for
    from group import ThreadGroup
    from pycollect.context import ALLREDUCE_ALGORITHMS, BROADCAST_ALGORITHMS

    g = ThreadGroup(size, transport="testplugin-sockets", segment_bytes=64, timeout=30)
    try:
        assert all(k in ("self", "testplugin-socket")
                   for k in g.contexts[0]._transport.pair_kinds())
        algorithms = [a for a in ALLREDUCE_ALGORITHMS if a != "hierarchical"]
        cases = [(a, op, n) for a in algorithms for op in ops_for("float32")
                 for n in counts_for(size)]

        def body(ctx):
            out = []
            for algorithm, op, n in cases:
                buf = make_input("float32", n, ctx.rank, op)
                ctx.allreduce(buf, op=op, algorithm=algorithm)
                out.append(buf)
            for algorithm in [a for a in BROADCAST_ALGORITHMS if a != "hierarchical"]:
                b = np.arange(1000, dtype=np.int64) if ctx.rank == 1 else np.zeros(1000, np.int64)
                ctx.broadcast(b, root=1, algorithm=algorithm)
                out.append(b)
            return out, _carried(ctx)

        results = g.run(body, timeout=120)
        for i, (algorithm, op, n) in enumerate(cases):
            expected = reduce_reference("float32", [make_input("float32", n, r, op)
                                                    for r in range(size)], op)
            for rank in range(size):
                assert_matches("float32", op, results[rank][0][i], expected,
                               "size %d rank %d %s %s" % (size, rank, algorithm, n))
        for out, (sent, received) in results:
            for b in out[len(cases):]:
                np.testing.assert_array_equal(b, np.arange(1000, dtype=np.int64))
            assert sent > 0 and received > 0
    finally:
        g.close()
