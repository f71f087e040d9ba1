"""init around failures: a retried init meets a late peer (an init that fails while joining
gives its context number back), a rank that fails after the join (rank 0's failure reaches
the others at once; the numbers stay aligned), and a store that leaves with rank 0."""

import os
import socket
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(60)

# Rank 0 retries init on Timeout, as a job script does until its peers are up; rank 1 is a
# fresh process that starts after rank 0's first init failed, during its second.  Both must
# meet in the same context and run a collective.
WORKER = r"""
import sys, time
import pycollect as pc
rank, url, late_s = int(sys.argv[1]), sys.argv[2], float(sys.argv[3])
tries, timeout = (3, 4.0) if rank == 0 else (1, 6.0)
time.sleep(late_s if rank == 1 else 0)
for attempt in range(tries):
    try:
        ctx = pc.init(rank=rank, size=2, store=url, timeout=timeout)
    except pc.Timeout as err:
        print(f"rank {rank}: attempt {attempt} timed out: {err}", flush=True)
        continue
    total = ctx.allreduce_object(rank + 1)
    ctx.barrier()
    ctx.close()
    print(f"rank {rank}: met on attempt {attempt}, total {total}", flush=True)
    break
else:
    sys.exit(f"rank {rank}: never met its peer")
"""


def _two_ranks(script, *args):
    """Run ``script`` as ranks 0 and 1 (argv: rank, then ``args``); their outputs."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
         os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    procs = [subprocess.Popen([sys.executable, "-c", script, str(rank), *map(str, args)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              stdin=subprocess.DEVNULL, text=True) for rank in (0, 1)]
    try:
        return [proc.communicate(timeout=45)[0] for proc in procs]
    except subprocess.TimeoutExpired:
        pytest.fail("the ranks hung")
    finally:
        for proc in procs:
            proc.kill()


def test_a_retried_init_meets_a_peer_that_starts_late(tmp_path):
    outputs = _two_ranks(WORKER, f"file://{tmp_path}/store", 4.8)
    report = "\n".join(outputs)
    for rank, out in enumerate(outputs):
        assert f"rank {rank}: met on attempt" in out and "total 3" in out, report
    assert "rank 0: met on attempt 1" in outputs[0], report


# A rank whose init fails after the ranks joined (simulated: its transport is made, then
# refused), the others' inits meanwhile: ``who`` fails, the rest do as they will.
AFTER_JOIN = r"""
import sys, time
import pycollect as pc
from pycollect import rendezvous
rank, url, who, tries = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
if rank == who:
    made = rendezvous.open_transport
    def refused(*args, **kwargs):
        if getattr(refused, "once", False):
            return made(*args, **kwargs)
        refused.once = True
        made(*args, **kwargs).close()
        raise pc.PluginError("simulated: rank %d's transport refused after the join" % rank)
    rendezvous.open_transport = refused
for attempt in range(tries):
    start = time.monotonic()
    try:
        ctx = pc.init(rank=rank, size=2, store=url, transport="tcp", timeout=8)
    except pc.Error as err:
        print(f"rank {rank}: attempt {attempt} failed after {time.monotonic() - start:.1f} s: "
              f"{type(err).__name__}: {err}", flush=True)
        continue
    try:
        print(f"rank {rank}: attempt {attempt} total {ctx.allreduce_object(rank + 1)}",
              flush=True)
        break
    except pc.Error as err:
        print(f"rank {rank}: attempt {attempt} collective failed: {type(err).__name__}",
              flush=True)
    finally:
        ctx.close()
"""


def test_rank_0_failing_after_the_join_fails_the_others_at_once(tmp_path):
    """Rank 0's init fails once the ranks joined: rank 1, waiting for rank 0 to confirm the
    run, raises rank 0's failure within seconds (it waited out its whole timeout: 'is rank 0
    stopped?')."""
    out0, out1 = _two_ranks(AFTER_JOIN, f"file://{tmp_path}/store", 0, 1)
    report = out0 + out1
    assert "rank 0: attempt 0 failed" in out0 and "simulated" in out0, report
    line = [l for l in out1.splitlines() if l.startswith("rank 1: attempt 0")][0]
    seconds = float(line.split(" after ")[1].split(" s:")[0]) if " after " in line else None
    assert seconds is not None and seconds < 5, report
    assert "rank 0 failed after the ranks joined" in line and "simulated" in line, report


def test_a_rank_that_fails_after_the_join_keeps_its_context_number(tmp_path):
    """Rank 1's init fails after the join while rank 0's succeeds; both try again: they meet
    in the next context (rank 1 gave its number back and waited in the old one, rank 0 in
    the new)."""
    out0, out1 = _two_ranks(AFTER_JOIN, f"file://{tmp_path}/store", 1, 2)
    report = out0 + out1
    assert "rank 1: attempt 0 failed" in out1, report
    assert "rank 0: attempt 1 total 3" in out0 and "rank 1: attempt 1 total 3" in out1, report


# Rank 0 hosts the tcp:// store and closes right after its init; rank 1 comes to confirm the
# run a second later, when the store is gone.
HOST_LEAVES = r"""
import sys, time
import pycollect as pc
from pycollect import rendezvous
rank, port = int(sys.argv[1]), sys.argv[2]
if rank == 1:
    leave = rendezvous.leave_run
    def late(*args):
        time.sleep(1.0)
        return leave(*args)
    rendezvous.leave_run = late
start = time.monotonic()
ctx = pc.init(rank=rank, size=2, store="tcp://127.0.0.1:" + port, transport="tcp", timeout=8)
print(f"rank {rank}: init took {time.monotonic() - start:.1f} s", flush=True)
ctx.close()
"""


def test_a_rank_whose_store_left_with_rank_0_ends_its_init_at_once():
    """Rank 0, which hosts the store, confirmed the run and left; rank 1 finds the store gone
    when it reads the confirmation, and returns (it retried the store's calls for three
    store timeouts: 25 s of an init of 8)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out0, out1 = _two_ranks(HOST_LEAVES, port)
    assert "rank 0: init took" in out0, out0 + out1
    took = float(out1.split("init took ")[1].split(" s")[0])
    assert took < 4, out0 + out1
