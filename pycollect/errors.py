"""The exception hierarchy: one root, a few subclasses that callers can act on.

Which errors leave a ``Context`` usable is documented in ``docs/errors.md``.
"""

import pickle

__all__ = [
    "Error",
    "InvalidArgument",
    "PeerError",
    "Timeout",
    "MismatchError",
    "Aborted",
    "StoreError",
    "PluginError",
    "UnpicklingRefused",
]


class Error(RuntimeError):
    """Root of every error pycollect raises."""


class InvalidArgument(Error, ValueError):
    """An argument was rejected before anything was sent; the context stays usable."""


class PeerError(Error):
    """A peer died, closed its connection or broke the protocol; the context is failed."""


class Timeout(Error, TimeoutError):
    """A deadline passed (collective, connect, handshake or store wait)."""


class MismatchError(Error):
    """Ranks disagree on the collective, count, dtype, op, root or algorithm."""


class Aborted(Error):
    """``Context.abort()`` ended the operation; the context is failed."""


class StoreError(Error):
    """The rendezvous store is unreachable or misbehaved."""


class PluginError(Error):
    """A store or transport plugin is unknown, broken or not installed."""


class UnpicklingRefused(Error, pickle.UnpicklingError):
    """An object collective's pickle named a global outside the unpickle allow-list
    (``Context.unpickle_allow``): nothing of it ran; the context stays usable."""
