"""A small collective benchmark: ``mpirun -n 2 python -m hpccomm.bench``.

Times all_reduce, all_gather_into_tensor and reduce_scatter_tensor (float32)
through hpccomm, through torch's gloo backend on the same ranks, and through
raw mpi4py on numpy buffers, and prints median time and bus bandwidth per
size (nccl-tests' definitions) with the ratios.  Each result is checked.
"""
from __future__ import annotations

import argparse
import statistics
import time
import warnings

import numpy as np
import torch
import torch.distributed as dist

import hpccomm

BUS_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
}


def _time(fn, iters: int, warmup: int, barrier) -> float:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(iters):
        barrier()
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def _torch_op(op, nbytes, size, group, dtype):
    count = max(nbytes // torch.tensor([], dtype=dtype).element_size(), 1)
    if op == "all_reduce":
        t = torch.ones(count, dtype=dtype)
        return lambda: dist.all_reduce(t, group=group), count, (lambda: bool(torch.all(t > 0)))
    if op == "all_gather":
        per = max(count // size, 1)
        inp, out = torch.ones(per, dtype=dtype), torch.empty(per * size, dtype=dtype)
        return lambda: dist.all_gather_into_tensor(out, inp, group=group), per * size, \
            (lambda: bool(torch.all(out == 1)))
    per = max(count // size, 1)
    inp, out = torch.ones(per * size, dtype=dtype), torch.empty(per, dtype=dtype)
    return lambda: dist.reduce_scatter_tensor(out, inp, group=group), per * size, \
        (lambda: bool(torch.all(out == size)))


def _mpi_op(op, nbytes, size, comm):
    from mpi4py import MPI

    count = max(nbytes // 4, 1)
    if op == "all_reduce":
        a = np.ones(count, dtype=np.float32)
        return lambda: comm.Allreduce(MPI.IN_PLACE, a, op=MPI.SUM)
    per = max(count // size, 1)
    if op == "all_gather":
        a, b = np.ones(per, np.float32), np.empty(per * size, np.float32)
        return lambda: comm.Allgather(a, b)
    a, b = np.ones(per * size, np.float32), np.empty(per, np.float32)
    return lambda: comm.Reduce_scatter_block(a, b, op=MPI.SUM)


def overlap(nbytes: int, iters: int, barrier) -> None:
    """Print (compute alone + comm alone) / (both together) for an async
    all_reduce of ``nbytes`` running while this thread multiplies matrices."""
    torch.set_num_threads(1)  # compute on one core; the comm thread has the other
    t = torch.ones(nbytes // 4)
    a = torch.randn(256, 256)

    def compute():
        for _ in range(iters):
            a @ a

    def comm():
        dist.all_reduce(t)

    def both():
        work = dist.all_reduce(t, async_op=True)
        compute()
        work.wait()

    t_compute = _time(compute, 5, 1, barrier)
    t_comm = _time(comm, 5, 1, barrier)
    t_both = _time(both, 5, 1, barrier)
    if dist.get_rank() == 0:
        print(f"# overlap: all_reduce of {nbytes >> 20} MiB async while {iters} 256x256 matmuls run")
        print(f"compute alone {t_compute * 1e3:.1f} ms, comm alone {t_comm * 1e3:.1f} ms, "
              f"both {t_both * 1e3:.1f} ms: overlap ratio (compute + comm) / both = "
              f"{(t_compute + t_comm) / t_both:.2f} (1 = none, 2 = perfect)", flush=True)


def add_arguments(p) -> None:
    p.add_argument("--ops", default="all_reduce,all_gather,reduce_scatter")
    p.add_argument("--min-bytes", type=int, default=8)
    p.add_argument("--max-bytes", type=int, default=16 << 20)
    p.add_argument("--factor", type=int, default=8, help="size step (×)")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--no-gloo", action="store_true")
    p.add_argument("--overlap", type=int, metavar="MIB", default=0,
                   help="instead of the sweep, measure compute/communication overlap with an async "
                        "all_reduce of MIB MiB")
    p.add_argument("--overlap-matmuls", type=int, default=60)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m hpccomm.bench", description=__doc__.splitlines()[0])
    add_arguments(p)
    return run(p.parse_args(argv))


def run(args) -> int:
    warnings.filterwarnings("ignore", category=FutureWarning)
    dtype = getattr(torch, args.dtype)

    hpccomm.init_process_group()
    from mpi4py import MPI

    rank, size = dist.get_rank(), dist.get_world_size()
    if args.overlap:
        overlap(args.overlap << 20, args.overlap_matmuls, MPI.COMM_WORLD.Barrier)
        dist.destroy_process_group()
        return 0
    gloo = None if args.no_gloo else dist.new_group(backend="gloo")
    raw = MPI.COMM_WORLD.Dup()
    barrier = raw.Barrier
    if rank == 0:
        print(f"# hpccomm {hpccomm.__version__}, {size} ranks, {args.dtype}, median of {args.iters}; "
              "busbw in GB/s; x/gloo and x/raw are bandwidth ratios (higher is better for hpccomm)")
        print(f"{'op':>15} {'bytes':>10} {'hpccomm us':>11} {'busbw':>7} {'gloo us':>9} {'busbw':>7} "
              f"{'raw us':>9} {'busbw':>7} {'x/gloo':>7} {'x/raw':>6} wrong")
    for op in args.ops.split(","):
        nbytes = args.min_bytes
        while nbytes <= args.max_bytes:
            fn, count, check = _torch_op(op, nbytes, size, None, dtype)
            t_h = _time(fn, args.iters, args.warmup, barrier)
            fn, _, _ = _torch_op(op, nbytes, size, None, dtype)
            wrong = 0
            fn2, _, check2 = _torch_op(op, nbytes, size, None, dtype)
            fn2()
            wrong += not check2()
            t_g = float("nan")
            if gloo is not None:
                fng, _, _ = _torch_op(op, nbytes, size, gloo, dtype)
                t_g = _time(fng, args.iters, args.warmup, barrier)
            t_r = _time(_mpi_op(op, nbytes, size, raw), args.iters, args.warmup, barrier) \
                if dtype == torch.float32 else float("nan")
            total = count * torch.tensor([], dtype=dtype).element_size()
            bw = lambda t: total / t * BUS_FACTOR[op](size) / 1e9 if size > 1 and t == t else float("nan")
            wrong = raw.allreduce(wrong)
            if rank == 0:
                print(f"{op:>15} {total:>10} {t_h * 1e6:>11.1f} {bw(t_h):>7.3f} {t_g * 1e6:>9.1f} {bw(t_g):>7.3f} "
                      f"{t_r * 1e6:>9.1f} {bw(t_r):>7.3f} {t_g / t_h:>7.2f} {t_r / t_h:>6.2f} {wrong}", flush=True)
            nbytes *= args.factor
    raw.Free()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
