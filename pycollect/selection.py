"""``algorithm="auto"`` as data: the rules that turn a collective call into a plan.

A rule says: for this collective, at this world size, on this topology, from
this many bytes (the calling rank's buffer), run this algorithm.  The rules of
a collective are tried in table order and the first that matches wins, so the
table reads from the largest messages down.  The crossovers were measured with
``benchmarks/crossover.py`` and ``benchmarks/hierarchy.py`` on this project's
2-core machines (docs/algorithms.md, whose rule table is ``markdown_table()``).

Topology, as every rank of a group sees it alike:

``shm``
    every pair of the group is on one host's shared memory;
``multi-host``
    the ranks span several hosts and some host holds several (the hierarchy
    has something to do);
``flags``
    every pair is on one host's shared memory and the transport has a flag
    area for small messages (``pycollect/_ext/_flags.pyx``; a sub-group has none);
``any``
    whatever the topology.

A plan is ``Plan(name, code, hierarchical)``: the algorithm to run, its code
in the wire header, and whether it is a hierarchical plan (phases on
sub-groups, ``pycollect/hierarchy.py``) rather than one compiled call.
``allreduce_coalesced`` has rules of its own: it stays flat, running
``halving_doubling`` where ``allreduce`` would go hierarchical.
"""

from ._ext import _allgather, _allreduce, _broadcast, _rooted
from ._ext._flags import MAX_BYTES as FLAGS_MAX_BYTES
from ._ext._transport import ALGORITHM_NAMES
from .errors import InvalidArgument

__all__ = ["Facts", "Plan", "RULES", "Rule", "Selector", "buffer_bytes", "choose",
           "markdown_table", "min_bytes", "named"]

KiB = 1 << 10
MiB = 1 << 20

HIERARCHICAL = next(code for code, name in ALGORITHM_NAMES.items() if name == "hierarchical")
# The algorithms each collective runs as one compiled call, by name.
FLAT = {"allreduce": _allreduce.ALGORITHMS, "allreduce_coalesced": _allreduce.ALGORITHMS,
        "broadcast": _broadcast.ALGORITHMS, "reduce": _rooted.REDUCE_ALGORITHMS,
        "allgather": _allgather.ALGORITHMS}
TOPOLOGIES = ("any", "shm", "multi-host", "flags")


class Plan:
    """What a collective call runs: an algorithm by name and wire code, flat or hierarchical."""

    __slots__ = ("name", "code", "hierarchical")

    def __init__(self, name, code, hierarchical=False):
        self.name = name
        self.code = code
        self.hierarchical = hierarchical

    def __repr__(self):
        return "<Plan %s%s>" % (self.name, " (phases on sub-groups)" if self.hierarchical else "")

    def __eq__(self, other):
        return isinstance(other, Plan) and (self.name, self.code, self.hierarchical) == (
            other.name, other.code, other.hierarchical)

    def __hash__(self):
        return hash((self.name, self.code, self.hierarchical))


class Facts:
    """What the rules may ask of a group: its size and its topology (``shm``, ``multi-host``,
    ``flags``)."""

    __slots__ = ("size", "shm", "multi_host", "flags")

    def __init__(self, size, shm=False, multi_host=False, flags=False):
        self.size = size
        self.shm = shm
        self.multi_host = multi_host
        self.flags = flags

    def matches(self, rule):
        if not _at_size(rule, self.size):
            return False
        return (rule.topology == "any" or (rule.topology == "shm" and self.shm)
                or (rule.topology == "multi-host" and self.multi_host)
                or (rule.topology == "flags" and self.flags))


class Rule:
    """From ``min_bytes`` on, at world size ``ranks`` (an int, "N+" or None: any), on
    ``topology``, ``collective`` runs ``algorithm``; ``why`` says what was measured."""

    __slots__ = ("collective", "ranks", "topology", "min_bytes", "algorithm", "why")

    def __init__(self, collective, ranks, topology, min_bytes, algorithm, why=""):
        assert topology in TOPOLOGIES, topology
        self.collective = collective
        self.ranks = ranks
        self.topology = topology
        self.min_bytes = min_bytes
        self.algorithm = algorithm
        self.why = why


def _allreduce_rules(collective, large_multi_host, why):
    """allreduce's rules, with what a multi-host topology runs from 128 KiB."""
    return [
        Rule(collective, None, "multi-host", 128 * KiB, large_multi_host, why),
        Rule(collective, 2, "shm", 4 * KiB + 1, "direct",
             "each rank reduces its slice straight from the peers' memory and writes it "
             "into theirs"),
        Rule(collective, None, "shm", 8 * KiB + 1, "direct",
             "each rank reduces its slice straight from the peers' memory and writes it "
             "into theirs"),
        Rule(collective, 2, "any", 256 * KiB + 1, "ring_chunked",
             "segments overlap the reduction with the wire; at 2 ranks 128 KiB ones below "
             "16 MiB keep the socket's bytes in cache (crossover.py over TCP: the fastest "
             "from 400 KiB, at 1 MiB 150-262 against 275-316 us for halving-doubling)"),
        Rule(collective, 4, "any", 16 * MiB, "ring_chunked",
             "segments overlap the reduction with the wire"),
        Rule(collective, 4, "any", 256 * KiB, "bcube",
             "base 4 at 4 ranks is one exchange step among all four"),
        Rule(collective, None, "flags", FLAGS_MAX_BYTES + 1, "halving_doubling"),
        Rule(collective, None, "flags", 0, "flags",
             "copy into shared memory, raise a flag, reduce every rank's copy: one "
             "synchronisation"),
        Rule(collective, 2, "any", 0, "recursive_doubling",
             "at 2 ranks one message each way instead of two (crossover.py over TCP, 128 "
             "and 200 KiB: 10-23 % ahead of halving-doubling)"),
        Rule(collective, None, "any", 4 * KiB + 1, "halving_doubling"),
        Rule(collective, None, "any", 0, "recursive_doubling",
             "the latency choice: one whole-buffer swap per step"),
    ]


