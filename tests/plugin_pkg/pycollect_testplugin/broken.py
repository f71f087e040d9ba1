"""A plugin module whose import fails, as when a dependency is missing."""

import pycollect_testplugin_missing_dependency  # noqa: F401  (not installed, on purpose)


def open_broken_store(url, **options):
    """Never reached."""


def create_broken_transport(rank, size, store, **options):
    """Never reached."""
