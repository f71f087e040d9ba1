"""CPU placement helpers of pycollect.plugins.hosts: cores from the kernel's topology,
rank r on core r % cores, and children started on given CPUs."""

import os
import subprocess
import sys

from pycollect.plugins.hosts import core_sets, rank_cpus, started_on


def fake_sysfs(tmp_path, siblings, name="core_cpus_list"):
    """A /sys/devices/system/cpu tree: CPU c's topology file lists ``siblings[c]``."""
    for cpu, text in siblings.items():
        topo = tmp_path / f"cpu{cpu}" / "topology"
        topo.mkdir(parents=True)
        if text is not None:
            (topo / name).write_text(text + "\n")
    return str(tmp_path)


def test_hardware_threads_of_one_core_form_one_set(tmp_path):
    # 4 cores of 2 threads each, numbered as Linux does on x86: CPU c and c + 4 share a core.
    sysfs = fake_sysfs(tmp_path, {c: f"{c % 4},{c % 4 + 4}" for c in range(8)})
    assert core_sets(range(8), sysfs) == [{0, 4}, {1, 5}, {2, 6}, {3, 7}]
    # Only the CPUs this process may use count; a core with none of them is left out.
    assert core_sets({0, 1, 5, 6}, sysfs) == [{0}, {1, 5}, {6}]


def test_ranges_and_the_older_sibling_file_are_read(tmp_path):
    sysfs = fake_sysfs(tmp_path, {c: "0-1" if c < 2 else "2-3" for c in range(4)},
                       name="thread_siblings_list")
    assert core_sets(range(4), sysfs) == [{0, 1}, {2, 3}]


def test_without_topology_every_cpu_is_a_core(tmp_path):
    sysfs = fake_sysfs(tmp_path, {0: None, 1: None, 2: "garbage"})
    assert core_sets({2, 0, 1}, sysfs) == [{0}, {1}, {2}]


def test_more_ranks_than_cores_share_them_evenly():
    sets = [frozenset({0, 4}), frozenset({1, 5})]
    assert rank_cpus(5, sets) == [sets[0], sets[1], sets[0], sets[1], sets[0]]
    assert rank_cpus(1, sets) == [sets[0]]
    assert all(rank_cpus(len(core_sets()) + 1))     # this machine's cores, none empty


def test_a_child_started_inside_runs_on_the_cpus_and_the_caller_gets_its_own_back():
    mine = os.sched_getaffinity(0)
    first = min(mine)
    probe = [sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"]
    with started_on({first}):
        inside = subprocess.run(probe, capture_output=True, text=True, check=True).stdout
    assert inside.strip() == str([first])
    assert os.sched_getaffinity(0) == mine
    with started_on(None):
        free = subprocess.run(probe, capture_output=True, text=True, check=True).stdout
    assert free.strip() == str(sorted(mine))
