"""A newcomer's first steps: processes pycollect starts import the installed package, an unbuilt
source tree explains itself, and the docs' plugin listing matches the package's entry points."""

import importlib.metadata
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import pycollect
from pycollect.launch import module_command

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 120


@pytest.fixture
def unbuilt_tree(tmp_path):
    """A folder holding a copy of pycollect's source package without its compiled extensions,
    as the root of a fresh clone is; the installed pycollect lives elsewhere."""
    source = Path(pycollect.__file__).resolve().parent
    shutil.copytree(source, tmp_path / "pycollect",
                    ignore=shutil.ignore_patterns("*.so", "*.c", "__pycache__"))
    return tmp_path


def _run(argv, cwd):
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=TIMEOUT_S,
                          stdin=subprocess.DEVNULL)


def test_an_unbuilt_tree_explains_itself(unbuilt_tree):
    done = _run([sys.executable, "-c", "import pycollect"], unbuilt_tree)
    assert done.returncode != 0
    assert "ImportError: pycollect's compiled extensions are not built in " \
           f"{unbuilt_tree / 'pycollect' / '_ext'}" in done.stderr
    assert f"cd {unbuilt_tree} && pip install -e ." in done.stderr
    assert "run from outside the source tree" in done.stderr


def _local_bench(command, cwd):
    done = _run(command + ["--local", "2", "--elements", "1,10", "--iteration-count", "3",
                           "--warmup-iters", "1", "allreduce"], cwd)
    assert done.returncode == 0, done.stderr
    rows = [line for line in done.stdout.splitlines() if re.match(r"^ *\d+ +\d+ ", line)]
    assert [line.split()[1] for line in rows] == ["1", "10"], done.stdout


def test_local_ranks_import_the_installed_package_from_a_source_tree(unbuilt_tree):
    # The parent runs with -P itself; the two ranks it starts are what is checked: started as a
    # plain `python -m pycollect.bench`, they would import the unbuilt copy and fail.
    _local_bench(module_command("pycollect.bench"), unbuilt_tree)


def test_the_python_3_10_command_keeps_the_working_directory_off_sys_path(unbuilt_tree,
                                                                           tmp_path_factory,
                                                                           monkeypatch):
    monkeypatch.setattr(sys, "version_info", (3, 10, 0))
    stub = module_command("pycollect.launch")
    assert "-P" not in stub
    monkeypatch.undo()
    # The launcher (pycollect.launch imports the package) is what the stub starts; the rank is
    # a script outside the tree, which imports whatever its own folder and sys.path give it.
    program = tmp_path_factory.mktemp("program") / "where.py"
    program.write_text("import pycollect\nprint(pycollect.__file__)\n")
    done = _run(stub + ["-n", "1", "--no-prefix-output", str(program)], unbuilt_tree)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == pycollect.__file__


def test_the_console_script_works_from_a_source_tree(unbuilt_tree):
    script = shutil.which("pycollect-bench", path=str(Path(sys.executable).parent))
    if script is None:
        pytest.skip("pycollect-bench is not installed beside this interpreter")
    _local_bench([script], unbuilt_tree)


def _doc_block(path, language, needle):
    blocks = re.findall(r"```%s\n(.*?)```" % language, path.read_text(), re.S)
    (block,) = [b for b in blocks if needle in b]
    return block


def test_the_documented_entry_points_are_the_packages():
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
    shown = tomllib.loads(_doc_block(ROOT / "docs" / "api.md", "toml", "pycollect.stores"))
    shown = shown["project"]["entry-points"]
    assert shown == declared


def test_the_documented_plugin_listing_is_what_available_says():
    shown = _doc_block(ROOT / "docs" / "api.md", "python", "available()")
    listing = eval(shown.split("\n", 1)[1].strip())   # the line under the >>> prompt
    builtins = {kind: {name: dist for name, dist in plugins.items() if dist == "pycollect"}
                for kind, plugins in pycollect.plugins.available().items()}
    assert listing == builtins


def test_the_tls_transport_is_found_under_both_spellings():
    assert pycollect.plugins.get_transport("tcp+tls") is \
        pycollect.plugins.get_transport("tcp-tls")


def test_a_plain_install_brings_bfloat16():
    requires = importlib.metadata.requires("pycollect") or []
    core = [r for r in requires if "extra ==" not in r]
    assert any(re.match(r"ml[_-]dtypes\b", r) for r in core), requires
