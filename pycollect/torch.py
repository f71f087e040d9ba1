"""pycollect as a ``torch.distributed`` backend for CPU tensors.

    import pycollect.torch            # registers the backend "pycollect"
    import torch.distributed as dist
    dist.init_process_group("pycollect", init_method=..., rank=r, world_size=n)

Every group torch creates (``new_group`` included) gets its own pycollect
Context, rendezvoused through the store torch hands the backend.  Tensors are
passed to pycollect as zero-copy NumPy views when they are contiguous; other
tensors are copied in and out (back at completion).  ``async_op=True`` (and
every call torch's C++ side makes, DDP's gradient all-reduces included) goes
through pycollect's async handles: the collective runs on the context's
runner thread (or on the thread that waits for it, when the wait comes first)
with the GIL released, and the returned ``dist.Work`` and its
``get_future()`` complete when it ends.

Limits: a backend written in Python replaces the whole process group, so
``"cpu:pycollect,cuda:nccl"`` is not possible; CUDA tensors are rejected.
See docs/torch.md.
"""

import datetime
import itertools
import threading
import time

import numpy as np
import torch
import torch.distributed as dist

import pycollect as pc
from .plugins.store import Store
from .tensors import array_view
from .work import Completion

__all__ = ["BACKEND_NAME", "ProcessGroupPycollect", "TorchStore", "PycollectWork",
           "shrink_group"]

BACKEND_NAME = "pycollect"


_R = dist.ReduceOp.RedOpType
_OPS = {
    _R.SUM: pc.SUM, _R.AVG: pc.AVG, _R.PRODUCT: pc.PRODUCT, _R.MIN: pc.MIN, _R.MAX: pc.MAX,
    _R.BAND: pc.BAND, _R.BOR: pc.BOR, _R.BXOR: pc.BXOR,
}


# -- store -------------------------------------------------------------------

_ADAPTERS = itertools.count()      # numbers every TorchStore this process makes


class TorchStore(Store):
    """A ``pycollect.Store`` over a ``torch.distributed.Store`` (c10d)."""

    def __init__(self, store, timeout=None):
        super().__init__(timeout)
        self._store = store
        # Unique per adapter: pycollect numbers the contexts made per store URL, and
        # each torch group hands us its own (already prefixed) store.  Not id(self): a
        # freed adapter's id comes back, on some ranks and not others, and a new group
        # there would then number its first context 1 where its peers number it 0.
        self.url = "torch-c10d-store:%d" % next(_ADAPTERS)

    def _wait_torch(self, keys, deadline):
        remaining = deadline.remaining()
        try:
            self._store.wait(list(keys), datetime.timedelta(seconds=max(remaining, 0.001)))
        except Exception as err:   # DistStoreError / RuntimeError on timeout
            missing = [k for k in keys if not self._store.check([k])]
            if missing:
                raise self.timeout_error(missing, deadline) from err
            # Every key arrived just as the wait gave up: the wait got what it wanted.

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
    if type(t) is torch.Tensor and t.is_cpu and t.layout == torch.strided:
        return      # the common case: t.device makes a torch.device object on every call
    if not isinstance(t, torch.Tensor):
        raise pc.InvalidArgument("pycollect backend: %s must be a torch.Tensor, got %s"
                                 % (what, type(t).__name__))
    if t.device.type != "cpu":
        raise pc.InvalidArgument(
            "pycollect backend: %s is on device %s; the pycollect torch backend supports CPU "
            "tensors only (GPU buffers are not supported yet; use nccl for CUDA tensors)"
            % (what, t.device))
    if t.layout != torch.strided:
        raise pc.InvalidArgument("pycollect backend: %s has layout %s; only dense (strided) "
                                 "tensors are supported" % (what, t.layout))


def _view(t):
    """A NumPy view of contiguous CPU tensor ``t`` (flattened, shares memory)."""
    return array_view(t).reshape(-1)


