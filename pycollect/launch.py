"""``pycollect-run``: start N ranks of a program on this machine, wired to one store.

    pycollect-run -n 4 train.py --epochs 3
    pycollect-run -n 2 --store file:///shared/rdv python -m mypkg.job

Each rank is a child process in its own process group with ``PYCOLLECT_RANK``,
``PYCOLLECT_SIZE``, ``PYCOLLECT_LOCAL_RANK``, ``PYCOLLECT_LOCAL_SIZE`` and
``PYCOLLECT_STORE`` set, so that ``pycollect.init()`` needs no arguments.  Without
``--store`` the launcher hosts the embedded TCP store on loopback and hands the
ranks a fresh secret in ``PYCOLLECT_AUTH``.  Every run gets its own store prefix,
so a store shared between runs never serves a stale key.

Where ``OMP_NUM_THREADS`` is not set, each rank gets the machine's cores divided
among the ranks (at least 1): the ranks' OpenMP and BLAS thread pools (NumPy's
OpenBLAS starts one at import) then share the cores instead of each taking all of
them, as torchrun does for its workers.

``--bind core`` binds rank r to physical core ``r % cores`` of those the launcher
may run on (a core's hardware threads together), as ``mpirun --bind-to core`` does;
more ranks than cores share them evenly.  A rank that stays on one core keeps its
caches and never waits for the scheduler to move it back beside its shared-memory
flags.  The default, ``none``, leaves placement to the kernel, which suits a
machine shared with other jobs.

The first rank that fails (non-zero exit or a signal) takes the job down: the
others get SIGTERM, then SIGKILL after a grace period, and the launcher exits
non-zero naming the rank it blames: of the failures seen, the first that is the
rank's own and not a consequence of another's (a ``PeerError``), as each rank's
exit report says (``pycollect/exit_report.py``).  SIGINT, SIGTERM and SIGHUP (a
hung-up terminal or ssh session, which the ranks, in sessions of their own, do not
get) sent to the launcher are forwarded to every rank.  A launcher started with
SIGHUP ignored (``nohup``) leaves it ignored, and so do its ranks.
"""

import argparse
import contextlib
import os
import queue
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from pycollect import exit_report, leftovers
from pycollect.errors import Error
from pycollect.plugins.hosts import cores, rank_cpus, started_on
from pycollect.plugins.registry import check_store_url, with_prefix

__all__ = ["main", "module_command"]

# How long ranks get to exit after SIGTERM (or a forwarded SIGINT) before SIGKILL.
GRACE_S = 5.0
# How long to wait for the kernel to reap ranks after SIGKILL.
REAP_S = 5.0
# How long to wait for the output threads to drain once the ranks are gone.
DRAIN_S = 2.0
# After a rank fails, how long to wait for the exits it causes before blaming one.
FAILURE_WINDOW_S = 0.3
# How much longer to wait while every failure seen is a consequence of another's (the
# failing rank's own exit, after its sockets closed, may come after its peers').
CAUSE_WAIT_S = 2.0
# Longest piece of a line read in one go; a longer line is passed on in pieces.
MAX_LINE = 1 << 16
# Exit status when --timeout ends the job (as timeout(1) does).
TIMEOUT_EXIT = 124


def module_command(module, python=None):
    """The argv that runs ``python -m module`` without the working directory on ``sys.path``.

    ``python -m`` puts the current directory first on ``sys.path``, so a child started from
    a source checkout would import the checkout (which has no compiled extensions) instead
    of the installed pycollect.  Every Python child that pycollect starts goes through this:
    ``-P`` where the interpreter has it (3.11+), else a ``-c`` stub that drops the path
    entry ``-c`` adds before it runs the module as ``__main__``.
    """
    python = python or sys.executable
    if sys.version_info >= (3, 11):     # -P: no working directory on sys.path
        return [python, "-P", "-m", module]
    return [python, "-c", "import runpy, sys; del sys.path[0]; "
            "runpy.run_module(%r, run_name='__main__', alter_sys=True)" % module]


