"""PYCOLLECT_DEBUG's output: detail checks without flooding the log, names algorithms, and a
sub-group's log lines say which group they belong to."""

import logging

import numpy as np
import pytest

import pycollect as pc
from group import ThreadGroup


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@pytest.fixture
def lines():
    logger = logging.getLogger("pycollect")
    handler, level = _Lines(), logger.level
    logger.addHandler(handler)
    yield handler.lines
    logger.removeHandler(handler)
    logger.setLevel(level)


def _group(monkeypatch, flag, size=2):
    monkeypatch.setenv("PYCOLLECT_DEBUG", flag)
    try:
        return ThreadGroup(size, timeout=20)
    finally:
        monkeypatch.delenv("PYCOLLECT_DEBUG")


def test_detail_checks_but_logs_nothing_by_itself(monkeypatch, lines):
    logging.getLogger("pycollect").setLevel(logging.WARNING)
    g = _group(monkeypatch, "detail")
    try:
        g.run(lambda ctx: ctx.allreduce(np.ones(2)))
        assert not logging.getLogger("pycollect").isEnabledFor(logging.DEBUG)
        assert not [line for line in lines if "collective #" in line], lines
        outcomes = g.outcomes(lambda ctx: ctx.allreduce(np.ones(2 + ctx.rank)))
        assert all(isinstance(o, pc.MismatchError) and "PYCOLLECT_DEBUG=detail check" in str(o)
                   for o in outcomes), outcomes
    finally:
        g.close()


def test_one_and_detail_does_both(monkeypatch, lines):
    g = _group(monkeypatch, "1,detail")
    try:
        g.run(lambda ctx: ctx.allreduce(np.ones(2)))
        assert [line for line in lines if "collective #" in line and " ran " in line]
        outcomes = g.outcomes(lambda ctx: ctx.allreduce(np.ones(2 + ctx.rank)))
        assert all(isinstance(o, pc.MismatchError) and "PYCOLLECT_DEBUG=detail check" in str(o)
                   for o in outcomes), outcomes
    finally:
        g.close()


def test_the_detail_mismatch_names_the_algorithm(monkeypatch):
    g = _group(monkeypatch, "detail")
    try:
        outcomes = g.outcomes(lambda ctx: ctx.allreduce(np.ones(2)) if ctx.rank == 0 else
                              ctx.allreduce(np.ones(2), algorithm="ring"))
        for o in outcomes:
            assert isinstance(o, pc.MismatchError)
            assert "algorithm auto)" in str(o) and "algorithm ring)" in str(o), o
            assert "#" not in str(o).split("called", 1)[1], o
    finally:
        g.close()


def test_sub_group_log_lines_name_their_group(monkeypatch, lines):
    g = _group(monkeypatch, "1", size=3)
    try:
        def body(ctx):
            sub = ctx.split(ctx.rank % 2)
            sub.allreduce(np.ones(2))
            pair = ctx.new_group([0, 2])
            if pair is not None:
                pair.barrier()
        g.run(body)
    finally:
        g.close()
    assert any("rank 0 of group split#0 color 0: collective #" in x for x in lines), lines
    assert any("rank 1 of group new_group#1 [0, 2]: collective #" in x for x in lines), lines
