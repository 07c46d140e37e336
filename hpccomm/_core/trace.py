"""``HPCCOMM_TRACE=FILE``: a merged Chrome/Perfetto timeline of every op on every rank.

Each rank records its ops (name, group, op number, bytes, start, end, thread)
in memory.  When the world group is destroyed (``dist.destroy_process_group``,
which every rank calls), rank 0 gathers every rank's records over MPI and
writes one trace: a process per rank, a track per thread (the caller and the
comm thread: a queued op that its waiter ran in the comm thread's place, see
hpccomm._core.comm_thread.steal, is drawn on the comm thread's track, where it
holds its place in the queue's order), clocks aligned to rank 0's by a ping exchange at start.  Open
the file in https://ui.perfetto.dev or chrome://tracing to see which rank was
late.  A job that ends without destroying the group writes ``FILE.rank<r>``
per rank at exit instead (merge them with ``python -m hpccomm._core.trace FILE``).
"""
from __future__ import annotations

import json
import threading
import time
from typing import Optional

from .. import config


class Tracer:
    def __init__(self, path: str, rank: int, size: int, offset_us: float) -> None:
        self.path, self.rank, self.size = path, rank, size
        self.offset_us = offset_us  # add to local microseconds to get rank 0's clock
        self.events: list = []
        self.written = False

    def record(self, op: str, group: str, seq: int, nbytes: int, start_ns: int, end_ns: int,
               track: Optional[str] = None) -> None:
        """``track``: the thread track to draw it on (default: the calling thread's name)."""
        self.events.append((op, group, seq, nbytes, start_ns, end_ns, track or threading.current_thread().name))

    def chrome_events(self) -> list:
        out = [{"ph": "M", "pid": self.rank, "name": "process_name", "args": {"name": f"rank {self.rank}"}}]
        for op, group, seq, nbytes, start, end, thread in self.events:
            out.append({"ph": "X", "pid": self.rank, "tid": thread, "name": op, "cat": group,
                        "ts": start / 1e3 + self.offset_us, "dur": max((end - start) / 1e3, 0.001),
                        "args": {"group": group, "op": seq, "bytes": nbytes, "transport": "mpi (host)"}})
        return out


_tracer: Optional[Tracer] = None


def start(comm) -> None:
    """Start tracing on every rank of ``comm`` if HPCCOMM_TRACE is set (collective)."""
    global _tracer
    path = config.get("HPCCOMM_TRACE")
    if not path or _tracer is not None:
        return
    rank, size = comm.Get_rank(), comm.Get_size()
    offset = 0.0
    for peer in range(1, size):  # one ping per rank: offset = rank 0's clock - ours
        if rank == 0:
            comm.recv(source=peer, tag=77)
            comm.send(time.time_ns() / 1e3, dest=peer, tag=77)
        elif rank == peer:
            t0 = time.time_ns() / 1e3
            comm.send(None, dest=0, tag=77)
            remote = comm.recv(source=0, tag=77)
            t1 = time.time_ns() / 1e3
            offset = remote - (t0 + t1) / 2
    _tracer = Tracer(path, rank, size, offset)
    import atexit

    atexit.register(_write_own_part)


def active() -> Optional[Tracer]:
    return _tracer


def now_ns() -> int:
    return time.time_ns()


def finish(comm) -> None:
    """Gather every rank's records on rank 0 and write the merged trace (collective)."""
    global _tracer
    tracer = _tracer
    if tracer is None or tracer.written:
        return
    parts = comm.gather(tracer.chrome_events(), root=0)
    tracer.written = True
    if tracer.rank == 0:
        merged = [e for part in parts for e in part]
        with open(tracer.path, "w") as fh:
            json.dump({"traceEvents": merged, "displayTimeUnit": "ms"}, fh)
    _tracer = None


def _write_own_part() -> None:
    tracer = _tracer
    if tracer is None or tracer.written:
        return
    with open(f"{tracer.path}.rank{tracer.rank}", "w") as fh:
        json.dump({"traceEvents": tracer.chrome_events()}, fh)


def merge(path: str) -> int:
    """Merge ``path.rank<r>`` files into ``path``; returns how many were found."""
    import glob

    events = []
    files = sorted(glob.glob(f"{path}.rank*"))
    for name in files:
        with open(name) as fh:
            events.extend(json.load(fh)["traceEvents"])
    with open(path, "w") as fh:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, fh)
    return len(files)


if __name__ == "__main__":  # python -m hpccomm._core.trace FILE
    import sys

    print(f"merged {merge(sys.argv[1])} rank files into {sys.argv[1]}")
    sys.exit(0)
