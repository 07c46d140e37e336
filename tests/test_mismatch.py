"""A collective that the ranks of a group call differently raises on every
rank, before any data moves, naming each rank's call and the op number
(hpccomm._core.signatures).  By default every call is compared
(``HPCCOMM_MISMATCH_CHECK=every``): for every collective, coalesced ones
included, a call after agreed ones that differs on one rank in its count,
dtype, ReduceOp, root or splits, or a different collective altogether, in
the blocking, async (queued) and posted forms; every rank raises, no rank
returns, the tensors are untouched, the group still works.  Each rank's
message is computed here from what every rank called.  The first-call mode
(``first``) keeps its own tests below, each on a group made in that mode.
"""
from __future__ import annotations

import contextlib
import re

import pytest
import torch
import torch.distributed as dist

import helpers
import hpccomm
from helpers import R, hgroup, verdict_comm

pytestmark = [pytest.mark.usefixtures("world")]
TWO = pytest.mark.mpi(min_size=2)  # (a mismatch needs two ranks: every test but the agreement's)

HINT = ("Nothing was sent. The ranks of a group must call the same collectives in the same order with matching "
        "sizes, dtypes, ReduceOps and roots")
SENTINEL = -7.0
DTYPE = {torch.float32: "float32", torch.int32: "int32", torch.float64: "float64"}


def listing(descriptions, seq: int) -> str:
    """``rank 0 called X (op #n); ranks 1, 2 called Y (op #n)``: ranks with one call listed together, in rank order."""
    calls: dict = {}
    for r, d in enumerate(descriptions):
        calls.setdefault(d, []).append(r)
    return "; ".join(f"{'ranks' if len(rs) > 1 else 'rank'} {', '.join(map(str, rs))} called {d} (op #{seq})"
                     for d, rs in calls.items())


def snapshot(tensors):
    return [t.clone() for t in tensors]


def untouched(tensors, before) -> bool:
    return all(torch.equal(t, b) for t, b in zip(tensors, before))


def verdict(ok: bool, what) -> None:
    """A failed expectation fails on every rank, naming the ranks (every rank enters)."""
    everyone = verdict_comm().allgather((ok, repr(what)[:600]))
    bad = [(r, w) for r, (k, w) in enumerate(everyone) if not k]
    assert not bad, bad


# --------------------------------------------------------------------------
# the cases: one call per rank (the last rank's differs), with each rank's
# description as the message must give it
# --------------------------------------------------------------------------

class Case:
    """``call(n, dtype, redop, root, odd)``: the op on fresh tensors (sizes from
    ``n``), returning its Work or None and the tensors it must leave as they
    were; ``describe(...)``: how the message names that call; ``vary``: the
    fields a rank could get wrong, each ``(name, what the odd rank passes)``."""

    def __init__(self, name, call, describe, vary, reducing=False, rooted=False, posted=False):
        self.name, self.call, self.describe, self.vary = name, call, describe, vary
        self.reducing, self.rooted, self.posted = reducing, rooted, posted


def _full(n, dtype, rank):
    return torch.full((n,), SENTINEL if dtype.is_floating_point else -7, dtype=dtype)


def _ones(n, dtype):
    return torch.ones(n, dtype=dtype)


# Each returns ``(tensors, run)``: the call's tensors (outputs filled with SENTINEL, inputs with ones) and
# ``run(async_op)``, which makes the call and returns its Work (or None).

def all_reduce(pg, n, dtype, redop, root, size, rank):
    t = _full(n, dtype, rank)
    return [t], lambda a: dist.all_reduce(t, op=redop, group=pg, async_op=a)


def reduce(pg, n, dtype, redop, root, size, rank):
    t = _full(n, dtype, rank)
    return [t], lambda a: dist.reduce(t, dst=root, op=redop, group=pg, async_op=a)


def broadcast(pg, n, dtype, redop, root, size, rank):
    t = _full(n, dtype, rank)
    return [t], lambda a: dist.broadcast(t, src=root, group=pg, async_op=a)


def all_gather_into_tensor(pg, n, dtype, redop, root, size, rank):
    out, inp = _full(n * size, dtype, rank), _ones(n, dtype)
    return [out, inp], lambda a: dist.all_gather_into_tensor(out, inp, group=pg, async_op=a)


def reduce_scatter_tensor(pg, n, dtype, redop, root, size, rank):
    out, inp = _full(n, dtype, rank), _ones(n * size, dtype)
    return [out, inp], lambda a: dist.reduce_scatter_tensor(out, inp, op=redop, group=pg, async_op=a)


