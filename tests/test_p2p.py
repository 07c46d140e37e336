"""Point-to-point: send/recv, isend/irecv, batch_isend_irecv, any-source
receives, tags, subgroups, tensor forms, the split (large-count) path, the
Work API of a pending operation, and argument errors.  Every received tensor
is compared with what the sender's rank puts in it (helpers.fill), computed
by the receiver for itself."""
from __future__ import annotations

import re
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future

import hpccomm
from helpers import hgroup, MOVE_DTYPES, Problems, fill, raised_by

pytestmark = pytest.mark.mpi

LIMIT = timedelta(seconds=60)  # a wait that would hang fails instead


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-identical (works for bfloat16, float8 and bool, which torch.equal may not)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def blank(shape, dtype) -> torch.Tensor:
    """A receive buffer whose contents differ from every fill() value."""
    return torch.zeros(shape, dtype=dtype)


def poll(predicate, seconds: float = 60.0) -> bool:
    """Whether ``predicate()`` became true within ``seconds`` (never blocks in MPI)."""
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(1e-4)
    return True


@pytest.fixture(autouse=True)
def no_stray_messages(world, groups):
    """After each test, receive and report whatever no receive took on the
    test groups' point-to-point channels, so that a failed test cannot
    feed stale messages to the next one (and a test that leaves some fails)."""
    yield
    from mpi4py import MPI

    from helpers import verdict_comm

    dist.barrier()  # what was sent before it has arrived (or announced itself)
    stray = []
    for g in groups:
        if not g.member:
            continue
        comm = hgroup(g.pg).p2p
        while True:
            status = MPI.Status()
            msg = comm.Improbe(MPI.ANY_SOURCE, MPI.ANY_TAG, status)
            if msg is None:
                break
            msg.Recv([bytearray(status.Get_count(MPI.BYTE)), MPI.BYTE])
            stray.append(f"group {g.name}: {status.Get_count(MPI.BYTE)} bytes from rank {status.Get_source()} "
                         f"with tag {status.Get_tag()}")
    everywhere = [m for ms in verdict_comm().allgather(stray) for m in ms]
    assert not everywhere, f"messages nobody received: {everywhere}"


def neighbours():
    r, n = dist.get_rank(), dist.get_world_size()
    return (r - 1) % n, (r + 1) % n


def world_pg():
    return dist.group.WORLD


# -- blocking send/recv -------------------------------------------------------------------------

@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype", MOVE_DTYPES, ids=[str(d)[6:] for d in MOVE_DTYPES])
def test_send_recv_every_dtype(world, dtype):
    """A blocking chain around the ring: rank 0 sends first, everyone else receives first."""
    r, n = world
    prev, nxt = neighbours()
    mine = fill((3, 4), dtype, r)
    got = blank((3, 4), dtype)
    if r == 0:
        dist.send(mine, dst=nxt)
        src = dist.recv(got, src=prev)
    else:
        src = dist.recv(got, src=prev)
        dist.send(mine, dst=nxt)
    assert src == prev
    assert same_bits(got, fill((3, 4), dtype, prev)), f"{dtype}: {got} from rank {prev}"
    assert same_bits(mine, fill((3, 4), dtype, r)), "send changed its tensor"


@pytest.mark.mpi(min_size=2)
def test_send_recv_pairs_both_directions(world):
    """Even ranks send to the odd rank above them, then the reverse; a rank
    without a partner (odd sizes) takes no part."""
    r, n = world
    partner = r + 1 if r % 2 == 0 else r - 1
    if partner >= n:
        return
    p = Problems()
    for first_sender in (0, 1):
        got = blank((5,), torch.int64)
        if r % 2 == first_sender:
            dist.send(fill((5,), torch.int64, r, salt=first_sender), dst=partner)
        else:
            dist.recv(got, src=partner)
            p.expect(torch.equal(got, fill((5,), torch.int64, partner, salt=first_sender)), f"round {first_sender}")
    p.verdict()


# -- isend / irecv -------------------------------------------------------------------------------

@pytest.mark.parametrize("numel", [7, 1 << 20], ids=["small", "4MB"])
def test_ring_isend_irecv(world, numel):
    """Each rank sends to the next and receives from the previous (at size 1: itself)."""
    r, n = world
    prev, nxt = neighbours()
    mine = fill((numel,), torch.float32, r)
    got = blank((numel,), torch.float32)
    rw = dist.irecv(got, src=prev)
    sw = dist.isend(mine, dst=nxt)
    assert sw.wait(LIMIT) is True
    assert rw.wait(LIMIT) is True
    assert torch.equal(got, fill((numel,), torch.float32, prev))
    assert rw.is_completed() and sw.is_completed()


