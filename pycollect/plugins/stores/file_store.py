"""A store on a shared filesystem (``file:///abs/dir``): one file per key in one directory."""

import contextlib
import fcntl
import hashlib
import os
import shutil
import tempfile
import threading
import time
from urllib.parse import quote, unquote

from ...errors import InvalidArgument, StoreError, Timeout
from ..store import Deadline, Store, backoff_delays, parse_counter, split_store_url

__all__ = ["FileStore", "open_file_store"]

# Waits poll the directory; the sleep between polls doubles up to the cap.
POLL_FIRST_S = 0.0005
POLL_CAP_S = 0.02
# File names stay well under NAME_MAX (255 bytes on common filesystems);
# a longer encoded key is replaced by its SHA-256.
LONGEST_READABLE_NAME = 200
LOCK_FILE_NAME = ".lock"
TEMP_FILE_PREFIX = ".tmp-"

# POSIX record locks (fcntl) belong to the process, not to the descriptor:
# two threads both "hold" one, and closing any descriptor of the file drops
# it.  So the threads of one process take turns through one in-process lock
# per lock file, and only the holder opens the file.
_process_locks = {}
_process_locks_guard = threading.Lock()


def _process_lock(lock_path):
    """The in-process lock that guards ``lock_path`` for every FileStore of this process."""
    with _process_locks_guard:
        return _process_locks.setdefault(os.path.realpath(lock_path), threading.Lock())


def key_file_name(key):
    """The file name of ``key``: percent-encoded and prefixed, or hashed when too long."""
    readable = "k." + quote(key, safe="")
    if len(readable) <= LONGEST_READABLE_NAME:
        return readable
    return "h." + hashlib.sha256(key.encode("utf-8")).hexdigest()


class FileStore(Store):
    """A store in directory ``path``, safe for many processes on a shared filesystem."""

    def __init__(self, path, timeout=None):
        super().__init__(timeout)
        try:
            self.path = os.path.abspath(os.fspath(path))
        except TypeError:
            raise InvalidArgument(f"FileStore needs a directory path, got {path!r}") from None
        self.url = "file://" + quote(self.path)
        with self._storage_errors("create the directory"):
            os.makedirs(self.path, exist_ok=True)
        self._lock_path = os.path.join(self.path, LOCK_FILE_NAME)
        self._add_lock = _process_lock(self._lock_path)

    @contextlib.contextmanager
    def _storage_errors(self, action):
        try:
            yield
        except OSError as err:
            raise StoreError(f"file store {self.path}: cannot {action}: {err}") from err

    def _file_of(self, key):
        return os.path.join(self.path, key_file_name(key))

    def _read(self, key):
        """The value of ``key``, or None when its file does not exist."""
        with self._storage_errors(f"read key {key!r}"):
            try:
                with open(self._file_of(key), "rb") as file:
                    return file.read()
            except FileNotFoundError:
                return None

    def _write(self, key, value):
        """Write ``value`` to a temporary file and rename it over the key's file."""
        with self._storage_errors(f"write key {key!r}"):
            fd, temp_path = tempfile.mkstemp(prefix=TEMP_FILE_PREFIX, dir=self.path)
            try:
                with os.fdopen(fd, "wb") as file:
                    file.write(value)
                os.rename(temp_path, self._file_of(key))
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(temp_path)
                raise

    def _missing(self, keys):
        return [key for key in keys if not os.path.exists(self._file_of(key))]

    def _await_files(self, keys, deadline):
        for delay in backoff_delays(POLL_FIRST_S, POLL_CAP_S):
            if not self._keep_waiting(self._missing(keys), deadline):
                return
            time.sleep(min(delay, deadline.remaining()))

    @contextlib.contextmanager
    def _add_locked(self, key):
        """Hold a POSIX lock on the store's lock file (and this process's lock) for the block.

        ``fcntl`` record locks, unlike ``flock``, reach the NFS lock manager and
        the cluster filesystems that honour POSIX locks.
        """
        deadline = Deadline(self.timeout)
        lock_path = self._lock_path
        if not self._add_lock.acquire(timeout=deadline.timeout):
            raise self._lock_timeout(key, lock_path, deadline)
        try:
            with self._storage_errors("open the lock file"):
                fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                for delay in backoff_delays(POLL_FIRST_S, POLL_CAP_S):
                    try:
                        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        break
                    except (BlockingIOError, PermissionError):   # EAGAIN or EACCES: held
                        if deadline.expired():
                            raise self._lock_timeout(key, lock_path, deadline) from None
                        time.sleep(min(delay, deadline.remaining()))
                yield
            finally:
                os.close(fd)  # closing the descriptor releases the record lock
        finally:
            self._add_lock.release()

    def _lock_timeout(self, key, lock_path, deadline):
        return Timeout(f"timed out after {deadline.timeout:g} s waiting for lock file "
                       f"{lock_path} to add to key {key!r} in store {self.url}")

    def _set(self, key, value):
        self._write(key, value)

    def _get(self, key, deadline):
        # A key deleted between the existence check and the read is waited for again.
        while True:
            self._await_files([key], deadline)
            value = self._read(key)
            if value is not None:
                return value

    def _wait(self, keys, deadline):
        self._await_files(keys, deadline)

    def _add(self, key, amount):
        with self._add_locked(key):
            stored = self._read(key)
            total = amount + (0 if stored is None else parse_counter(stored, key, self.url))
            self._write(key, str(total).encode("ascii"))
            return total

    def _delete(self, key):
        with self._storage_errors(f"delete key {key!r}"):
            try:
                os.unlink(self._file_of(key))
                return True
            except FileNotFoundError:
                return False

    def _check(self, keys):
        return not self._missing(keys)

    def cleanup(self):
        """Close the store and remove its directory with every key in it."""
        self.close()
        with self._storage_errors("remove the directory"), \
                contextlib.suppress(FileNotFoundError):
            shutil.rmtree(self.path)


def open_file_store(url, *, timeout=None, rank=None, size=None):
    """Open ``file:///abs/dir``, a directory that every rank can reach."""
    parts = split_store_url(url, "file")
    if parts.netloc not in ("", "localhost"):
        raise InvalidArgument(f"file store URL {url!r} names host {parts.netloc!r}; "
                              f"use file:///absolute/dir (three slashes)")
    path = unquote(parts.path)
    if not os.path.isabs(path):
        raise InvalidArgument(f"file store URL {url!r} needs an absolute path: file:///abs/dir")
    return FileStore(path, timeout=timeout)
