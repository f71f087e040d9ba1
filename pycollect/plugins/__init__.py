"""Rendezvous stores and the registry of store and transport plugins."""

from .stores.file_store import FileStore
from .stores.hash_store import HashStore
from .stores.mpi_store import MPIStore
from .stores.redis_store import RedisStore
from .registry import available, get_transport, open_store
from .store import PrefixStore, Store
from .stores.tcp_store import TCPStore, TCPStoreServer

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
