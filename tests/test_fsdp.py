"""Training on hpccomm with torch's parallelisms, CPU tensors: FSDP2
(``fully_shard``, also HSDP on a 2-D mesh), tensor parallelism
(``parallelize_module``), torch.compile of a DDP model, and
torch.distributed.checkpoint of sharded state.

References: the same FSDP2 run on a gloo mesh (same seeds and data), a plain
model trained locally on every rank's data (each rank regenerates every
rank's batch from its seed), and the plain model run locally for tensor
parallelism.  Tolerances are stated at each comparison; they allow only for
float32 sums taken in a different order.
"""
from __future__ import annotations

import os
import shutil
import tempfile

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from helpers import Problems, same_on_all_ranks
from test_mesh import mesh_shapes, shards

pytestmark = pytest.mark.mpi

#: float32 results whose sums were taken in another order (another backend's
#: reduction, a sharded matmul): relative 1e-5, absolute 1e-6.
F32_TOL = dict(rtol=1e-5, atol=1e-6)
STEPS = 3


class Block(nn.Module):
    """A transformer-style MLP block: LayerNorm, up-projection, GELU,
    down-projection, residual."""

    def __init__(self, dim=8, hidden=12):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x):
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


def make_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(Block(), Block(), nn.Linear(8, 3))


def batch(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, 8, generator=g), torch.randn(4, 3, generator=g)


def close(a, b, **tol):
    try:
        torch.testing.assert_close(a, b, **tol)
        return True
    except AssertionError:
        return False


def train_fsdp(mesh, reshard_after_forward=True, mp_policy=None):
    """STEPS of SGD on an FSDP2 model over ``mesh``; returns the full
    parameters (every rank's batch differs)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = make_model()
    kw = dict(mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy or MixedPrecisionPolicy())
    for block in model[:2]:
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        x, y = batch(step, dist.get_rank())
        loss = nn.functional.mse_loss(model(x).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return [p.full_tensor().detach().clone() for p in model.parameters()]


def train_local(n):
    """The same training without distribution: each step averages the loss of
    all ``n`` ranks' batches (what data parallelism's gradient average computes)."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        loss = sum(nn.functional.mse_loss(model(x), y) for x, y in (batch(step, r) for r in range(n))) / n
        loss.backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def gloo_mesh(shape, names=None):
    """The same mesh over gloo groups (torch's supported way to pick another
    backend per mesh dimension: init_device_mesh's backend_override)."""
    return init_device_mesh("cpu", shape, mesh_dim_names=names,
                            backend_override={d: "gloo" for d in range(len(shape))})


@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_fsdp2_training_matches_gloo_and_local(world, reshard_after_forward):
    """FSDP2 on a 1-D hpccomm mesh: trained weights equal on every rank, equal
    to gloo's run and to local full-batch training (F32_TOL)."""
    me, n = world
    p = Problems()
    mesh = init_device_mesh("cpu", (n,))
    p.expect(dist.get_backend(mesh.get_group()) == "hpccomm", "the mesh is not hpccomm's")
    ours = train_fsdp(mesh, reshard_after_forward)
    gmesh = gloo_mesh((n,))
    p.expect(dist.get_backend(gmesh.get_group()) == "gloo", f"reference mesh: {dist.get_backend(gmesh.get_group())}")
    ref = train_fsdp(gmesh, reshard_after_forward)
    local = train_local(n)
    for k, (a, b, c) in enumerate(zip(ours, ref, local)):
        p.expect(same_on_all_ranks(a), f"parameter {k} differs between ranks")
        p.expect(close(a, b, **F32_TOL), f"parameter {k} vs gloo: max diff {(a - b).abs().max():.3g}")
        p.expect(close(a, c, **F32_TOL), f"parameter {k} vs local: max diff {(a - c).abs().max():.3g}")
    p.verdict()


