"""A whole small job on thread ranks: init through a store, one checked allreduce, close."""

import numpy as np

import pycollect as pc
from group import run_ranks


def allreduce_job(size, store, **init_kwargs):
    """Run ``size`` ranks through ``store``; every rank's allreduce must give the exact sum."""
    contexts = run_ranks(size, lambda r: pc.init(rank=r, size=size, store=store,
                                                 **init_kwargs))
    try:
        results = run_ranks(size, lambda r: contexts[r].allreduce(np.full(5, r + 1.0)))
        expected = np.full(5, size * (size + 1) / 2)
        assert all(np.array_equal(result, expected) for result in results), results
    finally:
        for ctx in contexts:
            ctx.close()
