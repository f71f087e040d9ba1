"""CPU placement helpers of pycollect.plugins.hosts: cores from the kernel's topology,
rank r on core r % cores, and children started on given CPUs."""

import os
import subprocess
import sys

import pytest

from pycollect.plugins.hosts import (core_sets, cpu_list, cpu_mates, oversubscribed, rank_cpus,
                                     started_on)


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


def test_the_published_cpus_are_the_kernels_list_format(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 8, 10, 11})
    assert cpu_list() == "0-3,8,10-11"
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {5})
    assert cpu_list() == "5"


def record(cpus, boot="k1"):
    return {"hostid": "h", "boot": boot, "cpus": cpus}


def test_ranks_share_cores_when_more_of_them_overlap_a_ranks_cpus_than_it_has():
    bound = [record("0"), record("1")]
    assert not oversubscribed(0, bound) and not oversubscribed(1, bound)
    # Four ranks bound two to a core, or free on two CPUs: each shares.
    assert all(oversubscribed(r, [record("0"), record("1")] * 2) for r in range(4))
    assert all(oversubscribed(r, [record("0-1")] * 4) for r in range(4))
    assert not oversubscribed(0, [record("0-1")] * 2)
    # Another kernel's ranks never count; a rank that published no CPUs counts as sharing.
    assert not oversubscribed(0, [record("0"), record("0", boot="k2")])
    assert oversubscribed(0, [record("0"), {"hostid": "h", "boot": "k1"}])


def test_a_ranks_cpu_mates_are_the_ranks_of_its_kernel_that_may_run_on_its_cpus():
    two_by_two = [record("0"), record("1")] * 2
    assert [cpu_mates(r, two_by_two) for r in range(4)] == [{2}, {3}, {0}, {1}]
    assert cpu_mates(0, [record("0-1")] * 3) == {1, 2}
    assert cpu_mates(0, [record("0"), record("0", boot="k2"), record("0-3")]) == {2}
    # Nothing published (or nothing readable), on either side: every rank of the kernel.
    assert cpu_mates(0, [record("0"), {"hostid": "h", "boot": "k1"}, record("1")]) == {1}
    assert cpu_mates(0, [{"hostid": "h", "boot": "k1"}, record("5"), record("6")]) == {1, 2}
    assert cpu_mates(1, [record("bogus"), record("1"), record("2")]) == {0}


def test_without_published_cpus_the_rank_count_against_the_cores_decides(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    old = [{"hostid": "h", "boot": "k1"}] * 2
    assert not oversubscribed(0, old)
    assert oversubscribed(0, old * 2)
    assert oversubscribed(0, [record("bogus")] * 3)


def _bound_ranks(tmp_path, size, cpus, report):
    """Run ``size`` ranks over shm, rank r started on CPUs ``cpus(r)``; each prints its rank
    and the expression ``report`` (of ``ctx``), then takes a barrier.  Their printed words,
    in rank order."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 CPUs")
    program = tmp_path / "rank.py"
    program.write_text(
        "import pycollect as pc\n"
        "ctx = pc.init(transport='shm')\n"
        f"print(ctx.rank, {report}, flush=True)\n"
        "ctx.barrier()\n"
        "ctx.close()\n")
    procs = []
    for r in range(size):
        env = dict(os.environ, PYCOLLECT_RANK=str(r), PYCOLLECT_SIZE=str(size),
                   PYCOLLECT_STORE=f"file://{tmp_path}/store")
        env.pop("PYCOLLECT_SPIN_US", None)
        with started_on(cpus(r)):
            procs.append(subprocess.Popen([sys.executable, "-P", str(program)], env=env,
                                          stdout=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=60)[0].split() for p in procs]
    assert [p.returncode for p in procs] == [0] * size
    return sorted(outs)


@pytest.mark.parametrize("cpus, shared", [(lambda r: {r % 2}, False), (lambda r: {0}, True)])
def test_bound_ranks_spin_without_yielding_unless_they_share_a_core(tmp_path, cpus, shared):
    """Two ranks bound to one core each are no oversubscription (each may run on one CPU
    only); two bound to the same core are: the engine yields while it spins."""
    outs = _bound_ranks(tmp_path, 2, cpus,
                        "ctx._transport.yields_spin, ctx._transport.spin_us")
    for out in outs:
        assert out[1] == str(shared) and float(out[2]) == (50.0 if shared else 1000.0), outs


def test_four_ranks_bound_two_to_a_core_yield_at_once_only_for_their_core_mate(tmp_path):
    """Ranks 0 and 2 on CPU 0, 1 and 3 on CPU 1: each shares its core, and its flag
    area's waits give the core up at once only while its core-mate has not posted."""
    outs = _bound_ranks(tmp_path, 4, lambda r: {r % 2},
                        "ctx._transport.yields_spin, *ctx._transport.flag_area.mates")
    assert outs == [["0", "True", "2"], ["1", "True", "3"], ["2", "True", "0"],
                    ["3", "True", "1"]], outs


def test_cpus_that_cannot_be_had_are_named_and_the_caller_keeps_its_own():
    mine = os.sched_getaffinity(0)
    with pytest.raises(OSError, match=r"cannot bind to CPUs 100000: "):
        with started_on({100000}):
            pass
    assert os.sched_getaffinity(0) == mine
