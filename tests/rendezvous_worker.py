"""One rank of a launcher test: a bare ``pc.init()``, an allreduce and a broadcast, checked.

Usage: python tests/rendezvous_worker.py [--timeout S]   (under any launcher)

Rank, size and store come from the environment, as the launcher left it.
Success prints one JSON line (rank, size, the address this rank listened on
and why) and exits 0; a wrong result exits 1 with the reason on stderr.
"""

import argparse
import json
import logging
import re
import sys

import numpy as np

import pycollect as pc

COUNT = 1000
LISTENING = re.compile(r"rank (\d+): listening on (\S+) \((.*)\)")


class _ListenRecorder(logging.Handler):
    """Remembers the TCP transport's 'listening on ADDRESS (why)' debug line."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.address, self.why = None, None

    def emit(self, record):
        match = LISTENING.match(record.getMessage())
        if match:
            self.address, self.why = match.group(2), match.group(3)


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--timeout", type=float, default=30.0)
    args = parser.parse_args()
    recorder = _ListenRecorder()
    transport_log = logging.getLogger("pycollect.tcp")
    transport_log.addHandler(recorder)
    transport_log.setLevel(logging.DEBUG)
    with pc.init(timeout=args.timeout) as ctx:
        rank, size = ctx.rank, ctx.size
        data = np.full(COUNT, rank + 1.0)
        ctx.allreduce(data)
        if not np.all(data == size * (size + 1) / 2):
            sys.exit("rank %d: allreduce gave %r" % (rank, data[:4]))
        params = np.arange(16) * 7 if rank == 0 else np.zeros(16, np.int64)
        ctx.broadcast(params, root=0)
        if not np.array_equal(params, np.arange(16) * 7):
            sys.exit("rank %d: broadcast gave %r" % (rank, params))
        ctx.barrier()   # nobody closes (rank 0 may host the store) before all are done
        print(json.dumps({"rank": rank, "size": size, "address": recorder.address,
                          "why": recorder.why}), flush=True)


if __name__ == "__main__":
    main()
