"""Async completion under stress: mixed async ops (queued on the comm thread,
and posted with HPCCOMM_ASYNC_NONBLOCKING=1), waited by several threads at
once in random orders, with get_future().then(...) chains, wait(timeout),
is_completed() polling, and a peer that stalls.  Every result right on every
rank, every callback run once, no hang: every wait has a limit, and the
whole run is a fixed number of rounds (hpccomm._core.record)."""
from __future__ import annotations

import contextlib
import random
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from helpers import nonblocking_async, same_on_all_ranks, verdict_comm

pytestmark = pytest.mark.mpi

ROUNDS = 8
OPS = 10  # async ops per round, besides the point-to-point ring and a blocking op
WAITERS = 3  # threads waiting on every Work of a round, each in its own order
LIMIT = timedelta(seconds=60)  # every wait is bounded: a hang fails the test instead


def _tri(n: int) -> int:
    return n * (n - 1) // 2


def _issue(kind: str, rank: int, size: int, k: int):
    """One async op of ``kind`` (salt ``k``): ``(work, check)``, ``check()``
    asserting its result in closed form and returning it (for the cross-rank
    comparison)."""
    if kind == "all_reduce":
        t = torch.full((5,), float(rank + k))
        return dist.all_reduce(t, async_op=True), lambda: _eq(t, torch.full((5,), float(_tri(size) + size * k)))
    if kind == "all_reduce_avg":
        t = torch.full((3,), float(2 * rank + k), dtype=torch.float64)
        w = dist.all_reduce(t, op=dist.ReduceOp.AVG, async_op=True)
        return w, lambda: _eq(t, torch.full((3,), (2 * _tri(size) + size * k) / size, dtype=torch.float64))
    if kind == "all_reduce_half":  # a user-defined MPI op: always the comm thread's blocking form
        t = torch.full((4,), float(rank % 3), dtype=torch.float16)
        total = float(sum(r % 3 for r in range(size)))
        return dist.all_reduce(t, async_op=True), lambda: _eq(t, torch.full((4,), total, dtype=torch.float16))
    if kind == "all_reduce_big":  # past 64 KiB: always the comm thread's blocking form
        t = torch.full((20000,), float(k))
        return dist.all_reduce(t, async_op=True), lambda: _eq(t, torch.full((20000,), float(size * k)))
    if kind == "all_gather":
        out = torch.empty(4 * size)
        w = dist.all_gather_into_tensor(out, torch.full((4,), float(rank * 10 + k)), async_op=True)
        return w, lambda: _eq(out, (torch.arange(size, dtype=torch.float32) * 10 + k).repeat_interleave(4))
    if kind == "reduce_scatter":
        inp = torch.arange(3 * size, dtype=torch.float64) + rank + k
        out = torch.empty(3, dtype=torch.float64)
        w = dist.reduce_scatter_tensor(out, inp, async_op=True)
        mine = torch.arange(3 * size, dtype=torch.float64)[rank * 3:(rank + 1) * 3]
        return w, lambda: _eq(out, size * (mine + k) + _tri(size))
    if kind == "broadcast":
        root = k % size
        t = torch.full((6,), rank + 100 * k, dtype=torch.int64)
        return dist.broadcast(t, src=root, async_op=True), lambda: _eq(t, torch.full((6,), root + 100 * k))
    if kind == "all_to_all":  # no nonblocking form: the comm thread
        out = torch.empty(2 * size)
        inp = torch.arange(2 * size, dtype=torch.float32) + 100 * rank + k
        w = dist.all_to_all_single(out, inp, async_op=True)
        expect = torch.cat([torch.arange(2 * rank, 2 * rank + 2, dtype=torch.float32) + 100 * r + k
                            for r in range(size)])
        return w, lambda: _eq(out, expect)
    raise ValueError(kind)


KINDS = ("all_reduce", "all_reduce_avg", "all_reduce_half", "all_reduce_big", "all_gather", "reduce_scatter",
         "broadcast", "all_to_all")
PER_RANK = ("reduce_scatter", "all_to_all")  # each rank gets its own part: left out of the cross-rank comparison


