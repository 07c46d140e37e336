"""async_op=True: collectives run on the comm thread and complete in issue
order; results equal the blocking path; Work and future APIs behave."""
from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.distributed as dist

import hpccomm
import helpers
from helpers import fill, hgroup, nonblocking_async, same_on_all_ranks, verdict_comm

pytestmark = pytest.mark.mpi


def test_async_results_equal_blocking(world, groups):
    for g in groups:
        if not g.member:
            continue
        n = g.size
        values = [fill((1000,), torch.float32, r) for r in range(n)]
        a = values[g.rank].clone()
        b = values[g.rank].clone()
        work = dist.all_reduce(a, group=g.pg, async_op=True)
        dist.all_reduce(b, group=g.pg)  # queued behind the async op on the same group
        work.wait()
        assert torch.equal(a, b) and torch.equal(a, sum(values))


def test_many_async_then_wait_out_of_order(world):
    rank, size = world
    ts = [torch.full((257,), float(rank + k)) for k in range(8)]
    works = [dist.all_reduce(t, async_op=True) for t in ts]
    outs = [torch.empty(257 * size) for _ in range(3)]
    gworks = [dist.all_gather_into_tensor(o, torch.full((257,), float(rank)), async_op=True) for o in outs]
    for w in reversed(works + gworks):  # waited in the reverse of issue order
        w.wait()
    for k, t in enumerate(ts):
        assert torch.all(t == sum(r + k for r in range(size)))
    for o in outs:
        assert torch.equal(o, torch.arange(size, dtype=torch.float32).repeat_interleave(257))
    assert all(w.is_completed() and w.is_success() for w in works)


def test_future_completes_without_wait_and_then_chains(world):
    rank, size = world
    t = torch.full((64,), float(rank))
    work = dist.all_reduce(t, async_op=True)
    fut = work.get_future().then(lambda f: f.value()[0] * 2)
    doubled = fut.wait()
    assert torch.all(doubled == 2 * sum(range(size)))
    assert work.is_completed() and work.exception() is None


def test_wait_with_timeout_returns(world):
    from datetime import timedelta

    t = torch.ones(10)
    work = dist.all_reduce(t, async_op=True)
    assert work.wait(timeout=timedelta(seconds=60))
    assert torch.all(t == dist.get_world_size())


def test_async_work_returns_before_completion_when_a_peer_is_late(world):
    """The caller is free while the op waits for others: rank 0 issues an async
    op, then signals (over a side channel) that it got control back; the other
    ranks join only after that signal."""
    rank, size = world
    if size == 1:
        work = dist.all_reduce(torch.ones(1), async_op=True)
        work.wait()
        return
    from helpers import verdict_comm

    side = verdict_comm()
    t = torch.ones(4)
    if rank == 0:
        work = dist.all_reduce(t, async_op=True)
        returned_early = not work.is_completed()  # nobody else has joined yet
        side.bcast(True, root=0)
        work.wait()
    else:
        side.bcast(None, root=0)
        # async_op must match on every rank: MPI never matches a nonblocking collective with a blocking one
        dist.all_reduce(t, async_op=True).wait()
        returned_early = True
    flags = side.allgather(returned_early)
    assert all(flags) and torch.all(t == size)


def test_two_groups_interleaved_async(world, groups):
    rank, size = world
    even = next(g for g in groups if g.name == "even")
    t1, t2 = torch.full((5,), 1.0), torch.full((5,), float(rank))
    w1 = dist.all_reduce(t1, async_op=True)
    w2 = dist.all_reduce(t2, group=even.pg, async_op=True) if even.member else None
    w1.wait()
    if w2 is not None:
        w2.wait()
        assert torch.all(t2 == sum(even.ranks))
    assert torch.all(t1 == size)


def test_ddp_overlapped_equals_plain_averaging(world):
    """DDP (its allreduces are async, on the comm thread) ends with the same
    weights as averaging gradients by hand with blocking all_reduce."""
    rank, size = world
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    ref = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    ref.load_state_dict(model.state_dict())
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.001)  # several buckets
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(5):
        x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        opt_ref.zero_grad()
        torch.nn.functional.mse_loss(ref(x), y).backward()
        for p in ref.parameters():
            dist.all_reduce(p.grad)
            p.grad /= size
        opt_ref.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    assert same_on_all_ranks(flat)