class _Buf:
    """A tensor as a contiguous NumPy array; ``finish()`` copies back if it was copied in."""

    __slots__ = ("tensor", "staging", "array")

    def __init__(self, t, what, copy_in=True):
        _check_cpu(t, what)
        self.tensor = t
        if t.is_contiguous():
            self.staging = None
            self.array = _cached_view(t)
        else:
            self.staging = t.detach().contiguous() if copy_in else torch.empty(
                t.shape, dtype=t.dtype)
            self.array = _view(self.staging)

    def finish(self):
        if self.staging is not None:
            with torch.no_grad():
                self.tensor.copy_(self.staging)


# NumPy views of small tensors, reused: t.numpy() costs about 5 µs, a fifth of a
# one-element all_reduce.  An entry holds its tensor (the view does anyway), so a
# tensor's id cannot be reused while cached; it is used again only while the
# tensor still has the same memory, element count and dtype (``t.data = ...`` can
# change the dtype and keep the memory).  At most _VIEW_CACHE_SIZE
# tensors of at most _VIEW_CACHE_MAX_BYTES each are kept alive by the cache.
_VIEW_CACHE = {}
_VIEW_CACHE_SIZE = 8
_VIEW_CACHE_MAX_BYTES = 64 << 10


def _cached_view(t):
    """``_view(t)`` for a contiguous CPU tensor, from the cache when it still applies."""
    entry = _VIEW_CACHE.get(id(t))
    if entry is not None and entry[0] is t and entry[1] == t.data_ptr() \
            and entry[2] == t.numel() and entry[3] is t.dtype:
        return entry[4]
    array = _view(t)
    if array.nbytes <= _VIEW_CACHE_MAX_BYTES:
        try:
            while len(_VIEW_CACHE) >= _VIEW_CACHE_SIZE:
                del _VIEW_CACHE[next(iter(_VIEW_CACHE))]
        except (KeyError, RuntimeError, StopIteration):   # another thread evicted it
            pass
        _VIEW_CACHE[id(t)] = (t, t.data_ptr(), t.numel(), t.dtype, array)
    return array


def _finish_all(bufs):
    """A completion step that copies every staged buffer of ``bufs`` back."""
    staged = [b for b in bufs if b.staging is not None]
    if not staged:
        return None

    def finish():
        for b in staged:
            b.finish()
    return finish


def _flat_input(t, what):
    """A contiguous NumPy array holding ``t``'s values (a view when possible)."""
    _check_cpu(t, what)
    return _cached_view(t) if t.is_contiguous() else _view(t.detach().contiguous())


def _op_table():
    """{hash(opts.reduceOp): pycollect op} for the plain ops: torch hashes a ReduceOp by its
    type, and reading ``.op`` costs microseconds per call.  Empty (every call takes the slow
    path) if hashes ever stop telling the ops apart."""
    table = {}
    for code, op in _OPS.items():
        opts = dist.AllreduceOptions()
        opts.reduceOp = code
        rop = opts.reduceOp
        if rop.op != code:
            return {}
        table[hash(rop)] = op
    return table if len(table) == len(_OPS) else {}


_OP_BY_HASH = _op_table()


def _reduce_op(opts, what):
    """(pycollect op, PREMUL_SUM factor or None) for ``opts.reduceOp``."""
    rop = opts.reduceOp
    op = _OP_BY_HASH.get(hash(rop))
    if op is not None:
        return op, None
    code = getattr(rop, "op", rop)
    if code == _R.PREMUL_SUM:
        return pc.SUM, _premul_factor(rop, what)     # after _scale(inputs, factor)
    try:
        return _OPS[code], None
    except (KeyError, TypeError):
        raise pc.InvalidArgument("pycollect backend: %s does not support reduce op %r"
                                 % (what, rop)) from None


def _premul_factor(rop, what):
    for name in ("factor", "_factor"):
        f = getattr(rop, name, None)
        if f is not None:
            return f.item() if isinstance(f, torch.Tensor) else float(f)
    raise pc.InvalidArgument("pycollect backend: %s got PREMUL_SUM without a readable factor"
                             % what)


