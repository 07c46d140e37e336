"""What an MPI library does with a mismatched collective when nothing checks it
(docs/benchmarks.md, "The every-call check": why the check runs before the op on every MPI).

    for case in roots desync skip count redop; do
        timeout 20 mpiexec -n 2 python docs/scripts/raw_mismatch.py $case; echo "exit $?"
    done

mpi4py and numpy only (no torch, no hpccomm): each case is one call that the ranks make
differently, then a barrier; each rank that gets past them prints what its buffer holds.  Exit 124
(from ``timeout``) is a hang; an MPI error or abort is the library's own.  The cases:

- ``roots``: ``MPI_Bcast`` of 8 bytes, rank 0 naming root 0, the others root 1;
- ``desync``: rank 0 calls ``MPI_Bcast`` where the others call ``MPI_Allreduce`` (a different
  collective);
- ``skip``: rank 0 skips a step's ``MPI_Allreduce``, then every rank calls ``MPI_Bcast``;
- ``count``: ``MPI_Allreduce`` of 4 float32 on rank 0 and 6 on the others;
- ``redop``: ``MPI_Allreduce`` with ``MPI_SUM`` on rank 0 and ``MPI_MAX`` on the others.

A check that compares op k's call after op k ran (a "lagged" check, whose verdict comes at a later
op) can name only the cases where every rank gets past op k.
"""
from __future__ import annotations

import sys

import numpy as np
from mpi4py import MPI

CASES = ("roots", "desync", "skip", "count", "redop")


def main(case: str) -> None:
    comm = MPI.COMM_WORLD
    rank = comm.rank
    buf = np.full(2, float(rank + 1), dtype=np.float32)
    if case == "roots":
        comm.Bcast(buf, root=0 if rank == 0 else 1)
    elif case == "desync":
        if rank == 0:
            comm.Bcast(buf, root=0)
        else:
            comm.Allreduce(MPI.IN_PLACE, buf)
    elif case == "skip":
        if rank != 0:
            comm.Allreduce(MPI.IN_PLACE, buf)
        comm.Bcast(buf, root=0)
    elif case == "count":
        buf = np.ones(4 if rank == 0 else 6, dtype=np.float32)
        comm.Allreduce(MPI.IN_PLACE, buf)
    elif case == "redop":
        comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM if rank == 0 else MPI.MAX)
    comm.Barrier()
    print(f"{case}: rank {rank}/{comm.size} returned {buf.tolist()} ({MPI.Get_library_version().split()[0]})",
          flush=True)


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in CASES:
        sys.exit(f"usage: python {sys.argv[0]} {{{','.join(CASES)}}}")
    main(sys.argv[1])