def _positive_int(text):
    """Parse a rank count of at least 1."""
    try:
        value = int(text)
    except ValueError:
        # "-np 4" (mpirun's spelling) reaches here as -n with the value "p".
        hint = "; mpirun's -np N is -n N here" if text.startswith("p") else ""
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer{hint}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _positive_seconds(text):
    """Parse a duration in seconds greater than 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds > 0, got {text}")
    return value


def _parser():
    """Build the command-line parser."""
    parser = argparse.ArgumentParser(
        prog="pycollect-run",
        usage="%(prog)s -n N [--store URL] [--timeout S] [--bind {none,core}] "
              "[--no-prefix-output] program [args ...]",
        description="Run N ranks of a program on this machine for pycollect.",
        epilog="A program ending in .py runs with this Python interpreter. "
               "Exit status: 0 when every rank exits 0; the failed rank's exit code, "
               "128+signal when it died by a signal, 124 when --timeout ran out.",
    )
    parser.add_argument("-n", "--nranks", type=_positive_int, required=True, metavar="N",
                        help="number of ranks to start (>= 1)")
    parser.add_argument("--store", metavar="URL",
                        help="rendezvous store URL (default: host an embedded TCP store "
                             "on 127.0.0.1); a prefix=run-<random> query is added per run")
    parser.add_argument("--timeout", type=_positive_seconds, metavar="S",
                        help="terminate the whole job after S seconds (default: no limit)")
    parser.add_argument("--bind", choices=("none", "core"), default="none",
                        help="core: bind rank r to physical core r %% cores (a core's "
                             "hardware threads), as mpirun --bind-to core; none (default): "
                             "the kernel places the ranks")
    parser.add_argument("--no-prefix-output", dest="prefix_output", action="store_false",
                        help="pass the ranks' stdout and stderr through without '[rank R] '")
    parser.add_argument("program", nargs="?",
                        help="program to run (a .py file, or a command on PATH)")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the program")
    return parser


def _command(parser, program, args):
    """Resolve the program into an argv, or exit with a usage error."""
    if program.endswith(".py"):
        if not os.path.isfile(program):
            parser.error(f"program not found: {program}")
        return [sys.executable, program, *args]
    path = shutil.which(program)
    if path is None:
        if os.sep in program and os.path.exists(program):
            parser.error(f"program is not executable: {program}")
        parser.error(f"program not found: {program}")
    return [path, *args]


def _describe(returncode):
    """Say how a rank ended, from its Popen return code."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = "unknown signal"
        return f"was killed by signal {-returncode} ({name})"
    return f"exited with code {returncode}"


def _exit_status(returncode):
    """Map a failed rank's return code to the launcher's exit status."""
    return 128 - returncode if returncode < 0 else returncode


class _Output:
    """Copies one rank's stdout or stderr to ours, prefixing each line."""

    def __init__(self, pipe, sink, prefix, lock):
        self.pipe = pipe
        self.sink = sink
        self.prefix = prefix
        self.lock = lock
        self.thread = threading.Thread(target=self._run, daemon=True, name=f"output {prefix!r}")
        self.thread.start()

    def _write(self, data):
        """Write bytes to the sink and flush; a closed sink drops them."""
        if self.sink is None:
            return
        with self.lock:
            try:
                self.sink.write(data)
                self.sink.flush()
            except (OSError, ValueError):
                # Our own stdout went away (a closed pipe): keep draining the
                # rank so that it never blocks on a full pipe, but drop its output.
                self.sink = None

    def _run(self):
        """Read lines until EOF; the prefix starts every line, however long."""
        at_line_start = True
        with self.pipe:
            while True:
                piece = self.pipe.readline(MAX_LINE)
                if not piece:
                    break
                self._write(self.prefix + piece if at_line_start else piece)
                at_line_start = piece.endswith(b"\n")
        if not at_line_start:
            self._write(b"\n")


