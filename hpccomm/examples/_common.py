"""What the examples share: printing from rank 0, whether that output reaches a
terminal, and a job-wide verdict."""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

import hpccomm


def start() -> tuple:
    """Start hpccomm from MPI alone (no MASTER_ADDR, no torchrun): ``(rank, size)``."""
    hpccomm.init_process_group()
    return dist.get_rank(), dist.get_world_size()


def say(*args, end="\n") -> None:
    """Print from rank 0 only."""
    if dist.get_rank() == 0:
        print(*args, end=end, flush=True)


def rank0s(value):
    """Rank 0's ``value``, on every rank (a decision every rank must share)."""
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def each(text: str) -> None:
    """Print from every rank, prefixed with the rank (lines may interleave)."""
    print(f"[rank {dist.get_rank()}] {text}", flush=True)


#: Names (``/proc/<pid>/comm``, at most 15 characters) of the MPI launcher processes that pass a
#: rank's output on: Open MPI 5's ``prterun``/``prted`` (``orterun``/``orted`` before 5.0), Hydra's
#: ``mpiexec`` and its proxies (MPICH, Intel MPI).
LAUNCHER_PROCESSES = frozenset({"mpirun", "mpiexec", "prterun", "prted", "orterun", "orted", "mpiexec.hydra",
                                "hydra_pmi_proxy", "pmi_proxy", "hydra_bstrap_pr"})
#: What ``/proc/<pid>/fd/1`` of a process writing to a terminal points to.
TERMINALS = ("/dev/pts/", "/dev/tty", "/dev/console")


def _parent(pid: int):
    """``(name, parent pid)`` of process ``pid`` from /proc, or None where /proc cannot say."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    # "pid (name) state ppid ...": the name may hold spaces and parentheses, the last ")" ends it
    name = stat[stat.index("(") + 1:stat.rindex(")")]
    return name, int(stat[stat.rindex(")") + 2:].split()[1])


def output_is_terminal() -> bool:
    """Whether what this process prints reaches a terminal, so that a line
    updated in place with carriage returns reads well (else a log file or a
    pipe: print whole lines).

    Its stdout must be a terminal, and, when an MPI launcher passes its output
    on, so must the launcher's: Open MPI's ``mpirun`` gives every rank a
    pseudo-terminal even when its own output goes to a file (a batch job's
    log: ``sbatch`` runs ``mpirun`` with its output in ``slurm-<id>.out``) or
    a pipe, so ``sys.stdout.isatty()`` is True in the rank there.  The
    outermost launcher process above this one on the node is found through
    /proc (Linux) and its stdout read.  Where that cannot be seen (no /proc,
    or the rank runs on another node than ``mpirun``), a launched rank counts
    as not on a terminal: a plain line reads well on a terminal too, an
    in-place bar does not in a log.  Under ``srun`` (a pipe unless ``--pty``),
    ``torchrun`` and a plain ``python`` the process's own stdout decides.

    Never raises.

    Example::

        end = "\\r" if output_is_terminal() else "\\n"
    """
    try:
        if not sys.stdout.isatty():
            return False
    except (AttributeError, ValueError):  # replaced or closed stdout
        return False
    if hpccomm.launcher().name not in ("openmpi", "mpich", "intelmpi"):
        return True
    outer, pid = None, os.getppid()
    while pid > 1:
        found = _parent(pid)
        if found is None or found[0] not in LAUNCHER_PROCESSES:
            break
        outer, pid = pid, found[1]
    if outer is None:
        return False
    try:
        return os.readlink(f"/proc/{outer}/fd/1").startswith(TERMINALS)
    except OSError:
        return False


class Checks:
    """Checks made on each rank; :meth:`finish` agrees on the verdict over the
    world, so every rank exits with the same status."""

    def __init__(self) -> None:
        self.failed = []

    def expect(self, ok, what: str) -> None:
        if not ok:
            self.failed.append(what)
            each(f"WRONG: {what}")

    def finish(self, name: str) -> int:
        bad = torch.tensor([len(self.failed)], dtype=torch.int64)
        dist.all_reduce(bad)
        if bad.item() == 0:
            say(f"{name}: all checks passed on {dist.get_world_size()} rank(s)")
        else:
            say(f"{name}: {bad.item()} check(s) FAILED (see the WRONG lines above)")
        dist.destroy_process_group()
        return 0 if bad.item() == 0 else 1


def run(main) -> None:
    sys.exit(main())
