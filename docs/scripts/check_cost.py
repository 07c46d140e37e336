"""What the mismatch check costs (docs/benchmarks.md, "The every-call check"): time per op at N ranks.

    mpirun -n 2 python docs/scripts/check_cost.py [--rounds 16] [--repeat 1000]

Three groups of every rank, one per ``HPCCOMM_MISMATCH_CHECK`` mode (``every``, the default: every
call compared; ``first``: the first call of each signature; ``off``), take turns block by block in
an order that rotates every round, so that a burst of load on a shared machine hits them alike.
Each block times ``--repeat`` calls of one op (an all_reduce of 8 B to 16 MiB, an 8-byte broadcast)
whose signature the group agreed on, and, in the same round, a raw 8-byte ``MPI_Allreduce`` from
mpi4py on a communicator of its own (what the issue's budget is measured in: the every-call check
may add at most one such allreduce per small op, and 1 % from 1 MiB).  The figures are medians over
the rounds of the slowest rank's time per op, in microseconds.

Instruction counts (one rank, no time): ``docs/scripts/op_instructions.py`` with
``HPCCOMM_MISMATCH_CHECK=off``, ``first`` or the default.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
import torch
import torch.distributed as dist

import hpccomm
from hpccomm import config

MODES = ("every", "first", "off")
SIZES = (8, 1 << 10, 64 << 10, 1 << 20, 16 << 20)


def group_in(mode: str):
    """A new group of every rank whose checks run in ``mode`` (read when a group is made)."""
    os.environ["HPCCOMM_MISMATCH_CHECK"] = mode
    config.load()
    try:
        return dist.new_group(list(range(dist.get_world_size())))
    finally:
        os.environ.pop("HPCCOMM_MISMATCH_CHECK", None)
        config.load()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=16)
    p.add_argument("--repeat", type=int, default=1000, help="ops per block (fewer for the large sizes)")
    args = p.parse_args()
    hpccomm.init_process_group()
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    raw = comm.Dup()
    n = dist.get_world_size()
    groups = {mode: group_in(mode) for mode in MODES}
    cases = [(f"all_reduce {size} B", size, "all_reduce") for size in SIZES] + [("broadcast 8 B", 8, "broadcast")]
    tensors = {size: torch.ones(max(size // 4, 1)) for size in SIZES}
    sbuf, rbuf = np.ones(2, dtype=np.float32), np.empty(2, dtype=np.float32)
    results: dict = {}

    def timed(fn, reps: int) -> float:
        fn()
        comm.Barrier()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        return comm.allreduce((time.perf_counter() - t0) / reps, op=MPI.MAX)

    for r in range(args.rounds):
        order = MODES[r % 3:] + MODES[:r % 3]
        for name, size, op in cases:
            reps = args.repeat if size <= 64 << 10 else max(args.repeat // 50, 10)
            t = tensors[size]
            for mode in order:
                pg = groups[mode]
                fn = (lambda: dist.all_reduce(t, group=pg)) if op == "all_reduce" else \
                    (lambda: dist.broadcast(t, 0, group=pg))
                results.setdefault((name, mode), []).append(timed(fn, reps))
        results.setdefault(("raw MPI_Allreduce 8 B", "raw"), []).append(
            timed(lambda: raw.Allreduce(sbuf, rbuf, op=MPI.SUM), args.repeat))
    if dist.get_rank() == 0:
        med = {k: statistics.median(v) * 1e6 for k, v in results.items()}
        rawt = med["raw MPI_Allreduce 8 B", "raw"]
        print(f"# mismatch check, {n} ranks, torch {torch.__version__}, {MPI.Get_library_version().splitlines()[0]}; "
              f"medians of {args.rounds} rounds, us per op (slowest rank)")
        print(f"# raw 8-byte MPI_Allreduce (mpi4py), same run: {rawt:.2f} us")
        print(f"# {'case':22s} {'every':>9s} {'first':>9s} {'off':>9s} {'every-off':>10s} {'budget':>9s}  within")
        for name, size, _ in cases:
            every, first, off = (med[name, m] for m in MODES)
            budget = rawt if size <= 64 << 10 else 0.01 * off
            print(f"  {name:22s} {every:9.2f} {first:9.2f} {off:9.2f} {every - off:+10.2f} {budget:9.2f}  "
                  f"{'yes' if every - off <= budget else 'NO'}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
