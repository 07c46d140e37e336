"""What starting a job costs each rank, and how much of it is hpccomm's own (docs/benchmarks.md).

    mpirun -n 8 --oversubscribe python docs/scripts/init_cost.py [--json FILE]

Each rank times, in order: importing torch; starting MPI (mpi4py's ``MPI.Init_thread``, as hpccomm does);
``hpccomm.init_process_group()`` (the store, the rendezvous, the world group and its communicators; MPI
already up); a first 4-byte all_reduce; ``destroy_process_group()``.  Rank 0 prints the slowest rank's
time of each phase (a job waits for its slowest rank) and its median, and whether CUDA was initialised in
any rank (a CPU job should never initialise it).  Run it with ``PYTHONPATH`` naming the tree to measure.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

t0 = time.perf_counter()
import torch  # noqa: E402

t_torch = time.perf_counter() - t0

import mpi4py  # noqa: E402

mpi4py.rc.initialize = False  # (started below, timed; finalized at exit, as hpccomm leaves it)
mpi4py.rc.finalize = True
from mpi4py import MPI  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    t1 = time.perf_counter()
    MPI.Init_thread(MPI.THREAD_MULTIPLE)
    t_mpi = time.perf_counter() - t1
    import torch.distributed as dist

    import hpccomm

    t2 = time.perf_counter()
    hpccomm.init_process_group()
    t_init = time.perf_counter() - t2
    t3 = time.perf_counter()
    dist.all_reduce(torch.ones(1))
    t_first = time.perf_counter() - t3
    t4 = time.perf_counter()
    dist.destroy_process_group()
    t_destroy = time.perf_counter() - t4
    cuda = bool(torch.cuda.is_initialized())
    mine = {"import torch": t_torch, "MPI start": t_mpi, "hpccomm init": t_init, "first all_reduce": t_first,
            "destroy": t_destroy, "cuda initialised": cuda}
    everyone = MPI.COMM_WORLD.gather(mine, root=0)
    if MPI.COMM_WORLD.Get_rank() == 0:
        n = len(everyone)
        print(f"# {n} ranks, torch {torch.__version__}, hpccomm from {hpccomm.__file__}")
        print(f"{'phase':>18} {'slowest s':>10} {'median s':>10}")
        summary = {"ranks": n, "torch": torch.__version__, "phases": {}}
        for phase in ("import torch", "MPI start", "hpccomm init", "first all_reduce", "destroy"):
            values = [r[phase] for r in everyone]
            summary["phases"][phase] = {"max": max(values), "median": statistics.median(values)}
            print(f"{phase:>18} {max(values):>10.3f} {statistics.median(values):>10.3f}")
        summary["cuda_initialised_anywhere"] = any(r["cuda initialised"] for r in everyone)
        print(f"# CUDA initialised in any rank: {summary['cuda_initialised_anywhere']}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(summary, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
