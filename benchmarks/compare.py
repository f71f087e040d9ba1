"""pycollect against torch.distributed's Gloo and mpi4py on Open MPI, interleaved in one run.

    python benchmarks/compare.py                 # 2 and 4 ranks, every peer found; ~5 minutes
    python benchmarks/compare.py --quick         # a smoke run: 2 ranks, 3 sizes, short budgets
    python benchmarks/compare.py --peers pycollect-tcp,gloo --ranks 2 --no-write
    python benchmarks/compare.py --torch         # torch.distributed only: gloo vs "pycollect"
    python benchmarks/compare.py --dtype float16 --ranks 2 --collectives none   # 16-bit

Each peer runs as its own group of long-lived worker processes (MPI's under
mpirun).  The driver hands one case at a time to one group over a loopback
control socket; the other groups sleep in a socket read meanwhile, so they take
no CPU.  For every case the peers take turns, in a rotated order, for --rounds
rounds.  Every peer times the same way (pycollect.bench.time_calls): a warmup,
an iteration count agreed on from batches of calls timed on the slowest rank,
back-to-back calls, and per call the slowest rank's time; beside its p50, the small messages'
tables give OSU's average latency (each rank's time in its calls over the calls, the
slowest rank's), which tells more where ranks share cores: there a rank that arrives
last at a barrier leaves at once and its next call waits for a core, so per-call times
split into a short and a long mode and the p50 lands on either.  By default every
peer's rank r runs bound to core r mod cores (``--bind core``: pycollect-run's
``--bind core``, mpirun's ``--bind-to core:overload-allowed``); ``--bind none`` leaves
every peer's placement to the kernel.  The results go into
docs/performance.md (between the compare.py markers) and docs/img/*.png.
The script puts its own checkout first on ``sys.path`` (ahead of ``PYTHONPATH``), for
the driver and for every worker: to time another build, run that checkout's copy
(``python /path/to/other/benchmarks/compare.py``).

Peers: pycollect over each --transport given, torch 2.13.0 (the CPU wheel) with
backend gloo, torch.distributed with backend "pycollect" (pycollect.torch: the
same dist calls, tensors handed to pycollect), and mpi4py on Open MPI with its default (shared memory) and with
TCP forced (--mca pml ob1 --mca btl tcp,self).  A peer that is not installed
is left out and named in the report.

``--dtype float16`` or ``bfloat16`` times the same cases on that dtype, for the
peers that have it: pycollect and both torch backends (MPI has no standard
16-bit float type, and NumPy's 16-bit arithmetic is no memory ceiling); such a
run prints its tables and leaves the page, whose tables are float32's, alone.

Beside the peers, the run measures what the machine allows: the NumPy memory
ceiling (peer "ceiling-shm": ranks whose buffers already lie in shared memory
do, at the same time, the memory work of a direct allreduce with NumPy, see
``Ceiling``), a memcpy line, the TCP ceiling (``iperf3 --bidir`` over
loopback, per direction; "not measured" where iperf3 is absent), where a
TCP peer runs, the TCP latency floor at the start and the end of the run
(``TCPFloor``: benchmarks/tcp_floor.c, the kernel's own 1-float exchange), and
where a world size has more ranks than the CPUs and a shared-memory peer times
the barrier, the barrier floor likewise (``BarrierFloor``:
benchmarks/barrier_floor.c, the flags and the scheduler alone).
"""

import argparse
import datetime
import json
import mmap
import os
import platform
import secrets
import select
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))   # run from a checkout without installing
from pycollect.bench import busbw_factor, latency_stats, numpy_dtype, time_calls  # noqa: E402
from pycollect.plugins.hosts import rank_cpus, started_on  # noqa: E402
from pycollect.tensors import as_tensor_like  # noqa: E402

MPI_TCP_ARGS = ["--mca", "pml", "ob1", "--mca", "btl", "tcp,self",
                "--mca", "btl_tcp_if_include", "lo"]
MPIRUN = ["mpirun", "--allow-run-as-root", "--oversubscribe"]
# --bind core: every peer's rank r on core r % cores (pycollect-run --bind core); mpirun's
# own default binds to cores only while the ranks fit (none at 4 ranks on 2 cores).
MPI_BIND = {"core": ["--bind-to", "core:overload-allowed", "--map-by", "core:oversubscribe"],
            "none": ["--bind-to", "none"]}
ALLREDUCE_COUNTS = (1, 256, 4096, 65536, 262144, 1 << 20, 4 << 20, 16 << 20)
OTHER_CASES = (("broadcast", 1 << 20), ("allgather", 1 << 20), ("barrier", 0))
SETUP_S = 120.0
BEGIN_MARK = "<!-- compare.py: begin (generated; edit benchmarks/compare.py instead) -->"
END_MARK = "<!-- compare.py: end -->"
TORCH_BEGIN_MARK = ("<!-- compare.py --torch: begin (generated; edit benchmarks/compare.py "
                    "instead) -->")
TORCH_END_MARK = "<!-- compare.py --torch: end -->"
CEILING = "ceiling-shm"
POOLED = "pycollect-shm-pooled"   # pycollect over shm on arrays from pycollect.empty
COLORS = {CEILING: "#7f7f7f", "pycollect-tcp": "#1f5fb4", "pycollect-shm": "#17becf",
          POOLED: "#8c564b",
          "gloo": "#ff7f0e", "mpi-shm": "#d62728", "mpi-tcp": "#9467bd", "torch-pycollect": "#2ca02c"}
LABELS = {CEILING: "NumPy ceiling", "gloo": "torch gloo", "mpi-shm": "MPI shm",
          "mpi-tcp": "MPI TCP", "pycollect-shm": "pycollect shm", "pycollect-tcp": "pycollect tcp",
          "torch-pycollect": "torch pycollect", POOLED: "pycollect shm, pc.empty"}
TORCH_PEERS = ("gloo", "torch-pycollect")      # peers that run torch.distributed calls
DTYPES = ("float32", "float16", "bfloat16")


HUGE_BYTES = 2 << 20     # a transparent huge page, and the alignment of the larger arrays