def test_fsdp2_mixed_precision_matches_gloo(world):
    """MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32): bf16
    all-gathers (moved as bytes) and fp32 reduce-scatters; weights stay fp32,
    equal on every rank, and equal to gloo's run (F32_TOL: both backends compute
    the same bf16 forward and backward; only the fp32 sum order may differ)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    me, n = world
    p = Problems()
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    ours = train_fsdp(init_device_mesh("cpu", (n,)), True, mp)
    ref = train_fsdp(gloo_mesh((n,)), True, mp)
    fp32 = train_local(n)
    for k, (a, b) in enumerate(zip(ours, ref)):
        p.expect(a.dtype == torch.float32, f"parameter {k} is {a.dtype}")
        p.expect(same_on_all_ranks(a), f"parameter {k} differs between ranks")
        p.expect(close(a, b, **F32_TOL), f"parameter {k} vs gloo: max diff {(a - b).abs().max():.3g}")
    # bf16 compute really happened: the weights are near, but not equal to, the fp32 run's.
    drift = max((a - c).abs().max().item() for a, c in zip(ours, fp32))
    p.expect(0 < drift < 0.05, f"bf16 vs fp32 training drift {drift}")
    p.verdict()


def test_hsdp_on_2d_meshes(world):
    """FSDP2 over a 2-D mesh (HSDP: replicate over "dp", shard over "tp") for
    every mesh shape: equal to local full-batch training (F32_TOL)."""
    me, n = world
    p = Problems()
    local = train_local(n)
    for shape in mesh_shapes(n):
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp", "tp"))
        ours = train_fsdp(mesh)
        for k, (a, c) in enumerate(zip(ours, local)):
            p.expect(same_on_all_ranks(a), f"{shape}: parameter {k} differs between ranks")
            p.expect(close(a, c, **F32_TOL), f"{shape}: parameter {k} vs local: max diff {(a - c).abs().max():.3g}")
    p.verdict()


def _check_tp(p, tp_mesh, what):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    ref = Block()
    torch.manual_seed(0)
    block = parallelize_module(Block(), tp_mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    s, k = tp_mesh.size(), tp_mesh.get_local_rank()
    p.expect(isinstance(block.up.weight, DTensor) and block.up.weight.placements == (Shard(0),),
             f"{what}: up.weight is {type(block.up.weight).__name__}")
    p.expect(torch.equal(block.up.weight.to_local(), shards(ref.up.weight.detach(), s, 0)[k]),
             f"{what}: up.weight shard {k}")
    p.expect(block.down.weight.placements == (Shard(1),), f"{what}: down.weight {block.down.weight.placements}")
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(7))  # the same input on every rank
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    out, want = block(x1), ref(x2)
    p.expect(not isinstance(out, DTensor), f"{what}: output is a DTensor")
    p.expect(close(out, want, **F32_TOL), f"{what}: output max diff {(out - want).abs().max():.3g}")
    out.pow(2).sum().backward()
    want.pow(2).sum().backward()
    p.expect(close(x1.grad, x2.grad, **F32_TOL), f"{what}: input grad max diff {(x1.grad - x2.grad).abs().max():.3g}")
    for name, param in block.named_parameters():
        mine = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
        theirs = ref.get_parameter(name).grad
        p.expect(close(mine, theirs, **F32_TOL), f"{what}: {name}.grad max diff {(mine - theirs).abs().max():.3g}")
    p.expect(same_on_all_ranks(out.detach()), f"{what}: outputs differ between ranks")


def test_tensor_parallel_block_matches_local(world):
    """parallelize_module with ColwiseParallel (up) and RowwiseParallel (down)
    over a 1-D world mesh and over the "tp" dimension of every 2-D mesh: output,
    input gradient and parameter gradients equal the plain block's (F32_TOL)."""
    me, n = world
    p = Problems()
    _check_tp(p, init_device_mesh("cpu", (n,)), "world mesh")
    for shape in mesh_shapes(n):
        _check_tp(p, init_device_mesh("cpu", shape, mesh_dim_names=("dp", "tp"))["tp"], f"mesh {shape} [tp]")
    p.verdict()


