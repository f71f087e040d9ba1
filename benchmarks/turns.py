"""Peers taking turns, for the benchmarks that run each peer in processes of its own
(callpath.py, pingpong.py, async_wait.py): which of the asked-for peers can run here, and the rounds in
which every peer runs once, in an order that rotates from round to round.

A peer's run writes its figures as JSON to a file it is given; ``take_turns`` collects
them, per peer, in round order.  ``int_list`` reads a comma-separated option of integers for
any script here.  The runs import pycollect from the checkout these scripts
lie in (its root first on ``PYTHONPATH``), as compare.py's workers do: to time another
build, run that checkout's copy of the script.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

# The checkout these scripts lie in: its pycollect is the one the runs time.
CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def importable(modules, mpirun=False):
    """Whether ``modules`` (``"torch, pycollect.torch"``) import here, and, with ``mpirun``,
    whether ``mpirun`` is on PATH."""
    if mpirun and shutil.which("mpirun") is None:
        return False
    return subprocess.run([sys.executable, "-c", "import %s" % modules], capture_output=True,
                          timeout=120).returncode == 0


def int_list(parser, option, text, low):
    """The comma-separated integers that ``option`` was given (``text``), each at least
    ``low``; anything else is ``parser``'s usage error."""
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        parser.error("%s takes integers, comma-separated: %r" % (option, text))
    if min(values) < low:
        parser.error("%s must be at least %d each: %r" % (option, low, text))
    return values


def pick_peers(ap, spec, known, available):
    """(peers to run, peers asked for that cannot run here) of the comma-separated ``spec``;
    an unknown name is ``ap``'s usage error."""
    wanted = [p for p in spec.split(",") if p]
    unknown = sorted(set(wanted) - set(known))
    if unknown:
        ap.error("unknown peer(s) %s (choose from %s)" % (", ".join(unknown), ", ".join(known)))
    peers = [p for p in wanted if available(p)]
    return peers, [p for p in wanted if p not in peers]


def take_turns(peers, rounds, command):
    """Run ``command(peer, out)`` (an argv whose run writes JSON to ``out``) for every peer,
    ``rounds`` times; {peer: [the JSON of each round]}."""
    runs = {p: [] for p in peers}
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1",
               PYTHONPATH=os.pathsep.join(p for p in (CHECKOUT, os.environ.get("PYTHONPATH"))
                                          if p))
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds if peers else 0):
            for peer in peers[r % len(peers):] + peers[:r % len(peers)]:
                out = os.path.join(tmp, "%s.json" % peer)
                subprocess.run(command(peer, out), check=True, timeout=600, env=env, cwd=tmp,
                               stdout=subprocess.DEVNULL)
                with open(out) as f:
                    runs[peer].append(json.load(f))
    return runs


def summarize(runs, keys):
    """{peer: {key: {"median": the median of the rounds' medians, "best": the fastest
    batch of all}, or None where the peer's runs have no figure for ``key``}} of
    ``take_turns``'s runs (each run's JSON keyed by ``str(key)``)."""
    return {p: {k: None if rounds[0][str(k)] is None else {
        "median": statistics.median(run[str(k)]["median"] for run in rounds),
        "best": min(run[str(k)]["best"] for run in rounds)} for k in keys}
        for p, rounds in runs.items()}


def report(title, first, align, keys, figures, reference, missing, json_path, doc):
    """Print ``title`` and a table: a row per key (column ``first``, aligned ``align``, a
    markdown alignment such as "---:"), a column per peer, each cell "median (fastest)" in
    µs and, where ``reference(peer)`` gives (another peer, its label), that peer's median as
    a multiple: " = 1.23× label"; then the peers left out.  With ``json_path``, write
    ``doc`` there with the figures and the peers left out added."""
    peers = list(figures)
    print(title)
    print("| %s | %s |" % (first, " | ".join(peers)))
    print("|%s|" % align + "---:|" * len(peers))
    for k in keys:
        cells = []
        for p in peers:
            f = figures[p][k]
            if f is None:
                cells.append("—")
                continue
            cell = "%.2f (%.2f)" % (f["median"] * 1e6, f["best"] * 1e6)
            ref = reference(p)
            if ref is not None and ref[0] in figures and figures[ref[0]][k] is not None:
                cell += " = %.2f× %s" % (f["median"] / figures[ref[0]][k]["median"], ref[1])
            cells.append(cell)
        print("| %s | %s |" % (k, " | ".join(cells)))
    if missing:
        print("not installed here: %s" % ", ".join(missing))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(dict(doc, figures=figures, missing=missing), f, indent=1)


# -- the benchmarks of 2 ranks beside MPI (pingpong.py, async_wait.py) --

MPI_TCP = ["--mca", "pml", "ob1", "--mca", "btl", "tcp,self", "--mca", "btl_tcp_if_include", "lo"]


