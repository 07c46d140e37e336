"""Process groups: new_group (any rank order, sort_ranks=False, local
synchronisation), new_subgroups, new_subgroups_by_enumeration, rank
translation, interleaved use of several groups, hpccomm.from_mpi4py, a gloo
group beside the hpccomm world, the MPI communicator behind each group, and
use after destroy_process_group(group).  The world group is never destroyed
here."""
from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist

import hpccomm
from helpers import Problems, R, fill, raised_by, realign_group_counter

pytestmark = pytest.mark.mpi

NON_MEMBER = dist.GroupMember.NON_GROUP_MEMBER


def first_and_last(n):
    """Global ranks n-1 and 0, in that (reverse) order: non-consecutive when n > 2."""
    return [n - 1, 0] if n > 1 else [0]


def check_translation(p, pg, ranks):
    """torch's view of a group whose members are ``ranks`` (global, in group-rank order)."""
    me = dist.get_rank()
    p.expect(dist.get_process_group_ranks(pg) == ranks, f"get_process_group_ranks: {dist.get_process_group_ranks(pg)}"
             f" != {ranks}")
    p.expect(dist.get_world_size(pg) == len(ranks), f"get_world_size {dist.get_world_size(pg)} != {len(ranks)}")
    p.expect(dist.get_rank(pg) == ranks.index(me), f"get_rank {dist.get_rank(pg)} != {ranks.index(me)}")
    p.expect(pg.rank() == ranks.index(me) and pg.size() == len(ranks), f"pg.rank/size {pg.rank()}/{pg.size()}")
    for k, g in enumerate(ranks):
        p.expect(dist.get_group_rank(pg, g) == k, f"get_group_rank(pg, {g}) != {k}")
        p.expect(dist.get_global_rank(pg, k) == g, f"get_global_rank(pg, {k}) != {g}")
    for g in range(dist.get_world_size()):
        if g not in ranks:
            exc = raised_by(lambda: dist.get_group_rank(pg, g))
            p.expect(isinstance(exc, ValueError) and "not part of group" in str(exc),
                     f"get_group_rank(pg, {g}) of a non-member: {exc!r}")


def check_mpi_comm(p, pg, ranks):
    """The group runs on its own MPI communicator over exactly ``ranks``."""
    from mpi4py import MPI

    p.expect(dist.get_backend(pg) == "hpccomm", f"not an hpccomm group: {pg!r} ({dist.get_backend(pg)})")
    comm = hpccomm.mpi_comm(pg)
    if not isinstance(comm, MPI.Intracomm):
        p.expect(False, f"mpi_comm is {comm!r}")
        return
    p.expect(comm.Get_size() == len(ranks) == pg.size(), f"communicator size {comm.Get_size()} != {len(ranks)}")
    p.expect(comm.Get_rank() == ranks.index(dist.get_rank()), f"communicator rank {comm.Get_rank()}")
    p.expect(MPI.Comm.Compare(comm, MPI.COMM_WORLD) != MPI.IDENT, "the group uses COMM_WORLD itself")
    mine, world = comm.Get_group(), MPI.COMM_WORLD.Get_group()
    try:
        members = mine.Translate_ranks(list(range(comm.Get_size())), world)
        p.expect(members == ranks, f"the communicator holds world ranks {members}, not {ranks}")
    finally:
        mine.Free()
        world.Free()


def check_collectives(p, pg, ranks, salt=0):
    """all_reduce, all_gather and broadcast on ``pg`` give what ``ranks`` imply."""
    me = dist.get_rank()
    t = torch.tensor([me + 1 + salt, 10 * me], dtype=torch.int64)
    dist.all_reduce(t, group=pg)
    p.expect(t.tolist() == [sum(g + 1 + salt for g in ranks), sum(10 * g for g in ranks)],
             f"all_reduce over {ranks}: {t.tolist()}")
    out = [torch.zeros(3, dtype=torch.int32) for _ in ranks]
    dist.all_gather(out, fill((3,), torch.int32, me, salt), group=pg)
    for k, g in enumerate(ranks):
        p.expect(torch.equal(out[k], fill((3,), torch.int32, g, salt)), f"all_gather entry {k} is not rank {g}'s")
    root = ranks[-1]
    b = fill((4,), torch.float64, me, salt)
    dist.broadcast(b, src=root, group=pg)
    p.expect(torch.equal(b, fill((4,), torch.float64, root, salt)), f"broadcast from {root} over {ranks}")