def fresh_zeros(count, dtype):
    """A zeroed array of ``count`` elements in a mapping of its own: what NumPy gives a
    fresh process for a large array (a new anonymous mapping, advised for huge pages),
    the same for every peer, whatever the process allocated and freed before.  (NumPy's
    own arrays come from malloc, which serves a large one from memory an earlier case
    freed once its mmap threshold has grown past that size; such memory lies in small
    pages, the kernel copies of a collective cost more there, and which peer's process got
    which kind changed the 2-rank allgather of 1M floats by 20 % from run to run.)"""
    itemsize = np.dtype(dtype).itemsize
    nbytes = max(count * itemsize, 1)
    if nbytes < HUGE_BYTES:
        m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        return np.frombuffer(m, np.uint8)[:count * itemsize].view(dtype)
    m = mmap.mmap(-1, nbytes + HUGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    m.madvise(mmap.MADV_HUGEPAGE)
    raw = np.frombuffer(m, np.uint8)
    start = -raw.ctypes.data % HUGE_BYTES
    return raw[start:start + nbytes].view(dtype)


def label(peer):
    """The name a person reads for a peer."""
    return LABELS.get(peer, peer.replace("pycollect-", "pycollect "))


# -- workers ----------------------------------------------------------------------


class Ceiling:
    """The memory's limit on one host: what the collectives' memory work costs in NumPy.

    Every rank's buffers lie in shared memory (files in /dev/shm that every rank maps), so
    no rank copies anything through a transport.  allreduce: rank r owns slice r (at 2 ranks,
    half r); it adds every peer's slice r into its own, a barrier, then copies every peer's
    reduced slice over its own, and a barrier again (without it a rank could add into its
    slice for the next call while a peer still copies it, as no allreduce may).  broadcast: every rank but the root copies the root's buffer,
    then a barrier.  allgather: every rank copies each rank's block into place, then a
    barrier.  The barrier spins on per-rank counters in shared memory (yielding the CPU).
    """

    def __init__(self, rank, size, name):
        self.rank, self.size, self.name = rank, size, name
        self.gen = 0
        self.case = 0
        self.mine = []       # paths this rank created, unlinked at close
        self.maps = []
        self.ctl = self._open(f"{name}-ctl", size * 16 * 8, rank == 0).view(np.int64)
        self.flags = self.ctl[::16]         # one 128-byte line per rank
        self.values = self.ctl[8::16].view(np.float64)

    def _open(self, name, nbytes, create):
        import mmap
        path = f"/dev/shm/{name}"
        if create:
            with open(path + ".tmp", "wb") as f:
                f.truncate(max(nbytes, 1))
            os.rename(path + ".tmp", path)      # others never see a short file
            self.mine.append(path)
        deadline = time.monotonic() + SETUP_S
        while True:
            try:
                fd = os.open(path, os.O_RDWR)
                break
            except FileNotFoundError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"ceiling: {path} never appeared") from None
                time.sleep(0.01)
        try:
            m = mmap.mmap(fd, max(nbytes, 1))
        finally:
            os.close(fd)
        self.maps.append(m)
        return np.frombuffer(m, np.uint8)

    def barrier(self):
        """Every rank has arrived (a spin on shared counters)."""
        self.gen += 1
        self.flags[self.rank] = self.gen
        deadline = time.monotonic() + SETUP_S
        while self.flags[:self.size].min() < self.gen:
            os.sched_yield()
            if time.monotonic() > deadline:
                raise TimeoutError("ceiling: a rank never reached the barrier")

    def agree_max(self, value):
        """The largest ``value`` over the ranks."""
        self.values[self.rank] = value
        self.barrier()
        out = float(self.values[:self.size].max())
        self.barrier()
        return out

    def arrays(self, collective, count):
        """(every rank's send buffer, this rank's receive buffer or None), all in /dev/shm."""
        self.case += 1
        n = count * (self.size if collective == "allgather" else 1)
        name = f"{self.name}-{self.case}"
        self._open(f"{name}-{self.rank}", count * 4, True)
        self.barrier()
        sends = [self._open(f"{name}-{r}", count * 4, False)[:count * 4].view(np.float32)
                 for r in range(self.size)]
        recv = np.zeros(n, np.float32) if collective == "allgather" else None
        return sends, recv

    def call(self, collective, sends, recv):
        """The memory work of one call of ``collective`` on these buffers."""
        r, P = self.rank, self.size
        own = sends[r]
        n = own.size
        cuts = [c * (n // P) + min(c, n % P) for c in range(P + 1)]
        mine = slice(cuts[r], cuts[r + 1])
        peers = [q for q in range(P) if q != r]

        def allreduce():
            for q in peers:
                np.add(own[mine], sends[q][mine], out=own[mine])
            self.barrier()
            for q in peers:
                np.copyto(own[cuts[q]:cuts[q + 1]], sends[q][cuts[q]:cuts[q + 1]])
            self.barrier()      # nobody adds into its slice while a peer still copies it

        def broadcast():
            if r != 0:
                np.copyto(own, sends[0])
            self.barrier()

        def allgather():
            for q in range(P):
                np.copyto(recv[q * n:(q + 1) * n], sends[q])
            self.barrier()

        return {"allreduce": allreduce, "broadcast": broadcast, "allgather": allgather,
                "barrier": self.barrier}[collective]

    def close(self):
        """Unmap everything and remove this rank's files."""
        self.barrier()          # nobody still reads a file about to go
        self.flags = self.values = self.ctl = None
        for m in self.maps:
            try:
                m.close()
            except BufferError:
                pass            # a view still holds it; the process is about to exit
        for path in self.mine:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


class Peer:
    """One library's side of a worker: setup, the calls of each case, agree and barrier."""

    def __init__(self, kind, rank, size, rdv):
        self.kind = kind
        if kind == CEILING:
            self.ceiling = Ceiling(rank, size, rdv)
            self.rank, self.size = rank, size
            self.barrier = self.ceiling.barrier
        elif kind.startswith("pycollect-"):
            import pycollect as pc
            self.pc, self.ctx = pc, pc.init(rank=rank, size=size, store=rdv,
                                            transport=kind[10:].removesuffix("-pooled"))
            self.rank, self.size = rank, size
            self.barrier = self.ctx.barrier
        elif kind in TORCH_PEERS:
            import torch
            import torch.distributed as dist
            from datetime import timedelta
            if kind == "torch-pycollect":
                import pycollect.torch  # noqa: F401  (registers the backend "pycollect")
            dist.init_process_group("gloo" if kind == "gloo" else "pycollect", init_method=rdv,
                                    rank=rank, world_size=size,
                                    timeout=timedelta(seconds=SETUP_S))
            self.torch, self.dist = torch, dist
            self.rank, self.size = rank, size
            self.barrier = dist.barrier
        else:
            from mpi4py import MPI
            self.MPI, self.comm = MPI, MPI.COMM_WORLD
            self.rank, self.size = self.comm.rank, self.comm.size
            self.barrier = self.comm.Barrier

    def agree_max(self, value):
        """The largest ``value`` over the group."""
        if self.kind == CEILING:
            return self.ceiling.agree_max(value)
        buf = np.array([value], np.float64)
        if self.kind in TORCH_PEERS:
            t = self.torch.from_numpy(buf)
            self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX)
        elif self.kind.startswith("pycollect-"):
            self.ctx.allreduce(buf, op=self.pc.MAX)
        else:
            self.comm.Allreduce(self.MPI.IN_PLACE, buf, op=self.MPI.MAX)
        return float(buf[0])

    def call(self, collective, send, recv):
        """Return a no-argument function that runs one ``collective`` on these buffers."""
        if self.kind == CEILING:
            return self.ceiling.call(collective, send, recv)
        if self.kind.startswith("pycollect-"):
            ctx = self.ctx
            return {"allreduce": lambda: ctx.allreduce(send),
                    "broadcast": lambda: ctx.broadcast(send, 0),
                    "allgather": lambda: ctx.allgather(send, recv),
                    "barrier": ctx.barrier}[collective]
        if self.kind in TORCH_PEERS:
            dist = self.dist
            ts = as_tensor_like(send)
            tr = as_tensor_like(recv) if recv is not None else None
            return {"allreduce": lambda: dist.all_reduce(ts),
                    "broadcast": lambda: dist.broadcast(ts, 0),
                    "allgather": lambda: dist.all_gather_into_tensor(tr, ts),
                    "barrier": dist.barrier}[collective]
        comm, MPI = self.comm, self.MPI
        return {"allreduce": lambda: comm.Allreduce(MPI.IN_PLACE, send, op=MPI.SUM),
                "broadcast": lambda: comm.Bcast(send, root=0),
                "allgather": lambda: comm.Allgather(send, recv),
                "barrier": comm.Barrier}[collective]

    def arrays(self, collective, count, dtype=np.float32):
        """The buffers a case runs on: (send, recv or None)."""
        if self.kind == CEILING:
            return self.ceiling.arrays(collective, count)
        zeros = self.pc.zeros if self.kind == POOLED else fresh_zeros
        recv = zeros(count * self.size, dtype) if collective == "allgather" else None
        return zeros(count, dtype), recv

    def close(self):
        """Leave the group."""
        if self.kind == CEILING:
            self.ceiling.close()
        elif self.kind.startswith("pycollect-"):
            self.ctx.close()
        elif self.kind in TORCH_PEERS:
            self.dist.destroy_process_group()


def run_case(peer, command):
    """Check one call of the case, then time it; return this rank's seconds per call."""
    collective, count = command["collective"], command["count"]
    n, rank = peer.size, peer.rank
    buffers, recv = peer.arrays(collective, count, numpy_dtype(command.get("dtype", "float32")))
    send = buffers[rank] if peer.kind == CEILING else buffers
    call = peer.call(collective, buffers, recv)
    # One checked call: every peer must compute the right thing before it is timed.
    send[:] = rank + 1
    peer.barrier()    # the ceiling reads the peers' buffers: they must be filled first
    call()
    if collective == "allreduce":
        ok = bool(np.all(send == n * (n + 1) / 2))
    elif collective == "broadcast":
        ok = bool(np.all(send == 1))
    elif collective == "allgather":
        ok = bool(np.all(recv.reshape(n, count).astype(np.float32)
                         == np.arange(1, n + 1, dtype=np.float32)[:, None]))
    else:
        ok = True
    if not ok:
        raise RuntimeError(f"{peer.kind} {collective} of {count} gave a wrong result on "
                           f"rank {rank}")
    peer.barrier()    # ... and nobody may clear a buffer that a peer still reads
    send[:] = 0   # timed calls reduce zeros: nothing grows, no denormals
    times = time_calls(call, peer.barrier, peer.agree_max, command["warmup"], command["budget"],
                       None, command["min_iters"], command["max_iters"])
    return times.tolist()


def worker(args):
    """Serve the driver's commands on one rank until it says quit."""
    host, port = args.control.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=SETUP_S)
    sock.settimeout(None)
    stream = sock.makefile("rwb")

    def reply(message):
        stream.write(json.dumps(message).encode() + b"\n")
        stream.flush()

    try:
        peer = Peer(args.worker, args.rank, args.size, args.rdv)
    except Exception as exc:
        reply({"hello": args.worker, "rank": args.rank, "error": f"{type(exc).__name__}: {exc}"})
        return 1
    reply({"hello": args.worker, "rank": peer.rank, "size": peer.size})
    try:
        for line in stream:
            command = json.loads(line)
            if command.get("quit"):
                break
            try:
                reply({"times": run_case(peer, command)})
            except Exception as exc:
                reply({"error": f"{type(exc).__name__}: {exc}"})
                return 1
    finally:
        peer.close()
    return 0


