"""pycollect as a collective backend of Ray (``ray.util.collective``).

    import pycollect.ray                 # registers the backend "pycollect"
    import ray.util.collective as col
    col.init_collective_group(world_size, rank, backend="pycollect", group_name="g")
    col.allreduce(array, group_name="g")

Import this module in the driver and in every actor (at the top of the
module that defines the actor class does both) before a group is made.
Each group is one pycollect ``Context``: it rendezvouses through Ray's own
key-value store (``pycollect/plugins/stores/ray_store.py``), so no address or
port is chosen; ranks on one node talk over shared memory, ranks on
different nodes over TCP, bound to the interface that routes to the Ray head.
``context(group_name)`` hands an actor the group's Context for what Ray's
API lacks (gather, scatter, alltoall, sub-groups, async operations).

Arrays are NumPy arrays or CPU torch tensors, passed to pycollect as views
that share their memory; a collective may mix the two.  An array that Ray
handed the actor read-only (an argument or a ``ray.get`` result: its memory
is Ray's object store) is written in place, as Ray's "gloo" backend does,
with a warning: copy it first when anything else reads that object; any other
read-only array is refused, and so is an output that is not contiguous.  The
deadline of a group made by ``create_collective_group`` is its ``gloo_timeout``
(Ray keeps 30000 ms where none is given; ``gloo_timeout=None`` leaves it to
``PYCOLLECT_TIMEOUT``); a group made by ``init_collective_group`` takes
``PYCOLLECT_TIMEOUT`` (120 s when unset: Ray passes that call's ``gloo_timeout``
to its gloo backend only).  An option's ``timeout_ms`` bounds one call.  See
docs/ray.md.
"""

import ctypes
import itertools
import os
import sys
import warnings

import numpy as np
import ray
import ray.util.collective as col
from ray.util.collective import types as ray_types
from ray.util.collective.collective_group.base_collective_group import BaseGroup

import pycollect as pc
from . import settings
from .plugins.stores.ray_store import RayStore
from .tensors import array_view

__all__ = ["BACKEND_NAME", "PycollectGroup", "context", "register"]

BACKEND_NAME = "pycollect"
INFO_ACTOR_PREFIX = "info_"       # create_collective_group's named actor per group

_OPS = {
    ray_types.ReduceOp.SUM: pc.SUM,
    ray_types.ReduceOp.PRODUCT: pc.PRODUCT,
    ray_types.ReduceOp.MIN: pc.MIN,
    ray_types.ReduceOp.MAX: pc.MAX,
}
_UNSET = ray_types.unset_timeout_ms
_RAY_SUM = ray_types.ReduceOp.SUM
_opened = itertools.count()
# Ray's collective library: its frames lie between the program's call and this module.
_RAY_COLLECTIVE = os.path.dirname(col.__file__) + os.sep

def register():
    """Register the backend ``"pycollect"`` with Ray in this process (importing does it)."""
    if not col.is_backend_available(BACKEND_NAME):
        col.register_collective_backend(BACKEND_NAME, PycollectGroup)


# -- arrays ------------------------------------------------------------------

def _single(tensors, what):
    """The one array of Ray's one-element list (a bare array is taken too)."""
    if type(tensors) is list:
        if len(tensors) != 1:
            raise pc.InvalidArgument("%s: the pycollect backend takes one array per process, "
                                     "got a list of %d" % (what, len(tensors)))
        return tensors[0]
    return tensors


def _array(obj, what):
    """``obj`` (a NumPy array or a CPU torch tensor) as a NumPy array sharing its memory."""
    if isinstance(obj, np.ndarray):
        return obj
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        if obj.device.type != "cpu":
            raise pc.InvalidArgument("%s: the tensor is on %s; the pycollect backend takes "
                                     "CPU tensors (use backend 'nccl' for GPUs)"
                                     % (what, obj.device))
        if not obj.is_contiguous():
            raise pc.InvalidArgument("%s: the tensor is not contiguous; pass t.contiguous()"
                                     % what)
        try:
            return array_view(obj)
        except pc.InvalidArgument as exc:
            raise pc.InvalidArgument("%s: %s" % (what, exc)) from None
    raise pc.InvalidArgument("%s: expected a NumPy array or a CPU torch.Tensor, got %s"
                             % (what, type(obj).__name__))


def _in_ray_object_store(arr):
    """Whether ``arr``'s memory is Ray's object store: its chain of bases ends in a buffer
    of Ray's (how Ray hands an actor a deserialized array)."""
    base = arr
    for _ in range(16):     # bounded: a chain of views is short
        if type(base).__module__.partition(".")[0] == "ray":
            return True
        nxt = getattr(base, "base", None)
        if nxt is None:
            return False
        base = nxt
    return False


