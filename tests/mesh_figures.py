"""Figures for docs/mesh.md (not a test): max |difference| of FSDP2/HSDP training on hpccomm vs gloo and
vs local training, and compiled-vs-eager DDP step times (aot_eager, inductor).

    timeout 600 mpirun -n 4 --oversubscribe python tests/mesh_figures.py
"""
import os, sys, time; sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch, torch.distributed as dist, hpccomm
hpccomm.init_process_group()
me, n = dist.get_rank(), dist.get_world_size()
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
import test_fsdp as T
mx = lambda xs, ys: max((a - b).abs().max().item() for a, b in zip(xs, ys))
local = T.train_local(n)
for r in (True, False):
    a = T.train_fsdp(init_device_mesh("cpu", (n,)), r); b = T.train_fsdp(T.gloo_mesh((n,)), r)
    if me == 0: print(f"n={n} reshard={r}: vs gloo {mx(a,b):.3g}  vs local {mx(a,local):.3g}", flush=True)
mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
a = T.train_fsdp(init_device_mesh("cpu", (n,)), True, mp); b = T.train_fsdp(T.gloo_mesh((n,)), True, mp)
if me == 0: print(f"n={n} bf16/fp32: vs gloo {mx(a,b):.3g}  vs fp32 local {mx(a,local):.3g}", flush=True)
for shape in T.mesh_shapes(n):
    a = T.train_fsdp(init_device_mesh("cpu", shape, mesh_dim_names=("dp","tp")))
    if me == 0: print(f"n={n} HSDP {shape}: vs local {mx(a,local):.3g}", flush=True)
# inductor timing
from torch.nn.parallel import DistributedDataParallel as DDP
for backend in ("aot_eager", "inductor"):
    torch._dynamo.reset()
    m = DDP(T.make_model()); c = torch.compile(m, backend=backend); e = DDP(T.make_model())
    oc = torch.optim.SGD(m.parameters(), lr=0.1); oe = torch.optim.SGD(e.parameters(), lr=0.1)
    times = []
    for step in range(3):
        x, y = T.batch(step, me)
        t = time.perf_counter(); torch.nn.functional.mse_loss(c(x), y).backward(); oc.step(); oc.zero_grad(); times.append(time.perf_counter() - t)
        torch.nn.functional.mse_loss(e(x), y).backward(); oe.step(); oe.zero_grad()
    d = mx(list(m.parameters()), list(e.parameters()))
    if me == 0: print(f"n={n} compile {backend}: step times {[round(x,3) for x in times]} s, max diff vs eager {d:.3g}", flush=True)
dist.destroy_process_group()