# -- the driver -------------------------------------------------------------------


def free_port():
    """A loopback TCP port that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Group:
    """The worker processes of one peer at one world size, and their control connections."""

    def __init__(self, peer, size, control, logdir, store_url, bind="core"):
        self.peer, self.size = peer, size
        self.conns = {}
        self.error = None
        self.log = open(os.path.join(logdir, f"{peer}-{size}.log"), "w+")
        me = [sys.executable, str(Path(__file__).resolve()), "--worker", peer,
              "--control", control, "--size", str(size)]
        env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", PYTHONUNBUFFERED="1")
        if peer.startswith("mpi-"):
            argv = (MPIRUN + MPI_BIND[bind] + (MPI_TCP_ARGS if peer == "mpi-tcp" else [])
                    + ["-n", str(size)] + me)
            self.procs = [subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT,
                                           env=env, start_new_session=True)]
            return
        if peer in TORCH_PEERS:
            rdv = f"tcp://127.0.0.1:{free_port()}"
        elif peer == CEILING:
            rdv = self.shm_name = f"pycollect-ceiling-{size}-{secrets.token_hex(4)}"
        else:
            rdv = f"{store_url}?prefix={peer}-{size}-{secrets.token_hex(4)}"
        cpus = rank_cpus(size) if bind == "core" else [None] * size
        self.procs = []
        for r in range(size):
            with started_on(cpus[r]):
                self.procs.append(subprocess.Popen(
                    me + ["--rank", str(r), "--rdv", rdv], stdout=self.log,
                    stderr=subprocess.STDOUT, env=env, start_new_session=True))

    def tail(self):
        """The last lines the group's processes wrote."""
        self.log.flush()
        self.log.seek(0)
        return "".join(self.log.readlines()[-8:])

    def send(self, message):
        """Send one command to every rank."""
        data = json.dumps(message).encode() + b"\n"
        for conn in self.conns.values():
            conn.sendall(data)

    def collect(self, deadline):
        """Read one reply from every rank, bounded by ``deadline``."""
        replies, buffers = {}, {r: b"" for r in self.conns}
        while len(replies) < len(self.conns):
            left = deadline - time.monotonic()
            waiting = [c for r, c in self.conns.items() if r not in replies]
            ready, _, _ = select.select(waiting, [], [], max(0.0, left))
            if not ready:
                raise TimeoutError(f"{self.peer} did not answer in time")
            for rank, conn in self.conns.items():
                if conn in ready:
                    chunk = conn.recv(1 << 20)
                    if not chunk:
                        raise RuntimeError(f"{self.peer} rank {rank} went away:\n{self.tail()}")
                    buffers[rank] += chunk
                    if buffers[rank].endswith(b"\n"):
                        replies[rank] = json.loads(buffers[rank])
        for reply in replies.values():
            if "error" in reply:
                raise RuntimeError(f"{self.peer}: {reply['error']}")
        return replies

    def stop(self):
        """Ask the workers to quit, then make sure they are gone."""
        try:
            self.send({"quit": True})
        except OSError:
            pass
        deadline = time.monotonic() + 10
        for proc in self.procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.wait(5)
        for conn in self.conns.values():
            conn.close()
        self.log.close()
        if self.peer == CEILING:     # what ranks that died left behind
            for path in Path("/dev/shm").glob(self.shm_name + "-*"):
                path.unlink(missing_ok=True)


def connect_groups(listener, groups):
    """Accept every worker's hello, all of them bounded by one deadline (SETUP_S); mark the
    groups that failed to start.  A worker connects, then starts its peer (which may take
    long while dozens of processes import torch on two cores), then says hello: hellos are
    read as they come from every connection at once, so that one slow worker neither holds
    up the others nor ends the run."""
    deadline = time.monotonic() + SETUP_S
    by_peer = {g.peer: g for g in groups}
    pending = sum(g.size for g in groups)
    waiting = {}        # accepted connections whose hello has not come: conn -> bytes so far
    while pending and time.monotonic() < deadline:
        for g in groups:
            if not g.error and any(p.poll() not in (None, 0) for p in g.procs):
                g.error = f"its processes exited during setup:\n{g.tail()}"
                pending -= g.size - len(g.conns)
        ready, _, _ = select.select([listener] + list(waiting), [], [], 0.2)
        for sock in ready:
            if sock is listener:
                conn, _ = listener.accept()
                conn.setblocking(False)
                waiting[conn] = b""
                continue
            try:
                chunk = sock.recv(65536)
            except BlockingIOError:
                continue
            except OSError:
                chunk = b""
            if not chunk:       # closed before its hello: its group's exit says why
                del waiting[sock]
                sock.close()
                continue
            waiting[sock] += chunk
            if b"\n" not in waiting[sock]:
                continue
            line, rest = waiting.pop(sock).split(b"\n", 1)
            hello = json.loads(line)
            if rest:
                raise RuntimeError(f"compare: {hello.get('hello')} rank "
                                   f"{hello.get('rank')} said more than hello during setup")
            sock.setblocking(True)
            group = by_peer[hello["hello"]]
            if "error" in hello:
                group.error = hello["error"]
            group.conns[hello["rank"]] = sock
            pending -= 1
    for sock in waiting:
        sock.close()
    for g in groups:
        if not g.error and len(g.conns) < g.size:
            g.error = (f"only {len(g.conns)} of {g.size} ranks said hello within "
                       f"{SETUP_S:g} s:\n{g.tail()}")


def available_peers(transports):
    """The peers that can run here, and why the others cannot."""
    peers, missing = [], {}
    if os.path.isdir("/dev/shm"):
        peers.append(CEILING)
    else:
        missing[CEILING] = "no /dev/shm"
    for t in transports:
        from pycollect.plugins.registry import available
        if t.removesuffix("-pooled") in available()["transports"]:
            peers.append(f"pycollect-{t}")
        else:
            missing[f"pycollect-{t}"] = f"no transport {t!r} in this pycollect"
    try:
        import torch  # noqa: F401
        import torch.distributed  # noqa: F401
        peers += ["gloo", "torch-pycollect"]
    except ImportError:
        missing["gloo"] = missing["torch-pycollect"] = (
            "torch is not installed (pip install torch==2.13.0)")
    try:
        import mpi4py  # noqa: F401
        mpi_ok = shutil.which("mpirun") is not None
    except ImportError:
        mpi_ok = False
    if mpi_ok:
        peers += ["mpi-shm", "mpi-tcp"]
    else:
        missing["mpi-shm"] = missing["mpi-tcp"] = (
            "mpi4py or mpirun is missing (apt-get install openmpi-bin libopenmpi-dev; "
            "pip install mpi4py)")
    return peers, missing


