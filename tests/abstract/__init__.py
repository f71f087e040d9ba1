"""Conformance suites that every store and transport, built-in or third-party, subclasses."""

from .store_suite import StoreSuite
from .transport_suite import TransportSuite

__all__ = ["StoreSuite", "TransportSuite"]
