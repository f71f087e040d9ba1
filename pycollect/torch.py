"""pycollect as a ``torch.distributed`` backend for CPU tensors.

    import pycollect.torch            # registers the backend "pycollect"
    import torch.distributed as dist
    dist.init_process_group("pycollect", init_method=..., rank=r, world_size=n)

Every group torch creates (``new_group`` included) gets its own pycollect
Context, rendezvoused through the store torch hands the backend.  Tensors are
passed to pycollect as zero-copy NumPy views when they are contiguous; other
tensors are copied in and out.  Operations run synchronously: the returned
``Work`` is already complete and its future already holds the outputs.

Limits: a backend written in Python replaces the whole process group, so
``"cpu:pycollect,cuda:nccl"`` is not possible; CUDA tensors are rejected.
See docs/torch.md.
"""

import datetime

import numpy as np
import torch
import torch.distributed as dist

import pycollect as pc
from .plugins.store import Store

__all__ = ["BACKEND_NAME", "ProcessGroupPycollect", "TorchStore", "PycollectWork"]

BACKEND_NAME = "pycollect"

try:
    import ml_dtypes as _ml_dtypes
except ImportError:     # bfloat16 tensors then raise a clear error
    _ml_dtypes = None

_R = dist.ReduceOp.RedOpType
_OPS = {
    _R.SUM: pc.SUM, _R.AVG: pc.AVG, _R.PRODUCT: pc.PRODUCT, _R.MIN: pc.MIN, _R.MAX: pc.MAX,
    _R.BAND: pc.BAND, _R.BOR: pc.BOR, _R.BXOR: pc.BXOR,
}


# -- store -------------------------------------------------------------------

class TorchStore(Store):
    """A ``pycollect.Store`` over a ``torch.distributed.Store`` (c10d)."""

    def __init__(self, store, timeout=None):
        super().__init__(timeout)
        self._store = store
        # Unique per adapter: pycollect numbers the contexts made per store URL,
        # and each torch group hands us its own (already prefixed) store.
        self.url = "torch-c10d-store:%x" % id(self)

    def _wait_torch(self, keys, deadline):
        remaining = deadline.remaining()
        try:
            self._store.wait(list(keys), datetime.timedelta(seconds=max(remaining, 0.001)))
        except Exception as err:   # DistStoreError / RuntimeError on timeout
            missing = [k for k in keys if not self._store.check([k])]
            if missing:
                raise self.timeout_error(missing, deadline) from err
            raise pc.StoreError("torch store wait failed: %s" % err) from err

    def _set(self, key, value):
        self._store.set(key, value)

    def _get(self, key, deadline):
        self._wait_torch([key], deadline)
        return bytes(self._store.get(key))

    def _wait(self, keys, deadline):
        self._wait_torch(keys, deadline)

    def _add(self, key, amount):
        return int(self._store.add(key, amount))

    def _delete(self, key):
        return bool(self._store.delete_key(key))

    def _check(self, keys):
        return bool(self._store.check(list(keys)))


# -- tensors -----------------------------------------------------------------

def _check_cpu(t, what):
    if not isinstance(t, torch.Tensor):
        raise TypeError("pycollect backend: %s must be a torch.Tensor, got %s"
                        % (what, type(t).__name__))
    if t.device.type != "cpu":
        raise RuntimeError(
            "pycollect backend: %s is on device %s; the pycollect torch backend supports CPU "
            "tensors only (GPU buffers are not supported yet; use nccl for CUDA tensors)"
            % (what, t.device))
    if t.is_sparse:
        raise RuntimeError("pycollect backend: sparse tensors are not supported (%s)" % what)


def _view(t):
    """A NumPy view of contiguous CPU tensor ``t`` (flattened, shares memory)."""
    t = t.detach()
    if t.dtype == torch.bfloat16:
        if _ml_dtypes is None:
            raise RuntimeError("pycollect backend: bfloat16 tensors need the ml_dtypes package")
        return t.view(torch.int16).numpy().view(_ml_dtypes.bfloat16).reshape(-1)
    return t.numpy().reshape(-1)


