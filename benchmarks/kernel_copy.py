"""What one cross-memory-attach call costs: the piece size of the direct algorithms.

    python benchmarks/kernel_copy.py                    # 4 MiB in pieces of 4 KiB .. 4 MiB
    python benchmarks/kernel_copy.py --bytes 1048576 --pieces 262144,1048576

The direct algorithms (pycollect/_ext/_direct.pyx) copy a peer's buffer with
process_vm_readv and write into it with process_vm_writev wherever the peer's
buffer is not mapped here.  Two processes (a parent and a child it forks, each
with its own buffer in a fresh mapping advised for huge pages, as NumPy's large
arrays are) time moving ``--bytes`` between them in pieces of each size, one
call per piece, the median of ``--repeat`` transfers after a warmup, both ways;
then a plain memcpy of the same bytes inside one process.  The difference
between two piece sizes, divided by the difference in calls, is what a call
costs beyond its copy.
"""

import argparse
import ctypes
import mmap
import os
import statistics
import time

import numpy as np

from turns import int_list

HUGE = 2 << 20
MADV_HUGEPAGE = 14


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _buffer(nbytes, libc):
    """A touched array of ``nbytes`` in a mapping of its own, aligned and advised for huge
    pages; the mapping is returned with it (it must stay alive)."""
    m = mmap.mmap(-1, nbytes + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = np.frombuffer(m, np.uint8)
    start = (-whole.ctypes.data) % HUGE
    a = whole[start:start + nbytes]
    libc.madvise(ctypes.c_void_p(a.ctypes.data), ctypes.c_size_t(nbytes), MADV_HUGEPAGE)
    a[:] = 1
    return m, a


def _transfer(libc, pid, local, remote_addr, nbytes, piece, write):
    call = libc.process_vm_writev if write else libc.process_vm_readv
    off = 0
    while off < nbytes:
        take = min(piece, nbytes - off)
        mine = _IoVec(local.ctypes.data + off, take)
        theirs = _IoVec(remote_addr + off, take)
        got = call(pid, ctypes.byref(mine), 1, ctypes.byref(theirs), 1, 0)
        if got != take:
            err = ctypes.get_errno()
            raise OSError(err, "%s: %s" % (call.__name__, os.strerror(err)))
        off += take


def _median_us(fn, repeat, warmup=5):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bytes", type=int, default=4 << 20, help="bytes moved per transfer")
    parser.add_argument("--pieces", default="4096,65536,262144,1048576,4194304",
                        help="piece sizes (bytes per call), comma-separated")
    parser.add_argument("--repeat", type=int, default=50, help="timed transfers per case")
    args = parser.parse_args()
    pieces = int_list(parser, "--pieces", args.pieces, 1)     # bytes
    if args.bytes < 0:
        parser.error("--bytes must be 0 or more, got %d" % args.bytes)
    if args.repeat < 1:
        parser.error("--repeat must be at least 1, got %d" % args.repeat)
    libc = ctypes.CDLL(None, use_errno=True)

    to_child_r, to_child_w = os.pipe()
    to_parent_r, to_parent_w = os.pipe()
    pid = os.fork()
    if pid == 0:                    # the peer: its own buffer, allocated after the fork
        os.close(to_parent_r)
        keep, theirs = _buffer(args.bytes, libc)
        os.write(to_parent_w, b"%d\n" % theirs.ctypes.data)
        os.read(to_child_r, 1)      # until the parent is done
        os._exit(0)
    os.close(to_parent_w)
    try:
        remote = int(os.read(to_parent_r, 64))
        keep, mine = _buffer(args.bytes, libc)
        print(f"{args.bytes} bytes between two processes, median of {args.repeat} transfers")
        print(f"{'piece':>9} {'calls':>6} {'process_vm_readv':>17} {'process_vm_writev':>18}")
        for piece in pieces:
            calls = -(-args.bytes // piece)
            read = _median_us(lambda: _transfer(libc, pid, mine, remote, args.bytes, piece, 0),
                              args.repeat)
            write = _median_us(lambda: _transfer(libc, pid, mine, remote, args.bytes, piece, 1),
                               args.repeat)
            print(f"{piece:>9} {calls:>6} {read:>14.0f} µs {write:>15.0f} µs")
        other = np.empty_like(mine)
        copy = _median_us(lambda: np.copyto(other, mine), args.repeat)
        print(f"memcpy of the same bytes in one process: {copy:.0f} µs")
    finally:
        os.write(to_child_w, b"x")
        os.waitpid(pid, 0)


if __name__ == "__main__":
    main()