def test_isend_irecv_to_self(world):
    """torch allows isend/irecv to oneself (only blocking send is refused)."""
    r, n = world
    got = blank((3, 3), torch.int32)
    got_any = blank((4,), torch.int8)
    works = [dist.irecv(got, src=r, tag=4), dist.isend(fill((3, 3), torch.int32, r), dst=r, tag=4),
             dist.isend(fill((4,), torch.int8, r), dst=r, tag=5)]
    any_work = dist.irecv(got_any, tag=5)  # any source: it can only be this rank
    for w in works + [any_work]:
        w.wait(LIMIT)
    assert any_work._source_rank() == r
    assert torch.equal(got, fill((3, 3), torch.int32, r))
    assert torch.equal(got_any, fill((4,), torch.int8, r))


def test_ring_isend_first(world):
    """Send posted before the matching receive, several dtypes in flight at once."""
    r, n = world
    prev, nxt = neighbours()
    dtypes = [torch.float64, torch.bfloat16, torch.int8, torch.bool, torch.complex64]
    sends = [dist.isend(fill((6,), d, r, salt=i), dst=nxt, tag=i) for i, d in enumerate(dtypes)]
    gots = [blank((6,), d) for d in dtypes]
    recvs = [dist.irecv(g, src=prev, tag=i) for i, g in enumerate(gots)]
    for w in sends + recvs:
        w.wait(LIMIT)
    for i, (d, g) in enumerate(zip(dtypes, gots)):
        assert same_bits(g, fill((6,), d, prev, salt=i)), d


@pytest.mark.parametrize("numel", [3, 1 << 20], ids=["small", "4MB"])
def test_batch_isend_irecv_both_directions(world, numel):
    """Send to both neighbours and receive from both in one batch: with 4 MB
    messages (past MPI's eager limit) this deadlocks unless every op is
    posted before any is waited on."""
    r, n = world
    prev, nxt = neighbours()
    to_next = fill((numel,), torch.float32, r, salt=1)
    to_prev = fill((numel,), torch.float32, r, salt=2)
    from_prev = blank((numel,), torch.float32)
    from_next = blank((numel,), torch.float32)
    # With two ranks (or one) prev == next: same-pair ops match in list order,
    # which the order below keeps consistent on every rank.
    ops = [dist.P2POp(dist.irecv, from_prev, prev), dist.P2POp(dist.irecv, from_next, nxt),
           dist.P2POp(dist.isend, to_next, nxt), dist.P2POp(dist.isend, to_prev, prev)]
    works = dist.batch_isend_irecv(ops)
    # torch >= 2.14 coalesces the batch for a backend that supports it (hpccomm does): one Work for all
    assert len(works) == (1 if hpccomm._compat.py_backend() else 4), works
    for w in works:
        w.wait(LIMIT)
    assert torch.equal(from_prev, fill((numel,), torch.float32, prev, salt=1))
    assert torch.equal(from_next, fill((numel,), torch.float32, nxt, salt=2))


def test_batch_isend_irecv_with_tags_on_subgroups(world, groups):
    """batch_isend_irecv on each test group, addressing peers by group rank,
    with the sends listed before the receives and distinct tags."""
    p = Problems()
    for g in groups:
        if not g.member:
            continue
        k, m = g.rank, g.size
        nxt, prev = (k + 1) % m, (k - 1) % m
        out = fill((9,), torch.int32, g.ranks[k], salt=4)
        got = blank((9,), torch.int32)
        ops = [dist.P2POp(dist.isend, out, group=g.pg, tag=11, group_peer=nxt),
               dist.P2POp(dist.irecv, got, group=g.pg, tag=11, group_peer=prev)]
        for w in dist.batch_isend_irecv(ops):
            w.wait(LIMIT)
        p.expect(torch.equal(got, fill((9,), torch.int32, g.ranks[prev], salt=4)), g.name)
    p.verdict()


# -- any source ----------------------------------------------------------------------------------

@pytest.mark.mpi(min_size=2)
def test_recv_any_source_returns_global_rank(world):
    r, n = world
    if r == 0:
        seen = []
        for _ in range(n - 1):  # receive everything first: a failure must not leave messages behind
            got = blank((4,), torch.int64)
            seen.append((dist.recv(got), got))  # src=None: any source
        for src, got in seen:
            assert torch.equal(got, fill((4,), torch.int64, src)), f"data from {src} mismatched"
        assert sorted(src for src, _ in seen) == list(range(1, n))
    else:
        dist.send(fill((4,), torch.int64, r), dst=0)


@pytest.mark.mpi(min_size=2)
def test_recv_any_source_in_subgroup_returns_global_rank(world):
    """In a group whose ranks are not the world's, recv(src=None) still
    answers with the sender's global rank, and irecv's Work with its group rank."""
    r, n = world
    members = list(range(n - 1, 0, -1)) if n > 2 else [1, 0]  # given in reverse; torch sorts them
    pg = dist.new_group(members)
    members = sorted(members)
    if r not in members:
        return
    k, last = members.index(r), len(members) - 1
    if k == last:  # the last group rank receives from all others
        seen = []
        for _ in range(last):
            got = blank((3,), torch.int16)
            seen.append((dist.recv(got, group=pg), got))
        got = blank((3,), torch.int16)
        w = dist.irecv(got, group=pg, tag=1)
        w.wait(LIMIT)
        for src, data in seen:
            assert src in members[:-1]
            assert torch.equal(data, fill((3,), torch.int16, src)), src
        assert sorted(src for src, _ in seen) == members[:-1]
        assert w._source_rank() == 0 and w.source_rank() == 0  # a group rank
        assert torch.equal(got, fill((3,), torch.int16, members[0], salt=1))
    else:
        dist.send(fill((3,), torch.int16, r), group_dst=last, group=pg)
        if k == 0:
            dist.send(fill((3,), torch.int16, r, salt=1), dst=members[-1], group=pg, tag=1)


