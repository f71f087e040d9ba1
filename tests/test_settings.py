"""The settings table: one place for every PYCOLLECT_* variable, and the README that shows it."""

import os
import re

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
    ("PYCOLLECT_HOST_ID", " rack3 ", "rack3"),
    ("PYCOLLECT_MAX_SEGMENT_BYTES", "256", 256),
])
def test_values_are_parsed(name, raw, value):
    assert settings.get(name, {name: raw}) == value


@pytest.mark.parametrize("name,raw", [
    ("PYCOLLECT_SPIN_US", "fast"), ("PYCOLLECT_SPIN_US", "-1"), ("PYCOLLECT_SPIN_US", "2e6"),
    ("PYCOLLECT_TIMEOUT", "0"), ("PYCOLLECT_TIMEOUT", "inf"), ("PYCOLLECT_TIMEOUT", "soon"),
    ("PYCOLLECT_TIMEOUT", "1e10"),
    ("PYCOLLECT_CMA_MIN_BYTES", "-5"), ("PYCOLLECT_MAX_SEGMENT_BYTES", "0"),
    ("PYCOLLECT_RANK", "one"), ("PYCOLLECT_HOST_ID", "   "),
])
def test_a_bad_value_names_the_variable_and_the_value(name, raw):
    with pytest.raises(pc.InvalidArgument, match="^%s=%r is not " % (name, raw)):
        settings.get(name, {name: raw})


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