def all_gather(pg, n, dtype, redop, root, size, rank):
    outs, inp = [_full(n, dtype, rank) for _ in range(size)], _ones(n, dtype)
    return [*outs, inp], lambda a: dist.all_gather(outs, inp, group=pg, async_op=a)


def reduce_scatter(pg, n, dtype, redop, root, size, rank):
    out, ins = _full(n, dtype, rank), [_ones(n, dtype) for _ in range(size)]
    return [out, *ins], lambda a: dist.reduce_scatter(out, ins, op=redop, group=pg, async_op=a)


def gather(pg, n, dtype, redop, root, size, rank):
    inp = _ones(n, dtype)
    outs = [_full(n, dtype, rank) for _ in range(size)] if rank == root else None
    return [inp, *(outs or [])], lambda a: dist.gather(inp, outs, dst=root, group=pg, async_op=a)


def scatter(pg, n, dtype, redop, root, size, rank):
    out = _full(n, dtype, rank)
    ins = [_ones(n, dtype) for _ in range(size)] if rank == root else None
    return [out, *(ins or [])], lambda a: dist.scatter(out, ins, src=root, group=pg, async_op=a)


def all_to_all_single(pg, n, dtype, redop, root, size, rank):
    # n rows to the last rank, 1 to each other: the odd rank sends 2 to the last rank, which expects 1 from it
    splits = [1] * (size - 1) + [n]
    out, inp = _full(size, dtype, rank), _ones(sum(splits), dtype)
    return [out, inp], lambda a: dist.all_to_all_single(out, inp, None, splits, group=pg, async_op=a)


def all_to_all(pg, n, dtype, redop, root, size, rank):
    outs = [_full(1, dtype, rank) for _ in range(size)]
    ins = [_ones(1, dtype) for _ in range(size - 1)] + [_ones(n, dtype)]
    return [*outs, *ins], lambda a: dist.all_to_all(outs, ins, group=pg, async_op=a)


def all_reduce_coalesced(pg, n, dtype, redop, root, size, rank):
    ts = [_full(3, dtype, rank), _full(n, dtype, rank)]
    return ts, lambda a: dist.all_reduce_coalesced(ts, op=redop, group=pg, async_op=a)


def _coalesced(pg, a, calls):
    with dist._coalescing_manager(group=pg, async_ops=a) as cm:
        for call in calls:
            call()
    return cm if a else None


def all_gather_into_tensor_coalesced(pg, n, dtype, redop, root, size, rank):
    outs, ins = [_full(3 * size, dtype, rank), _full(n * size, dtype, rank)], [_ones(3, dtype), _ones(n, dtype)]
    return [*outs, *ins], lambda a: _coalesced(pg, a, [lambda o=o, i=i: dist.all_gather_into_tensor(o, i, group=pg)
                                                        for o, i in zip(outs, ins)])


def reduce_scatter_tensor_coalesced(pg, n, dtype, redop, root, size, rank):
    outs, ins = [_full(3, dtype, rank), _full(n, dtype, rank)], [_ones(3 * size, dtype), _ones(n * size, dtype)]
    return [*outs, *ins], lambda a: _coalesced(pg, a, [
        lambda o=o, i=i: dist.reduce_scatter_tensor(o, i, op=redop, group=pg) for o, i in zip(outs, ins)])


def all_gather_coalesced(pg, n, dtype, redop, root, size, rank):
    outs = [[_full(3, dtype, rank), _full(n, dtype, rank)] for _ in range(size)]
    ins = [_ones(3, dtype), _ones(n, dtype)]
    return [*[t for o in outs for t in o], *ins], lambda a: dist.all_gather_coalesced(outs, ins, group=pg,
                                                                                       async_op=a)


def _d(dtype):
    return DTYPE[dtype]


def _lst(dtype, n, size):
    return "[" + ", ".join([f"{_d(dtype)}[{n}]"] * size) + "]"


