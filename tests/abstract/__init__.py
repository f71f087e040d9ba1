"""Conformance suites that every store implementation, built-in or third-party, subclasses."""

from .store_suite import StoreSuite

__all__ = ["StoreSuite"]
