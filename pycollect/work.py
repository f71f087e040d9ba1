"""Async handles, receive statuses, and the thread that runs the queued operations of a
context and its sub-groups.

The Python face of ``pycollect/_ext/_work.pyx``, where they are compiled: ``Work`` (the
handle of an ``async_op=True`` call), ``Status`` (what a receive got), ``wait_all`` and
``wait_any``, and the context's ``Runner``.
"""

from ._ext._work import (BATCH_SLICE_S, P2P, Completion, Later, Runner, Status, Work,
                         wait_all, wait_any, wait_seconds)

__all__ = ["BATCH_SLICE_S", "Completion", "Work", "Later", "P2P", "Runner", "Status",
           "wait_seconds", "wait_all", "wait_any"]