COUNT, DTYPE_, REDOP, ROOT, SPLIT = "count", "dtype", "ReduceOp", "root", "split"
CASES = [
    Case("all_reduce", all_reduce, lambda n, d, o, root, s: f"all_reduce({_d(d)}[{n}], {o})",
         [COUNT, DTYPE_, REDOP], reducing=True, posted=True),
    Case("reduce", reduce, lambda n, d, o, root, s: f"reduce({_d(d)}[{n}], {o}, root {root})",
         [COUNT, DTYPE_, REDOP, ROOT], reducing=True, rooted=True),
    Case("broadcast", broadcast, lambda n, d, o, root, s: f"broadcast({_d(d)}[{n}], root {root})",
         [COUNT, DTYPE_, ROOT], rooted=True, posted=True),
    Case("all_gather_into_tensor", all_gather_into_tensor,
         lambda n, d, o, root, s: f"all_gather_into_tensor({_d(d)}[{n}], {_d(d)}[{n * s}])", [COUNT, DTYPE_],
         posted=True),
    Case("reduce_scatter_tensor", reduce_scatter_tensor,
         lambda n, d, o, root, s: f"reduce_scatter_tensor({_d(d)}[{n * s}], {_d(d)}[{n}], {o})", [COUNT, DTYPE_, REDOP],
         reducing=True, posted=True),
    Case("all_gather", all_gather, lambda n, d, o, root, s: f"all_gather({_lst(d, n, s)})", [DTYPE_]),
    Case("reduce_scatter", reduce_scatter, lambda n, d, o, root, s: f"reduce_scatter({_d(d)}[{n}], {o})",
         [COUNT, DTYPE_, REDOP], reducing=True),
    Case("gather", gather, lambda n, d, o, root, s: f"gather({_d(d)}[{n}], root {root})", [COUNT, DTYPE_, ROOT],
         rooted=True),
    Case("scatter", scatter, lambda n, d, o, root, s: f"scatter({_d(d)}[{n}], root {root})", [COUNT, DTYPE_, ROOT],
         rooted=True),
    Case("all_to_all_single", all_to_all_single, lambda n, d, o, root, s: f"all_to_all_single(dtype {_d(d)})",
         [SPLIT, DTYPE_]),
    Case("all_to_all", all_to_all, lambda n, d, o, root, s: f"all_to_all(dtype {_d(d)})", [SPLIT, DTYPE_]),
    Case("all_reduce_coalesced", all_reduce_coalesced,
         lambda n, d, o, root, s: f"all_reduce_coalesced({_d(d)}[3], {_d(d)}[{n}], {o})", [COUNT, DTYPE_, REDOP],
         reducing=True),
    Case("all_gather_into_tensor_coalesced", all_gather_into_tensor_coalesced,
         lambda n, d, o, root, s: f"all_gather_into_tensor_coalesced({_d(d)}[3], {_d(d)}[{3 * s}], {_d(d)}[{n}], "
                                  f"{_d(d)}[{n * s}])", [COUNT, DTYPE_]),
    Case("reduce_scatter_tensor_coalesced", reduce_scatter_tensor_coalesced,
         lambda n, d, o, root, s: f"reduce_scatter_tensor_coalesced({_d(d)}[{3 * s}], {_d(d)}[3], {_d(d)}[{n * s}], "
                                  f"{_d(d)}[{n}], {o})", [COUNT, DTYPE_, REDOP], reducing=True),
    Case("all_gather_coalesced", all_gather_coalesced,
         lambda n, d, o, root, s: f"all_gather_coalesced({_lst(d, 3, s)}, {_lst(d, n, s)})", [DTYPE_]),
]
BY_NAME = {c.name: c for c in CASES}


def _args(case, field, odd: bool, size: int):
    """``(n, dtype, redop, root)`` of a call: the agreed one, or the odd rank's in ``field``."""
    n, dtype, redop, root = (1 if case.name.startswith("all_to_all") else 4), torch.float32, R.SUM, 0
    if odd:
        if field in (COUNT, SPLIT):
            n = 2 if case.name.startswith("all_to_all") else 6
        elif field == DTYPE_:
            dtype = torch.int32 if not case.reducing else torch.float64
        elif field == REDOP:
            redop = R.MAX
        elif field == ROOT:
            root = 1
    return n, dtype, redop, root


def _name(redop) -> str:
    return str(redop).split(".")[-1]


