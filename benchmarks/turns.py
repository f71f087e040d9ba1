"""Peers taking turns, for the benchmarks that run each peer in processes of its own
(callpath.py, pingpong.py): which of the asked-for peers can run here, and the rounds in
which every peer runs once, in an order that rotates from round to round.

A peer's run writes its figures as JSON to a file it is given; ``take_turns`` collects
them, per peer, in round order.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile


def importable(modules, mpirun=False):
    """Whether ``modules`` (``"torch, pycollect.torch"``) import here, and, with ``mpirun``,
    whether ``mpirun`` is on PATH."""
    if mpirun and shutil.which("mpirun") is None:
        return False
    return subprocess.run([sys.executable, "-c", "import %s" % modules], capture_output=True,
                          timeout=120).returncode == 0


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
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds if peers else 0):
            for peer in peers[r % len(peers):] + peers[:r % len(peers)]:
                out = os.path.join(tmp, "%s.json" % peer)
                subprocess.run(command(peer, out), check=True, timeout=600, env=env, cwd=tmp,
                               stdout=subprocess.DEVNULL)
                with open(out) as f:
                    runs[peer].append(json.load(f))
    return runs