# -- tags ----------------------------------------------------------------------------------------

@pytest.mark.mpi(min_size=2)
def test_tags_match_out_of_order(world):
    r, n = world
    pg = world_pg()
    top = hgroup(pg).tag_ub
    tags = [5, 7, 0, top]
    if r == 0:
        works = [dist.isend(fill((4,), torch.float64, r, salt=t % 97), dst=1, tag=t) for t in tags]
        for w in works:
            w.wait(LIMIT)
    elif r == 1:
        gots = {t: blank((4,), torch.float64) for t in tags}
        for t in reversed(tags):  # opposite order of sending: tags decide the match
            dist.recv(gots[t], src=0, tag=t)
        for t in tags:
            assert torch.equal(gots[t], fill((4,), torch.float64, 0, salt=t % 97)), f"tag {t}"


@pytest.mark.mpi(min_size=2)
def test_any_source_respects_tag(world):
    """recv(src=None, tag=t) takes only tag-t messages, whoever sent first."""
    r, n = world
    if r == 0:
        got9 = blank((2,), torch.int32)
        src9 = dist.recv(got9, tag=9)
        got3 = blank((2,), torch.int32)
        src3 = dist.recv(got3, tag=3)
        assert (src9, src3) == (1, n - 1)
        assert torch.equal(got9, fill((2,), torch.int32, 1, salt=9))
        assert torch.equal(got3, fill((2,), torch.int32, n - 1, salt=3))
    else:
        works = []
        if r == n - 1:
            works.append(dist.isend(fill((2,), torch.int32, r, salt=3), dst=0, tag=3))
        if r == 1:
            works.append(dist.isend(fill((2,), torch.int32, r, salt=9), dst=0, tag=9))
        for w in works:
            w.wait(LIMIT)


# -- groups: group_dst / group_src vs global ranks ------------------------------------------------

def test_group_ranks_vs_global_ranks(world, groups):
    """On every test group: send by group rank (group_dst) and by global rank
    (dst); receive by group_src and by src; the data tells who sent it."""
    p = Problems()
    for g in groups:
        if not g.member or g.size < 2:
            continue
        k, m = g.rank, g.size
        nxt, prev = (k + 1) % m, (k - 1) % m
        sends = [dist.isend(fill((5,), torch.int64, g.ranks[k], 1), group_dst=nxt, group=g.pg),
                 dist.isend(fill((5,), torch.int64, g.ranks[k], 2), dst=g.ranks[nxt], group=g.pg)]
        got_a = blank((5,), torch.int64)
        got_b = blank((5,), torch.int64)
        src_a = dist.recv(got_a, group_src=prev, group=g.pg)
        src_b = dist.recv(got_b, src=g.ranks[prev], group=g.pg)
        for w in sends:
            w.wait(LIMIT)
        p.expect(src_a == g.ranks[prev] and src_b == g.ranks[prev], f"{g.name}: sources {src_a}, {src_b}")
        p.expect(torch.equal(got_a, fill((5,), torch.int64, g.ranks[prev], 1)), f"{g.name}: by group_src")
        p.expect(torch.equal(got_b, fill((5,), torch.int64, g.ranks[prev], 2)), f"{g.name}: by src")
    p.verdict()


def test_subgroup_p2p_does_not_match_world_p2p(world, groups):
    """The same (peer, tag) on two groups are two channels: messages never cross."""
    r, n = world
    prev, nxt = neighbours()
    sub = next(g for g in groups if g.name == "even")
    works, got_w = [], blank((3,), torch.int64)
    got_s = blank((3,), torch.int64) if sub.member else None
    works.append(dist.irecv(got_w, src=prev, tag=1))
    if sub.member:
        k, m = sub.rank, sub.size
        works.append(dist.irecv(got_s, group_src=(k - 1) % m, group=sub.pg, tag=1))
        works.append(dist.isend(fill((3,), torch.int64, r, salt=50), group_dst=(k + 1) % m, group=sub.pg, tag=1))
    works.append(dist.isend(fill((3,), torch.int64, r), dst=nxt, tag=1))
    for w in works:
        w.wait(LIMIT)
    assert torch.equal(got_w, fill((3,), torch.int64, prev))
    if sub.member:
        assert torch.equal(got_s, fill((3,), torch.int64, sub.ranks[(sub.rank - 1) % sub.size], salt=50))


# -- tensor forms --------------------------------------------------------------------------------