def _scale(arrays, factor):
    """PREMUL_SUM's first step: multiply the inputs by ``factor`` (floating types only)."""
    if factor is not None:
        for a in arrays:
            if a.dtype.kind not in "fcV" and a.dtype.name != "bfloat16":
                raise pc.InvalidArgument("pycollect backend: PREMUL_SUM needs a floating or "
                                         "complex tensor, got %s" % a.dtype)
            a *= np.asarray(factor).astype(a.dtype)


def _is_async(opts):
    """torch's asyncOp (True unless dist's caller waits at once; C++ callers leave it True)."""
    try:
        return opts is None or opts.asyncOp
    except AttributeError:      # options without the field: the caller may wait later
        return True


def _seconds(timeout):
    """A torch wait timeout (timedelta, 0 = no limit) in seconds, or None."""
    if timeout is None:
        return None
    if isinstance(timeout, datetime.timedelta):
        timeout = timeout.total_seconds()
    return min(timeout, pc.MAX_TIMEOUT_S) if timeout > 0 else None


# -- work --------------------------------------------------------------------

# Orders a PycollectWork's completion against the making of its future.
_FUTURE_MADE = threading.Lock()


class PycollectWork(dist.Work):
    """A ``dist.Work`` over pycollect async handles.

    ``works`` are the pycollect ``Work`` handles of the operation, in issue
    order (one context runs them in that order); when the last one ends,
    ``finish`` (copy-back of staged tensors) runs on the thread that ran it, then
    the torch future completes with ``outputs`` or with the first error.
    Without ``works`` the operation has already completed.
    """

    def __init__(self, outputs, works=None, finish=None, source=-1):
        super().__init__()
        self._outputs = outputs
        self._source = source
        self._exc = None
        # The future costs microseconds to make (so does the end's event, made only by a
        # wait that blocks): made when get_future() is called.
        self._fut = None
        self._works = works or ()
        self._end = Completion(done=not works)
        if works:
            self._finish = finish
            works[-1].add_done_callback(self._complete)

    def _complete(self, _last):
        exc = None
        for w in self._works:
            exc = w.exception()
            if exc is not None:
                break
        if exc is None and self._finish is not None:
            try:
                self._finish()
            except BaseException as err:      # handed to the waiter and the future
                exc = err
        self._exc = exc
        with _FUTURE_MADE:
            self._end.set()
            fut = self._fut
        if fut is not None:
            self._settle(fut)

    def _settle(self, fut):
        if self._exc is None:
            fut.set_result(self._outputs)
        else:
            fut.set_exception(self._exc)

    def wait(self, timeout=None):
        """Block until done (``timeout``: a timedelta, 0 or None = no limit); raise its error."""
        if not self._end.done:
            seconds = _seconds(timeout)
            # pycollect's wait runs the queued collectives here when the runner has not
            # started them (with a timeout, it has the runner run them now); their error,
            # if any, is this Work's, raised below.
            end = None if seconds is None else time.monotonic() + seconds
            try:
                self._works[-1].wait(seconds)
            except Exception:
                pass
            if not self._end.wait(None if end is None else max(end - time.monotonic(), 0.0)):
                raise pc.Timeout("pycollect backend: %s did not complete within %g s"
                                 % (self._works[-1].description, seconds))
        if self._exc is not None:
            raise self._exc
        return True

    def is_completed(self):
        if not self._end.done:
            self._works[-1].is_completed()      # a poll lets the runner run (pycollect's)
        return self._end.done

    def is_success(self):
        return self._end.done and self._exc is None

    def exception(self):
        return self._exc

    def result(self):
        """The output tensors, once the operation has ended (waits; raises its error)."""
        self.wait()
        return self._outputs

    def get_future(self):
        with _FUTURE_MADE:
            fut, settle = self._fut, False
            if fut is None:
                fut = self._fut = torch.futures.Future()
                settle = self._end.done     # else _complete settles it
        if settle:
            self._settle(fut)
        return fut

    def synchronize(self):
        self.wait()

    def _source_rank(self):
        src = self._source
        if isinstance(src, pc.Work):
            return src.result()[0]
        return src

    def source_rank(self):
        return self._source_rank()


