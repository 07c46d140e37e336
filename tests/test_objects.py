"""Object collectives (pickled Python objects over hpccomm's tensor ops):
broadcast_object_list, all_gather_object, gather_object,
scatter_object_list, send_object_list/recv_object_list, on the world and on
the test subgroups, with roots other than 0 and objects whose pickled size
differs from rank to rank.  Each rank builds every rank's object itself
(``obj_of``) to know what it should receive."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from helpers import Problems, fill

pytestmark = pytest.mark.mpi


def obj_of(rank: int, salt: int = 0):
    """A rank's object: a dict holding a string, a list, a tensor and nested
    values, whose pickled size grows with the rank (and the salt)."""
    return {
        "rank": rank,
        "salt": salt,
        "text": f"rank {rank} says " + "x" * (37 * rank + salt),
        "list": list(range(rank * 3 + salt)),
        "tensor": fill((rank + 1, 2 + salt), torch.float32, rank, salt),
        "nested": {"ints": fill((rank + salt,), torch.int64, rank), "tuple": (rank, str(salt), None)},
        "unicode": "é" * rank + "∑" * salt,
    }


def same(a, b) -> bool:
    """Deep equality that compares tensors by dtype, shape and value."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def test_same_can_fail():
    """The comparison the tests rely on tells different objects apart."""
    assert same(obj_of(1), obj_of(1))
    assert not same(obj_of(1), obj_of(2))
    assert not same(obj_of(1, 0), obj_of(1, 1))
    changed = obj_of(1)
    changed["nested"]["ints"][0] += 1
    assert not same(obj_of(1), changed)


def roots(g):
    """Roots to try on a group (group ranks): the last one, and 0 when different."""
    return sorted({g.size - 1, 0}, reverse=True)


def test_broadcast_object_list(world, groups):
    p = Problems()
    for g in groups:
        if not g.member:
            continue
        for root in roots(g):
            src = g.ranks[root]
            objs = [obj_of(src, 1), "a plain string", obj_of(src, 2)["tensor"], None, 12345]
            mine = list(objs) if g.rank == root else [None] * len(objs)
            dist.broadcast_object_list(mine, src=src, group=g.pg)
            p.expect(same(mine, objs), f"group {g.name}, root {root}")
    p.verdict()


def test_broadcast_object_list_group_src(world, groups):
    p = Problems()
    for g in groups:
        if not g.member:
            continue
        root = g.size - 1
        size_of_root = g.ranks[root] * 1000 + 1  # a long string: size differs with the root
        objs = ["s" * size_of_root, {"k": obj_of(g.ranks[root])}]
        mine = list(objs) if g.rank == root else [None, None]
        dist.broadcast_object_list(mine, group_src=root, group=g.pg)
        p.expect(same(mine, objs), g.name)
    p.verdict()


def test_all_gather_object(world, groups):
    p = Problems()
    for g in groups:
        if not g.member:
            continue
        out = [None] * g.size
        dist.all_gather_object(out, obj_of(dist.get_rank(), 3), group=g.pg)
        for k, got in enumerate(out):
            p.expect(same(got, obj_of(g.ranks[k], 3)), f"group {g.name}: entry {k}")
    p.verdict()


def test_all_gather_object_different_types(world):
    """Ranks send objects of different types and very different sizes."""
    r, n = world
    kinds = [lambda k: "t" * (k * 5000), lambda k: {"r": k}, lambda k: torch.arange(k, dtype=torch.int32),
             lambda k: [obj_of(k)] * (k + 1)]
    out = [None] * n
    dist.all_gather_object(out, kinds[r % 4](r))
    for k in range(n):
        assert same(out[k], kinds[k % 4](k)), k


def test_gather_object(world, groups):
    p = Problems()
    for g in groups:
        if not g.member:
            continue
        for root in roots(g):
            dst = g.ranks[root]
            out = [None] * g.size if g.rank == root else None
            dist.gather_object(obj_of(dist.get_rank(), 4), out, dst=dst, group=g.pg)
            if g.rank == root:
                for k, got in enumerate(out):
                    p.expect(same(got, obj_of(g.ranks[k], 4)), f"group {g.name} root {root}: entry {k}")
    p.verdict()