class _Job:
    """The running ranks, their output threads and the rules for ending them."""

    def __init__(self, prefix_output):
        self.prefix_output = prefix_output
        self.procs = []
        self.outputs = []
        self.stopping = False
        self.exits = queue.Queue()

    def start(self, argv, envs, cpus=None):
        """Start one rank per environment, rank r on ``cpus[r]`` where given; on failure
        stop those already started."""
        lock = threading.Lock()
        pipe = subprocess.PIPE if self.prefix_output else None
        try:
            for rank, env in enumerate(envs):
                with started_on(None if cpus is None else cpus[rank]):
                    proc = subprocess.Popen(
                        argv, env=env, start_new_session=True,
                        stdin=None if rank == 0 else subprocess.DEVNULL,
                        stdout=pipe, stderr=pipe,
                    )
                self.procs.append(proc)
                if self.prefix_output:
                    prefix = f"[rank {rank}] ".encode()
                    self.outputs.append(_Output(proc.stdout, sys.stdout.buffer, prefix, lock))
                    self.outputs.append(_Output(proc.stderr, sys.stderr.buffer, prefix, lock))
                threading.Thread(target=self._wait_rank, args=(rank, proc), daemon=True,
                                 name=f"wait rank {rank}").start()
        except BaseException:
            self.stop(signal.SIGTERM)
            raise

    def _wait_rank(self, rank, proc):
        """Report the rank's exit with the time it was seen."""
        returncode = proc.wait()
        self.exits.put((time.monotonic(), rank, returncode))

    def running(self):
        """Return the ranks that have not exited yet."""
        return [proc for proc in self.procs if proc.poll() is None]

    def signal(self, signum):
        """Send a signal to every rank's process group (its children too)."""
        for proc in self.procs:
            try:
                os.killpg(proc.pid, signum)
            except (ProcessLookupError, PermissionError):
                pass  # the whole group is gone already

    def _wait_all(self, seconds):
        """Wait up to ``seconds`` for every rank to exit; say whether they all did."""
        deadline = time.monotonic() + seconds
        while self.running():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)
        return True

    def stop(self, signum):
        """Send ``signum`` to every rank, then SIGKILL whatever outlives the grace period."""
        self.stopping = True
        self.signal(signum)
        if not self._wait_all(GRACE_S):
            self.signal(signal.SIGKILL)
            self._wait_all(REAP_S)
        # Grandchildren that outlived their rank still hold the group alive.
        self.signal(signal.SIGKILL)

    def drain(self):
        """Wait, bounded, for the output threads to pass on what the ranks wrote."""
        deadline = time.monotonic() + DRAIN_S
        for output in self.outputs:
            output.thread.join(max(0.0, deadline - time.monotonic()))