class _Buf:
    """A tensor as a contiguous NumPy array; ``finish()`` copies back if it was copied in."""

    __slots__ = ("tensor", "staging", "array")

    def __init__(self, t, what, copy_in=True):
        _check_cpu(t, what)
        self.tensor = t
        if t.is_contiguous():
            self.staging = None
            self.array = _view(t)
        else:
            self.staging = t.detach().contiguous() if copy_in else torch.empty(
                t.shape, dtype=t.dtype)
            self.array = _view(self.staging)

    def finish(self):
        if self.staging is not None:
            with torch.no_grad():
                self.tensor.copy_(self.staging)


def _flat_input(t, what):
    """A contiguous NumPy array holding ``t``'s values (a view when possible)."""
    _check_cpu(t, what)
    return _view(t if t.is_contiguous() else t.detach().contiguous())


def _reduce_op(opts, what):
    rop = opts.reduceOp
    code = getattr(rop, "op", rop)
    if code == _R.PREMUL_SUM:
        return pc.SUM, _premul_factor(rop, what)
    try:
        return _OPS[code], None
    except (KeyError, TypeError):
        raise RuntimeError("pycollect backend: %s does not support reduce op %r"
                           % (what, rop)) from None


def _premul_factor(rop, what):
    for name in ("factor", "_factor"):
        f = getattr(rop, name, None)
        if f is not None:
            return f.item() if isinstance(f, torch.Tensor) else float(f)
    raise RuntimeError("pycollect backend: %s got PREMUL_SUM without a readable factor" % what)


def _scale(arrays, factor):
    if factor is not None:
        for a in arrays:
            a *= np.asarray(factor).astype(a.dtype)


# -- work --------------------------------------------------------------------

class PycollectWork(dist.Work):
    """A completed operation: ``wait()`` returns True, ``get_future()`` holds the outputs."""

    def __init__(self, outputs, source_rank=-1):
        super().__init__()
        self._outputs = outputs
        self._source = source_rank
        self._fut = torch.futures.Future()
        self._fut.set_result(outputs)

    def wait(self, timeout=None):
        return True

    def is_completed(self):
        return True

    def is_success(self):
        return True

    def exception(self):
        return None

    def result(self):
        return self._outputs

    def get_future(self):
        return self._fut

    def synchronize(self):
        pass

    def _source_rank(self):
        return self._source

    def source_rank(self):
        return self._source


# -- process group -----------------------------------------------------------

