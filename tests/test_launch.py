"""pycollect-run, driven as a real process with tiny Python programs as ranks."""

import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from pycollect.launch import module_command

LAUNCHER = module_command("pycollect.launch")


def write_program(tmp_path, body, name="rank.py"):
    """Write a rank program into tmp_path and return its path."""
    path = tmp_path / name
    path.write_text("import os, signal, sys, time\n"
                    "RANK = int(os.environ['PYCOLLECT_RANK'])\n" + textwrap.dedent(body))
    return str(path)


def launch(tmp_path, *args, store=True, timeout=30):
    """Run the launcher to completion; return the CompletedProcess and its wall time."""
    store_args = ["--store", f"file://{tmp_path}/store"] if store else []
    start = time.monotonic()
    done = subprocess.run(LAUNCHER + store_args + list(args), capture_output=True,
                          timeout=timeout, cwd=tmp_path)
    return done, time.monotonic() - start


def alive(pid):
    """Say whether a process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            state = stat.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def wait_for_files(paths, seconds=15):
    """Wait until every path exists, failing after a bounded time."""
    deadline = time.monotonic() + seconds
    while not all(os.path.exists(p) for p in paths):
        assert time.monotonic() < deadline, f"never appeared: {paths}"
        time.sleep(0.02)


def assert_all_gone(pids, seconds=5):
    """Assert that every pid is gone within a bounded time."""
    deadline = time.monotonic() + seconds
    while any(alive(pid) for pid in pids):
        assert time.monotonic() < deadline, [pid for pid in pids if alive(pid)]
        time.sleep(0.02)


ENV_PRINTER = """
env = os.environ
print(RANK, env['PYCOLLECT_SIZE'], env['PYCOLLECT_LOCAL_RANK'], env['PYCOLLECT_LOCAL_SIZE'],
      env['PYCOLLECT_STORE'], env.get('PYCOLLECT_AUTH', '-'), sys.executable)
"""


def env_lines(stdout, size):
    """Parse the ENV_PRINTER lines by rank, checking each line's prefix."""
    lines = {}
    for line in stdout.decode().splitlines():
        match = re.fullmatch(r"\[rank (\d+)\] (.*)", line)
        assert match, line
        lines[int(match[1])] = match[2].split(" ")
    assert sorted(lines) == list(range(size))
    for rank, fields in lines.items():
        assert fields[:4] == [str(rank), str(size), str(rank), str(size)]
    return lines


def test_every_rank_runs_with_its_environment(tmp_path):
    program = write_program(tmp_path, ENV_PRINTER)
    done, _ = launch(tmp_path, "-n", "3", program)
    assert done.returncode == 0, done.stderr
    lines = env_lines(done.stdout, 3)
    stores = {fields[4] for fields in lines.values()}
    assert len(stores) == 1
    assert re.fullmatch(rf"file://{tmp_path}/store\?prefix=run-[0-9a-f]+", stores.pop())
    # With --store the launcher adds no secret: the ranks inherit the user's, if any.
    assert {fields[5] for fields in lines.values()} == {os.environ.get("PYCOLLECT_AUTH", "-")}
    # A .py program runs with the launcher's own interpreter.
    assert {fields[6] for fields in lines.values()} == {sys.executable}
    assert done.stderr == b""


