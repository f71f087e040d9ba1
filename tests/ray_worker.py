"""The Ray actor the Ray backend tests drive (importable by Ray's worker processes).

Importing this module imports ``pycollect.ray``, which registers the backend
"pycollect" in the worker before any group is made.
"""

import os
import socket
import time
import warnings

import numpy as np
import ray
import ray.util.collective as col

import pycollect as pc
import pycollect.ray as pcray


@ray.remote(num_cpus=0)
class Member:
    """One process of a collective group; each method runs one call and returns its result."""

    def __init__(self):
        self.reset(2)

    def reset(self, world_size):
        """Ray's test buffers: ten float32 ones, and a list of one such array per rank."""
        self.buffer = np.ones(10, np.float32)
        self.list_buffer = [np.ones(10, np.float32) for _ in range(world_size)]
        return True

    def pid(self):
        return os.getpid()

    def node(self):
        return ray.get_runtime_context().get_node_id()

    def hostname(self):
        return socket.gethostname()

    def allreduce_with_algorithm(self, count, group_name="default"):
        """Allreduce ``count`` floats of rank + 1 through the Context; (algorithm, first, last)."""
        ctx = pcray.context(group_name)
        buf = np.full(count, ctx.rank + 1.0, np.float32)
        work = ctx.allreduce(buf, async_op=True)
        work.wait()
        return work.algorithm, float(buf[0]), float(buf[-1])

    def join(self, world_size, rank, group_name="default", backend="pycollect"):
        col.init_collective_group(world_size, rank, backend, group_name)
        return True

    def leave(self, group_name="default"):
        col.destroy_collective_group(group_name)
        return True

    def set_buffer(self, data):
        self.buffer = data
        return True

    def set_list_buffer(self, arrays, copy=True):
        self.list_buffer = [a.copy() if isinstance(a, np.ndarray) else a.clone()
                            for a in arrays] if copy else list(arrays)
        return True

    def get_buffer(self):
        return self.buffer

    def allreduce(self, group_name="default", op=col.types.ReduceOp.SUM):
        col.allreduce(self.buffer, group_name, op)
        return self.buffer

    def reduce(self, group_name="default", dst_rank=0, op=col.types.ReduceOp.SUM):
        col.reduce(self.buffer, dst_rank, group_name, op)
        return self.buffer

    def broadcast(self, group_name="default", src_rank=0):
        col.broadcast(self.buffer, src_rank, group_name)
        return self.buffer

    def allgather(self, group_name="default"):
        col.allgather(self.list_buffer, self.buffer, group_name)
        return self.list_buffer

    def reducescatter(self, group_name="default", op=col.types.ReduceOp.SUM):
        col.reducescatter(self.buffer, self.list_buffer, group_name, op)
        return self.buffer

    def send(self, group_name="default", dst_rank=0):
        col.send(self.buffer, dst_rank, group_name)
        return self.buffer

    def recv(self, group_name="default", src_rank=0):
        col.recv(self.buffer, src_rank, group_name)
        return self.buffer

    def read_only_warnings(self, group_name="default"):
        """allreduce and allgather into read-only arrays of Ray's object store (as Ray hands
        an actor its arguments); each warning's (file name, line) and whether the results
        landed."""
        def read_only(a):
            return ray.get(ray.put(a))
        buf = read_only(np.ones(4, np.float32))
        blocks = [read_only(np.zeros(4, np.float32)) for _ in range(2)]
        assert not buf.flags.writeable and not blocks[0].flags.writeable
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            col.allreduce(buf, group_name)
            col.allgather(blocks, np.ones(4, np.float32), group_name)
        return ([(os.path.basename(w.filename), w.lineno) for w in caught],
                float(buf[0]), [float(b[0]) for b in blocks])

    def refused_outputs(self, group_name="default"):
        """Outputs the result cannot land in: a read-only array that is not Ray's (its
        memory a bytes object: it was written, an immutable bytes changed), strided and
        Fortran-ordered arrays (the result landed in a copy, and was lost); the messages."""
        raw = np.ones(4).tobytes()
        messages = []
        for call in (lambda: col.allreduce(np.frombuffer(raw, np.float64), group_name),
                     lambda: col.allgather([np.zeros((4, 4))[:, :2] for _ in range(2)],
                                           np.ones((4, 2)), group_name),
                     lambda: col.reducescatter(np.asfortranarray(np.zeros((2, 3))),
                                               [np.ones((2, 3)) for _ in range(2)],
                                               group_name)):
            try:
                call()
                messages.append(None)
            except pc.InvalidArgument as exc:
                messages.append(str(exc))
        return messages, raw == np.ones(4).tobytes()

    def barrier(self, group_name="default"):
        col.barrier(group_name)
        return True

    def rank(self, group_name="default"):
        return col.get_rank(group_name)

    def world_size(self, group_name="default"):
        return col.get_collective_group_size(group_name)

    def is_initialized(self, group_name="default"):
        return col.is_group_initialized(group_name)

    def context_timeout(self, group_name="default"):
        return pcray.context(group_name).timeout

    def group_call(self, method, options, group_name="default"):
        """Call the group object's ``method`` on the buffer with Ray options ``options``."""
        group = col.get_group_handle(group_name)
        getattr(group, method)([self.buffer], options)
        return self.buffer

    def beyond_ray(self, group_name="default"):
        """gather, scatter and alltoall through the group's pycollect Context."""
        ctx = pcray.context(group_name)
        mine = np.full(3, ctx.rank + 1, np.int64)
        gathered = ctx.gather(mine, root=0)
        part = np.empty(2, np.int64)
        ctx.scatter(np.arange(2 * ctx.size, dtype=np.int64) if ctx.rank == 0 else None,
                    part, root=0)
        exchanged = ctx.alltoall(np.full(ctx.size, ctx.rank, np.int64))
        work = ctx.allreduce(np.ones(4, np.float64), async_op=True)
        return (None if gathered is None else gathered.tolist(), part.tolist(),
                exchanged.tolist(), work.wait().tolist())

    def allreduce_after(self, delay, group_name="default"):
        """Sleep ``delay`` seconds, then allreduce; return (error class, message, seconds)."""
        time.sleep(delay)
        started = time.monotonic()
        try:
            col.allreduce(np.ones(1 << 16, np.float32), group_name)
        except pc.Error as err:
            return type(err).__name__, str(err), time.monotonic() - started
        return None, "", time.monotonic() - started

    def train(self, steps, group_name="default", seed=0):
        """Data-parallel least squares: each rank's gradient on its shard, averaged by allreduce.

        Returns the final weights, identical on every rank.
        """
        rank, size = col.get_rank(group_name), col.get_collective_group_size(group_name)
        rng = np.random.default_rng(seed)
        features = rng.normal(size=(64 * size, 4))
        target = features @ np.array([1.0, -2.0, 0.5, 3.0])
        shard = slice(64 * rank, 64 * (rank + 1))
        x, y = features[shard], target[shard]
        weights = np.zeros(4)
        for _ in range(steps):
            grad = 2 * x.T @ (x @ weights - y) / len(y)
            col.allreduce(grad, group_name)
            weights -= 0.1 * grad / size
        return weights
