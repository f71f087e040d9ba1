"""The built-in transport factories (``tcp``, ``shm``, ``auto``, ``tcp+tls``), one module each,
registered through pycollect's entry points."""
