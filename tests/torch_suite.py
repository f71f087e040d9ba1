"""Run torch's own distributed test suite against the "pycollect" backend.

    python tests/torch_suite.py [-k PATTERN ...] [--world-size N] [--budget SECONDS]
                                [--test-timeout SECONDS] [--list] [--backend gloo]

The suite ships inside the torch wheel
(``torch/testing/_internal/distributed/distributed_test.py``, ``DistributedTest._DistTestBase``).
It accepts a backend it does not know when the name is in
``DistTestCases.backend_feature["plugin"]`` before the module is imported; it
reads BACKEND, WORLD_SIZE and TEMP_DIR from the environment.  Each test forks
WORLD_SIZE ranks (torch's MultiProcessTestCase), which rendezvous through a
file store.  Needs ``pip install expecttest``.

With ``--as gloo`` (or ``--as mpi``) the suite is imported as for that
backend, so that the tests it keeps for it run too, while every group still
gets --backend: tests of that backend's own features or name then fail.

Prints one line per test (PASS / FAIL / SKIP / ERROR, with the reason), then
the counts.  Exit status 0 when no test failed.  ``--budget`` stops starting
new tests after that many seconds (the ones not run are counted as such).
"""

import argparse
import fnmatch
import os
import sys
import tempfile
import time
import unittest


# --collectives: the suite's CPU collective, point-to-point, group and DDP-on-CPU
# tests.
COLLECTIVE_TESTS = [
    "test_all_reduce*", "test_reduce*", "test_broadcast*", "test_all_gather*", "test_gather*",
    "test_scatter*", "test_all_to_all*", "test_reduce_scatter*", "test_barrier*",
    "test_send_recv*", "test_isend", "test_irecv", "test_batch_isend_irecv*",
    "test_DistributedDataParallelCPU*", "test_destroy*", "test_get_rank*", "test_get_backend",
    "test_Backend_enum_class", "test_new_subgroups*", "test_average_parameters*",
]
COLLECTIVE_EXCLUDES = ["*_profiler"]       # the same calls again, under torch's profilers
# --ci: one or two tests per collective family from those (about 1 s each on 2
# cores, every one forks its ranks): tests/test_torch_suite.py runs these.
CI_TESTS = [
    "test_all_reduce_sum", "test_all_reduce_sum_async", "test_all_reduce_max",
    "test_all_reduce_product", "test_all_reduce_sum_complex",
    "test_all_reduce_complex_unsupported_ops",
    "test_all_gather", "test_all_gather_coalesced_simple", "test_broadcast", "test_reduce_sum",
    "test_reduce_sum_twice", "test_gather", "test_gather_checks", "test_scatter",
    "test_scatter_checks", "test_barrier", "test_send_recv", "test_send_recv_any_source",
    "test_send_recv_with_tag", "test_isend", "test_irecv", "test_DistributedDataParallelCPU",
    "test_destroy_group", "test_get_rank_size_group",
]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-k", dest="patterns", action="append", default=[],
                    help="run the tests whose name matches this glob (repeatable; "
                         "default: every test)")
    ap.add_argument("--exclude", action="append", default=[],
                    help="skip the tests whose name matches this glob (repeatable)")
    ap.add_argument("--collectives", action="store_true",
                    help="only the CPU collective tests (COLLECTIVE_TESTS, as in CI)")
    ap.add_argument("--ci", action="store_true",
                    help="only CI_TESTS: one or two of --collectives per collective family")
    ap.add_argument("--backend", default="pycollect")
    ap.add_argument("--as", dest="as_backend", choices=("gloo", "mpi"),
                    help="import the suite as for this backend (so that the tests it keeps "
                         "for gloo, or for MPI, run too) but give every group the backend "
                         "--backend: a test that checks the backend's name, or that "
                         "backend's own features, then fails")
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--budget", type=float, default=None,
                    help="start no test after this many seconds")
    ap.add_argument("--test-timeout", type=float, default=60,
                    help="seconds one test's ranks may run before they are killed")
    ap.add_argument("--list", action="store_true", help="list the selected tests and exit")
    args = ap.parse_args(argv)
    if args.collectives:
        args.patterns += COLLECTIVE_TESTS
        args.exclude += COLLECTIVE_EXCLUDES
    if args.ci:
        args.patterns += CI_TESTS
    return args


def _as_backend(backend, alias):
    """Make torch.distributed give ``backend`` to every group asked for with ``alias``."""
    import torch.distributed as dist

    def swap(name):
        return backend if isinstance(name, str) and name.lower() == alias else name

    init, new_group = dist.init_process_group, dist.new_group

    def init_process_group(*args, **kwargs):
        if args:
            args = (swap(args[0]),) + args[1:]
        if "backend" in kwargs:
            kwargs["backend"] = swap(kwargs["backend"])
        return init(*args, **kwargs)

    def new_group_(*args, **kwargs):
        if len(args) > 2:
            args = args[:2] + (swap(args[2]),) + args[3:]
        if "backend" in kwargs:
            kwargs["backend"] = swap(kwargs["backend"])
        return new_group(*args, **kwargs)

    dist.init_process_group = init_process_group
    dist.new_group = new_group_


