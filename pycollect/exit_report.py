"""What a rank that pycollect-run started says about the error that ended it.

A rank that fails takes its peers down: they raise ``PeerError`` (the peer closed its
connection, failed, or left), and may exit before it does, because its own exit waits for
its interpreter to wind down after its sockets have closed.  The launcher, which sees only
exit codes in the order they come, would blame whichever exits first.  So the launcher gives
every rank a file to write (``PYCOLLECT_EXIT_REPORT``), ``pycollect.init`` installs a hook
(``install``) that, when an exception ends the program, writes the exception's type and
whether it is a consequence of another rank's failure, and the launcher (``read``) blames a
rank whose failure is its own.  A program that catches the exception and turns it into an
exit status itself (``pycollect-bench``) writes the report with ``report``.  A rank that ends
with ``sys.exit`` (and no ``report``), a signal or an exception raised before ``init`` writes
nothing: its failure counts as its own.
"""

import json
import os
import sys

from pycollect import settings

__all__ = ["ENV", "install", "is_consequence", "read", "report"]

ENV = "PYCOLLECT_EXIT_REPORT"
# The longest message kept in a report (its first line, cut).
MAX_MESSAGE = 500


def is_consequence(exc):
    """Whether ``exc`` reports another rank's failure rather than this rank's own: it, or
    an exception it was raised from (``raise ... from exc``, or raised while handling one,
    unless ``from None``), is a pycollect error ``caused_elsewhere`` (every ``PeerError``;
    a refusal another rank made)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if getattr(exc, "caused_elsewhere", False) is True:
            return True
        exc = exc.__cause__ if exc.__cause__ is not None else (
            None if exc.__suppress_context__ else exc.__context__)
    return False


def install():
    """Chain a hook to ``sys.excepthook`` that writes the report named by the environment
    (nothing where the variable is unset; installed once however often ``init`` runs)."""
    path = settings.get(ENV)
    if not path or getattr(sys.excepthook, "pycollect_exit_report", False):
        return
    previous = sys.excepthook

    def report_then_print(kind, value, traceback):
        try:
            _write(path, kind, value)
        except Exception:       # the report is a courtesy: the traceback still prints
            pass
        previous(kind, value, traceback)

    report_then_print.pycollect_exit_report = True
    sys.excepthook = report_then_print


def report(exc):
    """Write the report of ``exc``, an exception that ends the program although the program
    handles it itself (it prints a line and exits with a status of its own): nothing where
    the environment names no report file.  Never raises: the report is a courtesy."""
    try:
        path = settings.get(ENV)
        if path:
            _write(path, type(exc), exc)
    except Exception:
        pass


def _write(path, kind, value):
    lines = str(value).splitlines()
    report = {"error": kind.__name__, "message": (lines[0] if lines else "")[:MAX_MESSAGE],
              "consequence": is_consequence(value)}
    partial = path + ".partial"
    with open(partial, "w", encoding="utf-8") as out:
        json.dump(report, out)
    os.replace(partial, path)


def read(path):
    """The report at ``path`` as a dict (``error``, ``message``, ``consequence``), or None
    where the rank wrote none or it cannot be read."""
    try:
        with open(path, encoding="utf-8") as f:
            report = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(report, dict) or not isinstance(report.get("error"), str):
        return None
    report["consequence"] = report.get("consequence") is True
    return report