def _output(obj, what):
    """``_array(obj)``, writable and contiguous (the result lands in it, in place): a
    read-only array in Ray's object store is written in place; any other read-only array
    (bytes, a read-only memory map) is refused."""
    arr = _array(obj, what)
    if not arr.flags.c_contiguous:
        # reshape(-1) of it is a copy: the result would land there, and be lost
        raise pc.InvalidArgument("%s: the array is not contiguous, and the result is written "
                                 "in place; pass a contiguous one (np.ascontiguousarray, "
                                 "then copy back)" % what)
    if arr.flags.writeable:
        return arr
    if not _in_ray_object_store(arr):
        raise pc.InvalidArgument("%s: the array is read-only (not memory of Ray's object "
                                 "store, which is written anyway)" % what)
    warnings.warn("pycollect.ray: %s writes into a read-only array (memory of Ray's object "
                  "store, as Ray's gloo backend does); copy it first (array.copy()) if "
                  "anything else reads that object" % what, RuntimeWarning,
                  stacklevel=_caller_level())
    raw = (ctypes.c_char * arr.nbytes).from_address(arr.ctypes.data)
    return np.frombuffer(raw, arr.dtype).reshape(arr.shape)


def _caller_level():
    """The ``stacklevel`` of the first frame, seen from the caller, that is neither this
    module's nor Ray's collective library's: the line of the program that called Ray, so
    that a warning shows once per such line (a list comprehension, say, is a frame too)."""
    frame, level = sys._getframe(1), 1
    while frame is not None and (frame.f_code.co_filename == __file__ or
                                 frame.f_code.co_filename.startswith(_RAY_COLLECTIVE)):
        frame, level = frame.f_back, level + 1
    return level


def _blocks(tensor_list, world_size, like, what):
    """The arrays of Ray's ``[list]`` argument, checked against ``like``: one per rank."""
    inner = _single(tensor_list, what)
    if not isinstance(inner, (list, tuple)) or len(inner) != world_size:
        raise pc.InvalidArgument("%s: needs a list of %d arrays (one per rank), got %s"
                                 % (what, world_size, _describe(inner)))
    arrays = []
    for i, obj in enumerate(inner):
        arr = _array(obj, "%s: list[%d]" % (what, i))
        if arr.size != like.size or arr.dtype != like.dtype:
            raise pc.InvalidArgument("%s: list[%d] holds %d %s, the tensor %d %s"
                                     % (what, i, arr.size, arr.dtype, like.size, like.dtype))
        arrays.append(arr)
    return inner, arrays


def _describe(obj):
    if isinstance(obj, (list, tuple)):
        return "%d" % len(obj)
    return "a %s" % type(obj).__name__


def _reduce_op(op, what):
    try:
        return _OPS[op]
    except (KeyError, TypeError):
        if type(op) is pc.ReduceOp:
            return op       # beyond Ray's four: pycollect's AVG, BAND, BOR, BXOR
        raise pc.InvalidArgument("%s: unknown reduction op %r (Ray's ReduceOp or "
                                 "pycollect.ReduceOp)" % (what, op)) from None


def _call_timeout(options):
    """An option's ``timeout_ms`` in seconds, or None when it is unset."""
    timeout = getattr(options, "timeout_ms", _UNSET)
    if timeout is _UNSET or timeout is None:
        return None
    seconds = timeout.total_seconds() if hasattr(timeout, "total_seconds") else timeout / 1e3
    return min(seconds, pc.MAX_TIMEOUT_S) if seconds > 0 else None


# -- the group ---------------------------------------------------------------

def _group_timeout(group_name):
    """The group's deadline: create_collective_group's gloo_timeout (Ray keeps 30000 ms where
    none was given), else PYCOLLECT_TIMEOUT."""
    try:
        info = ray.get_actor(INFO_ACTOR_PREFIX + group_name)
    except ValueError:
        info = None
    if info is not None:
        gloo_timeout_ms = ray.get(info.get_info.remote())[4]
        if gloo_timeout_ms:
            return min(gloo_timeout_ms / 1e3, pc.MAX_TIMEOUT_S)
    return settings.get("PYCOLLECT_TIMEOUT")


