"""Allreduce and broadcast NumPy arrays across ranks: pycollect-run -n 3 python examples/allreduce.py"""

import sys
import time

import numpy as np

import pycollect as pc

COUNT = 1 << 20  # float32 elements in the allreduce (4 MiB)


def main():
    """Allreduce, then broadcast, checking both results on every rank."""
    # Rank, size and store come from PYCOLLECT_RANK, PYCOLLECT_SIZE and
    # PYCOLLECT_STORE, which pycollect-run sets for each rank.
    with pc.init() as ctx:
        rank, size = ctx.rank, ctx.size

        # Every rank contributes rank+1, so each element sums to 1+2+...+size.
        data = np.full(COUNT, rank + 1, dtype=np.float32)
        ctx.barrier()
        start = time.perf_counter()
        ctx.allreduce(data, op=pc.SUM, algorithm="auto")
        allreduce_s = time.perf_counter() - start
        expected = size * (size + 1) // 2
        if not np.all(data == expected):
            wrong = np.flatnonzero(data != expected)
            sys.exit(f"rank {rank}: allreduce gave {data[wrong[0]]} at index {wrong[0]} "
                     f"({wrong.size} wrong elements), expected {expected}")

        # Rank 0's values replace everyone else's, in place.
        params = np.arange(16, dtype=np.int64) * 10 if rank == 0 else np.zeros(16, np.int64)
        start = time.perf_counter()
        ctx.broadcast(params, root=0)
        broadcast_s = time.perf_counter() - start
        if not np.array_equal(params, np.arange(16) * 10):
            sys.exit(f"rank {rank}: broadcast gave {params}, expected rank 0's values")

        print(f"rank {rank}/{size}: allreduce of {COUNT} float32 = {expected} everywhere "
              f"in {allreduce_s * 1e3:.2f} ms ({data.nbytes / allreduce_s / 1e9:.2f} GB/s), "
              f"broadcast of {params.size} int64 in {broadcast_s * 1e6:.0f} us")


if __name__ == "__main__":
    main()
