"""DeviceMesh, functional collectives and DTensor on hpccomm (CPU tensors).

Meshes are 2-D, one per factorisation ``a x b`` of the world size (at 4 ranks:
1x4, 2x2, 4x1; at 3: 1x3, 3x1; at 2: 1x2, 2x1; at 1: 1x1), so every test runs
at every world size.  Mesh coordinates are row-major: rank ``r`` sits at
``(r // b, r % b)``; the "dp" dimension joins the ranks of one column, "tp" the
ranks of one row.  Expected values are computed on each rank from the member
ranks alone; small integers in float tensors keep every sum exact, so the
checks are equalities.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

import hpccomm
from helpers import Problems
from test_groups import check_collectives, check_mpi_comm, check_translation

pytestmark = pytest.mark.mpi


def mesh_shapes(n):
    """Every 2-D shape ``(a, b)`` with ``a * b == n``."""
    return [(a, n // a) for a in range(1, n + 1) if n % a == 0]


def dim_ranks(shape, dim):
    """The global ranks of this rank's group along mesh dimension ``dim``
    (0: same column, "dp"; 1: same row, "tp"), in mesh order."""
    a, b = shape
    i, j = divmod(dist.get_rank(), b)
    return [k * b + j for k in range(a)] if dim == 0 else [i * b + k for k in range(b)]


def shards(x, s, dim):
    """The ``s`` pieces DTensor's Shard(dim) gives ``x`` (torch.chunk's, then
    empty ones where torch.chunk returns fewer than ``s``)."""
    pieces = list(torch.chunk(x, s, dim=dim))
    return pieces + [x.narrow(dim, 0, 0)] * (s - len(pieces))


def make_mesh(shape):
    return init_device_mesh("cpu", shape, mesh_dim_names=("dp", "tp"))


def test_init_device_mesh_dims_are_hpccomm_communicators(world):
    """Each mesh dimension's group is an hpccomm group on its own MPI
    communicator over the right world ranks; sub-meshes and coordinates agree."""
    me, n = world
    p = Problems()
    for shape in mesh_shapes(n):
        mesh = make_mesh(shape)
        a, b = shape
        p.expect(list(mesh.get_coordinate()) == [me // b, me % b], f"{shape}: coordinate {mesh.get_coordinate()}")
        p.expect(mesh.mesh.tolist() == [[i * b + j for j in range(b)] for i in range(a)], f"{shape}: {mesh.mesh}")
        for dim, name in enumerate(("dp", "tp")):
            ranks = dim_ranks(shape, dim)
            pg = mesh.get_group(name)
            p.expect(pg is mesh.get_group(dim), f"{shape}: get_group({name!r}) is not get_group({dim})")
            p.expect(dist.get_backend(pg) == "hpccomm", f"{shape} {name}: backend {dist.get_backend(pg)}")
            check_translation(p, pg, ranks)
            check_mpi_comm(p, pg, ranks)
            check_collectives(p, pg, ranks, salt=dim)
            sub = mesh[name]  # a 1-D sub-mesh over the same group
            p.expect(sub.mesh.tolist() == ranks and sub.mesh_dim_names == (name,), f"{shape}: mesh[{name!r}] {sub}")
            p.expect(sub.get_group() is pg, f"{shape}: mesh[{name!r}].get_group() is another group")
            p.expect(sub.get_local_rank() == ranks.index(me), f"{shape}: local rank {sub.get_local_rank()}")
        both = mesh["dp", "tp"]
        p.expect(both.mesh.tolist() == mesh.mesh.tolist(), f"{shape}: mesh['dp', 'tp'] {both}")
        flat = mesh._flatten("dp_tp") if hasattr(mesh, "_flatten") else None
        if flat is not None:  # the flattened dimension is a group over the whole world
            check_translation(p, flat.get_group(), list(range(n)))
            check_mpi_comm(p, flat.get_group(), list(range(n)))
    p.verdict()


def test_mesh_from_an_hpccomm_group(world):
    """DeviceMesh.from_group over an hpccomm subgroup (the world's even ranks)."""
    me, n = world
    evens = list(range(0, n, 2))
    pg = dist.new_group(evens)
    p = Problems()
    if me in evens:
        mesh = DeviceMesh.from_group(pg, "cpu", mesh_dim_names=("x",))
        p.expect(mesh.mesh.tolist() == evens and mesh.get_group() is pg, f"from_group: {mesh}")
        out = done(funcol.all_reduce(torch.full((3,), float(me + 1)), "sum", mesh))
        p.expect(out.tolist() == [float(sum(r + 1 for r in evens))] * 3, f"all_reduce on the mesh: {out}")
    p.verdict()


def done(t):
    """The value of a functional collective's result (an AsyncCollectiveTensor,
    or a plain tensor where torch skipped the communication)."""
    return t.wait() if isinstance(t, funcol.AsyncCollectiveTensor) else t


def _check_funcol(p, group, ranks, what):
    """The four functional collectives over ``group`` (a process group or a
    ``(mesh, dim)`` pair) whose members are ``ranks``."""
    me = dist.get_rank()
    s, k = len(ranks), ranks.index(me)
    x = torch.arange(6, dtype=torch.float32).reshape(2, 3) + 10 * me
    out = done(funcol.all_reduce(x, "sum", group))
    want = s * torch.arange(6, dtype=torch.float32).reshape(2, 3) + 10 * sum(ranks)
    p.expect(torch.equal(out, want), f"{what}: all_reduce {out.tolist()} != {want.tolist()}")
    out = done(funcol.all_reduce(x, "max", group))
    p.expect(torch.equal(out, x - 10 * me + 10 * max(ranks)), f"{what}: all_reduce max {out.tolist()}")
    for dim in (0, 1):
        want = torch.cat([x - 10 * me + 10 * g for g in ranks], dim=dim)
        out = done(funcol.all_gather_tensor(x, dim, group))
        p.expect(torch.equal(out, want), f"{what}: all_gather_tensor dim {dim} {out.tolist()}")
        out = done(funcol.all_gather_single(x, dim, group))  # torch 2.13's new name
        p.expect(torch.equal(out, want), f"{what}: all_gather_single dim {dim} {out.tolist()}")
    y = torch.arange(2 * s * 3, dtype=torch.float64).reshape(2 * s, 3) + me
    out = done(funcol.reduce_scatter_tensor(y, "sum", 0, group))
    want = s * (torch.arange(2 * s * 3, dtype=torch.float64).reshape(2 * s, 3)[2 * k:2 * k + 2]) + sum(ranks)
    p.expect(torch.equal(out, want), f"{what}: reduce_scatter_tensor {out.tolist()} != {want.tolist()}")
    out = done(funcol.reduce_scatter_single(y, "sum", 0, group))
    p.expect(torch.equal(out, want), f"{what}: reduce_scatter_single {out.tolist()} != {want.tolist()}")
    # all_to_all_single, even splits: block d of each input goes to member d.
    z = torch.stack([torch.full((2,), 100.0 * me + d) for d in range(s)]).reshape(-1)
    out = done(funcol.all_to_all_single(z, None, None, group))
    want = torch.stack([torch.full((2,), 100.0 * g + k) for g in ranks]).reshape(-1)
    p.expect(torch.equal(out, want), f"{what}: all_to_all_single {out.tolist()} != {want.tolist()}")
    # uneven splits: member d gets d + 1 elements from everyone.
    z = torch.cat([torch.full((d + 1,), 100 * me + d, dtype=torch.int64) for d in range(s)])
    out = done(funcol.all_to_all_single(z, [k + 1] * s, [d + 1 for d in range(s)], group))
    want = torch.cat([torch.full((k + 1,), 100 * g + k, dtype=torch.int64) for g in ranks])
    p.expect(torch.equal(out, want), f"{what}: all_to_all_single uneven {out.tolist()} != {want.tolist()}")


def test_functional_collectives(world):
    """all_reduce, all_gather_tensor/all_gather_single,
    reduce_scatter_tensor/reduce_scatter_single and all_to_all_single
    on the world group, on hpccomm subgroups, on each dimension of every mesh
    (as ``(mesh, dim)``) and on a 1-D sub-mesh."""
    me, n = world
    p = Problems()
    _check_funcol(p, dist.group.WORLD, list(range(n)), "world")
    tail = list(range(n - 1, -1, -2))[::-1]  # odd-offset ranks ending with the last
    pg = dist.new_group(tail)
    if me in tail:
        _check_funcol(p, pg, tail, f"group {tail}")
        _check_funcol(p, pg.group_name, tail, f"group {tail} by name")
    for shape in mesh_shapes(n):
        mesh = make_mesh(shape)
        for dim, name in enumerate(("dp", "tp")):
            ranks = dim_ranks(shape, dim)
            _check_funcol(p, (mesh, dim), ranks, f"mesh {shape} dim {name}")
            _check_funcol(p, mesh[name], ranks, f"mesh {shape} sub-mesh {name}")
    p.verdict()


def test_functional_collectives_are_differentiable_and_traceable(world):
    """The autograd-aware functional all_reduce, and a functional collective
    inside torch.compile (aot_eager): results as in eager."""
    from torch.distributed.nn.functional import all_reduce as ad_all_reduce

    me, n = world
    p = Problems()
    x = torch.full((3,), float(me + 1), requires_grad=True)
    y = ad_all_reduce(x * (me + 1))  # sum over ranks of (r + 1)^2
    p.expect(y.tolist() == [float(sum((r + 1) ** 2 for r in range(n)))] * 3, f"autograd all_reduce {y}")
    y.sum().backward()  # d/dx_me = (me + 1) * sum over ranks of the upstream grad (1 each)
    p.expect(x.grad.tolist() == [float((me + 1) * n)] * 3, f"autograd all_reduce grad {x.grad}")

    group = dist.group.WORLD.group_name

    def f(t):
        return funcol.all_reduce(t * 2, "sum", group) + 1

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    t = torch.arange(4, dtype=torch.float32) + me
    out = compiled(t)
    want = 2 * (n * torch.arange(4, dtype=torch.float32) + n * (n - 1) / 2) + 1
    p.expect(torch.equal(out, want), f"compiled funcol {out.tolist()} != {want.tolist()}")
    p.verdict()


def _check_dtensor(p, mesh, what):
    """distribute_tensor, redistribute among Shard, Replicate and Partial, and
    full_tensor on a 1-D ``mesh``; the global tensor has 2n + 1 rows, so Shard(0)
    is uneven (torch pads the last shards)."""
    me = dist.get_rank()
    s, k = mesh.size(), mesh.get_local_rank()
    t = torch.arange((2 * s + 1) * 3, dtype=torch.float32).reshape(2 * s + 1, 3)
    d = distribute_tensor(t, mesh, [Shard(0)])
    p.expect(torch.equal(d.to_local(), shards(t, s, 0)[k]), f"{what}: Shard(0) local {d.to_local().tolist()}")
    p.expect(torch.equal(d.full_tensor(), t), f"{what}: Shard(0).full_tensor()")
    r = d.redistribute(mesh, [Replicate()])
    p.expect(torch.equal(r.to_local(), t), f"{what}: Shard(0) -> Replicate")
    s1 = r.redistribute(mesh, [Shard(1)])
    p.expect(torch.equal(s1.to_local(), shards(t, s, 1)[k]), f"{what}: Replicate -> Shard(1) {s1.to_local().tolist()}")
    s0 = s1.redistribute(mesh, [Shard(0)])  # torch does Shard -> Shard on CPU as all_gather + chunk
    p.expect(torch.equal(s0.to_local(), shards(t, s, 0)[k]), f"{what}: Shard(1) -> Shard(0) {s0.to_local().tolist()}")
    # Partial: each member holds (its mesh index + 1) * t; the sum is t * s(s+1)/2.
    part = DTensor.from_local(t * (k + 1), mesh, [Partial()])
    total = t * (s * (s + 1) // 2)
    p.expect(torch.equal(part.full_tensor(), total), f"{what}: Partial.full_tensor()")
    p.expect(torch.equal(part.redistribute(mesh, [Replicate()]).to_local(), total), f"{what}: Partial -> Replicate")
    ps = part.redistribute(mesh, [Shard(0)])
    p.expect(torch.equal(ps.to_local(), shards(total, s, 0)[k]), f"{what}: Partial -> Shard(0) {ps.to_local().tolist()}")
    # DTensor arithmetic: a sharded matmul against a replicated matrix, then a sum.
    w = distribute_tensor(torch.eye(3) * 2, mesh, [Replicate()])
    out = (d @ w).sum()
    p.expect(out.full_tensor().item() == float(2 * t.sum()), f"{what}: (d @ w).sum() = {out.full_tensor()}")
    del me


def test_dtensor_redistribute(world):
    """DTensor on a 1-D world mesh and on each dimension of every 2-D mesh."""
    me, n = world
    p = Problems()
    _check_dtensor(p, init_device_mesh("cpu", (n,)), "world mesh")
    for shape in mesh_shapes(n):
        mesh = make_mesh(shape)
        for name in ("dp", "tp"):
            _check_dtensor(p, mesh[name], f"mesh {shape} [{name}]")
    p.verdict()


def test_dtensor_on_a_2d_mesh(world):
    """Two placements at once: Shard(0) x Shard(1), Replicate x Shard(0),
    Partial x Shard(1), and back to full tensors."""
    me, n = world
    p = Problems()
    for shape in mesh_shapes(n):
        mesh = make_mesh(shape)
        a, b = shape
        i, j = divmod(me, b)
        t = torch.arange((2 * a) * (3 * b), dtype=torch.float64).reshape(2 * a, 3 * b)
        d = distribute_tensor(t, mesh, [Shard(0), Shard(1)])
        p.expect(torch.equal(d.to_local(), t[2 * i:2 * i + 2, 3 * j:3 * j + 3]), f"{shape}: S0xS1 local")
        p.expect(torch.equal(d.full_tensor(), t), f"{shape}: S0xS1 full")
        r = d.redistribute(mesh, [Replicate(), Shard(0)])
        p.expect(torch.equal(r.to_local(), shards(t, b, 0)[j]), f"{shape}: R x S0 local {r.to_local().shape}")
        part = DTensor.from_local(torch.chunk(t, b, 1)[j] * (i + 1), mesh, [Partial(), Shard(1)])
        full = part.full_tensor()
        p.expect(torch.equal(full, t * (a * (a + 1) // 2)), f"{shape}: P x S1 full")
    p.verdict()


def test_hpccomm_groups_are_what_torch_resolves(world):
    """torch's group-name registry resolves a mesh dimension's name back to the
    very hpccomm group object (what the C++ functional ops go through)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    me, n = world
    p = Problems()
    for shape in mesh_shapes(n):
        mesh = make_mesh(shape)
        for name in ("dp", "tp"):
            pg = mesh.get_group(name)
            p.expect(dist.get_backend(pg) == "hpccomm", f"{shape} {name}: {dist.get_backend(pg)}")
            p.expect(_resolve_process_group(pg.group_name) is pg, f"{shape} {name}: name {pg.group_name!r}")
    p.verdict()
