"""The built-in rendezvous stores, one module each, registered through pycollect's entry points."""