# -- process group -----------------------------------------------------------

class ProcessGroupPycollect(dist.ProcessGroup):
    """A torch ProcessGroup whose collectives run on a pycollect Context."""

    def __init__(self, store, rank, size, timeout, *, context=None):
        if context is not None:     # a group over an existing Context (shrink_group)
            super().__init__(context.rank, context.size)
            self._pc_store = None
            self._ctx = context
        else:
            super().__init__(rank, size)
            # torch's own longer timeouts (its gloo takes days) as pycollect's longest
            seconds = _seconds(timeout) or pc.DEFAULT_TIMEOUT
            self._pc_store = TorchStore(store, timeout=seconds)
            self._ctx = pc.init(rank=rank, size=size, store=self._pc_store, timeout=seconds)
        self._group_name = None
        self._group_desc = None
        # What a blocking (asyncOp=False) call returns: dist waits on it and drops it,
        # so one completed Work serves them all (its result: the latest call's outputs).
        self._done_work = PycollectWork([])

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
        """Close the group: work in flight or queued ends at once (Aborted)."""
        ctx, self._ctx = self._ctx, None
        if ctx is not None:
            ctx.close()

    def abort(self):
        """End blocked and queued work at once (from any thread) and close the group."""
        ctx, self._ctx = self._ctx, None
        if ctx is not None:
            ctx.abort()
            ctx.close()

    def shrink(self, ranks_to_exclude=None, timeout=None):
        """This group without ``ranks_to_exclude`` and without the ranks that are gone
        (``Context.shrink``): a new ProcessGroupPycollect, or None on a rank left out."""
        ctx = self._c().shrink(exclude=ranks_to_exclude, timeout=_seconds(timeout))
        return None if ctx is None else ProcessGroupPycollect(None, 0, 0, None, context=ctx)

    def _c(self):
        if self._ctx is None:
            raise pc.Error("pycollect backend: the process group has been shut down")
        return self._ctx

    def _work(self, async_op, outputs, works, finish=None, source=-1):
        """The dist.Work for an operation issued with ``async_op``: a pending one, or for a
        blocking call the group's one completed Work (a new dist.Work costs microseconds)."""
        if async_op:
            return PycollectWork(outputs, works, finish, source)
        if finish is not None:
            finish()
        if source != -1:
            return PycollectWork(outputs, source=source)
        self._done_work._outputs = outputs
        return self._done_work

    # collectives
    def allreduce(self, tensors, opts=None):
        op, factor = _reduce_op(opts, "allreduce") if opts is not None else (pc.SUM, None)
        a = _is_async(opts)
        ctx = self._c()
        if len(tensors) == 1:
            t = tensors[0]
            if factor is None and type(t) is torch.Tensor and t.is_cpu \
                    and t.layout == torch.strided and t.is_contiguous():
                # the common case, kept short: one contiguous CPU tensor
                w = ctx.allreduce(_cached_view(t), op, async_op=a)
                if a:
                    return PycollectWork(tensors, [w])
                self._done_work._outputs = tensors
                return self._done_work
        bufs = [_Buf(t, "allreduce tensor") for t in tensors]
        _scale([b.array for b in bufs], factor)
        if len(bufs) == 1:
            w = ctx.allreduce(bufs[0].array, op, async_op=a)
        else:
            w = ctx.allreduce_coalesced([b.array for b in bufs], op, async_op=a)
        return self._work(a, list(tensors), [w], _finish_all(bufs))

    def allreduce_coalesced(self, tensors, opts=None):
        return self.allreduce(tensors, opts)

    def broadcast(self, tensors, opts):
        a = _is_async(opts)
        ctx = self._c()
        if len(tensors) == 1 and not a:
            t = tensors[0]
            if type(t) is torch.Tensor and t.is_cpu and t.layout == torch.strided \
                    and t.is_contiguous():
                # the common case, kept short: one contiguous CPU tensor, blocking
                ctx.broadcast(_cached_view(t), opts.rootRank)
                self._done_work._outputs = tensors
                return self._done_work
        bufs = [_Buf(t, "broadcast tensor") for t in tensors]
        works = [ctx.broadcast(b.array, opts.rootRank, async_op=a) for b in bufs]
        return self._work(a, list(tensors), works, _finish_all(bufs))

    def reduce(self, tensors, opts):
        op, factor = _reduce_op(opts, "reduce")
        a = _is_async(opts)
        ctx = self._c()
        root = opts.rootRank
        bufs = [_Buf(t, "reduce tensor") for t in tensors]
        works, scaled = [], []
        for b in bufs:
            arr = b.array
            if factor is not None:
                # pycollect's reduce leaves non-root buffers untouched: keep
                # them so by scaling a copy.
                arr = arr.copy()
                _scale([arr], factor)
                scaled.append((b, arr))
            works.append(ctx.reduce(arr, root, op, async_op=a))
        copy_back = _finish_all(bufs)

        def finish():
            if ctx.rank == root:
                for b, arr in scaled:
                    b.array[...] = arr
            if copy_back is not None:
                copy_back()
        return self._work(a, list(tensors), works, finish if scaled else copy_back)

    def allgather(self, output_tensors, input_tensors, opts=None):
        return self._allgather(output_tensors, input_tensors, opts, output_tensors)

    def _allgather(self, output_tensors, input_tensors, opts, result):
        """``output_tensors[i][r]`` receives rank r's ``input_tensors[i]``."""
        a = _is_async(opts)
        ctx = self._c()
        works, copies = [], []
        for outs, inp in zip(output_tensors, input_tensors):
            send = _flat_input(inp, "allgather input")
            if len(outs) != ctx.size:
                raise pc.InvalidArgument("pycollect backend: all_gather needs %d output tensors, "
                                         "got %d" % (ctx.size, len(outs)))
            bufs = [_Buf(out, "allgather output", copy_in=False) for out in outs]
            for b in bufs:
                if b.array.size != send.size:
                    raise pc.InvalidArgument(
                        "pycollect backend: all_gather output tensors hold %d elements, the "
                        "input %d" % (b.array.size, send.size))
            recv = np.empty((ctx.size,) + send.shape, dtype=send.dtype)
            works.append(ctx.allgather(send, recv, async_op=a))
            copies.append((recv, bufs))

        def finish():
            for recv, bufs in copies:
                for r, b in enumerate(bufs):
                    b.array[...] = recv[r]
                    b.finish()
        return self._work(a, result, works, finish)

    def allgather_coalesced(self, output_lists, input_list, opts=None):
        # output_lists[r][i] receives rank r's input_list[i]
        ctx = self._c()
        if len(output_lists) != ctx.size or any(len(o) != len(input_list) for o in output_lists):
            raise pc.InvalidArgument("pycollect backend: all_gather_coalesced needs %d lists of "
                                     "%d output tensors" % (ctx.size, len(input_list)))
        per_input = [[outs[i] for outs in output_lists] for i in range(len(input_list))]
        return self._allgather(per_input, input_list, opts, output_lists)

    def _allgather_base(self, output, input, opts=None):
        a = _is_async(opts)
        ctx = self._c()
        send = _flat_input(input, "all_gather_into_tensor input")
        b = _Buf(output, "all_gather_into_tensor output", copy_in=False)
        if b.array.size != send.size * ctx.size:
            raise pc.InvalidArgument(
                "pycollect backend: all_gather_into_tensor output holds %d elements, expected "
                "%d x %d" % (b.array.size, ctx.size, send.size))
        w = ctx.allgather(send, b.array, async_op=a)      # flat: size blocks of send.size
        return self._work(a, [output], [w], _finish_all([b]))

    def all_gather_single(self, output, input, opts=None):
        return self._allgather_base(output, input, opts)

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        works = [self._allgather_base(o, i, opts) for o, i in zip(outputs, inputs)]
        return _merge(works, list(outputs))

    def reduce_scatter(self, output_tensors, input_lists, opts):
        op, factor = _reduce_op(opts, "reduce_scatter")
        a = _is_async(opts)
        ctx = self._c()
        works, bufs = [], []
        for out, ins in zip(output_tensors, input_lists):
            if len(ins) != ctx.size:
                raise pc.InvalidArgument("pycollect backend: reduce_scatter needs %d input "
                                         "tensors, got %d" % (ctx.size, len(ins)))
            send = np.concatenate([_flat_input(t, "reduce_scatter input") for t in ins])
            _scale([send], factor)
            b = _Buf(out, "reduce_scatter output", copy_in=False)
            works.append(ctx.reduce_scatter(send, b.array, op, async_op=a))
            bufs.append(b)
        return self._work(a, list(output_tensors), works, _finish_all(bufs))

    def _reduce_scatter_base(self, output, input, opts):
        op, factor = _reduce_op(opts, "reduce_scatter_tensor")
        a = _is_async(opts)
        send = _flat_input(input, "reduce_scatter_tensor input")
        if factor is not None:
            send = send.copy()
            _scale([send], factor)
        b = _Buf(output, "reduce_scatter_tensor output", copy_in=False)
        w = self._c().reduce_scatter(send, b.array, op, async_op=a)
        return self._work(a, [output], [w], _finish_all([b]))

    def reduce_scatter_single(self, output, input, opts):
        return self._reduce_scatter_base(output, input, opts)

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts):
        works = [self._reduce_scatter_base(o, i, opts) for o, i in zip(outputs, inputs)]
        return _merge(works, list(outputs))

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes,
                          opts=None):
        a = _is_async(opts)
        ctx = self._c()
        send = _flat_input(input, "all_to_all_single input")
        b = _Buf(output, "all_to_all_single output", copy_in=False)
        sendcounts = _counts(input, input_split_sizes, ctx.size, "input")
        recvcounts = _counts(output, output_split_sizes, ctx.size, "output")
        if not input_split_sizes and not output_split_sizes and send.size == b.array.size:
            w = ctx.alltoall(send, b.array, async_op=a)     # equal blocks: compiled
        else:
            w = ctx.alltoallv(send, sendcounts, b.array, recvcounts, async_op=a)
        return self._work(a, [output], [w], _finish_all([b]))

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        return self.all_to_all_single(output, input, output_split_sizes, input_split_sizes,
                                      opts)

    def alltoall(self, output_tensors, input_tensors, opts=None):
        a = _is_async(opts)
        ctx = self._c()
        sends = [_flat_input(t, "all_to_all input") for t in input_tensors]
        bufs = [_Buf(t, "all_to_all output", copy_in=False) for t in output_tensors]
        if len(sends) != ctx.size or len(bufs) != ctx.size:
            raise pc.InvalidArgument("pycollect backend: all_to_all needs %d input and output "
                                     "tensors, got %d and %d"
                                     % (ctx.size, len(sends), len(bufs)))
        send = np.concatenate(sends)
        recvcounts = [b.array.size for b in bufs]
        recv = np.empty(sum(recvcounts), dtype=send.dtype)
        w = ctx.alltoallv(send, [s.size for s in sends], recv, recvcounts, async_op=a)

        def finish():
            offset = 0
            for b, n in zip(bufs, recvcounts):
                b.array[...] = recv[offset:offset + n]
                b.finish()
                offset += n
        return self._work(a, list(output_tensors), [w], finish)

    def gather(self, output_lists, input_tensors, opts):
        a = _is_async(opts)
        ctx = self._c()
        root = opts.rootRank
        works, copies = [], []
        for i, inp in enumerate(input_tensors):
            send = _flat_input(inp, "gather input")
            if ctx.rank == root:
                bufs = [_Buf(out, "gather output", copy_in=False) for out in output_lists[i]]
                if len(bufs) != ctx.size:
                    raise pc.InvalidArgument("pycollect backend: gather needs %d output "
                                             "tensors on the root, got %d"
                                             % (ctx.size, len(bufs)))
                recv = np.empty((ctx.size,) + send.shape, dtype=send.dtype)
                works.append(ctx.gather(send, recv, root, async_op=a))
                copies.append((recv, bufs))
            else:
                works.append(ctx.gather(send, None, root, async_op=a))

        def finish():
            for recv, bufs in copies:
                for r, b in enumerate(bufs):
                    b.array[...] = recv[r]
                    b.finish()
        return self._work(a, output_lists, works, finish if copies else None)

    def scatter(self, output_tensors, input_lists, opts):
        a = _is_async(opts)
        ctx = self._c()
        root = opts.rootRank
        works, bufs = [], []
        for i, out in enumerate(output_tensors):
            b = _Buf(out, "scatter output", copy_in=False)
            send = None
            if ctx.rank == root:
                if len(input_lists[i]) != ctx.size:
                    raise pc.InvalidArgument("pycollect backend: scatter needs %d input tensors "
                                             "on the root, got %d"
                                             % (ctx.size, len(input_lists[i])))
                send = np.concatenate([_flat_input(t, "scatter input") for t in input_lists[i]])
            works.append(ctx.scatter(send, b.array, root, async_op=a))
            bufs.append(b)
        return self._work(a, list(output_tensors), works, _finish_all(bufs))

    def barrier(self, opts=None):
        a = _is_async(opts)
        return self._work(a, [], [self._c().barrier(async_op=a)])

    def monitored_barrier(self, timeout=None, wait_all_ranks=False):
        self._c().monitored_barrier(_seconds(timeout))

    # point to point: always queued, so that isend/irecv pairs cannot block each other
    def send(self, tensors, dst, tag=0):
        ctx = self._c()
        works = [ctx.send(_flat_input(t, "send tensor"), dst, tag, async_op=True)
                 for t in tensors]
        return self._work(True, list(tensors), works)

    def recv(self, tensors, src, tag=0):
        ctx = self._c()
        bufs = [_Buf(t, "recv tensor", copy_in=False) for t in tensors]
        works = [ctx.recv(b.array, src, tag, async_op=True) for b in bufs]
        return self._work(True, list(tensors), works, _finish_all(bufs), source=works[-1])

    def recv_anysource(self, tensors, tag=0):
        return self.recv(tensors, pc.ANY_SOURCE, tag)