def _two_ranks_parser(doc, peers, iters, iters_help, patterns=None):
    """The options every 2-rank benchmark takes (``--peers``, ``--counts``, ``--rounds``,
    ``--iters``, ``--json``, and the worker's own), and ``--pattern`` where the benchmark
    has ``patterns`` (the first is the default)."""
    # The docstring's first paragraph: its first sentence, which may span lines.
    ap = argparse.ArgumentParser(description=" ".join(doc.split("\n\n")[0].split()))
    ap.add_argument("--peers", default=",".join(peers))
    ap.add_argument("--counts", default="1,4096", help="float32 elements")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=iters, help=iters_help)
    ap.add_argument("--json", help="also write the figures here")
    if patterns:
        ap.add_argument("--pattern", choices=patterns, default=patterns[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    return ap


def _two_ranks_counts(ap, args):
    """``--counts`` as ints, with ``--iters`` and ``--rounds`` checked (else ``ap``'s error)."""
    try:
        counts = [int(c) for c in args.counts.split(",") if c]
    except ValueError:
        ap.error("--counts takes integers, comma-separated: %r" % args.counts)
    if not counts or min(counts) < 1 or args.iters < 1 or args.rounds < 1:
        ap.error("--counts, --iters and --rounds must be positive")
    return counts


def _two_ranks_available(peer):
    """Whether ``peer`` (pycollect-<transport>, mpi-shm, mpi-tcp) can run here."""
    mpi = peer.startswith("mpi-")
    return importable("mpi4py" if mpi else "pycollect", mpirun=mpi)


def _two_ranks_command(script, peer, counts, iters, out, pattern=None):
    """The argv that runs ``script``'s worker for ``peer`` on 2 ranks: under mpirun (TCP
    forced for mpi-tcp) or pycollect-run."""
    me = [sys.executable, os.path.abspath(script), "--worker", peer, "--counts",
          ",".join(map(str, counts)), "--iters", str(iters), "--out", out] + (
          ["--pattern", pattern] if pattern else [])
    if peer.startswith("mpi-"):
        return (["mpirun", "--allow-run-as-root", "-n", "2"]
                + (MPI_TCP if peer == "mpi-tcp" else []) + me)
    from pycollect.launch import module_command
    return module_command("pycollect.launch") + ["-n", "2", "--timeout", "300"] + me


def pycollect_transport(peer):
    """The transport of a pycollect peer: "pycollect-shm-pooled" (shm on pycollect.zeros
    buffers) and "pycollect-shm-ring" (shm with every message through the rings) run over
    "shm"."""
    return peer.split("-", 1)[1].removesuffix("-pooled").removesuffix("-ring")


def against_mpi(peer):
    """The reference of a pycollect peer in the 2-rank tables: MPI on the same transport."""
    return ("mpi-" + pycollect_transport(peer), "MPI") if peer.startswith("pycollect-") \
        else None


def two_ranks_table(title, first, keys_of):
    """A ``tabulate`` for ``two_ranks_main``: the table of ``keys_of(counts)`` (column
    ``first``) under ``title % rounds``, each pycollect peer beside MPI on its transport."""
    def tabulate(args, counts, runs, missing):
        keys = keys_of(counts)
        report(title % args.rounds, first, "---", keys, summarize(runs, keys), against_mpi,
               missing, args.json, {"rounds": args.rounds, "iters": args.iters})
    return tabulate


def save_figures(out, figures):
    """A 2-rank worker's figures (a dict), written as JSON to ``out`` for ``take_turns``."""
    with open(out, "w") as f:
        json.dump(figures, f)


def two_ranks_main(argv, doc, script, peers, iters, iters_help, worker, tabulate,
                   patterns=None):
    """A 2-rank benchmark's main: parse the shared options; as a worker, run
    ``worker(peer, counts, iters, out)`` (``pattern=`` added where the benchmark has
    ``patterns``); else run every peer that can run here in turns (``script`` under mpirun
    or pycollect-run) and hand ``tabulate(args, counts, runs, missing)`` the runs."""
    ap = _two_ranks_parser(doc, peers, iters, iters_help, patterns)
    args = ap.parse_args(argv)
    counts = _two_ranks_counts(ap, args)
    pattern = args.pattern if patterns else None
    if args.worker:
        if patterns:
            return worker(args.worker, counts, args.iters, args.out, pattern=pattern)
        return worker(args.worker, counts, args.iters, args.out)
    chosen, missing = pick_peers(ap, args.peers, peers, _two_ranks_available)
    runs = take_turns(chosen, args.rounds, lambda peer, out: _two_ranks_command(
        script, peer, counts, args.iters, out, pattern))
    tabulate(args, counts, runs, missing)
    return 0