def test_noncontiguous_recv_target_written_back(world):
    r, n = world
    prev, nxt = neighbours()
    base = torch.full((4, 6), -1.0)
    view = base[:, ::2]  # 4x3, strided
    assert not view.is_contiguous()
    tbase = torch.full((5, 3), -2, dtype=torch.int32)
    tview = tbase.t()  # 3x5, transposed
    assert not tview.is_contiguous()
    src_base = fill((3, 8), torch.float32, r)
    src = src_base[:, ::2].t()  # non-contiguous send source, 4x3
    works = [dist.irecv(view, src=prev, tag=1), dist.irecv(tview, src=prev, tag=2),
             dist.isend(src, dst=nxt, tag=1), dist.isend(fill((3, 5), torch.int32, r), dst=nxt, tag=2)]
    for w in works:
        w.wait(LIMIT)
    expected = fill((3, 8), torch.float32, prev)[:, ::2].t()
    assert torch.equal(base[:, ::2], expected)
    assert torch.all(base[:, 1::2] == -1.0), "elements outside the view were written"
    assert torch.equal(tview, fill((3, 5), torch.int32, prev))
    assert torch.equal(src_base, fill((3, 8), torch.float32, r)), "send changed its source"


def test_noncontiguous_recv_written_back_via_future(world):
    """The write-back also happens when the progress thread completes the op."""
    r, n = world
    prev, nxt = neighbours()
    base = torch.zeros(6, 4, dtype=torch.int64)
    view = base.t()
    rw = dist.irecv(view, src=prev)
    fut = rw.get_future()
    sw = dist.isend(fill((4, 6), torch.int64, r), dst=nxt)
    assert poll(fut.done), "future of irecv never completed"
    sw.wait(LIMIT)
    assert torch.equal(base.t(), fill((4, 6), torch.int64, prev))
    assert fut.value()[0].data_ptr() == view.data_ptr()


def test_zero_dim_and_empty(world):
    r, n = world
    prev, nxt = neighbours()
    scalar = torch.tensor(-1.5, dtype=torch.float64)
    empty = torch.empty(0, 3)
    works = [dist.irecv(scalar, src=prev, tag=1), dist.irecv(empty, src=prev, tag=2),
             dist.isend(torch.tensor(float(r) + 0.25, dtype=torch.float64), dst=nxt, tag=1),
             dist.isend(torch.empty(0, 3), dst=nxt, tag=2)]
    for w in works:
        w.wait(LIMIT)
    assert scalar.dim() == 0 and scalar.item() == prev + 0.25
    assert empty.shape == (0, 3)


# -- the split path: counts past the MPI count limit -----------------------------------------------

class LowCount:
    """Lower the world group's per-call count limit, as a 2**31-element tensor meets it."""

    def __init__(self, limit: int = 7) -> None:
        self.limit = limit

    def __enter__(self):
        self.g = hgroup(world_pg())
        self.old, self.g.max_count = self.g.max_count, self.limit
        self.g.checked.clear()  # (a checked call's plan is bound to the limit of its first call: Op.bind)
        return self

    def __exit__(self, *exc):
        self.g.max_count = self.old
        self.g.checked.clear()


@pytest.mark.mpi(min_size=2)
def test_split_send_recv(world):
    r, n = world
    p = Problems()
    with LowCount():
        # 7 fits; 8 and 50 leave a remainder; 49 = 7*7 none; 343 = 7**3 and 400 nest deeper
        for numel in (7, 8, 50, 49, 343, 400):
            got = blank((numel,), torch.int64)
            if r == 0:
                dist.send(fill((numel,), torch.int64, r, salt=numel), dst=1)
            elif r == 1:
                dist.recv(got, src=0)
                p.expect(torch.equal(got, fill((numel,), torch.int64, 0, salt=numel)), f"{numel} elements")
    p.verdict()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("lowered_on", ["sender", "receiver"])
def test_split_on_one_side_only(world, lowered_on):
    """A message described in pieces on one side and whole on the other still
    matches: MPI matches element by element, whatever the datatypes' shapes."""
    r, n = world
    numel = 1000
    lower = (r == 0) == (lowered_on == "sender")
    got = blank((numel,), torch.float64)
    with LowCount(3 if lower else hgroup(world_pg()).max_count):
        if r == 0:
            dist.send(fill((numel,), torch.float64, r), dst=1)
        elif r == 1:
            assert dist.recv(got) == 0
            assert torch.equal(got, fill((numel,), torch.float64, 0))


def test_split_ring_isend_irecv(world):
    r, n = world
    prev, nxt = neighbours()
    with LowCount(5):
        got = blank((3, 17), torch.bfloat16)
        w = dist.irecv(got.t(), src=prev)  # non-contiguous too
        dist.isend(fill((17, 3), torch.bfloat16, r), dst=nxt).wait(LIMIT)
        w.wait(LIMIT)
        assert same_bits(got.t(), fill((17, 3), torch.bfloat16, prev))