def _fail(message):
    """Write a launcher message to stderr; one whose stderr is gone (a hung-up terminal, a
    closed pipe) drops it, and goes on stopping the ranks."""
    try:
        sys.stderr.write(f"pycollect-run: {message}\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


def _forwarded_signals():
    """The signals the launcher forwards: SIGINT, SIGTERM, and SIGHUP unless it is ignored
    (``nohup``: the ranks inherit the ignoring, and the job outlives the hang-up)."""
    forwarded = [signal.SIGINT, signal.SIGTERM]
    if signal.getsignal(signal.SIGHUP) != signal.SIG_IGN:
        forwarded.append(signal.SIGHUP)
    return forwarded


@contextlib.contextmanager
def _signals_caught(job):
    """Catch the forwarded signals into a list while the job runs; a second one kills at
    once."""
    received = []

    def on_signal(signum, frame):
        if job.stopping:
            job.signal(signal.SIGKILL)  # a signal while stopping: no more grace
        else:
            received.append(signum)

    previous = {signum: signal.signal(signum, on_signal) for signum in _forwarded_signals()}
    try:
        yield received
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _more_exits(job, seconds):
    """Exits reported within ``seconds`` from now."""
    seen, deadline = [], time.monotonic() + seconds
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return seen
        try:
            seen.append(job.exits.get(timeout=left))
        except queue.Empty:
            return seen


def _blame(job, failed, reports):
    """The failed exit to blame, (seen, rank, returncode), and the line naming them all:
    the first failure seen that is the rank's own (its exit report says so, or it wrote
    none); while every failure seen is another's consequence, exits that come within
    CAUSE_WAIT_S more are waited for.  None of its own: the first seen."""
    read = {}       # a report is written before its rank exits: read each once

    def said(rank):
        if rank not in read:
            read[rank] = exit_report.read(reports[rank]) if reports is not None else None
        return read[rank]

    def own(exit_):
        report = said(exit_[1])
        return report is None or not report["consequence"]

    deadline = time.monotonic() + CAUSE_WAIT_S
    while not any(own(e) for e in failed) and job.running():
        left = deadline - time.monotonic()
        if left <= 0:
            break
        failed = sorted(failed + [e for e in _more_exits(job, min(left, 0.05)) if e[2] != 0])
    blamed = next((e for e in failed if own(e)), failed[0])

    def named(exit_):
        report = said(exit_[1])
        note = "" if report is None else " (%s%s)" % (
            report["error"], ": another rank's failure" if report["consequence"] else "")
        return f"rank {exit_[1]} {_describe(exit_[2])}{note}"

    rest = [e for e in failed if e is not blamed]
    return blamed, named(blamed) + "".join(
        ("; then " if e[0] > blamed[0] else "; before it, ") + named(e) for e in rest)


def _supervise(job, size, timeout, received, reports=None):
    """Wait for the ranks and return the launcher's exit status (``reports``: each rank's
    exit report path)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    finished = 0
    while finished < size:
        if received:
            signum = received[0]
            _fail(f"received {signal.Signals(signum).name}; forwarding it to the ranks")
            job.stop(signum)
            return 128 + signum
        if deadline is not None and time.monotonic() >= deadline:
            _fail(f"the job ran out of its {timeout:g} s timeout; terminating "
                  f"{len(job.running())} rank(s)")
            job.stop(signal.SIGTERM)
            return TIMEOUT_EXIT
        try:
            exit_ = job.exits.get(timeout=0.1)
        except queue.Empty:
            continue
        finished += 1
        if exit_[2] != 0:
            # A failing rank usually takes others down with it within
            # milliseconds; their exits can be seen in any order, so blame the
            # earliest one seen in a short window.
            failed = [exit_] + _more_exits(job, FAILURE_WINDOW_S)
            (_, _, returncode), line = _blame(job, sorted(e for e in failed if e[2] != 0),
                                              reports)
            others = len(job.running())
            _fail(line + (f"; terminating the other {others} rank(s)" if others else ""))
            job.stop(signal.SIGTERM)
            return _exit_status(returncode)
    job.signal(signal.SIGKILL)  # stray grandchildren of ranks that exited 0
    return 0


def _rank_envs(size, store_url, auth, reports):
    """Return the environment of each rank (``reports``: its exit report's path)."""
    envs = []
    threads = str(max(1, cores() // size))
    for rank in range(size):
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", threads)
        env.update({
            "PYCOLLECT_RANK": str(rank),
            "PYCOLLECT_SIZE": str(size),
            "PYCOLLECT_LOCAL_RANK": str(rank),
            "PYCOLLECT_LOCAL_SIZE": str(size),
            "PYCOLLECT_STORE": store_url,
            exit_report.ENV: reports[rank],
        })
        if auth is not None:
            env["PYCOLLECT_AUTH"] = auth
        envs.append(env)
    return envs


def main(argv=None):
    """Run the launcher; return its exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.program is None:
        parser.error("no program to run: pycollect-run -n N program [args...]")
    command = _command(parser, args.program, args.args)
    run_id = f"run-{secrets.token_hex(6)}"

    server = None
    auth = None
    store_url = args.store
    if store_url is not None:
        # Checked before any rank starts: every rank would fail on it the same way.
        try:
            check_store_url(store_url, across_processes=True)
        except Error as exc:
            parser.error(f"--store: {exc} (or no --store: the launcher hosts a TCP store)")
    if store_url is None:
        try:
            from pycollect.plugins.stores.tcp_store import TCPStoreServer
        except ImportError as exc:
            _fail(f"cannot host the embedded TCP store ({exc}); pass --store URL")
            return 1
        auth = secrets.token_hex(16)
        server = TCPStoreServer(host="127.0.0.1", port=0, auth=auth).start()
        store_url = server.url
    report_dir = tempfile.mkdtemp(prefix="pycollect-run-")
    reports = [os.path.join(report_dir, f"rank{r}.json") for r in range(args.nranks)]
    try:
        envs = _rank_envs(args.nranks, with_prefix(store_url, run_id), auth, reports)
        # Ranks write into our pipes: make Python ranks flush every line.
        if args.prefix_output:
            for env in envs:
                env.setdefault("PYTHONUNBUFFERED", "1")
        job = _Job(args.prefix_output)
        with _signals_caught(job) as received:
            try:
                job.start(command, envs,
                          rank_cpus(args.nranks) if args.bind == "core" else None)
            except OSError as exc:
                _fail(f"cannot start {command[0]}: {exc}")
                return 1
            try:
                return _supervise(job, args.nranks, args.timeout, received, reports)
            finally:
                job.drain()
    finally:
        # The ranks have ended: what shared memory a killed one left linked goes too.
        for rank, report in enumerate(reports):
            for name in leftovers.sweep(report):
                _fail(f"removed {leftovers.SHM_DIR}/{name}, which rank {rank} left behind")
        shutil.rmtree(report_dir, ignore_errors=True)
        if server is not None:
            server.close()


if __name__ == "__main__":
    sys.exit(main())