RULES = (
    _allreduce_rules("allreduce", "hierarchical",
                     "inside each host, then among the hosts' leaders")
    + _allreduce_rules("allreduce_coalesced", "halving_doubling",
                       "coalesced calls stay flat")
    + [
        # A hierarchical broadcast never beat the binomial tree (benchmarks/hierarchy.py):
        # the tree already crosses hosts once per host, so no rule picks it.
        Rule("broadcast", None, "shm", 256 * KiB, "direct",
             "the root and every reader share one copy, straight between their buffers"),
        Rule("broadcast", "3+", "any", 256 * KiB, "pipelined",
             "segments forwarded as they land keep every link busy"),
        Rule("broadcast", None, "flags", FLAGS_MAX_BYTES + 1, "binomial"),
        Rule("broadcast", None, "flags", 0, "flags",
             "the root's copy in shared memory, one synchronisation"),
        Rule("broadcast", None, "any", 0, "binomial"),
        Rule("reduce", None, "any", 256 * KiB, "ring"),
        Rule("reduce", None, "any", 0, "binomial"),
        Rule("allgather", None, "shm", 16 * KiB, "direct",
             "each rank writes its block straight into every peer's recvbuf: one copy per block"),
        # At 2 ranks the ring (one message each way) ties the flags at 4 KiB blocks and
        # is ahead above (benchmarks/allreduce_paired.py --collective allgather, 6 KiB:
        # 1.8 against 2.1 us); with more ranks the flags are ahead up to 16 KiB.
        Rule("allgather", 2, "flags", 4 * KiB, "ring"),
        Rule("allgather", None, "flags", 0, "flags",
             "every rank's block through the flag area, one synchronisation"),
        Rule("allgather", None, "any", 0, "ring"),
    ]
)


def _at_size(rule, size):
    """Whether ``rule`` applies at world size ``size``."""
    return rule.ranks is None or (size == rule.ranks if isinstance(rule.ranks, int)
                                  else size >= int(rule.ranks.rstrip("+")))


def min_bytes(collective, algorithm, ranks=None):
    """From how many bytes the first rule of ``collective`` that runs ``algorithm`` (at world
    size ``ranks``, when given) applies."""
    return next(rule.min_bytes for rule in RULES
                if rule.collective == collective and rule.algorithm == algorithm
                and (ranks is None or _at_size(rule, ranks)))


def named(collective, name):
    """The plan of ``collective`` run by the algorithm called ``name``, or InvalidArgument."""
    if name == "hierarchical" and collective in ("allreduce", "broadcast"):
        return Plan(name, HIERARCHICAL, True)
    table = FLAT[collective]
    try:
        return Plan(name, table[name])
    except (KeyError, TypeError):
        choices = ("auto",) + tuple(table) + (
            ("bcube:B",) if collective == "allreduce" else ()) + (
            ("hierarchical",) if collective in ("allreduce", "broadcast") else ())
        raise InvalidArgument("%s: unknown algorithm %r (choose from %s)" % (
            collective, name, ", ".join(choices))) from None


def choose(collective, facts):
    """The rules of ``collective`` for a group with ``facts``: ((min_bytes, Plan), ...), to
    be scanned in order for the first ``nbytes >= min_bytes`` (the last has 0)."""
    return tuple((rule.min_bytes, named(collective, rule.algorithm)) for rule in RULES
                 if rule.collective == collective and facts.matches(rule))


def buffer_bytes(buf):
    """The bytes of ``buf`` that the rules go by (0 for what the gatekeeper will refuse)."""
    try:
        return buf.nbytes
    except AttributeError:
        try:
            return memoryview(buf).nbytes
        except TypeError:
            return 0   # the compiled gatekeeper rejects it with the reason


def _size(nbytes):
    for unit, name in ((MiB, "MiB"), (KiB, "KiB")):
        if nbytes >= unit and nbytes % unit in (0, 1):
            text = "%d %s" % (nbytes // unit, name)
            return ("above " + text) if nbytes % unit else ("from " + text)
    return "any size" if nbytes == 0 else "from %d bytes" % nbytes


def markdown_table():
    """The rule table of docs/algorithms.md."""
    lines = ["| collective | ranks | topology | buffer | algorithm | why |",
             "|---|---|---|---|---|---|"]
    for rule in RULES:
        ranks = "any" if rule.ranks is None else str(rule.ranks)
        lines.append("| %s | %s | %s | %s | `%s` | %s |" % (
            rule.collective, ranks, rule.topology, _size(rule.min_bytes), rule.algorithm,
            rule.why))
    return "\n".join(lines) + "\n"


class Selector:
    """``auto`` for one group: each collective's rules for its facts, found once, then scanned."""

    __slots__ = ("facts", "_rules")

    def __init__(self, facts):
        self.facts = facts
        self._rules = {}

    def rules(self, collective):
        """``choose(collective, facts)``, found once."""
        rules = self._rules.get(collective)
        if rules is None:
            rules = self._rules[collective] = choose(collective, self.facts)
        return rules

    def plan(self, collective, nbytes):
        """The plan of ``collective`` for a buffer of ``nbytes`` on this rank."""
        rules = self._rules.get(collective) or self.rules(collective)
        for min_bytes, plan in rules:
            if nbytes >= min_bytes:
                return plan
        raise AssertionError("no rule of %s matches %d bytes" % (collective, nbytes))