def drive(args):
    """Run every case for every world size and return the results document."""
    import pycollect as pc
    from pycollect.plugins.stores.tcp_store import TCPStoreServer
    peers, missing = available_peers(args.transports)
    if args.peers:
        wanted = args.peers.split(",")
        missing.update({p: "not asked for" for p in peers if p not in wanted})
        peers = [p for p in peers if p in wanted]
    if args.dtype != "float32":
        why = {CEILING: "NumPy's 16-bit arithmetic is no memory ceiling",
               "mpi-shm": "MPI has no standard 16-bit float type",
               "mpi-tcp": "MPI has no standard 16-bit float type"}
        missing.update({p: f"{why[p]} ({args.dtype} run)" for p in peers if p in why})
        peers = [p for p in peers if p not in why]
    itemsize = numpy_dtype(args.dtype).itemsize
    cases = [("allreduce", c) for c in args.counts] + [c for c in OTHER_CASES
                                                       if c[0] in args.collectives]
    auth = secrets.token_hex(16)
    os.environ["PYCOLLECT_AUTH"] = auth
    doc = {"started": datetime.datetime.now().isoformat(timespec="seconds"),
           "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]),
           "load_before": os.getloadavg(), "machine": machine(), "versions": versions(peers),
           "missing": missing, "peers": peers, "dtype": args.dtype,
           "rounds": args.rounds, "budget_s": args.budget, "bind": args.bind,
           "warmup": args.warmup, "min_iters": args.min_iters, "max_iters": args.max_iters,
           "results": []}
    doc["memcpy_GBps"] = memcpy_bandwidth()
    doc["tcp_ceiling_GBps"], doc["tcp_ceiling_note"] = tcp_ceiling()
    floors = []
    if {"pycollect-tcp", "mpi-tcp"} & set(peers):
        doc["tcp_floor_us"], doc["tcp_floor_note"] = [], None
        floors.append(TCPFloor())
    cpus = len(os.sched_getaffinity(0))
    crowded = [n for n in args.ranks if n > cpus]
    if crowded and "barrier" in args.collectives and {"pycollect-shm", "mpi-shm"} & set(peers):
        doc["barrier_floor"] = {"ranks": crowded[0], "cpus": cpus, "runs": [], "note": None}
        floors.append(BarrierFloor(crowded[0]))
    for floor in floors:
        floor.measure(doc)
    logdir = tempfile.mkdtemp(prefix="pycollect-compare-")
    listener = socket.create_server(("127.0.0.1", 0))
    control = f"127.0.0.1:{listener.getsockname()[1]}"
    started = time.monotonic()
    with TCPStoreServer(host="127.0.0.1", port=0, auth=auth) as server:
        for size in args.ranks:
            groups = [Group(p, size, control, logdir, server.url, args.bind) for p in peers]
            try:
                connect_groups(listener, groups)
                for g in groups:
                    if g.error:
                        doc["missing"][f"{g.peer} ({size} ranks)"] = g.error.splitlines()[0]
                        print(f"compare: {g.peer} at {size} ranks left out: {g.error}",
                              file=sys.stderr)
                live = [g for g in groups if not g.error]
                for collective, count in cases:
                    load = os.getloadavg()[0]
                    samples = {g.peer: [] for g in live}
                    totals = {g.peer: [] for g in live}     # per round: each rank's sum
                    for round_no in range(args.rounds):
                        turn = round_no % max(1, len(live))
                        for g in live[turn:] + live[:turn]:
                            if g.error:
                                continue
                            try:
                                g.send({"collective": collective, "count": count,
                                        "dtype": args.dtype,
                                        "budget": args.budget / args.rounds,
                                        "warmup": args.warmup, "min_iters": args.min_iters,
                                        "max_iters": args.max_iters})
                                replies = g.collect(time.monotonic() + 60 + 20 * args.budget)
                            except (OSError, RuntimeError, TimeoutError) as exc:
                                g.error = str(exc)
                                print(f"compare: {g.peer} failed: {exc}", file=sys.stderr)
                                doc["missing"][f"{g.peer} ({size} ranks)"] = str(exc)[:200]
                                continue
                            per_rank = np.array([replies[r]["times"] for r in sorted(replies)])
                            samples[g.peer].append(per_rank.max(axis=0))
                            totals[g.peer].append(per_rank.sum(axis=1))
                    nbytes = count * itemsize * (size if collective == "allgather" else 1)
                    for peer, parts in samples.items():
                        if parts:
                            stats = latency_stats(np.concatenate(parts), nbytes,
                                                  busbw_factor(collective, size))
                            # OSU's average latency: each rank's time in its calls over the
                            # calls, the slowest rank's.
                            calls = sum(len(x) for x in parts)
                            stats["avg_us"] = float(np.sum(totals[peer], axis=0).max()
                                                    / calls * 1e6)
                            doc["results"].append(dict(stats, ranks=size, peer=peer, load=load,
                                                       collective=collective, count=count))
                    print(f"compare: {size} ranks, {collective} {count}: " + ", ".join(
                        f"{r['peer']} {num(r['p50_us'])} us" for r in doc["results"]
                        if (r["ranks"], r["collective"], r["count"]) == (size, collective, count))
                        + f"  [{time.monotonic() - started:.0f} s]", file=sys.stderr)
            finally:
                for g in groups:
                    g.stop()
    listener.close()
    shutil.rmtree(logdir, ignore_errors=True)
    for floor in floors:
        floor.measure(doc)
        floor.close()
    doc["load_after"] = os.getloadavg()
    doc["seconds"] = round(time.monotonic() - started, 1)
    doc["pycollect"] = pc.__version__
    return doc


def memcpy_bandwidth(counts=(1 << 20, 16 << 20), repeats=20):
    """{float32 count: GB/s of one process's np.copyto, the median of ``repeats``}."""
    out = {}
    for count in counts:
        a, b = np.ones(count, np.float32), np.zeros(count, np.float32)
        np.copyto(b, a)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            np.copyto(b, a)
            times.append(time.perf_counter() - start)
        out[count] = a.nbytes / float(np.median(times)) / 1e9
    return out


class CFloor:
    """A floor measured by a C program of benchmarks/ (``name``.c, built here with cc): what
    its runs print, read by the caller's parser, or ``note`` saying why there is none."""

    def __init__(self, name):
        self.name = name
        self.dir = tempfile.mkdtemp(prefix=f"pycollect-{name}-")
        self.exe, self.note = os.path.join(self.dir, name), None
        cc = shutil.which("cc") or shutil.which("gcc")
        if cc is None:
            self.note = "not measured (no C compiler: apt-get install gcc)"
            return
        built = subprocess.run([cc, "-O2", "-o", self.exe,
                                str(Path(__file__).with_name(f"{name}.c"))],
                               capture_output=True, text=True, timeout=120)
        if built.returncode:
            self.note = f"not measured ({name}.c did not build: %s)" % (
                built.stderr.strip().splitlines() or ["?"])[-1]

    def run(self, args, parse):
        """``parse`` of the output of one run with ``args``, or None (``note`` says why)."""
        if self.note is not None:
            return None
        try:
            out = subprocess.run([self.exe, *args], capture_output=True, text=True,
                                 timeout=120, check=True)
            return parse(out.stdout)
        except (OSError, subprocess.SubprocessError, IndexError, ValueError,
                StopIteration) as exc:
            self.note = f"not measured ({self.name} failed: {exc!r})"
            return None

    def close(self):
        shutil.rmtree(self.dir, ignore_errors=True)


class TCPFloor(CFloor):
    """The kernel's own 1-float TCP exchange (benchmarks/tcp_floor.c): two processes send
    each other 44 bytes over loopback and spin on recv(MSG_DONTWAIT), as pycollect's TCP
    allreduce of one float does on the wire; the median exchange."""

    def __init__(self):
        super().__init__("tcp_floor")

    def measure(self, doc):
        """Add one median (µs) to doc["tcp_floor_us"], or say why not in tcp_floor_note."""
        median = self.run(["spin"], lambda out: float(
            out.rsplit("(median", 1)[1].split(")")[0]))
        if median is not None:
            doc["tcp_floor_us"].append(median)
        doc["tcp_floor_note"] = self.note


class BarrierFloor(CFloor):
    """A barrier of more ranks than CPUs with nothing but the scheduler's part
    (benchmarks/barrier_floor.c): ``ranks`` processes bound as the peers' ranks post to
    shared memory and wait as pycollect's flags wait does (its row "... and every 8th");
    the slowest rank's p50 and the period, as compare.py times the peers."""

    WAY = "... and every 8th"

    def __init__(self, ranks):
        super().__init__("barrier_floor")
        self.ranks = ranks

    def measure(self, doc):
        """Add {"p50_us", "period_us"} to doc["barrier_floor"]["runs"], or say why not in
        its "note"."""
        def parse(out):
            row = next(line for line in out.splitlines() if line.startswith(self.WAY))
            period, p50 = (float(x) for x in row[len(self.WAY):].split()[:2])
            return {"p50_us": p50, "period_us": period}

        got = self.run([str(self.ranks)], parse)
        if got is not None:
            doc["barrier_floor"]["runs"].append(got)
        doc["barrier_floor"]["note"] = self.note


