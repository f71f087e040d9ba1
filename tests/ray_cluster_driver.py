"""Driver of the two-node Ray test: four actors on two nodes, one "pycollect" group, one JSON line.

    python ray_cluster_driver.py HEAD_ADDRESS:PORT

Runs inside the head's network namespace.  Each node offers a resource
named after it ("node1", "node2"), so that ranks 0 and 2 land on node 1 and
ranks 1 and 3 on node 2: every host holds two ranks, and consecutive ranks sit
on different hosts.
"""

import json
import socket
import sys
import time

import numpy as np
import ray

NODES_WAIT_S = 60
CALL_TIMEOUT_S = 60
PLACEMENT = ["node1", "node2", "node1", "node2"]


def wait_for_head(address):
    """Wait until the head's control service accepts connections (it starts in seconds)."""
    host, _, port = address.rpartition(":")
    end = time.monotonic() + NODES_WAIT_S
    while True:
        try:
            socket.create_connection((host, int(port)), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > end:
                raise SystemExit("the head at %s did not start within %d s"
                                 % (address, NODES_WAIT_S))
            time.sleep(0.2)


def main(address):
    wait_for_head(address)
    ray.init(address=address, log_to_driver=False)
    end = time.monotonic() + NODES_WAIT_S
    while sum(1 for node in ray.nodes() if node["Alive"]) < 2:
        if time.monotonic() > end:
            raise SystemExit("the worker node did not join within %d s" % NODES_WAIT_S)
        time.sleep(0.2)
    from ray_worker import Member
    actors = [Member.options(resources={node: 1}).remote() for node in PLACEMENT]
    size = len(actors)
    assert ray.get([a.join.remote(size, r, "two-nodes") for r, a in enumerate(actors)],
                   timeout=CALL_TIMEOUT_S) == [True] * size
    report = {
        "hosts": ray.get([a.hostname.remote() for a in actors], timeout=CALL_TIMEOUT_S),
        "nodes": ray.get([a.node.remote() for a in actors], timeout=CALL_TIMEOUT_S),
        # 1M floats: past the size from which auto goes hierarchical on several hosts.
        "large": ray.get([a.allreduce_with_algorithm.remote(1 << 20, "two-nodes")
                          for a in actors], timeout=CALL_TIMEOUT_S),
        "small": ray.get([a.allreduce_with_algorithm.remote(4, "two-nodes")
                          for a in actors], timeout=CALL_TIMEOUT_S),
    }
    for a in actors:
        a.set_buffer.remote(np.arange(8, dtype=np.float64))
    report["ray_api"] = [r.tolist() for r in ray.get([a.allreduce.remote("two-nodes")
                                                      for a in actors],
                                                     timeout=CALL_TIMEOUT_S)]
    ray.get([a.leave.remote("two-nodes") for a in actors], timeout=CALL_TIMEOUT_S)
    print(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1])