def load_suite(backend, world_size, temp_dir, alias=None):
    """The suite's test class for ``backend``, imported the way the suite expects."""
    if alias:
        _as_backend(backend, alias)
        backend = alias
    os.environ["BACKEND"] = backend
    os.environ["WORLD_SIZE"] = str(world_size)
    os.environ["TEMP_DIR"] = temp_dir
    os.environ.setdefault("PYTORCH_PRINT_REPRO_ON_FAILURE", "0")
    import torch.multiprocessing
    import pycollect.torch  # noqa: F401  (registers "pycollect")
    from torch.testing._internal import common_distributed
    if backend not in ("gloo", "nccl", "mpi", "ucc"):
        features = common_distributed.DistTestCases.backend_feature
        features["plugin"].add(backend)
        features["ddp"].add(backend)        # DDP on CPU tensors works
    from torch.testing._internal.distributed import distributed_test as suite

    class TestBackend(suite.TestDistBackend, suite.DistributedTest._DistTestBase):
        def setUp(self):
            super().setUp()
            # fork, not spawn: torch and pycollect are imported already, so
            # a rank starts in milliseconds instead of seconds
            self._start_processes(torch.multiprocessing.get_context("fork").Process)

    TestBackend.__module__ = __name__
    TestBackend.__name__ = TestBackend.__qualname__ = "Test_%s" % backend
    return common_distributed, TestBackend


class Result(unittest.TestResult):
    """Records each test's outcome and prints one line per test."""

    def __init__(self):
        super().__init__()
        self.outcomes = {}

    def startTest(self, test):
        super().startTest(test)
        self._started = time.monotonic()

    def _note(self, test, outcome, detail=""):
        name = test.id().rsplit(".", 1)[-1]
        self.outcomes[name] = (outcome, detail)
        print("%-5s %s %.1fs%s" % (outcome, name, time.monotonic() - self._started,
                                   ("  (" + detail + ")") if detail else ""), flush=True)

    def addSuccess(self, test):
        super().addSuccess(test)
        self._note(test, "PASS")

    def addSkip(self, test, reason):
        super().addSkip(test, reason)
        self._note(test, "SKIP", reason.strip().splitlines()[0][:160] if reason else "")

    def addFailure(self, test, err):
        super().addFailure(test, err)
        self._note(test, "FAIL", _last_line(self._exc_info_to_string(err, test)))

    def addError(self, test, err):
        super().addError(test, err)
        self._note(test, "ERROR", _last_line(self._exc_info_to_string(err, test)))

    def addExpectedFailure(self, test, err):
        super().addExpectedFailure(test, err)
        self._note(test, "XFAIL")

    def addUnexpectedSuccess(self, test):
        super().addUnexpectedSuccess(test)
        self._note(test, "XPASS")


def _last_line(text):
    """The line of a failure's text that names the error (the child's, when there is one)."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    named = [ln for ln in lines if ("Error" in ln or "Exception" in ln or "assert" in ln)
             and not ln.startswith(("To execute", "This message"))]
    return ((named or lines or [""])[-1])[:300]


def selected(names, patterns, excludes):
    out = []
    for n in names:
        if patterns and not any(fnmatch.fnmatchcase(n, p) for p in patterns):
            continue
        if any(fnmatch.fnmatchcase(n, p) for p in excludes):
            continue
        out.append(n)
    return out


def run(args):
    temp_dir = tempfile.mkdtemp(prefix="torch-suite-")
    common_distributed, cls = load_suite(args.backend, args.world_size, temp_dir,
                                         args.as_backend)
    # one test's ranks are killed after this long (torch's default is 300 s)
    common_distributed.TIMEOUT_DEFAULT = args.test_timeout
    names = selected(sorted(unittest.TestLoader().getTestCaseNames(cls)), args.patterns,
                     args.exclude)
    if args.list:
        print("\n".join(names))
        return 0
    result = Result()
    started = time.monotonic()
    not_run = []
    for name in names:
        if args.budget is not None and time.monotonic() - started > args.budget:
            not_run.append(name)
            continue
        cls(name).run(result)
    counts = {}
    for outcome, _ in result.outcomes.values():
        counts[outcome] = counts.get(outcome, 0) + 1
    print("\n%s%s, world size %d, %d tests selected in %.0f s: %s%s" % (
        args.backend, " (as %s)" % args.as_backend if args.as_backend else "", args.world_size, len(names), time.monotonic() - started,
        ", ".join("%d %s" % (counts[k], k.lower()) for k in sorted(counts)) or "none run",
        (", %d not run (budget)" % len(not_run)) if not_run else ""), flush=True)
    return 0 if not (result.failures or result.errors or not_run) else 1


if __name__ == "__main__":
    sys.exit(run(parse_args()))