def tcp_ceiling(seconds=3):
    """``iperf3 --bidir`` over loopback: GB/s per direction (the mean of both), or why not."""
    if shutil.which("iperf3") is None:
        return None, "not measured (iperf3 is not installed: apt-get install iperf3)"
    port = free_port()
    server = subprocess.Popen(["iperf3", "-s", "-B", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(50):      # until the server listens and serves (bounded)
            done = subprocess.run(["iperf3", "-c", "127.0.0.1", "-p", str(port), "--bidir",
                                   "-t", str(seconds), "-J"], capture_output=True, text=True,
                                  timeout=seconds + 30)
            # With -J, iperf3 (3.12) exits 0 even when it could not connect: the report's
            # "error" says so, and a server not listening yet is worth another try.
            report = json.loads(done.stdout) if done.stdout.strip() else {}
            if done.returncode == 0 and "error" not in report:
                break
            time.sleep(0.2)
        if done.returncode != 0 or "error" in report:
            return None, "not measured (iperf3: %s)" % report.get("error", done.stderr.strip())
        end = report["end"]
        rates = [end[k]["bits_per_second"] for k in ("sum_received",
                                                      "sum_received_bidir_reverse")]
        return sum(rates) / len(rates) / 8e9, None
    except (OSError, subprocess.SubprocessError, ValueError, KeyError) as exc:
        return None, f"not measured (iperf3 failed: {exc})"
    finally:
        server.kill()
        server.wait(10)


def machine():
    """A line about the machine the run used."""
    model = ""
    try:
        with open("/proc/cpuinfo") as info:
            model = next((line.split(":", 1)[1].strip() for line in info
                          if line.startswith("model name")), "")
    except OSError:
        pass
    return f"{os.cpu_count()} CPUs ({model or platform.processor()}), Linux {platform.release()}"


def versions(peers):
    """Library versions of the peers (and pycollect's git revision)."""
    out = {"python": platform.python_version(), "numpy": np.__version__}
    try:
        rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain",
                                "--untracked-files=no"], capture_output=True, text=True,
                               timeout=10).stdout.strip()
        out["pycollect_git"] = rev + ("+local changes" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    if any(p in TORCH_PEERS for p in peers):
        import torch
        out["torch"] = torch.__version__
    if any(p.startswith("mpi-") for p in peers):
        import mpi4py
        out["mpi4py"] = mpi4py.__version__
        try:
            text = subprocess.run(["mpirun", "--version"], capture_output=True, text=True,
                                  timeout=30).stdout
            out["mpi"] = text.splitlines()[0] if text else "unknown"
        except (OSError, subprocess.SubprocessError):
            out["mpi"] = "unknown"
    return out


# -- the report -------------------------------------------------------------------


def _find(doc, size, collective, count, peer):
    """The result row of one peer for one case, or None."""
    for r in doc["results"]:
        if (r["ranks"], r["collective"], r["count"], r["peer"]) == (size, collective, count, peer):
            return r
    return None


def num(x):
    """A figure with 3 significant digits at most, never in e-notation."""
    if x >= 100:
        return f"{x:.0f}"
    for limit, digits in ((10, 1), (1, 2), (0.1, 3), (0.01, 4)):
        if x >= limit:
            return f"{x:.{digits}f}"
    return f"{x:.2g}"


def _cell(row):
    """'p50 / p99; busbw' of a result row, in µs and GB/s (busbw from 16 KiB on)."""
    if row is None:
        return "–"
    text = f"{num(row['p50_us'])} / {num(row['p99_us'])}"
    if row["busbw_GBps"] is not None and row["bytes"] >= 16 << 10:
        text += f"; {num(row['busbw_GBps'])}"
    return text


def _count_name(count):
    """1048576 -> 1M, 4096 -> 4K."""
    for shift, suffix in ((20, "M"), (10, "K")):
        if count >= 1 << shift and count % (1 << shift) == 0:
            return f"{count >> shift}{suffix}"
    return str(count)


def _ratio(doc, size, collective, count, other, mine, key="p50_us"):
    """How many times ``other``'s p50 (or ``key``) is ``mine``'s (above 1: ``mine`` is
    faster)."""
    a, b = _find(doc, size, collective, count, other), _find(doc, size, collective, count, mine)
    if a is None or b is None or key not in a or key not in b:
        return None
    return a[key] / b[key]


def _fmt_ratio(value):
    """A ratio as '12.3×', or '–'."""
    return "–" if value is None else f"{num(value)}×"


def ratio_pairs(peers):
    """(peer, pycollect peer) pairs to show as ratios: TCP against TCP, shm against shm."""
    ours = [p for p in peers if p.startswith("pycollect-")]
    if not ours:
        return torch_pairs(peers)
    tcp = "pycollect-tcp" if "pycollect-tcp" in ours else ours[0]
    local = next((p for p in ours if p not in (tcp, POOLED)), tcp)
    pairs = [("gloo", tcp), ("mpi-tcp", tcp), ("gloo", local), ("mpi-shm", local),
             (CEILING, local), ("mpi-shm", POOLED), (CEILING, POOLED)]
    return list(dict.fromkeys((a, b) for a, b in pairs if a in peers and b in peers))


def torch_pairs(peers):
    """The torch.distributed comparison: gloo over backend "pycollect", when both ran."""
    return [("gloo", "torch-pycollect")] if set(TORCH_PEERS) <= set(peers) else []


def _avg_cell(row):
    """'p50 / avg' of a result row, in µs."""
    if row is None or "avg_us" not in row:
        return "–"
    return f"{num(row['p50_us'])} / {num(row['avg_us'])}"


def _table(doc, size, cases, first, avg=False):
    """Markdown rows: one per case, a cell per peer, ratios against pycollect, the load
    (``avg``: cells 'p50 / avg' and ratios of the averages)."""
    peers = doc["peers"]
    pairs = ratio_pairs(peers)
    pairs += [p for p in torch_pairs(peers) if p not in pairs]
    head = [first] + [label(p) for p in peers] + [f"{label(a)} ÷ {label(b)}" for a, b in pairs]
    rows = ["| " + " | ".join(head + ["load"]) + " |", "|" + "---|" * (len(head) + 1)]
    for coll, count in cases:
        found = [_find(doc, size, coll, count, p) for p in peers]
        if coll == "allreduce":
            name = _count_name(count) if first == "count" else f"allreduce {_count_name(count)}"
        else:
            name = f"{coll} {_count_name(count)}" if count else coll
            name += " per rank" if coll == "allgather" else ""
        load = next((f"{r['load']:.2f}" for r in found if r and "load" in r), "–")
        cell = _avg_cell if avg else _cell
        rows.append("| " + " | ".join([name] + [cell(r) for r in found] + [
            _fmt_ratio(_ratio(doc, size, coll, count, a, b, "avg_us" if avg else "p50_us"))
            for a, b in pairs] + [load]) + " |")
    return rows


def markers(doc):
    """The markers around the page's section for this run: the torch-only run has its own."""
    return (TORCH_BEGIN_MARK, TORCH_END_MARK) if doc.get("torch_only") else (BEGIN_MARK,
                                                                             END_MARK)


def markdown(doc, images):
    """The generated section of docs/performance.md; ``images``: the plots' paths by world
    size, or None where they could not be made (the page says so where they would be)."""
    peers = doc["peers"]
    ours = next((p for p in peers if p.startswith("pycollect-")), None)
    v = doc["versions"]
    begin, end = markers(doc)
    lines = [
        begin, "",
        f"Run of {doc['started']}, {doc['seconds']} s: `python benchmarks/{doc['command']}`.",
        f"Machine: {doc['machine']}; load average (1, 5, 15 min) "
        f"{'/'.join(f'{x:.2f}' for x in doc['load_before'])} before, "
        f"{'/'.join(f'{x:.2f}' for x in doc['load_after'])} after.",
        f"Peers: pycollect {doc['pycollect']} (git {v.get('pycollect_git', '?')})"
        + (f", torch {v['torch']} backend gloo" if "torch" in v else "")
        + (f", mpi4py {v['mpi4py']} on {v['mpi']} (shared memory = its default; TCP = "
           f"`{' '.join(MPI_TCP_ARGS)}`)" if "mpi4py" in v else "") + ".",
        f"Method: {doc.get('dtype', 'float32')}, SUM; back-to-back calls after {doc['warmup']} warmups; a call's "
        f"latency is the slowest rank's; {doc['rounds']} interleaved rounds of "
        f"{doc['budget_s'] / doc['rounds']:g} s per peer and case. algbw = bytes / p50; "
        f"busbw as NCCL-tests define it "
        f"(allreduce × 2(n-1)/n, allgather × (n-1)/n of n × 1M elements, broadcast × 1). "
        f"\"X ÷ pycollect\" is X's p50 over pycollect's: above 1, pycollect is faster. "
        f"load: the 1-minute load average as the case began (this run's own ranks count too). "
        f"Buffers: every peer's are fresh anonymous mappings, those of 2 MiB or more aligned to "
        f"and advised for 2 MiB huge pages, as NumPy gives a fresh process a large array "
        f"(pycollect.empty's and the ceiling's excepted). "
        + ("Placement: every peer's rank r bound to core r mod cores (pycollect-run "
           "`--bind core`; mpirun `" + " ".join(MPI_BIND["core"]) + "`)."
           if doc.get("bind") == "core" else
           "Placement: no peer's ranks bound to cores (mpirun `--bind-to none`)."
           if doc.get("bind") == "none" else ""),
    ]
    if doc["missing"]:
        lines.append("Left out: " + "; ".join(f"{k}: {v}" for k, v in doc["missing"].items())
                     + ".")
    for size in sorted({r["ranks"] for r in doc["results"]}):
        counts = sorted({r["count"] for r in doc["results"]
                         if r["ranks"] == size and r["collective"] == "allreduce"})
        lines += ["", f"### {size} ranks: allreduce, p50 / p99 latency (µs); busbw (GB/s)", ""]
        lines += _table(doc, size, [("allreduce", c) for c in counts], "count")
        rest = [(c, n) for c, n in OTHER_CASES if any(
            (r["ranks"], r["collective"]) == (size, c) for r in doc["results"])]
        if rest:
            lines += ["", f"{size} ranks, other collectives: p50 / p99 (µs); busbw (GB/s)", ""]
            lines += _table(doc, size, rest, "collective")
        small = [("allreduce", c) for c in counts if c <= 4096] + [
            c for c in rest if c[0] == "barrier"]
        if any("avg_us" in r for r in doc["results"]) and small:
            lines += ["", f"{size} ranks, small messages: p50 / average (µs), the average as "
                          f"OSU's (each rank's time in its calls over the calls, the slowest "
                          f"rank's); ratios of the averages", ""]
            lines += _table(doc, size, small, "case", avg=True)
        if images is None:
            lines += ["", "(No plot in this run: matplotlib is not installed; "
                          "`pip install '.[bench]'`.)"]
        elif size in images:
            lines += ["", f"![allreduce latency and busbw against size, {size} ranks]"
                          f"({images[size]})"]
    lines += ["", "### What the machine allows", ""] + ceilings(doc)
    if doc.get("dtype", "float32") != "float32":
        ours, peers = None, []      # the issues' targets are float32's
    if ours:
        lines += ["", f"### Issue 5's targets in this run ({label(ours)})", ""]
        lines += targets(doc, ours)
    if "pycollect-shm" in peers:
        lines += ["", "### Issue 18's targets in this run", ""]
        lines += targets(doc, "pycollect-shm", ISSUE18_SHM_TARGETS)
        if POOLED in peers:
            lines += targets(doc, POOLED, ISSUE18_POOLED_TARGETS,
                             tag=" on `pycollect.empty` arrays")[2:]
        if "pycollect-tcp" in peers:
            lines += targets(doc, "pycollect-tcp", ISSUE18_TCP_TARGETS)[2:]
        lines += ["", mpi_faster(doc, "pycollect-shm", "mpi-shm")]
        if POOLED in peers:
            lines += ["", mpi_faster(doc, POOLED, "mpi-shm")]
    if torch_pairs(peers):
        lines += ["", "### Issue 8's targets in this run (torch.distributed, backend "
                      "\"pycollect\" against \"gloo\")", ""]
        lines += targets(doc, "torch-pycollect", TORCH_TARGETS)
    lines += ["", end]
    return "\n".join(lines) + "\n"


# Issue 5's targets: (ranks, collective, count, peer, speedup needed, what is compared).
# The speedup is the peer's p50 over pycollect's, which for one size is also the busbw ratio.
TARGETS = (
    (2, "allreduce", 1, "gloo", 10, "p50"), (2, "allreduce", 1, "mpi-tcp", 1, "p50"),
    (2, "allreduce", 1 << 20, "gloo", 2, "busbw"),
    (2, "allreduce", 1 << 20, "mpi-tcp", 1, "busbw"),
    (2, "allreduce", 16 << 20, "gloo", 2, "busbw"),
    (2, "allreduce", 16 << 20, "mpi-tcp", 1, "busbw"),
    (2, "broadcast", 1 << 20, "gloo", 2, "p50"), (2, "allgather", 1 << 20, "gloo", 2, "p50"),
    (2, "barrier", 0, "gloo", 2, "p50"),
    (4, "allreduce", 1, "gloo", 5, "p50"), (4, "allreduce", 256, "gloo", 5, "p50"),
)


# Issue 18's (large and small messages against MPI and the NumPy ceiling). A goal of
# "≤ 0.8× MPI" in time is a speedup of 1.25.
ISSUE18_SHM_TARGETS = (
    (2, "allreduce", 1, "mpi-shm", 1.25, "p50"), (2, "barrier", 0, "mpi-shm", 1, "p50"),
    (2, "allreduce", 4096, "mpi-shm", 2, "p50"),
    (4, "allreduce", 1, "mpi-shm", 1, "p50"), (4, "barrier", 0, "mpi-shm", 1, "p50"),
    (2, "allreduce", 1 << 20, "mpi-shm", 1.15, "busbw"),
    (2, "allreduce", 1 << 20, CEILING, 0.9, "busbw"),
    (2, "allreduce", 16 << 20, "mpi-shm", 3, "busbw"),
    (2, "allreduce", 16 << 20, CEILING, 0.9, "busbw"),
)
ISSUE18_TCP_TARGETS = ((2, "allreduce", 1, "mpi-tcp", 1 / 0.6, "p50"),)
# The large-message rows again on arrays from pycollect.empty (shared memory, as the ceiling's).
ISSUE18_POOLED_TARGETS = ISSUE18_SHM_TARGETS[5:]


def mpi_faster(doc, ours, mpi):
    """A line: in how many rows (every collective, size and world size) ``mpi`` beat ``ours``."""
    slower = []
    rows = 0
    for r in doc["results"]:
        if r["peer"] != ours:
            continue
        theirs = _find(doc, r["ranks"], r["collective"], r["count"], mpi)
        if theirs is None:
            continue
        rows += 1
        if theirs["p50_us"] < r["p50_us"]:
            name = f"{r['collective']} {_count_name(r['count'])}" if r["count"] else \
                r["collective"]
            slower.append(f"{r['ranks']} ranks {name} "
                          f"({num(theirs['p50_us'] / r['p50_us'])}×)")
    return (f"{label(mpi)} faster than {label(ours)} in {len(slower)} of {rows} rows"
            + (": " + ", ".join(slower) if slower else "") + ".")


def ceilings(doc):
    """Lines on the memory's and the loopback's limits, and how close pycollect comes."""
    lines = []
    memcpy = {int(k): v for k, v in doc.get("memcpy_GBps", {}).items()}
    if memcpy:
        lines.append("memcpy (one process, `np.copyto`): " + ", ".join(
            f"{_count_name(c)} floats {num(v)} GB/s" for c, v in sorted(memcpy.items())) + ".")
    lines.append(f"Shared-memory ceiling: the peer \"{label(CEILING)}\" (ranks whose buffers "
                 f"already lie in shared memory do the collective's memory work with NumPy: "
                 f"allreduce = add the peers' slice r into one's own, a barrier, copy the "
                 f"peers' reduced slices); \"{label(CEILING)} ÷ pycollect shm\" is the "
                 f"fraction of it that pycollect reaches.  \"{label(POOLED)}\" is pycollect "
                 f"over shm on arrays from `pycollect.empty`, which lie in shared memory as "
                 f"the ceiling's do: its direct algorithms reduce and copy the peers' arrays "
                 f"with plain loads and stores.")
    for size in sorted({r["ranks"] for r in doc["results"]}):
        cells = []
        for count in sorted({r["count"] for r in doc["results"]
                             if (r["ranks"], r["collective"]) == (size, "allreduce")}):
            ceil = _find(doc, size, "allreduce", count, CEILING)
            ours = _find(doc, size, "allreduce", count, "pycollect-shm")
            pooled = _find(doc, size, "allreduce", count, POOLED)
            if ceil and ours and count >= 1 << 16:
                cells.append(f"{_count_name(count)} {num(ceil['busbw_GBps'])} GB/s "
                             f"(pycollect {num(ceil['p50_us'] / ours['p50_us'])} of it"
                             + (f", on `pycollect.empty` arrays "
                                f"{num(ceil['p50_us'] / pooled['p50_us'])}" if pooled else "")
                             + ")")
        if cells:
            lines.append(f"{size} ranks, allreduce busbw of the ceiling: " + "; ".join(cells)
                         + ".")
    tcp = doc.get("tcp_ceiling_GBps")
    if tcp is None:
        lines.append("TCP ceiling (`iperf3 --bidir` over loopback): "
                     + doc.get("tcp_ceiling_note", "not measured") + ".")
    else:
        cells = []
        for r in doc["results"]:
            if (r["peer"], r["collective"]) == ("pycollect-tcp", "allreduce") and \
                    r["count"] >= 1 << 20 and r["busbw_GBps"]:
                cells.append(f"{r['ranks']} ranks {_count_name(r['count'])} "
                             f"{num(r['busbw_GBps'])} GB/s ({num(r['busbw_GBps'] / tcp)} of it)")
        lines.append(f"TCP ceiling (`iperf3 --bidir` over loopback): {num(tcp)} GB/s per "
                     f"direction" + ("; pycollect tcp allreduce busbw: " + "; ".join(cells)
                                     if cells else "") + ".")
    floors = doc.get("tcp_floor_us")
    if floors:
        cells = []
        for peer in ("pycollect-tcp", "mpi-tcp"):
            r = _find(doc, 2, "allreduce", 1, peer)
            if r:
                cells.append(f"{label(peer)} {num(r['p50_us'])} µs "
                             f"({num(r['p50_us'] / min(floors))}× the lower floor)")
        lines.append("TCP latency floor (`benchmarks/tcp_floor.c`: two processes exchange "
                     "44 bytes over loopback, spinning on `recv(MSG_DONTWAIT)`; one "
                     "process's median exchange, at the start and the end of the run): "
                     + " and ".join(f"{num(f)} µs" for f in floors)
                     + ("; 2 ranks, allreduce 1 float p50: " + ", ".join(cells)
                        if cells else "") + ".")
        ours = _find(doc, 2, "allreduce", 1, "pycollect-tcp")
        mpi = _find(doc, 2, "allreduce", 1, "mpi-tcp")
        if ours and mpi:
            # The floor bounds every library on TCP sockets: pycollect's ratio to MPI can go
            # no lower than floor / MPI, whatever its own code costs.
            lines.append(f"Above the lower floor, 2 ranks, allreduce 1 float: pycollect tcp "
                         f"{num(ours['p50_us'] - min(floors))} µs, MPI TCP "
                         f"{num(mpi['p50_us'] - min(floors))} µs. The floor alone is "
                         f"{num(min(floors) / mpi['p50_us'])}× MPI TCP's p50: no library on "
                         f"loopback TCP sockets would be faster against MPI than that "
                         f"(issue 18's goal: {num(1 / ISSUE18_TCP_TARGETS[0][4])}×).")
    elif floors is not None:
        lines.append("TCP latency floor: " + (doc.get("tcp_floor_note") or "not measured")
                     + ".")
    lines += barrier_floor(doc)
    return [part for line in lines for part in (line, "")][:-1]   # one paragraph each


def barrier_floor(doc):
    """The line on the barrier floor where ranks outnumber the CPUs (none if not run)."""
    bf = doc.get("barrier_floor")
    if bf is None:
        return []
    head = f"Barrier floor, {bf['ranks']} ranks on {bf['cpus']} CPUs"
    if not bf["runs"]:
        return [f"{head}: {bf['note'] or 'not measured'}."]
    lower = min(run["p50_us"] for run in bf["runs"])
    cells = []
    for peer in ("pycollect-shm", "mpi-shm"):
        r = _find(doc, bf["ranks"], "barrier", 0, peer)
        if r:
            cells.append(f"{label(peer)} {num(r['p50_us'])} µs ({num(r['p50_us'] / lower)}× "
                         f"the lower floor)")
    return [f"{head} (`benchmarks/barrier_floor.c`: processes bound as the peers' ranks, "
            f"each barrier a post to its own cache line of shared memory and a wait for the "
            f"others', yielding the CPU as pycollect's flags wait does, and nothing else; "
            f"the slowest rank's p50 and the period, at the start and the end of the run): "
            + " and ".join(f"p50 {num(run['p50_us'])} µs (period {num(run['period_us'])})"
                           for run in bf["runs"])
            + (f"; {bf['ranks']} ranks, barrier p50: " + ", ".join(cells) if cells else "")
            + ". Two ranks share a CPU: a call that one enters first lasts until the other "
              "has had the CPU and posted, so the p50 sits above the period."]


# Issue 8's: the same dist.all_reduce calls with backend "pycollect" against backend "gloo".
TORCH_TARGETS = (
    (2, "allreduce", 1, "gloo", 5, "p50"),
    (2, "allreduce", 1 << 20, "gloo", 2, "busbw"),
    (2, "allreduce", 16 << 20, "gloo", 2, "busbw"),
)


def targets(doc, ours, table=TARGETS, tag=""):
    """The issue's speed targets, each with the measured figures and whether it holds
    (``tag`` follows each target's case: what sets these rows apart)."""
    rows = [f"| target | {label(ours)} | peer | speedup | holds |", "|---|---|---|---|---|"]
    for size, coll, count, peer, need, what in table:
        mine, theirs = (_find(doc, size, coll, count, p) for p in (ours, peer))
        if mine is None or theirs is None:
            continue
        speedup = theirs["p50_us"] / mine["p50_us"]
        key, unit = ("busbw_GBps", "GB/s") if what == "busbw" else ("p50_us", "µs")
        case = f"{coll} {_count_name(count)}" if count else coll
        goal = f"{num(need)}× {label(peer)}" if need != 1 else f"ahead of {label(peer)}"
        rows.append(f"| {size} ranks, {case}{tag}: {what} {goal} | {num(mine[key])} {unit} | "
                    f"{num(theirs[key])} {unit} | {num(speedup)}× | "
                    f"{'yes' if speedup >= need else 'no'} |")
    return rows


def plot(doc, img_dir):
    """Draw latency and busbw against size per world size; return {size: relative path}."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter
    images = {}

    def size_label(x, _pos):
        for shift, unit in ((20, "MiB"), (10, "KiB")):
            if x >= 1 << shift:
                return f"{x / (1 << shift):g} {unit}"
        return f"{x:g} B"

    for size in sorted({r["ranks"] for r in doc["results"]}):
        fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.6))
        for peer in doc["peers"]:
            rows = sorted((r for r in doc["results"] if (r["ranks"], r["collective"],
                          r["peer"]) == (size, "allreduce", peer)), key=lambda r: r["bytes"])
            if not rows:
                continue
            x = [r["bytes"] for r in rows]
            line, = left.plot(x, [r["p50_us"] for r in rows], marker="o", label=label(peer),
                              color=COLORS.get(peer))
            left.plot(x, [r["p99_us"] for r in rows], linestyle=":", color=line.get_color(),
                      alpha=0.6)
            bw = [(r["bytes"], r["busbw_GBps"]) for r in rows
                  if r["busbw_GBps"] and r["bytes"] >= 16 << 10]
            right.plot([b for b, _ in bw], [v for _, v in bw], marker="o", label=label(peer),
                       color=line.get_color())
        sizes = sorted({r["bytes"] for r in doc["results"]
                        if (r["ranks"], r["collective"]) == (size, "allreduce")})
        for ax in (left, right):
            ax.set_xscale("log", base=2)
            ticks = []
            for t in sizes:   # label the sizes measured, at least 8x apart so labels never collide
                if (ax is left or t >= 16 << 10) and (not ticks or t >= 8 * ticks[-1]):
                    ticks.append(t)
            ax.set_xticks(ticks)
            ax.set_yscale("log")
            ax.set_xlabel("message size per rank (bytes, float32)")
            ax.xaxis.set_major_formatter(FuncFormatter(size_label))
            ax.grid(True, which="major", alpha=0.3)
            ax.legend(fontsize=8)
        left.set_ylabel("latency per call (µs): p50 solid, p99 dotted")
        left.set_title(f"allreduce latency, {size} ranks")
        right.set_ylabel("bus bandwidth (GB/s) at p50")
        right.set_title(f"allreduce busbw, {size} ranks")
        loads = [r["load"] for r in doc["results"] if r["ranks"] == size and "load" in r]
        fig.suptitle(f"float32 SUM, in place; {doc['machine']}; 1-min load average "
                     f"{min(loads, default=0):.2f}..{max(loads, default=0):.2f}; "
                     f"{doc['started']}", fontsize=9)
        fig.tight_layout()
        name = f"allreduce-{size}ranks.png"
        fig.savefig(os.path.join(img_dir, name), dpi=110)
        plt.close(fig)
        images[size] = f"img/{name}"
    return images


PAGE_HEAD = """# Performance

How pycollect compares with torch.distributed's Gloo and with MPI on this kind of machine, and
how to measure it yourself.

"""


def write_page(path, section, marks=(BEGIN_MARK, END_MARK), title="Latest comparison"):
    """Replace the generated section of ``path`` between ``marks`` (or append it)."""
    begin, end = marks
    text = Path(path).read_text() if os.path.exists(path) else PAGE_HEAD
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        tail = rest.split(end, 1)[1]
        text = head + section.rstrip("\n") + tail
    else:
        text = text.rstrip("\n") + f"\n\n## {title}\n\n" + section
    Path(path).write_text(text)


# -- command line -------------------------------------------------------------------

# What every results document that drive() writes has, and markdown() reads.
RESULT_KEYS = ("started", "seconds", "command", "machine", "load_before", "load_after",
               "pycollect", "versions", "missing", "peers", "warmup", "rounds", "budget_s",
               "results")
OTHER_PEERS = TORCH_PEERS + ("mpi-shm", "mpi-tcp")     # besides pycollect's and the ceiling


def known_peers(transports):
    """Every peer name --peers may give: the ceiling, pycollect over each of
    ``transports``, torch's and MPI's (whether or not they are installed here)."""
    return [CEILING] + [f"pycollect-{t}" for t in transports] + list(OTHER_PEERS)


def read_result(parser, path):
    """The results document in ``path`` (a --json file), else ``parser``'s usage error."""
    try:
        doc = json.loads(Path(path).read_text())
    except OSError as exc:
        parser.error(f"--from-json {path}: {exc.strerror or exc}")
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        parser.error(f"--from-json {path}: not JSON ({exc}), so not a compare.py result")
    lacking = [k for k in RESULT_KEYS if k not in doc] if isinstance(doc, dict) else None
    if lacking is None or lacking:
        parser.error(f"--from-json {path}: not a compare.py result (a --json file of this "
                     "script); it lacks " + (", ".join(lacking) if lacking else
                                             "everything: it is not a JSON object"))
    return doc


def parse_args(argv=None):
    """Parse the command line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="2,4", help="world sizes (default 2,4)")
    parser.add_argument("--peers", help="only these: pycollect-<transport>, gloo, mpi-shm, "
                                        "mpi-tcp (default: every one installed)")
    parser.add_argument("--transports", default="tcp,shm,shm-pooled",
                        help="pycollect transports to time, comma-separated (default "
                             "tcp,shm,shm-pooled: shm-pooled is shm on arrays from "
                             "pycollect.empty); "
                             "the targets use the first")
    parser.add_argument("--counts", default=",".join(map(str, ALLREDUCE_COUNTS)),
                        help="allreduce element counts")
    parser.add_argument("--dtype", default="float32", choices=DTYPES,
                        help="the buffers' dtype (default float32; a 16-bit run prints its "
                             "tables and leaves the page alone)")
    parser.add_argument("--collectives", default="broadcast,allgather,barrier",
                        help="other collectives besides allreduce (default all three)")
    parser.add_argument("--budget", type=float, default=1.0,
                        help="timed seconds per peer and case, over all rounds (default 1)")
    parser.add_argument("--bind", choices=("core", "none"), default="core",
                        help="core (default): every peer's rank r bound to core r %% cores, "
                             "mpirun's with --bind-to core:overload-allowed; none: the "
                             "kernel places every peer's ranks")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds (default 2)")
    parser.add_argument("--warmup", type=int, default=3, help="warmup calls per round")
    parser.add_argument("--min-iters", type=int, default=10,
                        help="timed calls per round at least (default 10)")
    parser.add_argument("--max-iters", type=int, default=20000,
                        help="timed calls per round at most (default 20000)")
    parser.add_argument("--torch", action="store_true",
                        help="torch.distributed only: backend gloo against backend pycollect, "
                             "2 ranks, allreduce (the page's torch section; the rest is kept)")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: 2 ranks, counts 1,65536,1M, 0.2 s budgets")
    parser.add_argument("--out", default=str(ROOT / "docs" / "performance.md"),
                        help="the page to update (default docs/performance.md)")
    parser.add_argument("--img-dir", default=str(ROOT / "docs" / "img"),
                        help="where the plots go (default docs/img)")
    parser.add_argument("--json", metavar="FILE",
                        help="write the raw results here (default: <img-dir>/compare.json)")
    parser.add_argument("--from-json", metavar="FILE",
                        help="do not measure: redraw the page and plots from a --json file")
    parser.add_argument("--no-write", action="store_true",
                        help="print the markdown instead of updating the page and plots")
    # Worker mode (started by the driver, not by hand).
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--control", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--size", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--rdv", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.torch:
        defaults = parser.parse_args([])
        args.peers = args.peers or ",".join(TORCH_PEERS)
        if args.ranks == defaults.ranks:
            args.ranks = "2"
    if args.quick:
        defaults = parser.parse_args([])
        for key, value in (("ranks", "2"), ("counts", "1,65536,1048576"), ("budget", 0.2)):
            if getattr(args, key) == getattr(defaults, key):
                setattr(args, key, value)
    try:
        args.ranks = [int(n) for n in args.ranks.split(",")]
        args.counts = [int(c) for c in args.counts.split(",")]
    except ValueError:
        parser.error("--ranks and --counts take comma-separated integers")
    if args.dtype != "float32":
        args.no_write = True    # the page's tables are float32's
    args.transports = args.transports.split(",")
    args.collectives = args.collectives.split(",") if args.collectives else []
    others = [c for c, _ in OTHER_CASES]
    unknown = [c for c in args.collectives if c and c not in others + ["none"]]
    if unknown:
        parser.error("--collectives: unknown %s (choose from %s, or none; allreduce always "
                     "runs)" % (", ".join(map(repr, unknown)), ", ".join(others)))
    if args.peers:
        known = known_peers(args.transports)
        unknown = [p for p in args.peers.split(",") if p and p not in known]
        if unknown:
            parser.error("--peers: unknown %s (choose from %s; pycollect-T for each "
                         "transport T of --transports)"
                         % (", ".join(map(repr, unknown)), ", ".join(known)))
    args.result = None if args.from_json is None else read_result(parser, args.from_json)
    if min(args.ranks) < 2 or min(args.counts) < 1:
        parser.error("--ranks must be >= 2 and --counts >= 1")
    if not (args.budget > 0 and args.rounds >= 1 and 1 <= args.min_iters <= args.max_iters
            and args.warmup >= 0):
        parser.error("--budget, --rounds, --min-iters/--max-iters and --warmup must be positive")
    return args


def main(argv=None):
    """Drive the comparison (or serve as one worker); return the exit status."""
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    if args.from_json:
        doc = args.result
    else:
        doc = drive(args)
        doc["torch_only"] = args.torch
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
    elif not args.no_write and not args.from_json:
        # Keep the raw results beside the plots, so that --from-json can redraw them.
        os.makedirs(args.img_dir, exist_ok=True)
        name = "compare-torch.json" if doc.get("torch_only") else "compare.json"
        Path(args.img_dir, name).write_text(json.dumps(doc, indent=1) + "\n")
    if args.no_write:
        print(markdown(doc, {}))
        return 0
    os.makedirs(args.img_dir, exist_ok=True)
    if doc.get("torch_only"):
        page = Path(args.out)
        write_page(page, markdown(doc, {}), markers(doc),
                   "Latest torch.distributed comparison (backend pycollect against gloo)")
        print(f"compare: wrote the torch section of {page}", file=sys.stderr)
        return 0
    try:
        images = plot(doc, args.img_dir)
    except ImportError:
        print("compare: matplotlib is missing (pip install '.[bench]'); no plots, and the "
              "page says so", file=sys.stderr)
        images = None
    page = Path(args.out)
    rel = None if images is None else {
        k: os.path.relpath(os.path.join(args.img_dir, Path(v).name), page.parent)
        for k, v in images.items()}
    write_page(page, markdown(doc, rel))
    print(f"compare: wrote {page} and {len(rel or ())} plot(s) in {args.img_dir}",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