def test_compiled_ddp_matches_eager(world):
    """torch.compile (backend aot_eager: inductor works too but compiles for
    seconds per rank, see docs/mesh.md) of a DDP model over hpccomm: the same
    weights as eager DDP after a few steps, bitwise."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    me, n = world
    p = Problems()
    eager, compiled_ddp = DDP(make_model()), DDP(make_model())
    compiled = torch.compile(compiled_ddp, backend="aot_eager")
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager, compiled_ddp)]
    for step in range(STEPS):
        x, y = batch(step, me)
        for model, opt in zip((eager, compiled), opts):
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    for k, (a, b) in enumerate(zip(eager.parameters(), compiled_ddp.parameters())):
        p.expect(torch.equal(a, b), f"parameter {k}: compiled vs eager max diff {(a - b).abs().max():.3g}")
        p.expect(same_on_all_ranks(b.detach()), f"parameter {k} differs between ranks")
    p.verdict()


def shared_tmpdir():
    """A directory made by rank 0, its path broadcast over hpccomm."""
    path = [tempfile.mkdtemp(prefix="hpccomm-dcp-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path, src=0)
    return path[0]


def test_checkpoint_sharded_state_roundtrip(world):
    """torch.distributed.checkpoint: save an FSDP2 model's sharded state dict
    and a Shard(0) DTensor, load them into a differently initialised model and
    into a DTensor with other placements (resharded on load): equal to what
    was saved, exactly."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.fsdp import fully_shard

    me, n = world
    p = Problems()
    mesh = init_device_mesh("cpu", (n,))
    model = make_model(seed=0)
    fully_shard(model, mesh=mesh)
    t = torch.arange((2 * n + 1) * 6, dtype=torch.float64).reshape(2 * n + 1, 6)
    path = shared_tmpdir()
    try:
        saved = {"model": model.state_dict(), "extra": distribute_tensor(t, mesh, [Shard(0)])}
        dcp.save(saved, checkpoint_id=path)
        other = make_model(seed=1)
        fully_shard(other, mesh=mesh)
        a, b = mesh_shapes(n)[-1 if n > 1 else 0]
        mesh2 = init_device_mesh("cpu", (a, b), mesh_dim_names=("dp", "tp"))
        loaded = {"model": other.state_dict(),
                  "extra": distribute_tensor(torch.zeros_like(t), mesh2, [Replicate(), Shard(1)])}
        p.expect(not torch.equal(loaded["model"]["0.up.weight"].full_tensor(),
                                 saved["model"]["0.up.weight"].full_tensor()), "the models start out equal")
        dcp.load(loaded, checkpoint_id=path)
        for key, value in saved["model"].items():
            got = other.state_dict()[key]
            p.expect(torch.equal(got.to_local(), value.to_local()), f"{key}: local shard differs after load")
            p.expect(torch.equal(got.full_tensor(), value.full_tensor()), f"{key}: full tensor differs after load")
        p.expect(torch.equal(loaded["extra"].full_tensor(), t), "resharded DTensor differs after load")
        p.expect(torch.equal(loaded["extra"].to_local(), shards(t, b, 1)[me % b]), "resharded local shard")
        files = sorted(os.listdir(path))
        p.expect(".metadata" in files and sum(f.endswith(".distcp") for f in files) == n, f"files: {files}")
    finally:
        dist.barrier()
        if me == 0:
            shutil.rmtree(path, ignore_errors=True)
    p.verdict()


def test_checkpoint_model_and_optimizer_resumes_training(world):
    """DCP with torch.distributed.checkpoint.state_dict: an FSDP2 model and its
    Adam state saved after one step, loaded into a model trained from another
    seed; the optimizer state equals the saved one and the next step gives
    bitwise the same weights as the original run's."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard

    me, n = world
    p = Problems()
    mesh = init_device_mesh("cpu", (n,))
    full = lambda v: v.full_tensor() if isinstance(v, DTensor) else v  # noqa: E731

    def trained(seed):
        model = make_model(seed)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        x, y = batch(seed, me)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        return model, opt

    def step(model, opt):
        x, y = batch(99, me)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()

    model, opt = trained(0)
    path = shared_tmpdir()
    try:
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
        other, other_opt = trained(1)
        state = dict(zip(("model", "optim"), get_state_dict(other, other_opt)))
        dcp.load(state, checkpoint_id=path)
        set_state_dict(other, other_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        got = get_state_dict(other, other_opt)[1]["state"]
        p.expect(sorted(got) == sorted(osd["state"]), f"optimizer state keys {sorted(got)}")
        for key, entry in osd["state"].items():
            for name, value in entry.items():
                mine = got.get(key, {}).get(name)
                p.expect(mine is not None and torch.equal(full(mine), full(value)), f"optimizer {key}.{name} differs")
        step(model, opt)
        step(other, other_opt)
        for k, (a, b) in enumerate(zip(model.parameters(), other.parameters())):
            p.expect(torch.equal(a.full_tensor(), b.full_tensor()), f"parameter {k} after the resumed step")
    finally:
        dist.barrier()
        if me == 0:
            shutil.rmtree(path, ignore_errors=True)
    p.verdict()
