"""Network namespaces as test "hosts": the ``hosts`` fixture (conftest.py registers it).

HOSTS namespaces on one bridge, host i at 198.18.0.i/24 (the benchmarking range,
routed nowhere), built by the fixture (root and ``ip`` needed, else skipped) and
removed whatever happens.
"""

import os
import shutil
import subprocess

import pytest

HOSTS = 3
SUBNET = "198.18.0"
COMMAND_TIMEOUT_S = 10


def _why_not():
    """Why the namespaces cannot be built here, or None."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "needs root to create network namespaces"
    for tool in ("ip", "unshare", "hostname"):
        if shutil.which(tool) is None:
            return f"needs the {tool} command"
    return None


def _ip(*args, check=True):
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check,
                          timeout=COMMAND_TIMEOUT_S)


@pytest.fixture(scope="module")
def hosts():
    """Names of HOSTS namespaces wired to one bridge, host i at 198.18.0.i/24."""
    reason = _why_not()
    if reason:
        pytest.skip(reason)
    tag = "pc%d" % (os.getpid() % 100000)
    switch = tag + "sw"
    names = [f"{tag}h{i}" for i in range(1, HOSTS + 1)]
    created = []
    try:
        for name in [switch] + names:
            done = _ip("netns", "add", name, check=False)
            if done.returncode != 0:
                pytest.skip(f"cannot create network namespaces here: {done.stderr.strip()}")
            created.append(name)
        _ip("-n", switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", switch, "link", "set", "br0", "up")
        for index, name in enumerate(names, start=1):
            port = f"port{index}"
            _ip("-n", switch, "link", "add", port, "type", "veth", "peer", "name", "eth0",
                "netns", name)
            _ip("-n", switch, "link", "set", port, "master", "br0", "up")
            _ip("-n", name, "addr", "add", f"{SUBNET}.{index}/24", "dev", "eth0")
            _ip("-n", name, "link", "set", "eth0", "up")
            _ip("-n", name, "link", "set", "lo", "up")
        yield names
    finally:
        for name in reversed(created):
            _ip("netns", "del", name, check=False)