@pytest.mark.mpi(min_size=2)
def test_split_any_source(world):
    r, n = world
    with LowCount():
        if r == 0:
            seen = []
            for _ in range(n - 1):
                got = blank((50,), torch.float32)
                seen.append((dist.recv(got), got))
            for src, got in seen:
                assert torch.equal(got, fill((50,), torch.float32, src)), src
            assert sorted(src for src, _ in seen) == list(range(1, n))
        else:
            dist.send(fill((50,), torch.float32, r), dst=0)


@pytest.mark.mpi(min_size=2)
def test_split_any_source_receives_in_flight_together(world):
    """Several split messages from one sender, received by any-source and
    by-source receives posted at once: each receive gets one whole message,
    in sending order (MPI's non-overtaking rule), never pieces of two."""
    r, n = world
    with LowCount():
        gots = [blank((50,), torch.int64) for _ in range(4)]
        if r == 0:
            works = [dist.irecv(gots[0]), dist.irecv(gots[1], src=1), dist.irecv(gots[2]),
                     dist.irecv(gots[3])]
        dist.barrier()  # every receive is posted before anything is sent
        if r == 1:
            sends = [dist.isend(fill((50,), torch.int64, r, salt=10 * i), dst=0) for i in range(4)]
            for w in sends:
                w.wait(LIMIT)
        if r == 0:
            for w in works:
                w.wait(LIMIT)
            for i, got in enumerate(gots):
                assert torch.equal(got, fill((50,), torch.int64, 1, salt=10 * i)), f"receive {i}: {got}"
            assert [w._source_rank() for w in (works[0], works[2], works[3])] == [1, 1, 1]


# -- the Work API of a pending op -------------------------------------------------------------------

@pytest.mark.mpi(min_size=2)
def test_work_is_completed_then_wait(world):
    r, n = world
    got = blank((8,), torch.float32)
    early = False
    if r == 1:
        w = dist.irecv(got, src=0)
        early = w.is_completed()
    dist.barrier()
    if r == 0:
        w = dist.isend(fill((8,), torch.float32, 0), dst=1)
    if r in (0, 1):
        assert poll(w.is_completed), "is_completed() never became true"
        assert w.is_success() and w.exception() is None
        assert w.wait() is True
        assert w.wait(LIMIT) is True  # waiting again is harmless
    if r == 1:
        assert not early, "irecv completed before anything was sent"
        assert torch.equal(got, fill((8,), torch.float32, 0))
        res = w.result()
        assert len(res) == 1 and res[0].data_ptr() == got.data_ptr()


@pytest.mark.mpi(min_size=2)
def test_future_completes_without_wait(world):
    """The future of a pending op completes with nobody calling wait()
    (DDP waits only on futures): the progress thread completes it."""
    r, n = world
    got = blank((1000,), torch.int64)
    if r == 1:
        w = dist.irecv(got, src=0, tag=3)
        fut = w.get_future()
        chained = fut.then(lambda f: int(f.value()[0].sum()))
        early = fut.done()
    dist.barrier()
    if r == 0:
        w = dist.isend(fill((1000,), torch.int64, 0), dst=1, tag=3)
        fut = w.get_future()
    if r in (0, 1):
        assert poll(fut.done), "future never completed without wait()"
        value = fut.wait()
        assert isinstance(value, list) and len(value) == 1
        assert w.is_completed()
    if r == 1:
        assert not early, "the future completed before anything was sent"
        assert value[0].data_ptr() == got.data_ptr()
        assert torch.equal(got, fill((1000,), torch.int64, 0))
        assert poll(chained.done) and chained.value() == int(fill((1000,), torch.int64, 0).sum())


def test_callback_waits_on_another_future(world):
    """A callback run by the progress thread may wait on another pending
    op's future (as DDP comm hooks do) without deadlocking that thread."""
    r, n = world
    prev, nxt = neighbours()
    first, second = blank((4,), torch.int64), blank((4,), torch.int64)
    w1 = dist.irecv(first, src=prev, tag=1)
    w2 = dist.irecv(second, src=prev, tag=2)
    chained = w1.get_future().then(lambda f: int(f.value()[0].sum()) + int(w2.get_future().wait()[0].sum()))
    dist.barrier()  # both receives and the callback are in place before anything is sent
    sends = [dist.isend(fill((4,), torch.int64, r, 1), dst=nxt, tag=1),
             dist.isend(fill((4,), torch.int64, r, 2), dst=nxt, tag=2)]
    done = poll(chained.done, 30)
    for w in sends:
        w.wait(LIMIT)
    w2.wait(LIMIT)  # (only matters if the callback hung)
    assert done, "the callback waiting on another future never finished"
    assert chained.value() == int(fill((4,), torch.int64, prev, 1).sum() + fill((4,), torch.int64, prev, 2).sum())