def run_case(pg, case, field, form):
    """Every rank makes ``case``'s agreed calls (the odd rank's variant too, by
    every rank, so that both signatures are known to the group), then the
    call where the last rank differs in ``field``.  Returns this rank's
    outcome (its error's message, or None if it returned), whether its
    tensors stayed as they were, and the message it must give."""
    rank, size = dist.get_rank(), dist.get_world_size()
    g = hgroup(pg)
    for variant in ((False,) if field == SPLIT else (False, True)):  # (uneven splits on every rank would not fit)
        n, dtype, redop, root = _args(case, field, variant, size)
        _, call = case.call(pg, n, dtype, redop, root, size, rank)
        assert call(False) is None
    seq = g.seq + 1
    n, dtype, redop, root = _args(case, field, rank == size - 1, size)
    tensors, call = case.call(pg, n, dtype, redop, root, size, rank)
    before = snapshot(tensors)
    outcome = None
    try:
        with helpers.nonblocking_async() if form == "posted" else contextlib.nullcontext():
            work = call(form != "blocking")
            if work is not None:
                work.wait()
    except hpccomm.HpccommError as exc:
        outcome = str(exc)
    except RuntimeError as exc:  # (torch hands some async calls back as a future: its error wraps hpccomm's)
        outcome = re.sub(r"^Got the following error when running the callback: HpccommError: ", "",
                         str(exc)).split("\n")[0]  # (then the callback's traceback)

    def described(r):
        n, dtype, redop, root = _args(case, field, r == size - 1, size)
        return case.describe(n, dtype, _name(redop), root, size)

    fit = f": rank {size - 1} sends 2 elements to rank {size - 1}, which expects 1 from it" if field == SPLIT else ""
    want = (f"hpccomm {case.name} (op #{seq} on group '{g.name}', rank {rank}/{size}): the ranks called this "
            f"collective differently: {listing([described(r) for r in range(size)], seq)}{fit}. {HINT}")
    return outcome, untouched(tensors, before), want


FORMS = ["blocking", "async", "posted"]
MATRIX = [(c.name, f, form) for c in CASES for f in c.vary for form in FORMS if form != "posted" or c.posted]


@TWO
@pytest.mark.parametrize("name,field,form", MATRIX, ids=[f"{n}-{f}-{m}" for n, f, m in MATRIX])
def test_every_call_is_compared(name, field, form):
    """After agreed calls, one that the last rank makes differently (its count,
    dtype, ReduceOp, root or splits) raises on every rank, naming each rank's
    call and the op number; no rank returns; the tensors are untouched; the
    group still works."""
    pg = dist.new_group(list(range(dist.get_world_size())))
    case = BY_NAME[name]
    outcome, same, want = run_case(pg, case, field, form)
    verdict(outcome is not None, (name, field, form, "returned"))
    verdict(outcome == want, (outcome, want))
    verdict(same, (name, field, form, "tensors changed"))
    t = torch.ones(3)
    dist.all_reduce(t, group=pg)  # the group still works
    verdict(bool(torch.all(t == dist.get_world_size())), t)


@pytest.mark.mpi
def test_agreed_calls_pass_the_check_at_every_size():
    """Calls that agree are compared and run (no false alarm), at every size,
    one rank included, in every form; hpccomm.explain says each is compared."""
    pg, rank, size = dist.new_group(list(range(dist.get_world_size()))), dist.get_rank(), dist.get_world_size()
    for case in CASES:
        for form in ("blocking", "async"):
            tensors, call = case.call(pg, *_args(case, None, False, size), size, rank)
            work = call(form == "async")
            if work is not None:
                work.wait()
    assert hpccomm.explain("all_reduce", [torch.ones(2)], R.SUM, group=pg).compared
    t = torch.ones(2)
    dist.all_reduce(t, group=pg)
    assert torch.all(t == size)


# --------------------------------------------------------------------------
# the first-call mode (HPCCOMM_MISMATCH_CHECK=first)
# --------------------------------------------------------------------------

def fresh():
    """A group of every rank in the first-call mode, new: none of its signatures agreed on yet."""
    with helpers.setting("HPCCOMM_MISMATCH_CHECK", "first"):
        return dist.new_group(list(range(dist.get_world_size())))


def each_rank(describe) -> str:
    """``rank 0 called X (op #1); rank 1 called Y (op #1); ...`` with ``describe(rank)`` as X."""
    return "; ".join(f"rank {r} called {describe(r)} (op #1)" for r in range(dist.get_world_size()))


def expect(message: str, op: str, what: str, pg) -> None:
    """``message`` is this rank's, as it must read: checked on every rank, the verdict gathered."""
    rank, size = dist.get_rank(), dist.get_world_size()
    head = f"hpccomm {op} (op #1 on group '{hgroup(pg).name}', rank {rank}/{size}): "
    want = f"{head}the ranks called this collective differently: {what}. {HINT}"
    ok = verdict_comm().allgather(message == want)
    assert all(ok), (ok, message, want)


def run(call):
    with pytest.raises(hpccomm.HpccommError) as info:
        call()
    return str(info.value)