def check_all(p, pg, ranks, salt=0):
    check_translation(p, pg, ranks)
    check_mpi_comm(p, pg, ranks)
    check_collectives(p, pg, ranks, salt)


# -- new_group ----------------------------------------------------------------------------------

def test_world_group(world):
    r, n = world
    p = Problems()
    check_translation(p, dist.group.WORLD, list(range(n)))
    check_mpi_comm(p, dist.group.WORLD, list(range(n)))
    p.verdict()


def test_fixture_groups_backed_by_mpi(world, groups):
    p = Problems()
    for g in groups:
        if g.member:
            check_all(p, g.pg, g.ranks)
    p.verdict()


def test_new_group_any_order(world):
    """Ranks given in reverse, non-consecutive: group ranks follow global order."""
    r, n = world
    given = first_and_last(n)
    pg = dist.new_group(given)
    ranks = sorted(given)
    if r not in ranks:
        assert pg is NON_MEMBER and dist.get_rank(pg) == -1
        return
    p = Problems()
    check_all(p, pg, ranks)
    p.verdict()


def test_new_group_unsorted_ranks(world):
    """sort_ranks=False: group rank k is the k-th rank given."""
    r, n = world
    given = first_and_last(n)
    pg = dist.new_group(given, sort_ranks=False)
    if r not in given:
        assert pg is NON_MEMBER
        return
    p = Problems()
    check_all(p, pg, given, salt=1)
    p.verdict()


def test_new_group_all_shapes(world):
    """Every subset of the world's ranks (15 at size 4), given in reverse,
    each checked by its members: every rank creates every group, in the same order."""
    r, n = world
    made = []
    for mask in range(1, 2 ** n):
        ranks = [k for k in range(n) if mask >> k & 1]
        made.append((ranks, dist.new_group(list(reversed(ranks)))))
    p = Problems()
    for ranks, pg in made:
        if r in ranks:
            check_all(p, pg, ranks, salt=len(ranks))
        else:
            p.expect(pg is NON_MEMBER, f"non-member of {ranks} got {pg!r}")
    p.verdict()


# -- new_subgroups -------------------------------------------------------------------------------