@pytest.mark.mpi(min_size=2)
def test_many_futures_complete_in_any_order(world):
    r, n = world
    prev, nxt = neighbours()
    gots = [blank((64,), torch.float32) for _ in range(6)]
    futs = [dist.irecv(g, src=prev, tag=20 + i).get_future() for i, g in enumerate(gots)]
    sends = [dist.isend(fill((64,), torch.float32, r, salt=i), dst=nxt, tag=20 + i)
             for i in reversed(range(6))]
    assert poll(lambda: all(f.done() for f in futs + [s.get_future() for s in sends]))
    for i, g in enumerate(gots):
        assert torch.equal(g, fill((64,), torch.float32, prev, salt=i))


@pytest.mark.mpi(min_size=2)
def test_any_source_work_source_rank(world):
    r, n = world
    if r == 0:
        got = blank((2,), torch.int64)
        w = dist.irecv(got)
        assert poll(w.is_completed)
        src = w._source_rank()
        assert src == n - 1 and w.source_rank() == n - 1
        assert torch.equal(got, fill((2,), torch.int64, src))
    elif r == n - 1:
        dist.send(fill((2,), torch.int64, r), dst=0)


# -- errors --------------------------------------------------------------------------------------

def _where(r, n):
    return rf"\(p2p op #\d+ on group '[^']+', rank {r}/{n}\)"  # point-to-point ops are numbered apart


def test_bad_peer_and_tag_refused_before_communication(world):
    r, n = world
    prev, nxt = neighbours()
    top = hgroup(world_pg()).tag_ub
    t = fill((4,), torch.float32, r)
    cases = [
        (lambda: dist.isend(t, dst=n), "send", rf"dst {n} is not a rank of this group of size {n}"),
        (lambda: dist.send(t, dst=n + 5), "send", rf"dst {n + 5} is not a rank"),
        (lambda: dist.isend(t, dst=-1), "send", r"dst -1 is not a rank"),
        (lambda: dist.irecv(t, src=n), "recv", rf"src {n} is not a rank of this group of size {n}"),
        (lambda: dist.recv(t, src=n), "recv", rf"src {n} is not a rank"),
        (lambda: dist.isend(t, dst=nxt, tag=-1), "send", r"tag -1 is outside 0\.\." + str(top)),
        (lambda: dist.isend(t, dst=nxt, tag=top + 1), "send", rf"tag {top + 1} is outside"),
        (lambda: dist.irecv(t, src=prev, tag=-3), "recv", r"tag -3 is outside"),
        (lambda: dist.recv(t, tag=top + 1), "recv", rf"tag {top + 1} is outside"),  # any source
    ]
    for call, op, what in cases:
        before = t.clone()
        with pytest.raises(hpccomm.OpValueError, match=rf"^hpccomm {op} {_where(r, n)}: {what}"):
            call()
        assert torch.equal(t, before), f"{op} changed the tensor"
    assert_channel_clean()


def assert_channel_clean():
    """Nothing stray is waiting on the world's point-to-point channel, and
    the next exchange gets exactly the next message."""
    from mpi4py import MPI

    r = dist.get_rank()
    prev, nxt = neighbours()
    dist.barrier()
    assert not hgroup(world_pg()).p2p.Iprobe(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG), "a stray message is pending"
    dist.barrier()
    got = blank((4,), torch.float32)
    w = dist.irecv(got, src=prev)
    dist.isend(fill((4,), torch.float32, r, salt=7), dst=nxt).wait(LIMIT)
    w.wait(LIMIT)
    assert torch.equal(got, fill((4,), torch.float32, prev, salt=7))


def test_nothing_sent_by_refused_ops(world):
    """After a refused op, the next exchange gets exactly the next message."""
    r, n = world
    prev, nxt = neighbours()
    with pytest.raises(hpccomm.OpValueError):
        dist.isend(fill((4,), torch.float32, r), dst=nxt, tag=-1)
    with pytest.raises(hpccomm.OpValueError):
        dist.irecv(fill((4,), torch.float32, r), src=n)
    assert_channel_clean()


def test_group_peer_out_of_range_in_subgroup(world, groups):
    for g in groups:
        if not g.member:
            continue
        t = fill((3,), torch.int64, 0)
        before = t.clone()
        with pytest.raises(hpccomm.OpValueError,
                           match=rf"send {_where(g.rank, g.size)}: dst {g.size} is not a rank of this group "
                                 rf"of size {g.size}\. Pass a group rank"):
            dist.isend(t, group_dst=g.size, group=g.pg)
        with pytest.raises(hpccomm.OpValueError, match=rf"recv {_where(g.rank, g.size)}: src {g.size + 1} is not"):
            dist.irecv(t, group_src=g.size + 1, group=g.pg)
        assert torch.equal(t, before)


def test_blocking_send_to_self_refused(world):
    """A blocking send to oneself could never complete: refused before communication."""
    r, n = world
    t = fill((2,), torch.float32, r)
    before = t.clone()
    with pytest.raises(ValueError, match="rank"):
        dist.send(t, dst=r)
    assert torch.equal(t, before)


