"""What the first-call check costs (docs/troubleshooting.md): time per op at N ranks, check on and off.

    mpirun -n 2 python docs/scripts/check_cost.py [--rounds 15] [--new 200] [--repeat 2000]

Two groups of every rank, one with the first-call check (the default) and one without it (its
agreed signatures dropped, as ``HPCCOMM_MISMATCH_CHECK=off`` would make it), take turns block by
block, each first in every other round, so that a burst of load on a shared machine hits both
alike; the figures are medians over the rounds, of the slowest rank's time per op:

- ``first call``: an all_reduce of a size new to the group (a new signature: compared across the
  ranks first where the check is on), each of ``--new`` sizes once;
- ``repeated``: an 8-byte all_reduce and broadcast whose signature was agreed on, ``--repeat``
  times (what a training loop pays after its first step).

Instruction counts of the repeated case: ``docs/scripts/op_instructions.py`` (callgrind, one rank).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import hpccomm
from hpccomm import _compat as compat


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=16)
    p.add_argument("--new", type=int, default=60, help="new sizes per round (first calls)")
    p.add_argument("--repeat", type=int, default=2000, help="repeated ops per round")
    args = p.parse_args()
    hpccomm.init_process_group()
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    n = dist.get_world_size()
    on, off = dist.new_group(list(range(n))), dist.new_group(list(range(n)))
    compat.group_of(off).checks.agreed = None  # this group compares nothing
    small = torch.ones(2)
    results: dict = {}
    base = 1000  # element counts of the first calls: a fresh range each round and group
    for r in range(args.rounds):
        for name, pg in ((("on", on), ("off", off)) if r % 2 == 0 else (("off", off), ("on", on))):  # either first
            sizes = range(base, base + args.new)
            base += args.new
            tensors = [torch.ones(k) for k in sizes]  # made before timing: only the op is timed
            comm.Barrier()
            t0 = time.perf_counter()
            for t in tensors:
                dist.all_reduce(t, group=pg)
            results.setdefault(("first call: all_reduce of a new size", name), []).append(
                comm.allreduce((time.perf_counter() - t0) / args.new, op=MPI.MAX))
            for op, call in (("all_reduce", lambda: dist.all_reduce(small, group=pg)),
                             ("broadcast", lambda: dist.broadcast(small, 0, group=pg))):
                call()
                comm.Barrier()
                t0 = time.perf_counter()
                for _ in range(args.repeat):
                    call()
                results.setdefault((f"repeated: 8 B {op}", name), []).append(
                    comm.allreduce((time.perf_counter() - t0) / args.repeat, op=MPI.MAX))
    if dist.get_rank() == 0:
        print(f"# first-call check, {n} ranks, torch {torch.__version__}, medians of {args.rounds} rounds (us per op)")
        print(f"# {'case':40s} {'check on':>9s} {'off':>9s} {'on - off':>9s}")
        for case in dict.fromkeys(c for c, _ in results):
            a, b = (statistics.median(results[case, k]) * 1e6 for k in ("on", "off"))
            print(f"  {case:40s} {a:9.2f} {b:9.2f} {a - b:+9.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
