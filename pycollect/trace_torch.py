"""The flight recorder's dump in the format of torch's analyzer
(``python -m torch.distributed.flight_recorder.fr_trace DIR``).

torch reads one pickle per rank, named ``<prefix><rank>``, holding a dict with the
format ``version``, the process groups (``pg_config``) and the ``entries``, each with
torch's field names (``collective_seq_id``, ``profiling_name``, ``input_sizes``,
``state``...).  ``write(directory, snapshot)`` turns a recorder snapshot
(pycollect/recorder.py) of a top-level context into that file,
``pycollect_fr_rank_<R>``; torch imports nothing here.  torch's analyzer knows a fixed
set of backend names; CPU collectives are named ``gloo:<collective>`` in it.
"""

import os
import pickle

__all__ = ["write", "file_name", "VERSION", "PREFIX"]

VERSION = "2.10"
PREFIX = "pycollect_fr_rank_"
BACKEND = "gloo"        # torch's analyzer accepts a fixed list of backend names
PG_NAME, PG_DESC = "0", "default_pg"

_NAMES = {
    "allreduce": "all_reduce", "broadcast": "broadcast", "reduce": "reduce",
    "allgather": "all_gather", "allgatherv": "all_gather_v", "gather": "gather",
    "gatherv": "gather", "scatter": "scatter", "scatterv": "scatter",
    "reduce_scatter": "reduce_scatter", "reduce_scatterv": "reduce_scatter_v",
    "alltoall": "all_to_all", "alltoallv": "all_to_all_v_single", "barrier": "barrier",
    "monitored_barrier": "barrier", "allreduce_coalesced": "allreduce_coalesced",
}
_DTYPES = {
    "float32": "Float", "float64": "Double", "float16": "Half", "bfloat16": "BFloat16",
    "int64": "Long", "int32": "Int", "int16": "Short", "int8": "Char", "uint8": "Byte",
    "bool": "Bool", "complex64": "ComplexFloat", "complex128": "ComplexDouble",
}
_STATES = {"queued": "scheduled", "started": "started", "failed": "started",
           "completed": "completed"}


def file_name(rank):
    return PREFIX + str(rank)


def _entry(e, rank, p2p_seq):
    name = e["name"]
    is_p2p = name in ("send", "recv")
    if is_p2p:
        peer = e["peers"][0] if e["peers"] else -1
        profiling = "%s:%s %d%s%d" % (BACKEND, name, rank, "->" if name == "send" else "<-",
                                     peer)
    else:
        profiling = "%s:%s" % (BACKEND, _NAMES[name])
    sizes = [[e["count"]]] if e["count"] is not None else [[]]
    dtypes = [_DTYPES.get(e["dtype"], e["dtype"])] if e["dtype"] is not None else []
    frame = e["frame"]
    return {
        "record_id": e["id"],
        "pg_id": 0,
        "process_group": (PG_NAME, PG_DESC),
        "collective_seq_id": 0 if is_p2p else (e["seq"] or 0),
        "p2p_seq_id": p2p_seq if is_p2p else 0,
        "op_id": e["id"],
        "profiling_name": profiling,
        "time_created_ns": e["queued_ns"],
        "input_sizes": sizes,
        "input_dtypes": dtypes,
        "output_sizes": sizes,
        "output_dtypes": dtypes,
        "state": _STATES[e["state"]],
        "time_discovered_started_ns": e["started_ns"],
        "time_discovered_completed_ns": e["ended_ns"] if e["state"] == "completed" else None,
        "retired": e["state"] in ("completed", "failed"),
        "timeout_ms": None,
        "duration_ms": None,
        "is_p2p": is_p2p,
        "frames": [] if frame is None else [
            {"name": frame[2], "filename": frame[0], "line": frame[1]}],
    }


def convert(snapshot):
    """A recorder snapshot as torch's dump dict."""
    rank, entries, p2p = snapshot["rank"], [], 0
    last = {"completed": -1, "started": -1, "scheduled": -1}
    for e in snapshot["entries"]:
        if e["name"] not in _NAMES and e["name"] not in ("send", "recv"):
            continue        # shrink, agree: no torch counterpart
        if e["name"] in ("send", "recv"):
            p2p += 1
        entry = _entry(e, rank, p2p)
        entries.append(entry)
        if not entry["is_p2p"]:
            last[entry["state"]] = entry["collective_seq_id"]
    return {
        "version": VERSION,
        "pg_config": {PG_NAME: {"name": PG_NAME, "desc": PG_DESC,
                                "ranks": str(list(range(snapshot["size"])))}},
        "pg_status": {PG_NAME: {"last_enqueued_collective": max(last.values()),
                                "last_started_collective": max(last["started"],
                                                               last["completed"]),
                                "last_completed_collective": last["completed"]}},
        "entries": entries,
    }


def write(directory, snapshot):
    """Write ``snapshot`` (a top-level context's) as ``directory/pycollect_fr_rank_<R>``."""
    path = os.path.join(directory, file_name(snapshot["rank"]))
    tmp = "%s.%d.tmp" % (path, os.getpid())
    with open(tmp, "wb") as f:
        pickle.dump(convert(snapshot), f)
    os.replace(tmp, path)
    return path
