"""algorithm="auto" as data: the rule table, the plans it yields, and the docs that show it."""

import os

import pytest

import pycollect as pc
from pycollect import selection
from pycollect.selection import Facts, KiB, MiB, Selector

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _pick(collective, nbytes, size, shm=False, multi_host=False):
    return Selector(Facts(size, shm, multi_host)).plan(collective, nbytes).name


def test_the_docs_table_is_the_rule_table():
    with open(os.path.join(ROOT, "docs", "algorithms.md")) as f:
        text = f.read()
    start = text.index("| collective | ranks | topology | buffer | algorithm | why |")
    assert text[start:text.index("\n\n", start) + 1] == selection.markdown_table()


@pytest.mark.parametrize("size,shm,multi,cases", [
    (2, True, False, [(4 * KiB, "recursive_doubling"), (4 * KiB + 1, "direct"),
                      (32 * KiB, "direct"), (64 * MiB, "direct")]),
    (2, False, False, [(256 * KiB, "recursive_doubling"), (256 * KiB + 1, "ring_chunked"),
                       (1 * MiB, "ring_chunked"), (64 * MiB, "ring_chunked")]),
    (4, False, False, [(4 * KiB, "recursive_doubling"), (4 * KiB + 1, "halving_doubling"),
                       (256 * KiB, "bcube"), (16 * MiB, "ring_chunked")]),
    (4, True, False, [(8 * KiB, "halving_doubling"), (8 * KiB + 1, "direct"),
                      (128 * KiB, "direct"), (16 * MiB, "direct")]),
    (3, True, False, [(8 * KiB, "halving_doubling"), (8 * KiB + 1, "direct")]),
    (3, False, False, [(4 * KiB + 1, "halving_doubling"), (64 * MiB, "halving_doubling")]),
    (4, False, True, [(4 * KiB, "recursive_doubling"), (128 * KiB - 1, "halving_doubling"),
                      (128 * KiB, "hierarchical"), (16 * MiB, "hierarchical")]),
    (1, False, False, [(1, "recursive_doubling"), (MiB, "halving_doubling")]),
])
def test_allreduce_plans_by_size_ranks_and_topology(size, shm, multi, cases):
    for nbytes, name in cases:
        assert _pick("allreduce", nbytes, size, shm, multi) == name, (nbytes, name)


def test_a_coalesced_allreduce_stays_flat_where_allreduce_goes_hierarchical():
    assert _pick("allreduce", MiB, 4, multi_host=True) == "hierarchical"
    assert _pick("allreduce_coalesced", MiB, 4, multi_host=True) == "halving_doubling"
    for nbytes in (1, 8 * KiB, 300 * KiB, 32 * MiB):
        for size, shm in ((2, True), (2, False), (4, False), (4, True), (5, False)):
            assert _pick("allreduce_coalesced", nbytes, size, shm) == \
                _pick("allreduce", nbytes, size, shm)


@pytest.mark.parametrize("size", [2, 3, 4, 8])
def test_small_messages_of_a_group_with_a_flag_area_take_flags(size):
    """On one host's shared memory with a flag area: broadcast up to the flag area's 16 KiB,
    allreduce up to where ``direct`` starts (4 KiB at 2 ranks, 8 KiB with more); above
    that, and for a group on shared memory without one (a sub-group), as before."""
    with_area, without = Selector(Facts(size, True, False, True)), Selector(Facts(size, True))
    allreduce_max = 4 * KiB if size == 2 else 8 * KiB
    for collective, most in (("allreduce", allreduce_max), ("allreduce_coalesced", allreduce_max),
                             ("broadcast", 16 * KiB)):
        for nbytes in (0, 1, most // 2, most):
            assert with_area.plan(collective, nbytes).name == "flags", (collective, nbytes)
            assert without.plan(collective, nbytes).name != "flags"
        for nbytes in (most + 1, 256 * KiB - 1, MiB, 16 * MiB):
            assert with_area.plan(collective, nbytes) == without.plan(collective, nbytes)


def test_broadcast_and_reduce_plans():
    assert _pick("broadcast", 256 * KiB, 2) == "binomial"
    assert _pick("broadcast", 256 * KiB - 1, 3) == "binomial"
    assert _pick("broadcast", 256 * KiB, 3) == "pipelined"
    assert _pick("broadcast", 16 * MiB, 8, multi_host=True) == "pipelined"
    assert _pick("reduce", 256 * KiB - 1, 4) == "binomial"
    assert _pick("reduce", 256 * KiB, 2) == "ring"


def test_a_plan_by_name_and_a_hierarchical_plan():
    plan = selection.named("allreduce", "hierarchical")
    assert plan.hierarchical and plan.code == selection.HIERARCHICAL
    assert not selection.named("allreduce", "ring").hierarchical
    with pytest.raises(pc.InvalidArgument, match="unknown algorithm 'nope'.*hierarchical"):
        selection.named("allreduce", "nope")
    with pytest.raises(pc.InvalidArgument, match="reduce: unknown algorithm 'hierarchical'"):
        selection.named("reduce", "hierarchical")


def test_the_allreduce_choices_name_bcube_with_a_base():
    with pytest.raises(pc.InvalidArgument, match=r"choose from .*bcube, .*bcube:B"):
        selection.named("allreduce", "nope")
    with pytest.raises(pc.InvalidArgument) as broadcast_error:
        selection.named("broadcast", "nope")
    assert "bcube:B" not in str(broadcast_error.value)


def test_every_rule_names_an_algorithm_its_collective_runs():
    for rule in selection.RULES:
        assert selection.named(rule.collective, rule.algorithm).name == rule.algorithm
