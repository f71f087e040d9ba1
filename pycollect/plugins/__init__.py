"""Rendezvous stores and the registry of store and transport plugins."""

from .file_store import FileStore
from .hash_store import HashStore
from .mpi_store import MPIStore
from .redis_store import RedisStore
from .registry import available, get_transport, open_store
from .store import PrefixStore, Store
from .tcp_store import TCPStore, TCPStoreServer

__all__ = [
    "FileStore",
    "HashStore",
    "MPIStore",
    "PrefixStore",
    "RedisStore",
    "Store",
    "TCPStore",
    "TCPStoreServer",
    "available",
    "get_transport",
    "open_store",
]