def _eq(actual: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    assert torch.equal(actual, expected), (actual, expected)
    return actual.double().reshape(-1)


def _wait_somehow(work, how: str) -> None:
    """Wait for ``work`` one of the ways torch code does, never without a limit."""
    if how == "wait":
        assert work.wait(LIMIT)
        return
    done = work.get_future().done if how == "future" else work.is_completed  # (the future completes on its own)
    deadline = time.monotonic() + LIMIT.total_seconds()
    while not done():  # polling, as a training loop checking for overlap does
        assert time.monotonic() < deadline, f"{how}: never complete"
        time.sleep(1e-4)
    if how == "future":
        work.get_future().wait()


@pytest.mark.parametrize("posted", [False, True], ids=["comm-thread", "posted"])
def test_async_completion_under_concurrent_waiters(world, posted):
    rank, size = world
    side = verdict_comm()
    shared = random.Random(29)  # the same on every rank: what is issued, in which order
    mine = random.Random(1000 + rank)  # this rank's own: how and in which order each waiter waits
    calls: dict = {}  # callback key -> times it ran
    lock = threading.Lock()

    def counted(key, then=None):
        def callback(fut):
            with lock:
                calls[key] = calls.get(key, 0) + 1
            value = fut.value()
            return value if then is None else then(value)
        return callback

    flats, chains = [], []
    context = nonblocking_async() if posted else contextlib.nullcontext()
    with context:
        for rnd in range(ROUNDS):
            works, checks, kinds, chained = [], [], [], []
            stall = size > 1 and rnd % 3 == 1  # a peer that stalls: it issues this round's first op late
            staller = rnd % size
            if stall and rank == staller:
                side.barrier()  # until every other rank saw its first op time out
            for i in range(OPS):
                kind = shared.choice(KINDS)
                w, check = _issue(kind, rank, size, rnd * OPS + i)
                if stall and i == 0 and rank != staller:
                    with pytest.raises(TimeoutError):
                        w.wait(timedelta(milliseconds=20))  # the staller has not issued it yet
                    side.barrier()
                if shared.random() < 0.4:  # a chain asked for in issue order, as DDP's hooks are
                    key = (rnd, i)
                    fut = w.get_future().then(counted(key + (1,))).then(counted(key + (2,), lambda v: v[0] * 2))
                    chained.append((key, fut, check))
                works.append(w)
                checks.append(check)
                kinds.append(kind)
            # a point-to-point ring, posted, and a blocking op queued behind the async ones
            ring_in, ring_out = torch.empty(4), torch.full((4,), float(rank + rnd))
            ring = [dist.irecv(ring_in, (rank - 1) % size), dist.isend(ring_out, (rank + 1) % size)]
            blocking = torch.full((2,), 1.0)
            dist.all_reduce(blocking)
            works += ring
            # several threads wait on every Work at once, each in its own order and its own ways
            errors: list = []
            plans = [(mine.sample(works, len(works)), [mine.choice(("wait", "future", "poll")) for _ in works])
                     for _ in range(WAITERS)]

            def waiter(order, hows):
                try:
                    for w, how in zip(order, hows):
                        _wait_somehow(w, how)
                except BaseException as exc:  # noqa: BLE001 - reported below
                    errors.append(exc)

            threads = [threading.Thread(target=waiter, args=plan) for plan in plans]
            for t in threads:
                t.start()
            for w in works[::-1]:  # the main thread waits too, in reverse issue order
                assert w.wait(LIMIT)
            for t in threads:
                t.join(LIMIT.total_seconds())
                assert not t.is_alive(), "a waiter thread hangs"
            assert not errors, errors
            assert all(w.is_completed() and w.is_success() and w.exception() is None for w in works)
            for key, fut, check in chained:  # the chain's value: the op's output, doubled by its last callback
                assert torch.equal(fut.wait().double().reshape(-1), check() * 2), key
            chains += [key for key, _, _ in chained]
            flats += [check() for check, kind in zip(checks, kinds) if kind not in PER_RANK]
            assert torch.equal(ring_in, torch.full((4,), float((rank - 1) % size + rnd)))
            assert torch.all(blocking == size)
    expected = {key + (step,) for key in chains for step in (1, 2)}
    assert all(calls.get(k) == 1 for k in expected), {k: calls.get(k) for k in expected if calls.get(k) != 1}
    assert all(n == 1 for n in calls.values()), calls
    assert same_on_all_ranks(torch.cat(flats))
