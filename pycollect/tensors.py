"""Torch tensors (CPU, contiguous or not) handed straight to a Context's collectives.

A contiguous CPU tensor becomes a NumPy view of its memory (bfloat16 through
``ml_dtypes``); a non-contiguous one is staged in a contiguous copy, which
``Host.finish`` copies back into the tensor once the collective has written
it.  Arrays the Context allocates for a tensor input (``recvbuf=None``) are
handed back as tensors.  torch is imported only when a tensor is passed.
"""

import numpy as np

from .errors import InvalidArgument

__all__ = ["is_tensor", "array_view", "Host", "as_tensor_like"]


def is_tensor(obj):
    """Whether ``obj`` is a torch tensor (without importing torch)."""
    cls = type(obj)
    return cls.__module__.partition(".")[0] == "torch" and hasattr(obj, "is_contiguous") \
        and hasattr(obj, "data_ptr")


def _bfloat16():
    try:
        import ml_dtypes
    except ImportError:
        raise InvalidArgument("bfloat16 tensors need the ml_dtypes package "
                              "(pip install ml_dtypes)") from None
    return ml_dtypes.bfloat16


def array_view(t):
    """A NumPy array sharing contiguous CPU tensor ``t``'s memory, in its shape (bfloat16
    as ml_dtypes' bfloat16; the torch backend and pycollect.ray use this too)."""
    import torch
    if t.requires_grad:
        t = t.detach()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(_bfloat16())
    return t.numpy()


class Host:
    """``tensor`` as a NumPy array the collectives can use (``array``)."""

    __slots__ = ("tensor", "staging", "array")

    def __init__(self, tensor, what, arg):
        if tensor.device.type != "cpu":
            raise InvalidArgument(
                "%s: argument %r is a tensor on %s; the collectives take CPU tensors (the "
                "torch backend, backend='pycollect', stages others)" % (what, arg, tensor.device))
        self.tensor = tensor
        if tensor.is_contiguous():
            self.staging = None
            self.array = array_view(tensor)
        else:
            self.staging = tensor.detach().contiguous()
            self.array = array_view(self.staging)

    def check_writable(self, what, arg):
        """Refuse a tensor the collective would write whose elements share memory (a
        dimension of stride 0 and size > 1, as ``expand`` makes): torch refuses to copy the
        result into it, which it would do only after the collective had run."""
        if self.staging is not None and any(
                stride == 0 and size > 1
                for size, stride in zip(self.tensor.shape, self.tensor.stride())):
            raise InvalidArgument("%s: argument %r is a tensor whose elements share memory "
                                  "(strides %s), so it cannot hold a result; pass a "
                                  "tensor of its own memory (.clone())"
                                  % (what, arg, tuple(self.tensor.stride())))

    def finish(self):
        """Copy a staged copy back into the tensor (after the collective wrote it)."""
        if self.staging is not None:
            import torch
            with torch.no_grad():
                self.tensor.copy_(self.staging)


def as_tensor_like(array):
    """A torch tensor sharing ``array``'s memory (the Context's output for tensor input)."""
    import torch
    if array.dtype == _bfloat16():
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)