@TWO
def test_all_reduce_of_different_sizes_is_named_on_every_rank():
    pg, rank, size = fresh(), dist.get_rank(), dist.get_world_size()
    t = torch.full((4 + rank,), SENTINEL)
    message = run(lambda: dist.all_reduce(t, group=pg))
    expect(message, "all_reduce", each_rank(lambda r: f"all_reduce(float32[{4 + r}], SUM)"), pg)
    assert torch.all(t == SENTINEL)  # nothing ran
    t = torch.ones(3)
    dist.all_reduce(t, group=pg)  # the group still works
    assert torch.all(t == size)


@TWO
def test_broadcast_of_different_sizes_is_named_on_every_rank():
    # Without the check, MPI returns a silently wrong tensor on every rank.
    pg, rank = fresh(), dist.get_rank()
    t = torch.full((4 + rank,), SENTINEL)
    message = run(lambda: dist.broadcast(t, src=0, group=pg))
    expect(message, "broadcast", each_rank(lambda r: f"broadcast(float32[{4 + r}], root 0)"), pg)
    assert torch.all(t == SENTINEL)
    t = torch.full((2,), float(rank))
    dist.broadcast(t, src=0, group=pg)
    assert torch.all(t == 0)


@TWO
def test_all_gather_of_different_sizes_is_named_on_every_rank():
    pg, rank, size = fresh(), dist.get_rank(), dist.get_world_size()
    outs = [torch.full((4 + rank,), SENTINEL) for _ in range(size)]  # each expects its own size from all
    message = run(lambda: dist.all_gather(outs, torch.ones(4 + rank), group=pg))
    lists = lambda r: ", ".join([f"float32[{4 + r}]"] * size)  # noqa: E731 - each rank's list: its own size
    expect(message, "all_gather", each_rank(lambda r: f"all_gather([{lists(r)}])") + ": rank 0 sends 4 elements to "
           "rank 1, which expects 5 from it", pg)
    assert all(torch.all(o == SENTINEL) for o in outs)
    outs = [torch.empty(r + 1) for r in range(size)]  # sizes that differ but fit: allowed
    dist.all_gather(outs, torch.full((rank + 1,), float(rank)), group=pg)
    assert all(torch.all(o == r) for r, o in enumerate(outs))


@TWO
def test_reduce_scatter_of_different_sizes_is_named_on_every_rank():
    pg, rank, size = fresh(), dist.get_rank(), dist.get_world_size()
    out = torch.full((4 + rank,), SENTINEL)
    message = run(lambda: dist.reduce_scatter(out, [torch.ones(4 + rank) for _ in range(size)], group=pg))
    expect(message, "reduce_scatter", each_rank(lambda r: f"reduce_scatter(float32[{4 + r}], SUM)"), pg)
    assert torch.all(out == SENTINEL)


@pytest.mark.mpi(min_size=3)
def test_ranks_that_agree_are_listed_together():
    pg, rank = fresh(), dist.get_rank()
    last = dist.get_world_size() - 1
    t = torch.ones(8 if rank == last else 4)
    message = run(lambda: dist.all_reduce(t, op=R.MAX, group=pg))
    agree = ", ".join(map(str, range(last)))
    expect(message, "all_reduce", f"rank{'s' if last > 1 else ''} {agree} called all_reduce(float32[4], MAX) "
                                  f"(op #1); rank {last} called all_reduce(float32[8], MAX) (op #1)", pg)


@TWO
def test_a_different_reduce_op_or_root_is_named():
    pg, rank = fresh(), dist.get_rank()
    t = torch.ones(2)
    message = run(lambda: dist.all_reduce(t, op=R.MAX if rank == 1 else R.SUM, group=pg))
    assert re.search(r"rank 1 called all_reduce\(float32\[2\], MAX\) \(op #1\)", message), message
    message = run(lambda: dist.broadcast(t, src=1 if rank == 1 else 0, group=pg))
    assert "rank 1 called broadcast(float32[2], root 1) (op #2)" in message, message


@pytest.mark.mpi
def test_only_the_first_call_of_a_signature_is_compared():
    """hpccomm.explain says whether a call would be compared: a new
    signature is, and once the ranks agreed on it, it is not (a training loop
    pays on its first step only)."""
    pg = fresh()
    t = torch.ones(6)
    assert hpccomm.explain("all_reduce", [t], R.SUM, group=pg).compared
    dist.all_reduce(t, group=pg)
    assert not hpccomm.explain("all_reduce", [t], R.SUM, group=pg).compared
    assert hpccomm.explain("all_reduce", [torch.ones(7)], R.SUM, group=pg).compared  # another size
    assert hpccomm.explain("all_to_all_single", torch.empty(0), torch.empty(0), [], [], group=pg).compared
    dist.all_to_all_single(torch.empty(0), torch.empty(0), group=pg)  # its first call of a dtype is compared
    assert not hpccomm.explain("all_to_all_single", torch.empty(0), torch.empty(0), [], [], group=pg).compared
    assert torch.all(t == dist.get_world_size())



