"""Shared-memory segments that a rank would leave in /dev/shm if it died while they are linked.

The first rank of a host creates a context's segment (pycollect/plugins/transports/shm.py)
and unlinks it once every rank of the host has mapped it.  A rank killed in between stays
linked for good: ``pycollect-run`` sends SIGTERM to the other ranks when one fails, and
Python's default SIGTERM runs no ``finally``.  So under the launcher a rank notes each such
segment beside its exit report (``note``, before creating it) until it has unlinked it
(``drop``), and the launcher, once its ranks have ended, unlinks what they noted and left
(``sweep``).  Elsewhere (no ``PYCOLLECT_EXIT_REPORT``) nothing is noted.
"""

import glob
import os
import re

from . import exit_report, settings

__all__ = ["note", "drop", "sweep"]

SHM_DIR = "/dev/shm"
# The names pycollect gives its segments: only such names are noted and swept.
_NAME = re.compile(r"pycollect-[0-9a-f]{24}\Z")
_MARK = ".segment."


def note(path):
    """Note the segment ``path`` (about to be created) beside this rank's exit report; the
    note, for ``drop``, or None where there is no report or ``path`` is not one of ours."""
    report = settings.get(exit_report.ENV)
    name = os.path.basename(path)
    if not report or os.path.dirname(path) != SHM_DIR or not _NAME.match(name):
        return None
    marker = report + _MARK + name
    try:
        with open(marker, "w"):
            pass
    except OSError:         # the launcher's directory is gone: nothing will sweep
        return None
    return marker


def drop(marker):
    """Forget a note (the segment is unlinked, or was never created)."""
    if marker is not None:
        try:
            os.unlink(marker)
        except OSError:
            pass


def sweep(report):
    """Unlink the segments that the rank whose exit report is ``report`` noted and did not
    unlink (it died with them linked), and the notes; the names of those unlinked."""
    removed = []
    for marker in glob.glob(glob.escape(report) + _MARK + "*"):
        name = marker[len(report) + len(_MARK):]
        if _NAME.match(name):
            try:
                os.unlink(os.path.join(SHM_DIR, name))
                removed.append(name)
            except OSError:         # unlinked already (it died after the unlink)
                pass
        drop(marker)
    return removed
