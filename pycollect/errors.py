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
    """Root of every error pycollect raises.

    ``caused_elsewhere`` is True where the error reports another rank's failure or refusal
    rather than this rank's own: every ``PeerError``, and a refusal that another rank made
    (the ``MismatchError`` a refusing rank's peers raise; an object collective's
    ``InvalidArgument`` on the ranks that did not refuse).  ``pycollect-run`` blames a rank
    whose error is not (pycollect/exit_report.py)."""

    caused_elsewhere = False

    def restated(self, text):
        """The same kind of error, saying ``text``, and caused where this one was."""
        other = type(self)(text)
        other.caused_elsewhere = self.caused_elsewhere
        return other


class InvalidArgument(Error, ValueError):
    """An argument was rejected before anything was sent; the context stays usable."""


class PeerError(Error):
    """A peer died, closed its connection or broke the protocol; the context is failed."""

    caused_elsewhere = True


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
