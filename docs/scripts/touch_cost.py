"""What a small piece of work costs in front of a cache-hot MPI_Allreduce (docs/benchmarks.md).

Each variant runs ``comm.Allreduce`` in place on the same buffer in a loop, with one small piece of
work before every call, and prints what that adds per call compared with the bare loop, beside what
the work costs on its own.  Pure Python arithmetic adds about what it costs; a call into torch's
C++ (a tensor attribute, a device object, a c10d Work) adds several times what it costs once the
buffer is about the size of the core's L2 cache.

    mpirun -n 2 python docs/scripts/touch_cost.py [BYTES] [OPS_PER_SAMPLE] [SAMPLES]   # default 2 MiB 200 5
"""
import sys
import time
import timeit

import numpy as np
import torch
import torch.distributed as dist
from mpi4py import MPI

nbytes = int(sys.argv[1]) if len(sys.argv) > 1 else 2 << 20
per_sample = int(sys.argv[2]) if len(sys.argv) > 2 else 200
samples = int(sys.argv[3]) if len(sys.argv) > 3 else 5
comm = MPI.COMM_WORLD
t = torch.ones(nbytes // 4)
a = t.numpy()


class Work(dist.Work):  # the least a process group must return per op
    def __init__(self):
        super().__init__()


def spin():
    s = 0
    for i in range(60):
        s += i


work = {
    "nothing": lambda: None,
    "python arithmetic": spin,
    "numpy: small array": lambda: np.empty(8),
    "t.dtype": lambda: t.dtype,
    "t.is_contiguous()": lambda: t.is_contiguous(),
    "t.data_ptr()": lambda: t.data_ptr(),
    "t.numel(), t.element_size()": lambda: (t.numel(), t.element_size()),
    "t.device.type": lambda: t.device.type,
    "dist.Work()": Work,
    "torch.futures.Future()": torch.futures.Future,
    "torch.empty(2)": lambda: torch.empty(2),
}
alone = {k: min(timeit.repeat(f, number=20000, repeat=5)) / 20000 * 1e6 for k, f in work.items()}
totals = {k: [] for k in work}
for _ in range(samples):
    for k, f in work.items():  # the variants take turns: load on the machine hits them alike
        comm.Barrier()
        t0 = time.perf_counter()
        for _ in range(per_sample):
            f()
            comm.Allreduce(MPI.IN_PLACE, a)
        totals[k].append((time.perf_counter() - t0) / per_sample * 1e6)
med = {k: sorted(v)[len(v) // 2] for k, v in totals.items()}
if comm.rank == 0:
    print(f"# {comm.size} ranks, in-place float32 Allreduce of {nbytes} B, median of {samples} x {per_sample} calls")
    print(f"# bare loop: {med['nothing']:.1f} us per call")
    print(f"{'work before each call':32s} {'alone (us)':>10s} {'adds (us)':>10s}")
    for k in work:
        if k != "nothing":
            print(f"{k:32s} {alone[k]:10.2f} {med[k] - med['nothing']:10.1f}")
