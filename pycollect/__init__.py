"""pycollect: collective communications for Python programs.

    import pycollect as pc
    ctx = pc.init()                  # rank, size and store from PYCOLLECT_* variables
    ctx.allreduce(array, op=pc.SUM)  # in place
"""

from .errors import (Aborted, Error, InvalidArgument, MismatchError, PeerError,
                     PluginError, StoreError, Timeout, UnpicklingRefused)
from .types import ReduceOp
from .context import ANY_SOURCE, ANY_TAG, Context
from .work import Status, Work, wait_all, wait_any
from .plugins.store import PrefixStore, Store
from .plugins.stores.hash_store import HashStore
from .plugins.stores.file_store import FileStore
from .plugins.stores.tcp_store import TCPStore, TCPStoreServer
from . import plugins
from .rendezvous import DEFAULT_TIMEOUT, init
from .settings import MAX_TIMEOUT_S
from .shared import empty, zeros

SUM = ReduceOp.SUM
PRODUCT = ReduceOp.PRODUCT
MIN = ReduceOp.MIN
MAX = ReduceOp.MAX
AVG = ReduceOp.AVG
BAND = ReduceOp.BAND
BOR = ReduceOp.BOR
BXOR = ReduceOp.BXOR

__version__ = "0.1.0"

__all__ = [
    "init", "Context", "empty", "zeros", "Work", "Status", "wait_all", "wait_any",
    "DEFAULT_TIMEOUT", "MAX_TIMEOUT_S", "ANY_SOURCE", "ANY_TAG",
    "ReduceOp", "SUM", "PRODUCT", "MIN", "MAX", "AVG", "BAND", "BOR", "BXOR",
    "Store", "PrefixStore", "HashStore", "FileStore", "TCPStore", "TCPStoreServer", "plugins",
    "Error", "InvalidArgument", "PeerError", "Timeout", "MismatchError", "Aborted",
    "StoreError", "PluginError", "UnpicklingRefused",
]