class ProcessGroupPycollect(dist.ProcessGroup):
    """A torch ProcessGroup whose collectives run on a pycollect Context."""

    def __init__(self, store, rank, size, timeout):
        super().__init__(rank, size)
        seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else timeout
        if not seconds or seconds <= 0:
            seconds = pc.DEFAULT_TIMEOUT
        self._pc_store = TorchStore(store, timeout=seconds)
        self._ctx = pc.init(rank=rank, size=size, store=self._pc_store, timeout=seconds)
        self._group_name = None
        self._group_desc = None

    # names, life cycle
    def getBackendName(self):
        return BACKEND_NAME

    def name(self):
        return BACKEND_NAME

    def getGroupName(self):
        return self._group_name

    def setGroupName(self, name):
        self._group_name = name

    def getGroupDesc(self):
        return self._group_desc

    def setGroupDesc(self, desc):
        self._group_desc = desc

    @property
    def context(self):
        """The pycollect Context under this group."""
        return self._ctx

    def shutdown(self):
        ctx, self._ctx = self._ctx, None
        if ctx is not None:
            ctx.close()

    def abort(self):
        ctx, self._ctx = self._ctx, None
        if ctx is not None:
            ctx.abort()

    def _c(self):
        if self._ctx is None:
            raise RuntimeError("pycollect backend: the process group has been shut down")
        return self._ctx

    # collectives
    def allreduce(self, tensors, opts=None):
        op, factor = _reduce_op(opts, "allreduce") if opts is not None else (pc.SUM, None)
        bufs = [_Buf(t, "allreduce tensor") for t in tensors]
        _scale([b.array for b in bufs], factor)
        ctx = self._c()
        if len(bufs) == 1:
            ctx.allreduce(bufs[0].array, op)
        else:
            ctx.allreduce_coalesced([b.array for b in bufs], op)
        for b in bufs:
            b.finish()
        return PycollectWork(list(tensors))

    def allreduce_coalesced(self, tensors, opts=None):
        return self.allreduce(tensors, opts)

    def broadcast(self, tensors, opts):
        root = opts.rootRank
        for t in tensors:
            b = _Buf(t, "broadcast tensor")
            self._c().broadcast(b.array, root)
            b.finish()
        return PycollectWork(list(tensors))

    def reduce(self, tensors, opts):
        op, factor = _reduce_op(opts, "reduce")
        for t in tensors:
            b = _Buf(t, "reduce tensor")
            if factor is not None:
                # pycollect's reduce leaves non-root buffers untouched; torch's
                # contract does not promise that, but stay clean: scale a copy.
                work = b.array.copy()
                _scale([work], factor)
                self._c().reduce(work, opts.rootRank, op)
                if self._c().rank == opts.rootRank:
                    b.array[...] = work
            else:
                self._c().reduce(b.array, opts.rootRank, op)
            b.finish()
        return PycollectWork(list(tensors))

    def allgather(self, output_tensors, input_tensors, opts=None):
        ctx = self._c()
        for outs, inp in zip(output_tensors, input_tensors):
            send = _flat_input(inp, "allgather input")
            recv = np.empty((ctx.size,) + send.shape, dtype=send.dtype)
            ctx.allgather(send, recv)
            for r, out in enumerate(outs):
                b = _Buf(out, "allgather output", copy_in=False)
                b.array[...] = recv[r]
                b.finish()
        return PycollectWork(output_tensors)

    def allgather_coalesced(self, output_lists, input_list, opts=None):
        for outs, inp in zip(output_lists, input_list):
            self.allgather([outs], [inp], opts)
        return PycollectWork(output_lists)

    def _allgather_base(self, output, input, opts=None):
        ctx = self._c()
        send = _flat_input(input, "all_gather_into_tensor input")
        b = _Buf(output, "all_gather_into_tensor output", copy_in=False)
        if b.array.size != send.size * ctx.size:
            raise ValueError("pycollect backend: all_gather_into_tensor output holds %d "
                             "elements, expected %d x %d" % (b.array.size, ctx.size, send.size))
        ctx.allgather(send, b.array.reshape(ctx.size, send.size))
        b.finish()
        return PycollectWork([output])

    def all_gather_single(self, output, input, opts=None):
        return self._allgather_base(output, input, opts)

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        for o, i in zip(outputs, inputs):
            self._allgather_base(o, i, opts)
        return PycollectWork(list(outputs))

    def reduce_scatter(self, output_tensors, input_lists, opts):
        op, factor = _reduce_op(opts, "reduce_scatter")
        for out, ins in zip(output_tensors, input_lists):
            send = np.concatenate([_flat_input(t, "reduce_scatter input").copy() for t in ins])
            _scale([send], factor)
            b = _Buf(out, "reduce_scatter output", copy_in=False)
            self._c().reduce_scatter(send, b.array, op)
            b.finish()
        return PycollectWork(list(output_tensors))

    def _reduce_scatter_base(self, output, input, opts):
        op, factor = _reduce_op(opts, "reduce_scatter_tensor")
        send = _flat_input(input, "reduce_scatter_tensor input")
        if factor is not None or not input.is_contiguous():
            send = send.copy()
            _scale([send], factor)
        b = _Buf(output, "reduce_scatter_tensor output", copy_in=False)
        self._c().reduce_scatter(send, b.array, op)
        b.finish()
        return PycollectWork([output])

    def reduce_scatter_single(self, output, input, opts):
        return self._reduce_scatter_base(output, input, opts)

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts):
        for o, i in zip(outputs, inputs):
            self._reduce_scatter_base(o, i, opts)
        return PycollectWork(list(outputs))

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes,
                          opts=None):
        ctx = self._c()
        send = _flat_input(input, "all_to_all_single input")
        b = _Buf(output, "all_to_all_single output", copy_in=False)
        sendcounts = _counts(input, input_split_sizes, ctx.size, "input")
        recvcounts = _counts(output, output_split_sizes, ctx.size, "output")
        ctx.alltoallv(send, sendcounts, b.array, recvcounts)
        b.finish()
        return PycollectWork([output])

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        return self.all_to_all_single(output, input, output_split_sizes, input_split_sizes,
                                      opts)

    def alltoall(self, output_tensors, input_tensors, opts=None):
        ctx = self._c()
        sends = [_flat_input(t, "all_to_all input") for t in input_tensors]
        send = np.concatenate(sends) if sends else np.empty(0)
        recvcounts = [t.numel() for t in output_tensors]
        recv = np.empty(sum(recvcounts), dtype=send.dtype)
        ctx.alltoallv(send, [a.size for a in sends], recv, recvcounts)
        offset = 0
        for t, n in zip(output_tensors, recvcounts):
            b = _Buf(t, "all_to_all output", copy_in=False)
            b.array[...] = recv[offset:offset + n]
            b.finish()
            offset += n
        return PycollectWork(list(output_tensors))

    def gather(self, output_lists, input_tensors, opts):
        ctx = self._c()
        root = opts.rootRank
        for i, inp in enumerate(input_tensors):
            send = _flat_input(inp, "gather input")
            if ctx.rank == root:
                recv = np.empty((ctx.size,) + send.shape, dtype=send.dtype)
                ctx.gather(send, recv, root)
                for r, out in enumerate(output_lists[i]):
                    b = _Buf(out, "gather output", copy_in=False)
                    b.array[...] = recv[r]
                    b.finish()
            else:
                ctx.gather(send, None, root)
        return PycollectWork(output_lists)

    def scatter(self, output_tensors, input_lists, opts):
        ctx = self._c()
        root = opts.rootRank
        for i, out in enumerate(output_tensors):
            b = _Buf(out, "scatter output", copy_in=False)
            send = None
            if ctx.rank == root:
                send = np.concatenate([_flat_input(t, "scatter input") for t in input_lists[i]])
            ctx.scatter(send, b.array, root)
            b.finish()
        return PycollectWork(list(output_tensors))

    def barrier(self, opts=None):
        self._c().barrier()
        return PycollectWork([])

    def monitored_barrier(self, timeout=None, wait_all_ranks=False):
        if isinstance(timeout, datetime.timedelta):
            timeout = timeout.total_seconds()
        self._c().monitored_barrier(timeout)

    # point to point
    def send(self, tensors, dst, tag=0):
        for t in tensors:
            self._c().send(_flat_input(t, "send tensor"), dst, tag)
        return PycollectWork(list(tensors))

    def recv(self, tensors, src, tag=0):
        got = src
        for t in tensors:
            b = _Buf(t, "recv tensor", copy_in=False)
            got = self._c().recv(b.array, src, tag)
            b.finish()
        return PycollectWork(list(tensors), got)

    def recv_anysource(self, tensors, tag=0):
        return self.recv(tensors, pc.ANY_SOURCE, tag)


def _counts(t, splits, size, what):
    """Element counts per rank for all_to_all_single's ``splits`` (rows of dim 0)."""
    n = t.numel()
    if t.dim() == 0:
        rows, row = 1, n
    else:
        rows = t.shape[0]
        row = n // rows if rows else 0
    if not splits:
        if rows % size:
            raise ValueError("pycollect backend: all_to_all_single %s dim 0 (%d) is not "
                             "divisible by the group size %d" % (what, rows, size))
        return [rows // size * row] * size
    splits = [int(s) for s in splits]
    if len(splits) != size or sum(splits) != rows:
        raise ValueError("pycollect backend: all_to_all_single %s splits %s do not cover "
                         "dim 0 (%d) for %d ranks" % (what, splits, rows, size))
    return [s * row for s in splits]


def _create(store, rank, size, timeout):
    return ProcessGroupPycollect(store, rank, size, timeout)


if BACKEND_NAME not in dist.Backend.backend_list:
    dist.Backend.register_backend(BACKEND_NAME, _create, devices=["cpu"])