# --------------------------------------------------------------------------
# a different collective: the classic desync
# --------------------------------------------------------------------------

@TWO
@pytest.mark.parametrize("form", FORMS)
def test_a_different_collective_is_named_on_every_rank(form):
    """The last rank calls another collective whose signature the group
    knows (a broadcast where the others all_reduce, both agreed on before),
    or skips a step's all_reduce and calls the next op (a barrier): every rank
    raises, naming each rank's call, before any data moves (without the
    check: wrong data, or a hang until the timeout)."""
    pg, rank, size = dist.new_group(list(range(dist.get_world_size()))), dist.get_rank(), dist.get_world_size()
    g, last = hgroup(pg), rank == size - 1
    dist.all_reduce(torch.ones(4), group=pg)
    dist.broadcast(torch.ones(4), src=0, group=pg)
    dist.barrier(group=pg)
    for other, described in (("broadcast", "broadcast(float32[4], root 0)"), ("barrier", "barrier()")):
        seq = g.seq + 1
        t = torch.full((4,), SENTINEL)
        outcome = None
        try:
            with helpers.nonblocking_async() if form == "posted" else contextlib.nullcontext():
                a = form != "blocking"
                if not last:
                    work = dist.all_reduce(t, group=pg, async_op=a)
                elif other == "broadcast":
                    work = dist.broadcast(t, src=0, group=pg, async_op=a)
                else:
                    work = dist.barrier(group=pg, async_op=a)
                if work is not None:
                    work.wait()
        except hpccomm.HpccommError as exc:
            outcome = str(exc)
        mine = other if last else "all_reduce"
        calls = ["all_reduce(float32[4], SUM)"] * (size - 1) + [described]
        want = (f"hpccomm {mine} (op #{seq} on group '{g.name}', rank {rank}/{size}): the ranks called this "
                f"collective differently: {listing(calls, seq)}. {HINT}")
        verdict(outcome == want, (form, other, outcome, want))
        verdict(bool(torch.all(t == SENTINEL)), (form, other, t))
    t = torch.ones(3)
    dist.all_reduce(t, group=pg)
    verdict(bool(torch.all(t == size)), t)


@TWO
@pytest.mark.parametrize("form", ["blocking", "async"])
def test_a_refusal_on_one_rank_is_raised_on_every_rank(form):
    """The last rank's own checks refuse the call (its list does not fit its
    input) while the others call it correctly: its refusal joins their
    comparison, so every rank raises at once (that rank its own OpError, the
    others an error naming it, its message and the fix), nothing is sent,
    and no rank waits for the timeout."""
    pg, rank, size = dist.new_group(list(range(dist.get_world_size()))), dist.get_rank(), dist.get_world_size()
    g, last = hgroup(pg), rank == size - 1
    dist.all_gather([torch.empty(2) for _ in range(size)], torch.ones(2), group=pg)
    seq = g.seq + 1
    outs = [torch.full((2,), SENTINEL) for _ in range(size)]
    refused = (f"hpccomm all_gather (op #{seq} on group '{g.name}', rank {size - 1}/{size}): tensor_list[{size - 1}] "
               f"(this rank's slot) has 2 elements but the input has 3")
    outcome = None
    try:
        work = dist.all_gather(outs, torch.ones(3 if last else 2), group=pg, async_op=form == "async")
        if work is not None:
            work.wait()
    except hpccomm.HpccommError as exc:
        outcome = (type(exc).__name__, str(exc))
    if last:
        want = ("OpValueError", refused)
    else:
        want = ("HpccommError", f"hpccomm all_gather (op #{seq} on group '{g.name}', rank {rank}/{size}): rank "
                                f"{size - 1} refused this call (OpValueError: {refused}). Nothing was sent. Fix the "
                                f"call on rank {size - 1}: its message says what is wrong")
    verdict(outcome == want, (outcome, want))
    verdict(all(bool(torch.all(o == SENTINEL)) for o in outs), outs)
    t = torch.ones(3)
    dist.all_reduce(t, group=pg)
    verdict(bool(torch.all(t == size)), t)