def test_wrong_tensor_refused(world):
    r, n = world
    prev, nxt = neighbours()
    with pytest.raises(hpccomm.OpTypeError, match=rf"send {_where(r, n)}: tensor is a meta tensor"):
        dist.isend(torch.empty(3, device="meta"), dst=nxt)
    sparse = torch.eye(3).to_sparse()
    with pytest.raises(hpccomm.OpTypeError, match=rf"recv {_where(r, n)}: tensor has layout torch.sparse_coo"):
        dist.irecv(sparse, src=prev)


@pytest.mark.mpi(min_size=2)
def test_recv_into_smaller_tensor_fails_on_wait(world):
    r, n = world
    if r == 0:
        dist.send(fill((8,), torch.float32, r), dst=1)
    elif r == 1:
        got = blank((4,), torch.float32)
        w = dist.irecv(got, src=0)
        raised = raised_by(lambda: w.wait(LIMIT))
    assert_channel_clean()  # the group still works
    if r == 1:
        assert isinstance(raised, hpccomm.HpccommError), repr(raised)
        assert re.search(rf"^hpccomm recv {_where(1, n)}: the message from rank 0 is larger than the tensor "
                         r"\(4 elements\).*Sender and receiver must pass tensors with the same number", str(raised))
        assert not w.is_success() and w.exception() is raised


@pytest.mark.mpi(min_size=2)
def test_recv_into_larger_tensor_fails_on_future(world):
    """A short message is an error too (no silently half-filled tensor), and
    it reaches a future completed by the progress thread."""
    r, n = world
    if r == 0:
        dist.send(fill((3,), torch.int64, r), dst=1)
    elif r == 1:
        got = torch.full((5,), -7, dtype=torch.int64)
        fut = dist.irecv(got).get_future()  # any source
        done = poll(fut.done)
        raised = raised_by(fut.wait) if done else None
        # what C++ callers (DDP, functional collectives) see: a failed future, not a successful one
        seen_by_cpp = _create_work_from_future(fut).exception() if done else None
    assert_channel_clean()
    if r == 1:
        assert done, "the future never completed"
        why = r"received 3 elements from rank 0 but the tensor has 5; only its first 3 elements were written"
        assert re.search(why, str(raised)), repr(raised)
        assert seen_by_cpp is not None and re.search(why, str(seen_by_cpp)), "C++ sees the future as successful"
        assert torch.equal(got[3:], torch.full((2,), -7, dtype=torch.int64))


# -- send and recv on the tensor's own memory ------------------------------------------------------