def test_comm_thread_is_used_for_async(world):
    seen = []
    t = torch.ones(3)
    work = dist.all_reduce(t, async_op=True)
    work.get_future().then(lambda f: seen.append(threading.current_thread().name)).wait()
    assert seen and seen[0] in ("hpccomm-comm", threading.main_thread().name)


def _train(hook=None, state=None, steps=4):
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    if hook is not None:
        ddp.register_comm_hook(state, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(100 + rank)
    for _ in range(steps):
        x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def test_ddp_comm_hooks(world):
    """The default allreduce, fp16_compress_hook and PowerSGD run on hpccomm
    (their futures complete on the comm thread) and keep ranks identical."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    plain = _train()
    fp16 = _train(default_hooks.fp16_compress_hook, None)
    allreduce = _train(default_hooks.allreduce_hook, None)
    state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2,
                                        min_compression_rate=0.5, use_error_feedback=True, warm_start=True)
    psgd = _train(powerSGD_hook.powerSGD_hook, state)
    torch.testing.assert_close(allreduce, plain, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(fp16, plain, rtol=2e-2, atol=2e-3)  # gradients rounded to fp16 once
    assert torch.isfinite(psgd).all()
    for flat in (plain, fp16, allreduce, psgd):
        assert same_on_all_ranks(flat)


# -- posted collectives (async_op=True as nonblocking MPI: hpccomm._ops.op_path.form) ----------------------


@pytest.fixture
def posted(world):
    """HPCCOMM_ASYNC_NONBLOCKING on every group, on every rank together."""
    with nonblocking_async():
        yield

def _tri(size):
    return size * (size - 1) // 2


def _posted_ops(rank, size, k, n=9):
    """One async op of each posted kind, salted by ``k``; ``(works, check)``:
    ``check()`` asserts every result against its closed form."""
    a = torch.full((n,), float(rank + k))
    g_in = torch.full((n,), float(rank * 10 + k))
    g_out = torch.empty(n * size)
    rs_in = torch.arange(n * size, dtype=torch.float64) + rank + k
    rs_out = torch.empty(n, dtype=torch.float64)
    b = torch.full((n,), float(rank + 100 * k), dtype=torch.int64)
    root = k % size
    works = [dist.all_reduce(a, async_op=True),
             dist.all_gather_into_tensor(g_out, g_in, async_op=True),
             dist.reduce_scatter_tensor(rs_out, rs_in, async_op=True),
             dist.broadcast(b, src=root, async_op=True)]

    def check():
        assert torch.all(a == _tri(size) + size * k)
        assert torch.equal(g_out, (torch.arange(size, dtype=torch.float32) * 10 + k).repeat_interleave(n))
        base = torch.arange(n * size, dtype=torch.float64)[rank * n:(rank + 1) * n]
        assert torch.equal(rs_out, size * (base + k) + _tri(size))
        assert torch.all(b == root + 100 * k)
        return torch.cat([a.double(), g_out.double(), b.double()])  # (rs_out is this rank's part)

    return works, check


def test_posted_back_to_back_waited_in_reverse(world, posted):
    """Many async ops of the four posted kinds in flight at once, waited in the
    reverse of issue order: every result right, and equal on every rank."""
    rank, size = world
    made = [_posted_ops(rank, size, k) for k in range(6)]
    works = [w for ws, _ in made for w in ws]
    for w in reversed(works):
        assert w.wait()
    assert all(w.is_completed() and w.is_success() and w.exception() is None for w in works)
    flat = torch.cat([check() for _, check in made])
    assert same_on_all_ranks(flat)


@pytest.mark.parametrize("mode", ["every", "first"])
def test_posted_here_and_queued_there_are_checked_alike(world, mode):
    """Whether an async call is posted or queued depends on each rank's own
    queue.  Here rank 0 queues a new-signature all_reduce behind an
    all_to_all that still waits for the other ranks, which post it with
    their queues empty.  The ranks agree on which collectives run whatever
    the forms: compared in both (every call: the posted one before it is
    posted, the queued one where it runs), or in neither (the first-call
    mode does not check the nonblocking forms; when only the queued form
    checked, rank 0 waited in the check, the others in the op, and the
    watchdog ended the job as a mismatch: exit code 6)."""
    from hpccomm._core import comm_thread

    rank, size = world
    assert comm_thread.usable(), "this test needs MPI_THREAD_MULTIPLE (the comm thread)"
    with helpers.setting("HPCCOMM_MISMATCH_CHECK", mode):
        pg = dist.new_group(list(range(size)))  # a new group: every signature is new to it
    g = hgroup(pg)
    with nonblocking_async():
        inp = torch.arange(2 * size, dtype=torch.float64) + 100 * rank
        out = torch.empty(2 * size, dtype=torch.float64)
        x = torch.full((13,), float(rank + 1))
        if rank > 0:
            verdict_comm().barrier()  # after rank 0 has issued both ops
        w1 = dist.all_to_all_single(out, inp, group=pg, async_op=True)  # no nonblocking form: the comm thread
        if rank > 0:
            w1.wait()  # this rank's queue is empty: its all_reduce is posted
        queued = g.queued
        w2 = dist.all_reduce(x, group=pg, async_op=True)
        if rank == 0:
            verdict_comm().barrier()
        w2.wait()
        w1.wait()
    if size > 1:  # (alone, rank 0's all_to_all may complete at once: no queue to differ)
        assert (queued > 0) == (rank == 0), (rank, queued)
    assert torch.all(x == size * (size + 1) / 2)
    assert torch.equal(out, torch.tensor([100.0 * j + 2 * rank + i for j in range(size) for i in range(2)],
                                         dtype=torch.float64))
    assert same_on_all_ranks(x)
    dist.destroy_process_group(pg)


def test_posted_mixed_with_blocking_and_comm_thread_ops(world, posted, groups):
    """Posted async ops interleaved with blocking ones and with async ops that
    stay on the comm thread (all_to_all, an all_reduce past 64 KiB, float16
    with its user-defined MPI op): issue order holds on every rank."""
    rank, size = world
    for g in groups:
        if not g.member:
            assert same_on_all_ranks(None, g.ranks)  # collective over the world: every rank takes part
            continue
        n, r = g.size, g.rank
        tri = _tri(n)
        x1 = torch.full((5,), float(r))
        w1 = dist.all_reduce(x1, group=g.pg, async_op=True)  # posted
        a2a_in = [torch.full((2,), float(r * 10 + j)) for j in range(n)]
        a2a_out = [torch.empty(2) for _ in range(n)]
        w2 = dist.all_to_all(a2a_out, a2a_in, group=g.pg, async_op=True)  # comm thread
        x3 = torch.full((3,), float(r + 1))
        dist.all_reduce(x3, group=g.pg)  # blocking, behind the queued all_to_all
        big = torch.full((40000,), float(r))  # 160 KB: past 64 KiB, the blocking form on the comm thread
        w4 = dist.all_reduce(big, group=g.pg, async_op=True)
        h = torch.full((7,), float(r), dtype=torch.float16)
        w5 = dist.all_reduce(h, group=g.pg, async_op=True)  # float16: its blocking form on the comm thread
        x6 = torch.full((4,), float(r + 2))
        w6 = dist.all_reduce(x6, group=g.pg, async_op=True)  # queued behind those, then posted and waited there
        base = torch.full((4, 6), float(r))
        view = base[:, ::2]  # strided: staged, same nonblocking form
        w7 = dist.all_reduce(view, group=g.pg, async_op=True)
        x8 = torch.full((2,), float(r))
        dist.broadcast(x8, group=g.pg, group_src=n - 1)  # blocking
        for w in (w7, w6, w5, w4, w2, w1):
            w.wait()
        assert torch.all(x1 == tri)
        assert [t.tolist() for t in a2a_out] == [[float(j * 10 + r)] * 2 for j in range(n)]
        assert torch.all(x3 == tri + n)
        assert torch.all(big == tri)
        assert torch.all(h == tri)
        assert torch.all(x6 == tri + 2 * n)
        assert torch.all(base[:, ::2] == tri) and torch.all(base[:, 1::2] == r)
        assert torch.all(x8 == n - 1)
        assert same_on_all_ranks(torch.cat([x1, x3, big[:3], h.float(), x6, base[:, ::2].reshape(-1)]), g.ranks)


def test_posted_future_callback_issues_collectives(world, posted):
    """get_future().then(callback issuing a collective), as PowerSGD does,
    interleaved with later ops: the callback's op runs at one point of the op
    order on every rank, and every result is right."""
    rank, size = world
    tri = _tri(size)
    seen = []
    inner = torch.empty(0)

    def callback(fut):
        t = fut.value()[0]
        nonlocal inner
        inner = t.clone()
        dist.all_reduce(inner)  # a collective issued from the callback
        w = dist.all_reduce(t, async_op=True)  # an async one too: posted and waited there
        w.wait()
        seen.append(threading.current_thread().name)
        return t

    first = torch.full((6,), float(rank))
    fut = dist.all_reduce(first, async_op=True).get_future().then(callback)
    later = torch.full((6,), float(rank + 1))
    w_later = dist.all_reduce(later, async_op=True)
    gathered = torch.empty(6 * size)
    w_gather = dist.all_gather_into_tensor(gathered, torch.full((6,), float(rank)), async_op=True)
    blocking = torch.full((6,), 1.0)
    dist.all_reduce(blocking)
    done = fut.wait()
    w_gather.wait()
    w_later.wait()
    assert torch.all(inner == tri * size)
    assert torch.all(done == tri * size) and torch.all(first == tri * size)
    assert torch.all(later == tri + size)
    assert torch.equal(gathered, torch.arange(size, dtype=torch.float32).repeat_interleave(6))
    assert torch.all(blocking == size)
    assert seen and seen[0] in ("hpccomm-comm", threading.main_thread().name)
    assert same_on_all_ranks(torch.cat([inner, done, later, gathered, blocking]))


def test_posted_wait_with_timeout_and_polling(world, posted):
    """wait(timeout) on a posted collective whose peers come late raises
    TimeoutError and leaves it pending; is_completed() polls it to completion."""
    from datetime import timedelta

    from helpers import verdict_comm

    rank, size = world
    side = verdict_comm()
    t = torch.full((8,), float(rank))
    timed_out = False
    if rank == 0:
        work = dist.all_reduce(t, async_op=True)
        if size > 1:
            try:
                work.wait(timeout=timedelta(milliseconds=50))
            except TimeoutError:
                timed_out = True
        side.barrier()  # the others post only now
    else:
        side.barrier()
        work = dist.all_reduce(t, async_op=True)
    deadline = time.monotonic() + 60
    while not work.is_completed():
        assert time.monotonic() < deadline, "is_completed() never turned True"
        time.sleep(1e-3)
    assert work.is_success() and work.wait(timeout=timedelta(seconds=5))
    assert torch.all(t == _tri(size))
    flags = side.allgather(timed_out)
    assert flags[0] == (size > 1)


def test_posted_non_contiguous(world, posted):
    """Strided tensors in the four posted ops: staged through a contiguous
    buffer and written back; what is not part of the tensor is untouched."""
    rank, size = world
    tri = _tri(size)
    base = torch.full((5, 4), float(rank))
    w1 = dist.all_reduce(base[:, 1::2], async_op=True, op=dist.ReduceOp.AVG)
    out_base = torch.full((3, 2 * size), -1.0)
    out = out_base.t()[::1]  # non-contiguous output of 2*size x 3
    inp = torch.full((3, 2), float(rank)).t()  # non-contiguous input, 2 x 3
    w2 = dist.all_gather_into_tensor(out, inp, async_op=True)
    rs_in = (torch.arange(3 * size * 2, dtype=torch.float32).reshape(2, 3 * size) + rank).t()  # (3*size, 2)
    rs_out = torch.zeros(2, 3).t()  # (3, 2), non-contiguous
    w3 = dist.reduce_scatter_tensor(rs_out, rs_in, async_op=True)
    b_base = torch.full((4, 3), float(rank))
    w4 = dist.broadcast(b_base[:, 0], src=size - 1, async_op=True)
    for w in (w4, w3, w2, w1):
        w.wait()
    assert torch.all(base[:, 1::2] == tri / size) and torch.all(base[:, 0::2] == rank)
    assert torch.equal(out, torch.arange(size, dtype=torch.float32).repeat_interleave(2)[:, None].expand(-1, 3))
    full = sum(torch.arange(3 * size * 2, dtype=torch.float32).reshape(2, 3 * size).t() + r for r in range(size))
    assert torch.equal(rs_out, full[rank * 3:(rank + 1) * 3])
    assert torch.all(b_base[:, 0] == size - 1) and torch.all(b_base[:, 1:] == rank)
    assert same_on_all_ranks(torch.cat([base[:, 1::2].reshape(-1), out.reshape(-1), b_base[:, 0]]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int32, torch.int64, torch.uint8,
                                   torch.bool, torch.complex64, torch.float16, torch.bfloat16])
def test_posted_gather_and_broadcast_dtypes(world, posted, dtype):
    """all_gather_into_tensor and broadcast move every dtype in their async form."""
    rank, size = world

    def val(r):
        return torch.tensor([r % 2 == 1] * 3) if dtype == torch.bool else torch.full((3,), r + 1).to(dtype)
    out = torch.empty(3 * size, dtype=dtype)
    w1 = dist.all_gather_into_tensor(out, val(rank), async_op=True)
    b = val(rank)
    w2 = dist.broadcast(b, src=size - 1, async_op=True)
    w2.wait()
    w1.wait()
    assert torch.equal(out, torch.cat([val(r) for r in range(size)]))
    assert torch.equal(b, val(size - 1))


def test_posted_forms_in_place_and_aliased_twice(world, posted):
    """Each posted kind called twice with the same dtype and reduction (the
    second call's reduction found in the cache the first filled): in place and
    aliased buffers, a refusal after an accepted call, and results equal to
    each rank's own closed form."""
    rank, size = world
    tri = _tri(size)
    n = 4
    for k in range(2):
        a = torch.full((n,), float(rank + k))
        w_a = dist.all_reduce(a, async_op=True)
        # all_gather_into_tensor in place (the input is this rank's slot of the output)
        out = torch.full((n * size,), -1.0)
        out[rank * n:(rank + 1) * n] = rank + k
        w_g = dist.all_gather_into_tensor(out, out[rank * n:(rank + 1) * n], async_op=True)
        # ... and with the input in another rank's slot: MPI must read a copy
        other = (rank + 1) % size
        out2 = torch.arange(n * size, dtype=torch.float32) + 100 * rank + k
        sent = out2[other * n:(other + 1) * n].clone()
        w_g2 = dist.all_gather_into_tensor(out2, out2[other * n:(other + 1) * n], async_op=True)
        # reduce_scatter_tensor with the output inside the input (aliased: staged)
        rs = torch.arange(n * size, dtype=torch.float64) + rank + k
        w_r = dist.reduce_scatter_tensor(rs[rank * n:(rank + 1) * n], rs, async_op=True)
        rs2_in = torch.arange(n * size, dtype=torch.float64) + rank + k
        rs2_out = torch.empty(n, dtype=torch.float64)
        w_r2 = dist.reduce_scatter_tensor(rs2_out, rs2_in, async_op=True)
        b = torch.full((n,), rank + 10 * k, dtype=torch.int32)
        w_b = dist.broadcast(b, src=(size - 1 + k) % size, async_op=True)
        for w in (w_b, w_r2, w_r, w_g2, w_g, w_a):
            w.wait()
        assert torch.all(a == tri + size * k)
        assert torch.equal(out, (torch.arange(size, dtype=torch.float32) + k).repeat_interleave(n))
        slots = [torch.arange(n, dtype=torch.float32) + ((r + 1) % size) * n + 100 * r + k for r in range(size)]
        assert torch.equal(out2, torch.cat(slots)) and torch.equal(out2[rank * n:(rank + 1) * n], slots[rank])
        assert torch.equal(slots[rank], sent)
        mine = torch.arange(n * size, dtype=torch.float64)[rank * n:(rank + 1) * n] * size + tri + size * k
        assert torch.equal(rs[rank * n:(rank + 1) * n], mine) and torch.equal(rs2_out, mine)
        assert torch.all(b == (size - 1 + k) % size + 10 * k)
        assert same_on_all_ranks(torch.cat([a.double(), out.double(), out2.double(), b.double()]))
    # a refusal after accepted calls: raised on this rank, before any communication
    short = torch.empty(n * size + 1)
    with pytest.raises(hpccomm.HpccommError, match=r"all_gather_into_tensor.*output has"):
        dist.all_gather_into_tensor(short, torch.ones(n), async_op=True)
    assert dist.all_reduce(torch.ones(1), async_op=True).wait()  # the group still works