class PycollectGroup(BaseGroup):
    """One Ray collective group: a pycollect Context rendezvoused through Ray's key-value store."""

    def __init__(self, world_size, rank, group_name):
        super().__init__(world_size, rank, group_name)
        timeout = _group_timeout(group_name)
        namespace = ray.get_runtime_context().namespace
        # A fresh label per group made: pycollect numbers contexts per store URL, and a
        # group re-made under its old name must number like a newly started actor.
        store = RayStore("%s/%s" % (namespace, group_name), timeout=timeout,
                         label="%d.%d" % (os.getpid(), next(_opened)))
        try:
            self._context = pc.init(rank=rank, size=world_size, store=store, timeout=timeout)
            # Past this barrier every rank has finished with the store: clear its keys.
            self._context.barrier()
        except BaseException:
            store.close()
            raise
        if rank == 0:
            store.cleanup()
        else:
            store.close()

    @property
    def context(self):
        """The group's ``pycollect.Context``."""
        return self._context

    @classmethod
    def backend(cls):
        return BACKEND_NAME.upper()

    @classmethod
    def check_backend_availability(cls):
        return True

    def destroy_group(self):
        self._context.close()

    def _run(self, options, what, start):
        """``start(async_op)``, bounded by the option's ``timeout_ms`` when it is shorter."""
        limit = _call_timeout(options)
        if limit is None or limit >= self._context.timeout:
            return start(False)
        work = start(True)
        try:
            return work.wait(limit)
        except pc.Timeout:
            self._context.abort()
            raise pc.Timeout("rank %d of group %r: %s did not complete within its "
                             "timeout_ms of %g s; the group has failed: destroy it and make "
                             "a new one" % (self._rank, self._group_name, what, limit)) \
                from None

    def allreduce(self, tensor, allreduce_options=ray_types.AllReduceOptions):
        # The usual case (one writable NumPy array, SUM, no timeout_ms) takes the
        # shortest road: this is the per-call cost the benchmark's "Ray's layer" shows.
        buf = tensor[0] if type(tensor) is list and len(tensor) == 1 else tensor
        if type(buf) is not np.ndarray or not buf.flags.writeable:
            buf = _output(_single(tensor, "allreduce"), "allreduce")
        op = allreduce_options.reduceOp
        op = pc.SUM if op is _RAY_SUM else _reduce_op(op, "allreduce")
        if allreduce_options.timeout_ms is _UNSET:
            self._context.allreduce(buf, op)
            return
        self._run(allreduce_options, "allreduce",
                  lambda async_op: self._context.allreduce(buf, op, async_op=async_op))

    def barrier(self, barrier_options=ray_types.BarrierOptions):
        self._run(barrier_options, "barrier",
                  lambda async_op: self._context.barrier(async_op=async_op))

    def reduce(self, tensor, reduce_options=ray_types.ReduceOptions):
        root = reduce_options.root_rank
        obj = _single(tensor, "reduce")
        buf = _output(obj, "reduce") if root == self._rank else _array(obj, "reduce")
        op = _reduce_op(reduce_options.reduceOp, "reduce")
        self._run(reduce_options, "reduce",
                  lambda async_op: self._context.reduce(buf, root, op, async_op=async_op))

    def broadcast(self, tensor, broadcast_options=ray_types.BroadcastOptions):
        root = broadcast_options.root_rank
        obj = _single(tensor, "broadcast")
        buf = _array(obj, "broadcast") if root == self._rank else _output(obj, "broadcast")
        self._run(broadcast_options, "broadcast",
                  lambda async_op: self._context.broadcast(buf, root, async_op=async_op))

    def allgather(self, tensor_list, tensor, allgather_options=ray_types.AllGatherOptions):
        send = _array(_single(tensor, "allgather"), "allgather")
        _, outputs = _blocks(tensor_list, self._world_size, send, "allgather")
        outputs = [_output(out, "allgather") for out in outputs]
        gathered = np.empty((self._world_size, send.size), send.dtype)
        self._run(allgather_options, "allgather", lambda async_op: self._context.allgather(
            send.reshape(-1), gathered, async_op=async_op))
        for out, block in zip(outputs, gathered):
            out.reshape(-1)[...] = block

    def reducescatter(self, tensor, tensor_list,
                      reducescatter_options=ray_types.ReduceScatterOptions):
        out = _output(_single(tensor, "reducescatter"), "reducescatter")
        _, blocks = _blocks(tensor_list, self._world_size, out, "reducescatter")
        send = np.concatenate([block.reshape(-1) for block in blocks])
        op = _reduce_op(reducescatter_options.reduceOp, "reducescatter")
        self._run(reducescatter_options, "reducescatter",
                  lambda async_op: self._context.reduce_scatter(
                      send, out.reshape(-1), op, async_op=async_op))

    def send(self, tensor, send_options):
        buf = _array(_single(tensor, "send"), "send")
        dst = send_options.dst_rank
        self._run(send_options, "send",
                  lambda async_op: self._context.send(buf, dst, async_op=async_op))

    def recv(self, tensor, recv_options):
        buf = _output(_single(tensor, "recv"), "recv")
        src = recv_options.src_rank
        self._run(recv_options, "recv",
                  lambda async_op: self._context.recv(buf, src, async_op=async_op))


def context(group_name="default"):
    """The ``pycollect.Context`` of this actor's group ``group_name`` (backend "pycollect")."""
    group = col.get_group_handle(group_name)
    if not isinstance(group, PycollectGroup):
        raise pc.InvalidArgument("group %r uses backend %s, not pycollect"
                                 % (group_name, group.backend()))
    return group.context


register()