def test_send_recv_plans_and_records(world, groups):
    """send and recv of dense contiguous CPU tensors post one MPI_Isend/MPI_Irecv on the tensor's own
    memory, nothing before or after it (hpccomm.explain), planned alike in every round, on every group
    shape; each received tensor against the sender's data, computed by the receiver; the p2p op
    number advancing by one per op; the watchdog's record of a posted op (op, peer, group, deadline =
    post time + the group's timeout) and gone once it completed; ops in a batch_isend_irecv waited
    for by the batch; a receive from any source posted the same way, and a strided tensor staged
    (copied out once it arrived), with the same results.  A short message received by a blocking
    recv is an error naming the op."""
    from hpccomm._core import state
    from hpccomm._core.record import OpRecord

    def posted_on(e, call, t):
        assert (e.where, e.call, e.before, e.after) == ("posted", call, False, False), e
        assert [b[0] for b in e.buffers] == [t.data_ptr()], (e, t.data_ptr())

    def records(hg):
        return [r for r in state.records() if isinstance(r, OpRecord) and r.group is hg]

    p = Problems()
    for tg in groups:
        if not tg.member:
            continue
        pg, m, me = tg.pg, tg.size, tg.rank
        hg = hgroup(pg)
        nxt, prev = (me + 1) % m, (me - 1) % m
        for k, dtype in enumerate((torch.int64, torch.float16, torch.int64, torch.float16)):
            seq = hg.p2p_seq
            got = blank((7,), dtype)
            out = fill((7,), dtype, tg.ranks[me], salt=k)
            posted_on(hpccomm.explain("recv", [got], prev, k, group=pg), "Irecv", got)
            posted_on(hpccomm.explain("send", [out], nxt, k, group=pg), "Isend", out)
            # irecv first, then isend
            rw = dist.irecv(got, group_src=prev, group=pg, tag=k)
            sw = dist.isend(out, group_dst=nxt, group=pg, tag=k)
            pending = records(hg)
            p.expect(hg.p2p_seq == seq + 2, f"{tg.name} round {k}: p2p op number {seq} -> {hg.p2p_seq}")
            # (nothing completes them before their wait: nobody asked for a future)
            seen = sorted((rec.name, rec.peer, rec.seq) for rec in pending)
            p.expect(seen == [("recv", prev, seq + 1), ("send", nxt, seq + 2)], f"{tg.name} round {k}: {seen}")
            for rec in pending:
                p.expect(rec.deadline == rec.start + hg.timeout_s and rec.kind == "p2p" and rec.token is not None
                         and rec.where().startswith(f"p2p op #{rec.seq} on group '{hg.name}', rank {me}/{m}"),
                         f"{tg.name} round {k}: {rec.name} record {rec.describe()}")
            # waited for without a time limit (the fast wait), as torch's blocking send/recv do
            assert sw.wait() is True and rw.wait() is True
            p.expect(torch.equal(got, fill((7,), dtype, tg.ranks[prev], salt=k)), f"{tg.name} round {k}: {got}")
            p.expect(not records(hg), f"{tg.name} round {k}: records left {records(hg)}")
            if m > 1:  # torch's blocking forms (torch refuses a blocking send to oneself)
                got2 = blank((7,), dtype)
                mine = fill((7,), dtype, tg.ranks[me], salt=10 + k)
                if me == 0:
                    dist.send(mine, group_dst=nxt, group=pg)
                    src = dist.recv(got2, group_src=prev, group=pg)
                else:
                    src = dist.recv(got2, group_src=prev, group=pg)
                    dist.send(mine, group_dst=nxt, group=pg)
                p.expect(src == tg.ranks[prev], f"{tg.name} round {k}: source {src}")
                p.expect(torch.equal(got2, fill((7,), dtype, tg.ranks[prev], salt=10 + k)),
                         f"{tg.name} round {k}: blocking {got2}")
                p.expect(hg.p2p_seq == seq + 4, f"{tg.name} round {k}: p2p op number {hg.p2p_seq}")
        # in a batch (torch >= 2.14 coalesces it): the batch's Work waits for its ops
        got = blank((5,), torch.int64)
        ops = [dist.P2POp(dist.isend, fill((5,), torch.int64, tg.ranks[me], salt=20), group=pg, tag=20,
                          group_peer=nxt),
               dist.P2POp(dist.irecv, got, group=pg, tag=20, group_peer=prev)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        p.expect(torch.equal(got, fill((5,), torch.int64, tg.ranks[prev], salt=20)), f"{tg.name} batch: {got}")
        p.expect(not records(hg), f"{tg.name} batch: records left {records(hg)}")
        # any source: the same plan; a strided tensor: staged, copied out once it arrived
        any_src = blank((3,), torch.int64)
        strided = torch.zeros(6, dtype=torch.int64)[::2]
        posted_on(hpccomm.explain("recv", [any_src], None, 21, group=pg), "Irecv", any_src)
        e = hpccomm.explain("recv", [strided], prev, 22, group=pg)
        p.expect((e.where, e.call, e.before, e.after) == ("posted", "Irecv", False, True)
                 and e.buffers[0][0] != strided.data_ptr(), f"{tg.name}: strided receive {e}")
        rw = dist.irecv(any_src, group=pg, tag=21)  # any source
        rs = dist.irecv(strided, group_src=prev, group=pg, tag=22)  # staged
        seq = hg.p2p_seq
        more = records(hg)  # their records: as above
        seen = sorted((rec.name, -1 if rec.peer is None else rec.peer, rec.seq) for rec in more)
        p.expect(seen == [("recv", -1, seq - 1), ("recv", prev, seq)], f"{tg.name}: records {seen}")
        for rec in more:
            p.expect(rec.deadline == rec.start + hg.timeout_s and rec.kind == "p2p" and rec.token is not None
                     and rec.where().startswith(f"p2p op #{rec.seq} on group '{hg.name}', rank {me}/{m}"),
                     f"{tg.name}: {rec.name} record {rec.describe()}")
        sends = [dist.isend(fill((3,), torch.int64, tg.ranks[me], salt=s), group_dst=nxt, group=pg, tag=s)
                 for s in (21, 22)]
        for w in [rw, rs] + sends:
            w.wait()
        p.expect(torch.equal(any_src, fill((3,), torch.int64, tg.ranks[prev], salt=21)), f"{tg.name}: any source")
        if isinstance(rw, hpccomm._core.work.Work):  # (the Backend route hands torch's own Work back)
            p.expect(rw._source_rank() == prev, f"{tg.name}: any source from {rw._source_rank()}")
        p.expect(torch.equal(strided, fill((3,), torch.int64, tg.ranks[prev], salt=22)), f"{tg.name}: strided")
        if m > 1:  # a short message into a blocking recv: an error naming the op, on the receiver
            short = torch.full((5,), -7, dtype=torch.int64)
            if me == 0:
                dist.send(fill((3,), torch.int64, tg.ranks[me]), group_dst=1, group=pg)
            elif me == 1:
                raised = raised_by(lambda: dist.recv(short, group_src=0, group=pg))
                p.expect(isinstance(raised, hpccomm.HpccommError) and re.search(
                    r"^hpccomm recv \(p2p op #\d+ on group '.*', rank 1/\d+\): received 3 elements from rank 0 but "
                    r"the tensor has 5", str(raised)) is not None, f"{tg.name}: {raised!r}")
                p.expect(torch.equal(short[3:], torch.full((2,), -7, dtype=torch.int64)), f"{tg.name}: {short}")
                p.expect(not records(hg), f"{tg.name}: records left after the error {records(hg)}")
    p.verdict()