def _merge(works, outputs):
    """One dist.Work over several of this module's (pending or completed) Works."""
    pending = [w for w in works if w._works]
    if not pending:
        return PycollectWork(outputs)
    inner = [pc_w for w in pending for pc_w in w._works]

    def finish():
        for w in pending:
            w.wait()
    return PycollectWork(outputs, inner, finish)


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
            raise pc.InvalidArgument("pycollect backend: all_to_all_single %s dim 0 (%d) is not "
                             "divisible by the group size %d" % (what, rows, size))
        return [rows // size * row] * size
    splits = [int(s) for s in splits]
    if len(splits) != size or sum(splits) != rows:
        raise pc.InvalidArgument("pycollect backend: all_to_all_single %s splits %s do not cover "
                         "dim 0 (%d) for %d ranks" % (what, splits, rows, size))
    return [s * row for s in splits]


def shrink_group(ranks_to_exclude=None, group=None, timeout=None):
    """``dist.shrink_group`` for the pycollect backend, which torch does not route to a
    Python backend (docs/torch.md): the group (default: the world) without
    ``ranks_to_exclude`` and the ranks that are gone, over the same connections.

    Every surviving rank calls it.  Returns a new ProcessGroupPycollect (call its
    methods, e.g. ``pg.allreduce([t]).wait()``), or None on a rank left out.
    """
    pg = dist.group.WORLD if group is None else group
    if not isinstance(pg, ProcessGroupPycollect):
        raise pc.InvalidArgument("shrink_group: %r is not a pycollect process group" % (pg,))
    return pg.shrink(ranks_to_exclude, timeout)


def _create(store, rank, size, timeout):
    return ProcessGroupPycollect(store, rank, size, timeout)


if BACKEND_NAME not in dist.Backend.backend_list:
    dist.Backend.register_backend(BACKEND_NAME, _create, devices=["cpu"])