@pytest.mark.parametrize("user", [None, "3"])
def test_ranks_share_the_cores_for_their_thread_pools(tmp_path, monkeypatch, user):
    """Without OMP_NUM_THREADS each rank gets the cores divided among the ranks (at least 1),
    so that their OpenMP and BLAS pools do not each take every core; a value the user set
    is kept."""
    if user is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", user)
    program = write_program(tmp_path, "print(os.environ.get('OMP_NUM_THREADS'))\n")
    cores = len(os.sched_getaffinity(0))
    for n in (1, 2, 3):
        done, _ = launch(tmp_path, "-n", str(n), program)
        assert done.returncode == 0, done.stderr
        values = {line.split(b" ")[-1] for line in done.stdout.splitlines()}
        assert len(done.stdout.splitlines()) == n
        assert values == {(user or str(max(1, cores // n))).encode()}, (n, values)


def test_bind_core_puts_rank_r_on_core_r_mod_cores(tmp_path):
    """--bind core: each rank runs on one core from its first instruction (its threads
    too), rank r on core r % cores; without it every rank may run on every CPU."""
    from pycollect.plugins.hosts import core_sets
    program = write_program(tmp_path, """
        import threading
        seen = []
        t = threading.Thread(target=lambda: seen.append(sorted(os.sched_getaffinity(0))))
        t.start(); t.join()
        print(RANK, sorted(os.sched_getaffinity(0)), seen[0])
    """)
    sets = core_sets()
    everything = sorted(os.sched_getaffinity(0))
    for extra, expect in ((["--bind", "core"], lambda r: sorted(sets[r % len(sets)])),
                          ([], lambda r: everything), (["--bind", "none"], lambda r: everything)):
        done, _ = launch(tmp_path, "-n", "3", *extra, program)
        assert done.returncode == 0, done.stderr
        lines = sorted(line.split(b"] ", 1)[1].decode() for line in done.stdout.splitlines())
        assert lines == [f"{r} {expect(r)} {expect(r)}" for r in range(3)], (extra, lines)
    # The launcher itself keeps every CPU.
    assert sorted(os.sched_getaffinity(0)) == everything


def test_embedded_store_serves_every_rank_with_a_secret(tmp_path):
    program = write_program(tmp_path, """
        from urllib.parse import parse_qs, urlsplit
        from pycollect.plugins.store import PrefixStore
        from pycollect.plugins.stores.tcp_store import TCPStore
        url = urlsplit(os.environ["PYCOLLECT_STORE"])
        auth = os.environ["PYCOLLECT_AUTH"]
        with PrefixStore(parse_qs(url.query)["prefix"][0],
                         TCPStore(url.hostname, url.port, timeout=20, auth=auth)) as store:
            store.set(f"hello-{RANK}", auth.encode())
            seen = {store.get(f"hello-{r}").decode() for r in range(3)}
            arrived = store.add("arrived", 1)
        print(os.environ["PYCOLLECT_STORE"], auth, len(seen), arrived)
    """)
    done, _ = launch(tmp_path, "-n", "3", program, store=False)
    assert done.returncode == 0, done.stderr
    fields = [line.split(b" ") for line in sorted(done.stdout.splitlines())]
    assert [f[0] for f in fields] == [b"[rank", b"[rank", b"[rank"]
    assert len({(f[2], f[3]) for f in fields}) == 1  # one store URL and one secret
    assert re.fullmatch(rb"tcp://127\.0\.0\.1:\d+\?prefix=run-[0-9a-f]+", fields[0][2])
    assert re.fullmatch(rb"[0-9a-f]{32}", fields[0][3])
    assert {f[4] for f in fields} == {b"1"}  # every rank read the same secret back
    assert sorted(int(f[5]) for f in fields) == [1, 2, 3]


def test_embedded_store_secret_is_not_inherited(tmp_path, monkeypatch):
    monkeypatch.setenv("PYCOLLECT_AUTH", "from-the-user")
    program = write_program(tmp_path, ENV_PRINTER)
    runs = [launch(tmp_path, "-n", "1", program, store=False)[0] for _ in range(2)]
    secrets = {env_lines(done.stdout, 1)[0][5] for done in runs}
    assert len(secrets) == 2 and "from-the-user" not in secrets


def test_each_run_gets_a_fresh_prefix_inside_the_users(tmp_path):
    program = write_program(tmp_path, ENV_PRINTER)
    stores = []
    for _ in range(2):
        done = subprocess.run(LAUNCHER + ["-n", "1", "--store", "file:///x?mode=a&prefix=job",
                                          program], capture_output=True, timeout=30)
        assert done.returncode == 0, done.stderr
        stores.append(env_lines(done.stdout, 1)[0][4])
    assert stores[0] != stores[1]
    for store in stores:
        assert re.fullmatch(r"file:///x\?mode=a&prefix=job/run-[0-9a-f]+", store)


def test_command_from_path_gets_its_arguments(tmp_path):
    done, _ = launch(tmp_path, "-n", "2", "sh", "-c", 'echo "$PYCOLLECT_RANK $1 $2"', "sh",
                     "-n", "--store")
    assert done.returncode == 0, done.stderr
    assert sorted(done.stdout.splitlines()) == [b"[rank 0] 0 -n --store",
                                                b"[rank 1] 1 -n --store"]


def test_output_is_prefixed_per_line_and_binary_safe(tmp_path):
    program = write_program(tmp_path, """
        sys.stdout.buffer.write(b"\\xff\\xfe raw\\r\\nsecond\\n" + b"x" * 200000 + b"\\n")
        sys.stdout.flush()
        sys.stderr.write("warning without newline")
    """)
    done, _ = launch(tmp_path, "-n", "1", program)
    assert done.returncode == 0, done.stderr
    assert done.stdout == (b"[rank 0] \xff\xfe raw\r\n[rank 0] second\n"
                           b"[rank 0] " + b"x" * 200000 + b"\n")
    assert done.stderr == b"[rank 0] warning without newline\n"


def test_no_prefix_output_passes_output_through(tmp_path):
    program = write_program(tmp_path, """
        os.write(1, f"plain {RANK}\\n".encode())
        os.write(2, f"err {RANK}\\n".encode())
    """)
    done, _ = launch(tmp_path, "-n", "2", "--no-prefix-output", program)
    assert done.returncode == 0, done.stderr
    assert sorted(done.stdout.splitlines()) == [b"plain 0", b"plain 1"]
    assert sorted(done.stderr.splitlines()) == [b"err 0", b"err 1"]


SLEEP_UNLESS_FAILING = """
open(f"tmp-{RANK}", "w").write(str(os.getpid()))
os.rename(f"tmp-{RANK}", f"pid-{RANK}")
if RANK == 1:
    while not all(os.path.exists(f"pid-{r}") for r in (0, 2)):
        time.sleep(0.01)
    FAIL
time.sleep(60)
"""


def test_a_failed_rank_stops_the_job(tmp_path):
    program = write_program(tmp_path, SLEEP_UNLESS_FAILING.replace("FAIL", "sys.exit(3)"))
    done, elapsed = launch(tmp_path, "-n", "3", program)
    assert done.returncode == 3
    assert b"pycollect-run: rank 1 exited with code 3; terminating the other 2 rank(s)" \
        in done.stderr
    assert elapsed < 15
    assert_all_gone([int((tmp_path / f"pid-{r}").read_text()) for r in range(3)])


# Rank 1 fails after closing its context, so that its peers raise PeerError and exit first,
# then takes WAIT seconds to exit in the way FAIL says.
FAILS_AFTER_ITS_PEERS = """
import numpy as np
import pycollect as pc
ctx = pc.init()
if RANK == 1:
    ctx.close()
    time.sleep(WAIT)
    FAIL
ctx.allreduce(np.ones(4))
"""


def test_the_rank_that_failed_first_of_its_own_is_blamed(tmp_path):
    """Its peers' PeerError exits come first; their exit reports say they are another
    rank's failure, so the launcher waits for rank 1's and exits with its code."""
    program = write_program(tmp_path, FAILS_AFTER_ITS_PEERS.replace("WAIT", "0.8").replace(
        "FAIL", "sys.exit(3)"))
    done, elapsed = launch(tmp_path, "-n", "3", program)
    err = done.stderr.decode()
    assert done.returncode == 3, err
    line = re.search(r"pycollect-run: (.*)", err).group(1)
    assert re.fullmatch(r"rank 1 exited with code 3(; before it, rank [02] exited with code 1 "
                        r"\(PeerError: another rank's failure\)){2}", line), line
    assert elapsed < 15


def test_an_exception_that_ends_a_rank_is_named(tmp_path):
    program = write_program(tmp_path, FAILS_AFTER_ITS_PEERS.replace("WAIT", "0").replace(
        "FAIL", "raise ValueError('bad input')"))
    done, _ = launch(tmp_path, "-n", "3", program)
    err = done.stderr.decode()
    assert done.returncode == 1, err
    assert "pycollect-run: rank 1 exited with code 1 (ValueError)" in err, err
    assert "ValueError: bad input" in err        # the rank's own traceback still prints


def test_consequences_alone_blame_the_first_seen_after_a_bounded_wait(tmp_path):
    """Rank 1 closes its context and never exits: only PeerErrors are seen; after
    CAUSE_WAIT_S the first of them is blamed and rank 1 is stopped."""
    program = write_program(tmp_path, FAILS_AFTER_ITS_PEERS.replace("WAIT", "60").replace(
        "FAIL", ""))
    done, elapsed = launch(tmp_path, "-n", "3", program)
    err = done.stderr.decode()
    assert done.returncode == 1, err
    assert re.search(r"pycollect-run: rank [02] exited with code 1 \(PeerError: another "
                     r"rank's failure\); then rank [02] .*; terminating the other 1 rank",
                     err), err
    assert elapsed < 15


def test_a_rank_killed_by_a_signal_stops_the_job(tmp_path):
    program = write_program(
        tmp_path, SLEEP_UNLESS_FAILING.replace("FAIL", "os.kill(os.getpid(), signal.SIGKILL)"))
    done, elapsed = launch(tmp_path, "-n", "3", program)
    assert done.returncode == 128 + signal.SIGKILL
    assert b"rank 1 was killed by signal 9 (SIGKILL)" in done.stderr
    assert elapsed < 15
    assert_all_gone([int((tmp_path / f"pid-{r}").read_text()) for r in range(3)])


def test_shared_memory_that_a_killed_rank_left_is_removed(tmp_path):
    """Rank 0 creates its host's segment and waits for rank 1 to map it; rank 1 fails
    first, so the launcher SIGTERMs rank 0, whose default SIGTERM runs no finally: the
    segment stayed in /dev/shm.  The launcher removes it and says so."""
    program = write_program(tmp_path, """
        import threading
        import pycollect._ext._shm as shm
        real = shm.Segment
        def late(path, length, create):     # rank 1 maps the segment late, and fails first
            if not create:
                threading.Timer(1.0, os._exit, (1,)).start()
                time.sleep(30)
            return real(path, length, create)
        shm.Segment = late
        import pycollect as pc
        pc.init(transport="shm", timeout=20)
        """)
    before = set(os.listdir("/dev/shm"))
    done, elapsed = launch(tmp_path, "-n", "2", program)
    assert done.returncode == 1, done.stderr
    found = re.search(rb"removed /dev/shm/(pycollect-[0-9a-f]{24}), which rank 0 left behind",
                      done.stderr)
    assert found, done.stderr
    assert found.group(1).decode() not in os.listdir("/dev/shm")
    assert not {n for n in set(os.listdir("/dev/shm")) - before if n.startswith("pycollect-")}
    assert elapsed < 20


def test_ranks_ignoring_sigterm_and_their_children_are_killed(tmp_path):
    program = write_program(tmp_path, """
        import subprocess
        if RANK == 0:
            while not os.path.exists("ready"):
                time.sleep(0.01)
            sys.exit(1)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        child = subprocess.Popen(["sleep", "60"])
        open("pids", "w").write(f"{os.getpid()} {child.pid}")
        os.rename("pids", "ready")
        time.sleep(60)
    """)
    done, elapsed = launch(tmp_path, "-n", "2", program)
    assert done.returncode == 1
    assert b"rank 0 exited with code 1" in done.stderr
    assert elapsed < 15
    assert_all_gone([int(pid) for pid in (tmp_path / "ready").read_text().split()])


def test_timeout_ends_the_job(tmp_path):
    program = write_program(tmp_path, "time.sleep(60)\n")
    done, elapsed = launch(tmp_path, "-n", "2", "--timeout", "0.5", program)
    assert done.returncode == 124
    assert b"ran out of its 0.5 s timeout" in done.stderr
    assert elapsed < 15


# Each rank writes its pid and the directory of its exit report, then waits for SIGNUM (which
# it records and exits on) or, for at most 60 s, for a file named "go".
WAITS_FOR_A_SIGNAL = """
def stop(signum, frame):
    open(f"got-{RANK}", "w").write(str(signum))
    sys.exit(0)
signal.signal(SIGNUM, stop)
report_dir = os.path.dirname(os.environ["PYCOLLECT_EXIT_REPORT"])
open(f"tmp-{RANK}", "w").write(f"{os.getpid()} {report_dir}")
os.rename(f"tmp-{RANK}", f"ready-{RANK}")
deadline = time.monotonic() + 60
while not os.path.exists("go") and time.monotonic() < deadline:
    time.sleep(0.01)
print("done", RANK)
"""


def start_waiting_ranks(tmp_path, signum, **popen):
    """Start the launcher on 3 WAITS_FOR_A_SIGNAL ranks; return it, the ranks' pids and the
    launcher's report directory once every rank is ready."""
    program = write_program(tmp_path, WAITS_FOR_A_SIGNAL.replace("SIGNUM", str(int(signum))))
    launcher = subprocess.Popen(LAUNCHER + ["--store", f"file://{tmp_path}/store", "-n", "3",
                                            program],
                                cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                **popen)
    try:
        ready = [tmp_path / f"ready-{r}" for r in range(3)]
        wait_for_files(ready)
    except BaseException:
        launcher.kill()
        launcher.wait(5)
        raise
    fields = [path.read_text().split(" ", 1) for path in ready]
    assert len({report_dir for _, report_dir in fields}) == 1
    return launcher, [int(pid) for pid, _ in fields], fields[0][1]


def stop_leftovers(launcher, pids):
    """Kill the launcher and any rank that outlived it (a failing test leaves no orphan)."""
    launcher.kill()
    launcher.wait(5)
    for pid in pids:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_signals_to_the_launcher_reach_every_rank(tmp_path, signum):
    """SIGHUP too (a hung-up terminal or ssh session): the ranks, each in a session of its
    own, get none from the terminal.  The launcher removes its report directory."""
    launcher, pids, report_dir = start_waiting_ranks(tmp_path, signum)
    try:
        assert os.path.isdir(report_dir)
        launcher.send_signal(signum)
        _, stderr = launcher.communicate(timeout=15)
        assert_all_gone(pids)
    finally:
        stop_leftovers(launcher, pids)
    assert launcher.returncode == 128 + signum
    assert f"received {signal.Signals(signum).name}".encode() in stderr
    for rank in range(3):
        assert (tmp_path / f"got-{rank}").read_text() == str(int(signum))
    assert not os.path.exists(report_dir)


def test_a_hangup_reaches_every_rank_when_the_launchers_stderr_is_gone(tmp_path):
    """After a hang-up the launcher's terminal refuses writes: its message is dropped, and
    the ranks are still stopped."""
    launcher, pids, report_dir = start_waiting_ranks(tmp_path, signal.SIGHUP)
    try:
        launcher.stderr.close()         # its next write fails (EPIPE), as a hung-up tty's does
        launcher.send_signal(signal.SIGHUP)
        launcher.wait(15)
        assert_all_gone(pids)
    finally:
        stop_leftovers(launcher, pids)
    assert launcher.returncode == 128 + signal.SIGHUP
    for rank in range(3):
        assert (tmp_path / f"got-{rank}").read_text() == str(int(signal.SIGHUP))
    assert not os.path.exists(report_dir)


def test_under_nohup_a_hangup_leaves_the_job_running(tmp_path):
    """A launcher started with SIGHUP ignored keeps it ignored, and so do its ranks."""
    launcher, pids, _ = start_waiting_ranks(
        tmp_path, signal.SIGUSR1,
        preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))
    try:
        launcher.send_signal(signal.SIGHUP)
        for pid in pids:
            os.kill(pid, signal.SIGHUP)     # what a terminal's hang-up would send them
        time.sleep(0.5)
        assert launcher.poll() is None and all(alive(pid) for pid in pids)
        (tmp_path / "go").touch()
        stdout, stderr = launcher.communicate(timeout=15)
    finally:
        stop_leftovers(launcher, pids)
    assert launcher.returncode == 0, stderr
    assert sorted(stdout.splitlines()) == [b"[rank %d] done %d" % (r, r) for r in range(3)]


def test_a_program_that_cannot_start_is_reported(tmp_path):
    program = tmp_path / "not-a-program"
    program.write_bytes(b"\x00\x01 not an executable format")
    program.chmod(0o755)
    done, _ = launch(tmp_path, "-n", "2", "./not-a-program")
    assert done.returncode == 1
    assert b"pycollect-run: cannot start " in done.stderr
    assert b"Exec format error" in done.stderr


@pytest.mark.parametrize("args, message", [
    (["-n", "0", "x.py"], "must be at least 1, got 0"),
    (["-n", "-2", "x.py"], "must be at least 1, got -2"),
    (["-n", "two", "x.py"], "'two' is not an integer"),
    (["-np", "2", "x.py"], "'p' is not an integer; mpirun's -np N is -n N here"),
    (["x.py"], "the following arguments are required: -n"),
    (["-n", "2"], "no program to run"),
    (["-n", "2", "no-such-program-pycollect"], "program not found: no-such-program-pycollect"),
    (["-n", "2", "missing.py"], "program not found: missing.py"),
    (["-n", "2", "--timeout", "0", "x.py"], "must be a finite number of seconds > 0"),
    (["-n", "2", "--bind", "socket", "x.py"], "argument --bind: invalid choice: 'socket'"),
])
def test_argument_errors(tmp_path, args, message):
    done, _ = launch(tmp_path, *args, store=False)
    assert done.returncode == 2
    assert done.stderr.startswith(b"usage: pycollect-run -n N")
    assert b"pycollect-run: error: " in done.stderr and message.encode() in done.stderr
    assert done.stdout == b""


@pytest.mark.parametrize("store, message", [
    ("hash://x", "--store: store 'hash://x' lives inside one process"),
    ("bogus://x", "--store: no store plugin named 'bogus'"),
    ("notaurl", "--store: store URL 'notaurl' has no scheme"),
    ("redis://:s3cret@h:1?prefix=a&prefix=b", "at most one non-empty ?prefix=NAME"),
])
def test_a_store_that_cannot_serve_the_ranks_is_refused_before_they_start(tmp_path, store,
                                                                          message):
    program = write_program(tmp_path, ENV_PRINTER)
    done = subprocess.run(LAUNCHER + ["-n", "2", "--store", store, program],
                          capture_output=True, timeout=30)
    assert done.returncode == 2, done.stderr
    assert message.encode() in done.stderr and b"s3cret" not in done.stderr, done.stderr
    assert done.stdout == b""       # no rank ran


def test_what_counts_as_another_ranks_failure():
    """The exit report's verdict: an error caused elsewhere (every PeerError; a refusal
    another rank made, which the refusal tests mark), or one raised from it; anything else,
    and anything raised ``from None``, is the rank's own."""
    import pycollect as pc
    from pycollect.exit_report import is_consequence
    told = pc.MismatchError("rank 0: allgather(float64 x 2, flags) #1 failed: rank 1 "
                            "(127.0.0.1:51765) refused its arguments to allgather #1: bad")
    told.caused_elsewhere = True
    assert is_consequence(told) and is_consequence(pc.PeerError("rank 0: closed"))
    assert is_consequence(told.restated("gather_object: %s" % told))     # kept when restated
    try:
        try:
            raise pc.PeerError("gone")
        except pc.PeerError as exc:
            raise RuntimeError("the step failed") from exc
    except RuntimeError as wrapped:
        assert is_consequence(wrapped)
    try:
        try:
            raise pc.PeerError("gone")
        except pc.PeerError:
            raise ValueError("a bug of its own") from None
    except ValueError as own:
        assert not is_consequence(own)
    for own in (ValueError("x"), pc.Timeout("t"), pc.InvalidArgument("allreduce: bad op"),
                pc.MismatchError("rank 0: allreduce #1 disagrees with rank 1")):
        assert not is_consequence(own), own
