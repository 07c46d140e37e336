"""The 1 MiB all_gather breakdown quoted in docs/benchmarks.md: what each layer adds, and what
touching memory or running Python before each call adds to the same MPI call.

    mpirun -n 2 python docs/scripts/allgather_breakdown.py
"""
import time, torch, torch.distributed as dist, hpccomm, numpy as np, warnings
warnings.filterwarnings("ignore")
torch.set_num_threads(1)
hpccomm.init_process_group()
from mpi4py import MPI
from hpccomm import _mpi
from hpccomm.ops import gather as G
c = MPI.COMM_WORLD
N = (1 << 20) // 4
o = torch.empty(2 * N); i = torch.ones(N)
ov = o.view(-1)
s64 = np.empty(1 << 16, np.uint8); s512 = np.empty(1 << 19, np.uint8)
hg = dist.distributed_c10d._get_default_group()._g
fns = dict(
  hp=lambda: dist.all_gather_into_tensor(o, i),
  raw=lambda: hg.comm.Allgather(_mpi.buffer(i), [_mpi.buffer(o)[0], N, MPI.FLOAT]),
  op=lambda: G.all_gather_single(hg, o, i)(),
  agv=lambda: G._allgatherv(hg, i, o, [N, N]),
  agvview=lambda: G._allgatherv(hg, i, o.view(-1), [N, N]),
  run1=G.all_gather_single(hg, o, i),
  agvpre=lambda: G._allgatherv(hg, i, ov, [N, N]),
  agv2=lambda: (o.view(-1), G._allgatherv(hg, i, o, [N, N])),
  spin1=lambda: (sum(range(30)), G._allgatherv(hg, i, o, [N, N])),
  spin10=lambda: (sum(range(300)), G._allgatherv(hg, i, o, [N, N])),
  touch64k=lambda: (s64.fill(0), G._allgatherv(hg, i, o, [N, N])),
  touch512k=lambda: (s512.fill(0), G._allgatherv(hg, i, o, [N, N])),
)
tot = {k: [] for k in fns}
for rep in range(30):
    for k, fn in fns.items():
        c.Barrier(); t0 = time.perf_counter()
        for _ in range(20): fn()
        tot[k].append((time.perf_counter() - t0) / 20 * 1e6)
import timeit
if c.rank == 0: print('sum30', timeit.timeit(lambda: sum(range(30)), number=10000)*100, 'us; sum300', timeit.timeit(lambda: sum(range(300)), number=10000)*100, 'fill64k', timeit.timeit(lambda: s64.fill(0), number=10000)*100, 'fill512k', timeit.timeit(lambda: s512.fill(0), number=10000)*100)
if c.rank == 0: print({k: round(sorted(v)[len(v)//2]) for k, v in tot.items()}, flush=True)
dist.destroy_process_group()