def test_new_subgroups(world):
    r, n = world
    p = Problems()
    for size in [d for d in range(1, n + 1) if n % d == 0]:
        cur, subgroups = dist.new_subgroups(group_size=size)
        p.expect(len(subgroups) == n // size, f"group_size {size}: {len(subgroups)} subgroups")
        ranks = list(range(r // size * size, r // size * size + size))
        check_all(p, cur, ranks, salt=size)
        p.expect(dist.get_process_group_ranks(subgroups[r // size]) == ranks, f"group_size {size}: my subgroup")
    p.verdict()


def test_new_subgroups_by_enumeration(world):
    """Subgroups given as lists in any order; at size 4 rank 2 is in none."""
    r, n = world
    spec = [first_and_last(n)] + ([[1]] if n >= 3 else [])
    cur, subgroups = dist.new_subgroups_by_enumeration(spec)
    p = Problems()
    p.expect(len(subgroups) == len(spec), f"{len(subgroups)} subgroups for {spec}")
    mine = [sorted(s) for s in spec if r in s]
    if not mine:
        p.expect(cur is None and n == 4 and r == 2, f"rank {r} in no subgroup got {cur!r}")
    else:
        check_all(p, cur, mine[0], salt=3)
    check_collectives(p, dist.group.WORLD, list(range(n)), salt=4)  # the world still works beside them
    p.verdict()


# -- interleaving ----------------------------------------------------------------------------------

def test_world_and_subgroup_interleaved(world):
    """A subgroup made from ranks, then ops alternating between it and the world."""
    r, n = world
    given = first_and_last(n)
    sub = dist.new_group(given)
    ranks = sorted(given)
    prev, nxt = (r - 1) % n, (r + 1) % n
    p = Problems()
    for i in range(4):
        t = torch.tensor([float(r + i)])
        dist.all_reduce(t)
        p.expect(t.item() == sum(k + i for k in range(n)), f"round {i}: world all_reduce {t.item()}")
        if r in ranks:
            u = torch.tensor([r * 100 + i], dtype=torch.int64)
            dist.all_reduce(u, op=R.MAX, group=sub)
            p.expect(u.item() == max(ranks) * 100 + i, f"round {i}: subgroup all_reduce {u.item()}")
            k, m = ranks.index(r), len(ranks)
            got = torch.zeros(2, dtype=torch.int64)
            works = [dist.irecv(got, group_src=(k - 1) % m, group=sub, tag=i),
                     dist.isend(fill((2,), torch.int64, r, i), group_dst=(k + 1) % m, group=sub, tag=i)]
        w = torch.zeros(2, dtype=torch.int64)
        world_works = [dist.irecv(w, src=prev, tag=i), dist.isend(fill((2,), torch.int64, r, 9 + i), dst=nxt, tag=i)]
        out = [torch.zeros(1) for _ in range(n)]
        dist.all_gather(out, torch.tensor([float(r * i)]))
        p.expect([o.item() for o in out] == [float(k * i) for k in range(n)], f"round {i}: world all_gather")
        for x in world_works:
            x.wait()
        p.expect(torch.equal(w, fill((2,), torch.int64, prev, 9 + i)), f"round {i}: world p2p")
        if r in ranks:
            for x in works:
                x.wait()
            p.expect(torch.equal(got, fill((2,), torch.int64, ranks[(k - 1) % m], i)), f"round {i}: subgroup p2p")
            check_collectives(p, sub, ranks, salt=i)
        dist.barrier()
    p.verdict()


def test_collectives_on_several_groups_interleaved(world, groups):
    """Round after round over every test group (they overlap at some sizes)."""
    r, n = world
    p = Problems()
    for i in range(3):
        for g in groups:
            if not g.member:
                continue
            t = torch.tensor([r + i], dtype=torch.int64)
            dist.all_reduce(t, group=g.pg)
            p.expect(t.item() == sum(k + i for k in g.ranks), f"round {i}, {g.name}: all_reduce")
            b = torch.tensor([r * 7 + i], dtype=torch.int64)
            root = g.ranks[i % g.size]
            dist.broadcast(b, src=root, group=g.pg)
            p.expect(b.item() == root * 7 + i, f"round {i}, {g.name}: broadcast")
    p.verdict()


def test_async_collectives_on_several_groups(world, groups):
    """async_op=True all_reduces on every test group, all waited on at the end."""
    r, n = world
    works, checks = [], []
    for g in groups:
        if g.member:
            t = torch.tensor([float(r + 1)])
            works.append(dist.all_reduce(t, group=g.pg, async_op=True))
            checks.append((g, t))
    for w in works:
        w.wait()
    for g, t in checks:
        assert t.item() == sum(k + 1 for k in g.ranks), g.name


# -- local synchronisation ---------------------------------------------------------------------------
# torch names a group made with use_local_synchronization=True after its
# ranks AND the number of groups the calling rank already belongs to
# (distributed_c10d._hash_ranks_to_str), so members with different group
# histories get different names and group_ids.  gloo hangs then (its store
# prefix differs); hpccomm must not depend on the name agreeing (it derives
# its MPI_Comm_create_group tag from the ranks alone).

def groups_held():
    """How many process groups each world rank belongs to (raw MPI, every rank calls)."""
    from torch.distributed.distributed_c10d import _world

    from helpers import verdict_comm

    return verdict_comm().allgather(len(_world.pg_names))


def test_new_group_local_synchronization(world):
    """Only the members call new_group; the others go straight on to the barrier."""
    r, n = world
    held = groups_held()
    classes = {}
    for k, h in enumerate(held):
        classes.setdefault(h, []).append(k)
    ranks = max(classes.values(), key=lambda c: (len(c), c[-1]))  # members that agree on the name
    p = Problems()
    if r in ranks:
        pg = dist.new_group(list(reversed(ranks)), use_local_synchronization=True)
        check_all(p, pg, ranks, salt=5)
    dist.barrier()
    realign_group_counter()
    p.verdict()


def test_disjoint_groups_made_at_once_with_local_synchronization(world):
    """Ranks make their own disjoint groups (by parity, and by group history
    so that members agree on torch's name) at the same time."""
    r, n = world
    held = groups_held()
    ranks = [k for k in range(n) if k % 2 == r % 2 and held[k] == held[r]]
    pg = dist.new_group(list(reversed(ranks)), use_local_synchronization=True)
    p = Problems()
    check_all(p, pg, ranks, salt=6)
    t = torch.tensor([1.0])
    dist.all_reduce(t)  # the world is unaffected
    p.expect(t.item() == n, f"world all_reduce {t.item()}")
    realign_group_counter()
    p.verdict()


def test_local_synchronization_members_with_different_histories(world):
    """Members that hold different numbers of groups (so torch gives them
    different names for the new group) still make it together."""
    r, n = world
    held = groups_held()
    if held[0] == held[n - 1]:
        dist.new_group([0])  # every rank calls it: rank 0 now holds one group more than rank n-1
    ranks = sorted({0, n - 1})
    p = Problems()
    held = groups_held()
    p.expect(n == 1 or held[0] != held[n - 1], f"group histories do not differ: {held}")
    if r in ranks:
        pg = dist.new_group(ranks, use_local_synchronization=True)
        check_all(p, pg, ranks, salt=10)
    dist.barrier()
    realign_group_counter()
    p.verdict()


# -- from_mpi4py ---------------------------------------------------------------------------------------

def test_from_mpi4py_split_by_parity(world):
    from mpi4py import MPI

    r, n = world
    ranks = [k for k in range(n) if k % 2 == r % 2]
    sub = MPI.COMM_WORLD.Split(color=r % 2, key=r)
    p = Problems()
    try:
        pg = hpccomm.from_mpi4py(sub)
        check_all(p, pg, ranks, salt=7)
        p.expect(MPI.Comm.Compare(hpccomm.mpi_comm(pg), sub) != MPI.IDENT, "the group uses the user's communicator")
        t = torch.full((5,), float(r))
        dist.all_reduce(t, op=R.MAX, group=pg)
        p.expect(torch.all(t == max(ranks)), f"MAX over {ranks}: {t}")
    finally:
        sub.Free()
    p.verdict()


def test_from_mpi4py_reversed_key_follows_world_order(world):
    """A communicator whose ranks run opposite to the world's: the torch
    group's ranks still follow world-rank order (as new_group's do)."""
    from mpi4py import MPI

    r, n = world
    ranks = [k for k in range(n) if k % 2 == r % 2]
    rev = MPI.COMM_WORLD.Split(color=r % 2, key=n - r)
    p = Problems()
    try:
        p.expect(rev.Get_rank() == len(ranks) - 1 - ranks.index(r), "the user's communicator is not reversed")
        pg = hpccomm.from_mpi4py(rev)
        p.expect(dist.get_rank(pg) == ranks.index(r), f"group rank {dist.get_rank(pg)}")
        check_translation(p, pg, ranks)
        check_mpi_comm(p, pg, ranks)
        out = [torch.zeros(2, dtype=torch.int64) for _ in ranks]
        dist.all_gather(out, torch.tensor([r, r * r]), group=pg)
        p.expect([o.tolist() for o in out] == [[k, k * k] for k in ranks], f"all_gather {out}")
        t = torch.tensor([float(r + 1)])
        dist.all_reduce(t, group=pg)
        p.expect(t.item() == sum(k + 1 for k in ranks), f"all_reduce {t.item()}")
    finally:
        rev.Free()
    p.verdict()


def test_from_mpi4py_world(world):
    from mpi4py import MPI

    r, n = world
    pg = hpccomm.from_mpi4py(MPI.COMM_WORLD)
    p = Problems()
    check_all(p, pg, list(range(n)), salt=8)
    p.verdict()


def test_from_mpi4py_on_some_ranks_keeps_torch_group_names_aligned(world):
    """Groups made by their members only (rank 0, twice, from COMM_SELF):
    torch >= 2.14 salts such a group's name with its per-process group
    counter, which then moved on rank 0 only, and the next default-named
    gloo group every rank makes hung (its rendezvous is by name).  The
    counters stay equal on every rank, and the gloo group works."""
    from mpi4py import MPI
    from torch.distributed.distributed_c10d import _world

    from helpers import verdict_comm

    r, n = world
    p = Problems()
    if r == 0:
        first, second = hpccomm.from_mpi4py(MPI.COMM_SELF), hpccomm.from_mpi4py(MPI.COMM_SELF)
        p.expect(first.group_name != second.group_name, f"one name for two groups: {first.group_name}")
        for pg in (first, second):
            t = torch.tensor([7.0])
            dist.all_reduce(t, group=pg)
            p.expect(t.item() == 7.0, f"all_reduce alone {t.item()}")
    counts = verdict_comm().allgather(_world.group_count)
    p.expect(len(set(counts)) == 1, f"torch's group counters differ between ranks: {counts}")
    if len(set(counts)) == 1:  # else the gloo rendezvous below would wait forever
        gloo = dist.new_group(backend="gloo")
        t = torch.tensor([float(r + 1)])
        dist.all_reduce(t, group=gloo)
        p.expect(t.item() == n * (n + 1) / 2, f"gloo all_reduce {t.item()}")
        dist.destroy_process_group(gloo)
    p.verdict()


# -- gloo beside hpccomm --------------------------------------------------------------------------------

GLOO_CASES = [(d, o) for d in (torch.float32, torch.int64) for o in ("SUM", "MAX", "MIN", "PRODUCT")]


@pytest.fixture(scope="module")
def gloo_groups(world):
    """A gloo group over the world and one over the even ranks, with the
    hpccomm group over the same ranks (every rank calls new_group)."""
    r, n = world
    even = [k for k in range(n) if k % 2 == 0]
    everyone = dist.new_group(backend="gloo")
    evens = dist.new_group(even, backend="gloo")
    hp_evens = dist.new_group(even)
    return [(list(range(n)), everyone, dist.group.WORLD), (even, evens, hp_evens)]


@pytest.mark.parametrize("dtype,opname", GLOO_CASES, ids=[f"{str(d)[6:]}-{o}" for d, o in GLOO_CASES])
def test_gloo_and_hpccomm_agree(world, gloo_groups, dtype, opname):
    r, n = world
    op = getattr(R, opname)
    p = Problems()
    for ranks, gloo_pg, hp_pg in gloo_groups:
        if r not in ranks:
            continue
        p.expect(dist.get_backend(gloo_pg) == "gloo" and dist.get_backend(hp_pg) == "hpccomm", "backends")
        mine = fill((2, 5), dtype, r)
        a, b = mine.clone(), mine.clone()
        dist.all_reduce(a, op=op, group=gloo_pg)
        dist.all_reduce(b, op=op, group=hp_pg)
        values = torch.stack([fill((2, 5), dtype, k).to(torch.float64) for k in ranks])
        expected = {"SUM": values.sum(0), "MAX": values.amax(0), "MIN": values.amin(0),
                    "PRODUCT": values.prod(0)}[opname].to(dtype)
        p.expect(torch.equal(a, expected), f"gloo {opname} on {ranks}: {a}")
        p.expect(torch.equal(b, expected), f"hpccomm {opname} on {ranks}: {b}")
        p.expect(torch.equal(a, b), f"{opname} on {ranks}: gloo and hpccomm differ")
    p.verdict()


def test_gloo_group_has_no_mpi_comm(world, gloo_groups):
    _, gloo_pg, _ = gloo_groups[0]
    t = torch.tensor([1.0])
    dist.all_reduce(t, group=gloo_pg)
    assert dist.get_backend(gloo_pg) == "gloo"
    with pytest.raises(hpccomm.HpccommError, match=r"is not an hpccomm process group \(its backend is 'gloo'\)"):
        hpccomm.mpi_comm(gloo_pg)
    assert t.item() == dist.get_world_size()


# -- destroyed groups -------------------------------------------------------------------------------------

def test_ops_after_destroy_raise(world):
    """After destroy_process_group(group): its communicator is freed, torch
    refuses the group, and the group's own methods raise, naming the op."""
    r, n = world
    given = first_and_last(n)
    pg = dist.new_group(given)
    ranks = sorted(given)
    p = Problems()
    if r in ranks:
        check_collectives(p, pg, ranks)
        dist.destroy_process_group(pg)
        p.expect(hpccomm.mpi_comm(pg) is None, "destroy did not free the group's communicator")
        t = torch.ones(3)
        exc = raised_by(lambda: dist.all_reduce(t, group=pg))  # torch no longer knows the group
        p.expect(isinstance(exc, ValueError) and "not initialized in the world group map" in str(exc),
                 f"dist.all_reduce on a destroyed group: {exc!r}")
        for name, call in [("all_reduce", lambda: pg.allreduce([t])),
                           ("broadcast", lambda: pg.broadcast([t], dist.BroadcastOptions())),
                           ("send", lambda: pg.send([t], 0, 0)),
                           ("recv", lambda: pg.recv_anysource([t], 0)),
                           ("barrier", lambda: pg.barrier())]:
            exc = raised_by(call)
            p.expect(isinstance(exc, hpccomm.HpccommError) and re.fullmatch(
                rf"hpccomm {name} \(group '[^']+'\): the process group was destroyed", str(exc)),
                f"{name} on a destroyed group: {exc!r}")
        p.expect(torch.equal(t, torch.ones(3)), "a refused op changed the tensor")
    check_collectives(p, dist.group.WORLD, list(range(n)), salt=9)  # the world is untouched
    p.verdict()