def test_gather_object_group_dst(world, groups):
    p = Problems()
    for g in groups:
        if not g.member:
            continue
        root = g.size - 1
        out = [None] * g.size if g.rank == root else None
        dist.gather_object(["x" * (g.rank * 100), g.rank], out, group_dst=root, group=g.pg)
        if g.rank == root:
            p.expect(out == [["x" * (k * 100), k] for k in range(g.size)], g.name)
    p.verdict()


def test_scatter_object_list(world, groups):
    p = Problems()
    for g in groups:
        if not g.member:
            continue
        for root in roots(g):
            src = g.ranks[root]
            inputs = [obj_of(g.ranks[k], 5 + root) for k in range(g.size)] if g.rank == root else None
            out = [None]
            dist.scatter_object_list(out, inputs, src=src, group=g.pg)
            p.expect(same(out[0], obj_of(dist.get_rank(), 5 + root)), f"group {g.name} root {root}")
    p.verdict()


def test_scatter_object_list_group_src(world, groups):
    p = Problems()
    for g in groups:
        if not g.member:
            continue
        root = g.size - 1
        inputs = [{"to": k, "pad": "p" * (k * 777)} for k in range(g.size)] if g.rank == root else None
        out = [None]
        dist.scatter_object_list(out, inputs, group_src=root, group=g.pg)
        p.expect(out[0] == {"to": g.rank, "pad": "p" * (g.rank * 777)}, g.name)
    p.verdict()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("use_batch", [False, True], ids=["send", "batch"])
def test_send_recv_object_list_ring(world, use_batch):
    """Around the world ring, blocking: rank 0 sends first, the others receive first."""
    r, n = world
    prev, nxt = (r - 1) % n, (r + 1) % n
    mine = [obj_of(r, 6), "r" * (r * 321), None]
    got = [None] * 3
    if r == 0:
        dist.send_object_list(mine, dst=nxt, use_batch=use_batch)
        src = dist.recv_object_list(got, src=prev, use_batch=use_batch)
    else:
        src = dist.recv_object_list(got, src=prev, use_batch=use_batch)
        dist.send_object_list(mine, dst=nxt, use_batch=use_batch)
    assert src == prev
    assert same(got, [obj_of(prev, 6), "r" * (prev * 321), None])


def test_send_recv_object_list_subgroups(world, groups):
    """In each group of two or more ranks: the last group rank sends to group
    rank 0 (addressed by group rank), which answers (addressed by global rank)."""
    p = Problems()
    for g in groups:
        if not g.member or g.size < 2:
            continue
        first, last = g.ranks[0], g.ranks[-1]
        if g.rank == g.size - 1:
            dist.send_object_list([obj_of(last, 7), g.name], group_dst=0, group=g.pg)
            back = [None]
            p.expect(dist.recv_object_list(back, src=first, group=g.pg) == first, f"{g.name}: reply's sender")
            p.expect(same(back, [{"reply": first, "t": fill((first + 2,), torch.int8, first)}]), f"{g.name}: reply")
        elif g.rank == 0:
            got = [None, None]
            p.expect(dist.recv_object_list(got, group_src=g.size - 1, group=g.pg) == last, f"{g.name}: sender")
            p.expect(same(got, [obj_of(last, 7), g.name]), g.name)
            dist.send_object_list([{"reply": first, "t": fill((first + 2,), torch.int8, first)}], dst=last,
                                  group=g.pg)
    p.verdict()


def test_large_object(world):
    """An object of several MB (past MPI's eager limit) from the last rank."""
    r, n = world
    root = n - 1
    big = {"blob": bytes(range(256)) * (16 * 1024), "t": fill((300, 300), torch.float64, root)}
    mine = [big if r == root else None]
    dist.broadcast_object_list(mine, src=root)
    assert same(mine[0], big)
