"""Bad input is refused before any communication, on every rank alike.

Each test hands EVERY rank (or every member of a group) the same bad input, so
no rank enters MPI and none is left waiting.  Each asserts the exception type,
that the message names the op, this rank as ``rank R/N`` (group rank and size)
and what is wrong, and that the user's tensors are unchanged afterwards.

Some bad input never reaches hpccomm: torch's own Python layer
(``distributed_c10d.py``) raises first.  Those tests assert torch's error and
say so in their docstring ("torch raises"); the same bad input handed straight
to the process group's method (as C++ callers do) is then checked separately
against hpccomm's own message.

A check whose outcome cannot depend on the world size (a dtype, a layout, a
reduction a dtype lacks, the lists of a one-rank group) is marked ``one_size``:
tests/run.sh runs it at 2 ranks (every rank raises, none is left waiting), not at
each size; checks of per-rank lists, counts, splits and roots run at every size.
"""
from __future__ import annotations

import contextlib
import re

import pytest
import torch
import torch.distributed as dist

import hpccomm
import helpers
from helpers import FLOAT8, R, FakeCudaTensor

pytestmark = pytest.mark.mpi

# --------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------


def _snapshot(t):
    """What must not change: every byte of the tensor's storage (a view's
    whole storage, so a write next to the view is caught too)."""
    if not isinstance(t, torch.Tensor):
        return t
    if t.device.type == "meta":
        return ("meta", t.shape, t.dtype)
    if t.layout != torch.strided:
        return ("sparse", t._indices().clone(), t._values().clone(), t.shape)
    raw = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())
    return ("dense", raw.clone(), t.shape, t.stride(), t.storage_offset(), t.dtype)


def _same(t, snap) -> bool:
    now = _snapshot(t)
    if not isinstance(snap, tuple):
        return now is snap
    return len(now) == len(snap) and all(
        torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b for a, b in zip(now, snap))


def _flatten(items):
    for x in items:
        if isinstance(x, (list, tuple)):
            yield from _flatten(x)
        else:
            yield x


@contextlib.contextmanager
def refused(exc, op: str, what: str, *tensors, rank: int | None = None, size: int | None = None):
    """Expect hpccomm's ``exc`` for ``op`` with a message matching ``what``
    (a regex) and naming ``rank R/N``; ``tensors`` (nested lists allowed) must
    be unchanged.  ``rank``/``size`` default to the world's."""
    rank = dist.get_rank() if rank is None else rank
    size = dist.get_world_size() if size is None else size
    flat = list(_flatten(tensors))
    snaps = [_snapshot(t) for t in flat]
    label = "p2p op" if op in ("send", "recv") else "op"  # point-to-point ops are numbered apart
    pattern = rf"^hpccomm {re.escape(op)} \({label} #\d+ on group '[^']+', rank {rank}/{size}\): {what}"
    with pytest.raises(exc, match=pattern) as info:
        yield info
    assert info.value.op == op, info.value.op
    assert isinstance(info.value, hpccomm.OpError)
    for i, (t, s) in enumerate(zip(flat, snaps)):
        assert _same(t, s), f"{op}: argument tensor #{i} changed although the op was refused"


@contextlib.contextmanager
def torch_refuses(exc, what: str, *tensors):
    """Expect torch's own Python layer to raise ``exc`` (not an hpccomm error)."""
    flat = list(_flatten(tensors))
    snaps = [_snapshot(t) for t in flat]
    with pytest.raises(exc, match=what) as info:
        yield info
    assert not isinstance(info.value, hpccomm.HpccommError), "expected torch's error, got hpccomm's"
    for i, (t, s) in enumerate(zip(flat, snaps)):
        assert _same(t, s), f"argument tensor #{i} changed although the op was refused"


def _nr():
    return dist.get_world_size(), dist.get_rank()


@pytest.fixture(scope="module")
def solo(world):
    """A one-rank group per rank (every rank makes all of them, as torch
    requires): in it every rank is the root, so a check done on the root only
    (scatter_list, gather_list) fails on every rank alike."""
    n, me = _nr()
    return [dist.new_group([r]) for r in range(n)][me]


@pytest.fixture(scope="module")
def even(groups):
    """The even ranks' group (helpers.make_groups): its size and this rank's
    group rank, or None outside it.  Global rank 1 is never in it."""
    g = next(g for g in groups if g.name == "even")
    return g


def _scatter_opts(root):
    o = dist.ScatterOptions()
    o.rootRank = root
    return o


def _gather_opts(root):
    o = dist.GatherOptions()
    o.rootRank = root
    return o


def _bcast_opts(root):
    o = dist.BroadcastOptions()
    o.rootRank = root
    return o


# --------------------------------------------------------------------------
# wrong sizes
# --------------------------------------------------------------------------

@pytest.mark.parametrize("extra", [1, -1])
def test_all_gather_into_tensor_wrong_output_size(world, extra):
    n, _ = _nr()
    inp, out = torch.arange(4.0), torch.full((4 * n + extra,), -1.0)
    with refused(hpccomm.OpValueError, "all_gather_into_tensor",
                 rf"output has {4 * n + extra} elements, expected input's 4 × group size {n} = {4 * n}", out, inp):
        dist.all_gather_into_tensor(out, inp)


@pytest.mark.parametrize("extra", [1, -1])
def test_reduce_scatter_tensor_wrong_output_size(world, extra):
    n, _ = _nr()
    out, inp = torch.full((4 + extra,), -1.0), torch.arange(4.0 * n)
    with refused(hpccomm.OpValueError, "reduce_scatter_tensor",
                 rf"input has {4 * n} elements, expected output's {4 + extra} × group size {n} = "
                 rf"{(4 + extra) * n}", out, inp):
        dist.reduce_scatter_tensor(out, inp)


def test_all_gather_this_ranks_slot_wrong_size(world):
    n, me = _nr()
    outs = [torch.zeros(3) for _ in range(n)]
    outs[me] = torch.zeros(5)  # every rank's own slot is wrong: all ranks refuse
    inp = torch.ones(3)
    with refused(hpccomm.OpValueError, "all_gather",
                 rf"tensor_list\[{me}\] \(this rank's slot\) has 5 elements but the input has 3", outs, inp):
        dist.all_gather(outs, inp)


@pytest.mark.one_size
def test_scatter_list_entry_wrong_size(solo):
    out, ins = torch.zeros(3), [torch.ones(4)]
    with refused(hpccomm.OpValueError, "scatter", r"scatter_list\[0\] has 4 elements but the output has 3\. "
                 r"scatter needs tensors of the output's size", out, ins, rank=0, size=1):
        dist.scatter(out, ins, group_src=0, group=solo)


@pytest.mark.one_size
def test_gather_list_entry_wrong_size(solo):
    inp, outs = torch.ones(3), [torch.zeros(4)]
    with refused(hpccomm.OpValueError, "gather", r"gather_list\[0\] has 4 elements but the input has 3\. "
                 r"gather needs tensors of one size on every rank", inp, outs, rank=0, size=1):
        dist.gather(inp, outs, group_dst=0, group=solo)


# --------------------------------------------------------------------------
# mismatched list lengths
# --------------------------------------------------------------------------

def test_all_gather_list_length(world):
    n, _ = _nr()
    outs, inp = [torch.zeros(2) for _ in range(n + 1)], torch.ones(2)
    with refused(hpccomm.OpValueError, "all_gather",
                 rf"tensor_list has {n + 1} tensors, expected {n} \(one per rank of the group\)", outs, inp):
        dist.all_gather(outs, inp)


def test_reduce_scatter_list_length(world):
    n, _ = _nr()
    out, ins = torch.zeros(2), [torch.ones(2) for _ in range(n + 1)]
    with refused(hpccomm.OpValueError, "reduce_scatter",
                 rf"input_list has {n + 1} tensors, expected {n} \(one per rank of the group\)", out, ins):
        dist.reduce_scatter(out, ins)


def test_all_to_all_list_length(world):
    n, _ = _nr()
    outs, ins = [torch.zeros(2) for _ in range(n + 1)], [torch.ones(2) for _ in range(n + 1)]
    with refused(hpccomm.OpValueError, "all_to_all",
                 rf"output_tensor_list has {n + 1} tensors, expected {n} \(one per rank of the group\)", outs, ins):
        dist.all_to_all(outs, ins)


def test_all_to_all_single_split_sizes_length(world):
    n, _ = _nr()
    out, inp = torch.zeros(n), torch.ones(n)
    with refused(hpccomm.OpValueError, "all_to_all_single",
                 rf"input_split_sizes has {n + 1} entries, expected {n} \(one per rank\)", out, inp):
        dist.all_to_all_single(out, inp, [1] * (n + 1), [1] * (n + 1))


def test_all_to_all_single_split_sizes_sum(world):
    n, _ = _nr()
    out, inp = torch.zeros(n), torch.ones(n)
    splits = [1] * n
    splits[0] = 2
    with refused(hpccomm.OpValueError, "all_to_all_single",
                 rf"input_split_sizes \[.*\] do not add up to input's {n} rows \(dim 0\)", out, inp):
        dist.all_to_all_single(out, inp, [1] * n, splits)


@pytest.mark.one_size
def test_scatter_list_length(solo):
    out, ins = torch.zeros(2), [torch.ones(2), torch.ones(2)]
    with refused(hpccomm.OpValueError, "scatter",
                 r"scatter_list has 2 tensors, expected 1 \(one per rank of the group\)", out, ins, rank=0, size=1):
        dist.scatter(out, ins, group_src=0, group=solo)


@pytest.mark.one_size
def test_gather_list_length(solo):
    inp, outs = torch.ones(2), [torch.zeros(2), torch.zeros(2)]
    with refused(hpccomm.OpValueError, "gather",
                 r"gather_list has 2 tensors, expected 1 \(one per rank of the group\)", inp, outs, rank=0, size=1):
        dist.gather(inp, outs, group_dst=0, group=solo)


@pytest.mark.mpi(min_size=2)
def test_scatter_list_on_non_source_direct(world):
    """torch refuses a scatter_list on a non-source rank itself; a caller of
    the process group method gets hpccomm's check.  Every rank passes n+1
    tensors: the source refuses the length, the others refuse having a list."""
    n, me = _nr()
    pg = dist.group.WORLD
    out, ins = torch.zeros(2), [torch.ones(2) for _ in range(n + 1)]
    if me == 0:
        what = rf"scatter_list has {n + 1} tensors, expected {n}"
    else:
        what = rf"scatter_list must be empty or None on rank {me}, which is not the source \(rank 0\)"
    with refused(hpccomm.OpValueError, "scatter", what, out, ins):
        pg.scatter([out], [ins], _scatter_opts(0))


@pytest.mark.mpi(min_size=2)
def test_gather_list_on_non_destination_direct(world):
    n, me = _nr()
    pg = dist.group.WORLD
    inp, outs = torch.ones(2), [torch.zeros(2) for _ in range(n + 1)]
    if me == 0:
        what = rf"gather_list has {n + 1} tensors, expected {n}"
    else:
        what = rf"gather_list must be empty or None on rank {me}, which is not the destination \(rank 0\)"
    with refused(hpccomm.OpValueError, "gather", what, inp, outs):
        pg.gather([outs], [inp], _gather_opts(0))


# --------------------------------------------------------------------------
# dtype mismatches
# --------------------------------------------------------------------------

@pytest.mark.one_size
def test_all_gather_into_tensor_dtype_mismatch(world):
    n, _ = _nr()
    out, inp = torch.zeros(4 * n, dtype=torch.float64), torch.ones(4)
    with refused(hpccomm.OpTypeError, "all_gather_into_tensor",
                 r"input has dtype torch\.float32 but output has torch\.float64", out, inp):
        dist.all_gather_into_tensor(out, inp)


@pytest.mark.one_size
def test_reduce_scatter_tensor_dtype_mismatch(world):
    n, _ = _nr()
    out, inp = torch.zeros(4, dtype=torch.int32), torch.ones(4 * n)
    with refused(hpccomm.OpTypeError, "reduce_scatter_tensor",
                 r"input has dtype torch\.float32 but output has torch\.int32", out, inp):
        dist.reduce_scatter_tensor(out, inp)


@pytest.mark.one_size
def test_all_to_all_single_dtype_mismatch_torch_raises(world):
    """torch raises (distributed_c10d._ensure_all_tensors_same_dtype)."""
    n, _ = _nr()
    out, inp = torch.zeros(n, dtype=torch.int32), torch.ones(n)
    with torch_refuses(ValueError, "Invalid usage of tensors with different dtypes", out, inp):
        dist.all_to_all_single(out, inp)


@pytest.mark.one_size
def test_all_to_all_single_dtype_mismatch_direct(world):
    n, _ = _nr()
    out, inp = torch.zeros(n, dtype=torch.int32), torch.ones(n)
    with refused(hpccomm.OpTypeError, "all_to_all_single",
                 r"input has dtype torch\.float32 but output has torch\.int32", out, inp):
        dist.group.WORLD.all_to_all_single(out, inp, [], [], dist.AllToAllOptions())


@pytest.mark.one_size
@pytest.mark.parametrize("op", ["all_gather", "reduce_scatter", "all_to_all", "scatter", "gather"])
def test_list_dtype_mismatch_torch_raises(world, solo, op):
    """torch raises (distributed_c10d._ensure_all_tensors_same_dtype) before
    the process group is called, for every list-taking op."""
    n, _ = _nr()
    one = torch.ones(2)
    ints = [torch.zeros(2, dtype=torch.int32) for _ in range(n)]
    call = {
        "all_gather": lambda: dist.all_gather(ints, one),
        "reduce_scatter": lambda: dist.reduce_scatter(one, ints),
        "all_to_all": lambda: dist.all_to_all(ints, [torch.ones(2) for _ in range(n)]),
        "scatter": lambda: dist.scatter(one, ints[:1], group_src=0, group=solo),
        "gather": lambda: dist.gather(one, ints[:1], group_dst=0, group=solo),
    }[op]
    with torch_refuses(ValueError, "Invalid usage of tensors with different dtypes", one, ints):
        call()


@pytest.mark.one_size
def test_all_gather_dtype_mismatch_direct(world):
    n, _ = _nr()
    outs, inp = [torch.zeros(2, dtype=torch.int32) for _ in range(n)], torch.ones(2)
    with refused(hpccomm.OpTypeError, "all_gather", r"tensor_list\[0\] has dtype torch\.int32 but the input has "
                 r"torch\.float32\. All tensors of one op must have the same dtype", outs, inp):
        dist.group.WORLD.allgather([outs], [inp])


@pytest.mark.one_size
def test_reduce_scatter_dtype_mismatch_direct(world):
    n, _ = _nr()
    out, ins = torch.zeros(2), [torch.ones(2, dtype=torch.int64) for _ in range(n)]
    with refused(hpccomm.OpTypeError, "reduce_scatter", r"input_list\[0\] has dtype torch\.int64 but the input "
                 r"has torch\.float32", out, ins):
        dist.group.WORLD.reduce_scatter([out], [ins])


@pytest.mark.one_size
def test_all_to_all_dtype_mismatch_direct(world):
    n, _ = _nr()
    outs, ins = [torch.zeros(2, dtype=torch.int32) for _ in range(n)], [torch.ones(2) for _ in range(n)]
    with refused(hpccomm.OpTypeError, "all_to_all", r"output_tensor_list\[0\] has dtype torch\.int32 but the "
                 r"input has torch\.float32", outs, ins):
        dist.group.WORLD.alltoall(outs, ins)


@pytest.mark.one_size
def test_scatter_dtype_mismatch_direct(solo):
    out, ins = torch.zeros(2), [torch.ones(2, dtype=torch.float16)]
    with refused(hpccomm.OpTypeError, "scatter", r"scatter_list\[0\] has dtype torch\.float16 but the input "
                 r"has torch\.float32", out, ins, rank=0, size=1):
        solo.scatter([out], [ins], _scatter_opts(0))


@pytest.mark.one_size
def test_gather_dtype_mismatch_direct(solo):
    inp, outs = torch.ones(2), [torch.zeros(2, dtype=torch.float16)]
    with refused(hpccomm.OpTypeError, "gather", r"gather_list\[0\] has dtype torch\.float16 but the input "
                 r"has torch\.float32", inp, outs, rank=0, size=1):
        solo.gather([outs], [inp], _gather_opts(0))


# --------------------------------------------------------------------------
# roots and peers
# --------------------------------------------------------------------------

ROOTED = ["broadcast", "reduce", "scatter", "gather"]


def _rooted_call(op, root, t, group=None, **kw):
    if op == "broadcast":
        return dist.broadcast(t, src=root, group=group, **kw)
    if op == "reduce":
        return dist.reduce(t, dst=root, group=group, **kw)
    if op == "scatter":
        return dist.scatter(t, None, src=root, group=group, **kw)
    return dist.gather(t, None, dst=root, group=group, **kw)


# hpccomm's name for the root in each op's message.
# NOTE: reduce says "root" where the user passed dst (ops/reduce.py calls
# check_root without what="dst"); either is accepted here.
_ROOT_WORD = {"broadcast": "src", "reduce": "(?:dst|root)", "scatter": "src", "gather": "dst"}


@pytest.mark.parametrize("op", ROOTED)
@pytest.mark.parametrize("where", ["size", "negative"])
def test_root_out_of_range(world, op, where):
    """On the world group torch passes the rank through unchecked; hpccomm refuses it."""
    n, _ = _nr()
    root = n if where == "size" else -1
    t = torch.arange(3.0)
    with refused(hpccomm.OpValueError, op, rf"{_ROOT_WORD[op]} {root} is not a rank of this group of size {n}\. "
                 r"Pass a group rank in 0\.\.size-1", t):
        _rooted_call(op, root, t)


@pytest.mark.parametrize("op", ROOTED)
def test_group_root_out_of_range(even, op):
    """group_src/group_dst past a subgroup's size reach hpccomm (torch does not check them)."""
    if not even.member:
        return  # non-members take no part in the group's ops
    t = torch.arange(3.0)
    kw = {"group_src": even.size} if op in ("broadcast", "scatter") else {"group_dst": even.size}
    call = {"broadcast": lambda: dist.broadcast(t, group=even.pg, **kw),
            "reduce": lambda: dist.reduce(t, group=even.pg, **kw),
            "scatter": lambda: dist.scatter(t, None, group=even.pg, **kw),
            "gather": lambda: dist.gather(t, None, group=even.pg, **kw)}[op]
    with refused(hpccomm.OpValueError, op, rf"{_ROOT_WORD[op]} {even.size} is not a rank of this group of size "
                 rf"{even.size}", t, rank=even.rank, size=even.size):
        call()


@pytest.mark.parametrize("op", [*ROOTED, "send"])
def test_root_not_in_group_torch_raises(even, op):
    """A global rank outside the group: torch raises (get_group_rank) before
    the process group is called.  Global rank 1 is never an even rank (at
    size 1 it is no process at all)."""
    if not even.member:
        return
    t = torch.arange(3.0)
    with torch_refuses(ValueError, r"Global rank 1 is not part of group", t):
        if op == "send":
            dist.send(t, dst=1, group=even.pg)
        else:
            _rooted_call(op, 1, t, group=even.pg)


@pytest.mark.one_size
def test_send_to_self_torch_raises(world):
    """torch raises for a blocking send to oneself (distributed_c10d._check_not_self_rank).
    isend/irecv to oneself are allowed by torch, and by hpccomm (ops/p2p.py)."""
    _, me = _nr()
    t = torch.arange(3.0)
    with torch_refuses(ValueError, r"Invalid destination rank: destination rank should not be the same", t):
        dist.send(t, dst=me)


@pytest.mark.parametrize("op", ["isend", "irecv"])
def test_p2p_peer_out_of_range(world, op):
    n, _ = _nr()
    t = torch.arange(3.0)
    word, name = ("dst", "send") if op == "isend" else ("src", "recv")
    with refused(hpccomm.OpValueError, name, rf"{word} {n} is not a rank of this group of size {n}", t):
        dist.isend(t, dst=n) if op == "isend" else dist.irecv(t, src=n)


@pytest.mark.one_size
@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("tag", [-1, 2**40])
def test_p2p_tag_out_of_range(world, tag):
    n, me = _nr()
    t = torch.arange(3.0)
    with refused(hpccomm.OpValueError, "send", rf"tag {tag} is outside 0\.\.\d+ \(MPI_TAG_UB\)", t):
        dist.isend(t, dst=(me + 1) % n, tag=tag)


# --------------------------------------------------------------------------
# unsupported dtypes and reductions
# --------------------------------------------------------------------------

@pytest.mark.one_size
def test_band_on_float(world):
    t = torch.arange(3.0)
    with refused(hpccomm.OpTypeError, "all_reduce",
                 r"ReduceOp\.BAND needs an integer or bool tensor, got torch\.float32", t):
        dist.all_reduce(t, op=R.BAND)


@pytest.mark.one_size
@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128])
@pytest.mark.parametrize("opname", ["MIN", "MAX"])
def test_min_max_on_complex_via_reduce(world, dtype, opname):
    n, _ = _nr()
    t = torch.full((3,), 1 + 2j, dtype=dtype)
    with refused(hpccomm.OpTypeError, "reduce", rf"ReduceOp\.{opname} is not defined for complex tensors", t):
        dist.reduce(t, dst=n - 1, op=getattr(R, opname))


@pytest.mark.one_size
def test_min_on_complex_via_all_reduce_torch_raises(world):
    """torch's all_reduce raises for MIN/MAX/PRODUCT on complex itself (it
    views complex as real before calling the group)."""
    t = torch.full((3,), 1 + 2j, dtype=torch.complex64)
    with torch_refuses(ValueError, r"all_reduce does not support RedOpType\.MIN on complex tensors", t):
        dist.all_reduce(t, op=R.MIN)


@pytest.mark.one_size
def test_max_on_complex_via_reduce_scatter_tensor(world):
    n, _ = _nr()
    out, inp = torch.zeros(2, dtype=torch.complex64), torch.ones(2 * n, dtype=torch.complex64)
    with refused(hpccomm.OpTypeError, "reduce_scatter_tensor", r"ReduceOp\.MAX is not defined for complex tensors",
                 out, inp):
        dist.reduce_scatter_tensor(out, inp, op=R.MAX)


@pytest.mark.one_size
def test_avg_on_bool(world):
    t = torch.tensor([True, False, True])
    with refused(hpccomm.OpTypeError, "all_reduce", r"ReduceOp\.AVG is not defined for bool tensors", t):
        dist.all_reduce(t, op=R.AVG)


@pytest.mark.one_size
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.uint8, torch.bool])
def test_premul_sum_on_integer(world, dtype):
    t = torch.ones(3, dtype=dtype)
    with refused(hpccomm.OpTypeError, "all_reduce",
                 rf"ReduceOp\.PREMUL_SUM needs a floating-point or complex tensor, got {re.escape(str(dtype))}", t):
        dist.all_reduce(t, op=dist._make_nccl_premul_sum(2.0))


FLOAT8_OPS = ["all_reduce", "reduce", "reduce_scatter_tensor", "reduce_scatter", "all_reduce_coalesced"]


@pytest.mark.one_size
@pytest.mark.filterwarnings("ignore:`torch.distributed.all_reduce_coalesced` will be deprecated:FutureWarning")
@pytest.mark.parametrize("dtype", FLOAT8, ids=[str(d)[6:] for d in FLOAT8])
@pytest.mark.parametrize("op", FLOAT8_OPS)
@pytest.mark.parametrize("opname", ["SUM", "MAX"])
def test_float8_any_reduction(world, dtype, op, opname):
    n, _ = _nr()
    redop = getattr(R, opname)
    a = torch.ones(2).to(dtype)
    b = torch.ones(2 * n).to(dtype)
    parts = [torch.ones(2).to(dtype) for _ in range(n)]
    call = {
        "all_reduce": lambda: dist.all_reduce(a, op=redop),
        "reduce": lambda: dist.reduce(a, dst=0, op=redop),
        "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(a, b, op=redop),
        "reduce_scatter": lambda: dist.reduce_scatter(a, parts, op=redop),
        "all_reduce_coalesced": lambda: dist.all_reduce_coalesced([a, b], op=redop),
    }[op]
    with refused(hpccomm.OpTypeError, op, rf"{re.escape(str(dtype))} can be moved but not reduced", a, b, parts):
        call()


@pytest.mark.one_size
def test_not_a_reduce_op_direct(world):
    t = torch.ones(3)
    with refused(hpccomm.OpTypeError, "all_reduce", r"'sum' is not a torch\.distributed\.ReduceOp", t):
        dist.group.WORLD.allreduce([t], "sum")


def _unknown_dtype_tensors():
    out = {"bits8": lambda: torch.zeros(3, dtype=torch.bits8),
           "float4_e2m1fn_x2": lambda: torch.zeros(3, dtype=torch.float4_e2m1fn_x2)}
    if hasattr(torch, "uint4"):
        out["uint4"] = lambda: torch.zeros(3, dtype=torch.uint4)
    return out


UNKNOWN = _unknown_dtype_tensors()


@pytest.mark.one_size
@pytest.mark.parametrize("name", sorted(UNKNOWN))
@pytest.mark.parametrize("op", ["broadcast", "all_reduce"])
def test_unknown_dtype(world, name, op):
    t = UNKNOWN[name]()
    with refused(hpccomm.OpTypeError, op, rf"tensor has dtype torch\.{name}, which hpccomm cannot send\. "
                 r"Supported: float32, ", t):
        dist.broadcast(t, src=0) if op == "broadcast" else dist.all_reduce(t)


@pytest.mark.one_size
def test_not_a_tensor_direct(world):
    with refused(hpccomm.OpTypeError, "broadcast", r"tensor is a list, not a torch\.Tensor"):
        dist.group.WORLD.broadcast([[1.0, 2.0]], _bcast_opts(0))


# --------------------------------------------------------------------------
# layouts and devices
# --------------------------------------------------------------------------

@pytest.mark.one_size
def test_sparse_tensor_broadcast_refused(world):
    """Sparse tensors are summed by all_reduce (tests/test_reduce.py); other ops refuse them."""
    t = torch.tensor([0.0, 2.0, 0.0]).to_sparse()
    with refused(hpccomm.OpTypeError, "broadcast", r"tensor has layout torch\.sparse_coo; only dense \(strided\) "
                 r"tensors can be sent\. Call \.to_dense\(\) first", t):
        dist.broadcast(t, src=0)


@pytest.mark.one_size
@pytest.mark.parametrize("redop", [R.MAX, R.PRODUCT, R.AVG])
def test_sparse_all_reduce_is_sum_only(world, redop):
    t = torch.tensor([0.0, 2.0, 0.0]).to_sparse()
    name = str(redop).split(".")[-1]
    with refused(hpccomm.OpTypeError, "all_reduce", rf"sparse tensors reduce with ReduceOp\.SUM only \(as gloo\), "
                 rf"not {name}\. Call \.to_dense\(\) first for other ReduceOps", t):
        dist.all_reduce(t, op=redop)


@pytest.mark.one_size
@pytest.mark.parametrize("op", ["all_reduce", "broadcast", "all_gather_into_tensor"])
def test_meta_tensor(world, op):
    n, _ = _nr()
    t = torch.empty(3, device="meta")
    dense = torch.zeros(3)
    what = "tensor" if op != "all_gather_into_tensor" else "output"
    with refused(hpccomm.OpTypeError, op, rf"{what} is a meta tensor: it has no data to communicate", t, dense):
        if op == "all_reduce":
            dist.all_reduce(t)
        elif op == "broadcast":
            dist.broadcast(t, src=0)
        else:
            dist.all_gather_into_tensor(torch.empty(3 * n, device="meta"), dense)


@pytest.fixture
def no_gpu_transport():
    """Probe findings of a machine with no GPU transport (injected: the real
    probes answer for this machine's libraries, see tests/test_gpu_unit.py)."""
    from hpccomm._gpu import findings, probe, select

    with findings.assumed(select.Capabilities(probe.Finding(False, "injected: not CUDA-aware"),
                                              probe.Finding(False, "injected: no NCCL in torch"),
                                              probe.Finding(False, "injected: no cupy"))):
        yield


@pytest.mark.parametrize("op", ["all_reduce", "all_gather_into_tensor"])
@pytest.mark.parametrize("transport,what", [
    ("mpi", r"CUDA tensors cannot be sent: HPCCOMM_GPU_TRANSPORT=mpi but the MPI library is not CUDA-aware\. Use a "
            r"CUDA-aware MPI build \(see hpccomm info, \[gpu\]\), or set HPCCOMM_GPU_TRANSPORT=auto"),
    ("nccl", r"CUDA tensors cannot be sent: HPCCOMM_GPU_TRANSPORT=nccl but NCCL is not available on every rank "
             r"\(torch's NCCL: every rank lacks it; CuPy's: every rank lacks it\)\. Install a torch built with CUDA"),
])
def test_cuda_tensor_with_a_transport_that_cannot_serve(world, no_gpu_transport, op, transport, what):
    """A forced GPU transport this machine lacks: a CUDA tensor is refused on
    every rank before any communication, naming the variable and the fix
    (``auto`` always serves: staging at worst).  (Not broadcast: torch's own
    broadcast asks the fake tensor's GPU for its compute capability.)"""
    n, _ = _nr()
    t = torch.arange(3.0).as_subclass(FakeCudaTensor)
    out = torch.zeros(3 * n).as_subclass(FakeCudaTensor)
    assert t.device.type == "cuda"
    with helpers.setting("HPCCOMM_GPU_TRANSPORT", transport), refused(hpccomm.OpTypeError, op, what, t, out):
        if op == "all_reduce":
            dist.all_reduce(t)
        else:
            dist.all_gather_into_tensor(out, t)


@pytest.mark.one_size
def test_mixed_devices_refused(world):
    """A CPU output with a CUDA input: refused before any communication."""
    n, _ = _nr()
    t = torch.arange(3.0).as_subclass(FakeCudaTensor)
    out = torch.zeros(3 * n)
    with refused(hpccomm.OpValueError, "all_gather_into_tensor", r"the call mixes devices \(cpu, cuda:0\)\. Put "
                 r"every input and output of one call on the same device", t, out):
        dist.all_gather_into_tensor(out, t)


# --------------------------------------------------------------------------
# after all that
# --------------------------------------------------------------------------

def test_group_usable_after_refusals(world, even):
    """A refused op leaves no trace: the next ops on the groups complete."""
    n, me = _nr()
    t = torch.full((3,), float(me))
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((3,), n * (n - 1) / 2))
    if even.member:
        u = torch.ones(2)
        dist.all_reduce(u, group=even.pg)
        assert torch.equal(u, torch.full((2,), float(even.size)))


def test_a_refusal_names_the_refused_call_behind_queued_async_ops(world):
    """A call refused while this rank still has async ops queued on the group
    is named by its own number (after theirs: they run first), not by the
    number of the first of them (which the op path's counter held while they
    waited on the comm thread); the queued ops complete as they would."""
    pg = dist.new_group(list(range(dist.get_world_size())))
    g = helpers.hgroup(pg)
    before = g.seq
    t = torch.ones(1 << 12)
    works = [dist.all_reduce(t, group=pg, async_op=True) for _ in range(5)]
    u = torch.ones(2)
    with refused(hpccomm.OpValueError, "broadcast", r"src \d+ is not a rank of this group", u) as info:
        pg.broadcast([u], _bad_root(dist.get_world_size()))  # (every rank refuses: src is bad everywhere)
    assert f"(op #{before + 6} on group '{g.name}'," in str(info.value), str(info.value)
    for w in works:
        w.wait()
    assert torch.all(t == dist.get_world_size() ** 5)


def _bad_root(size: int):
    """A BroadcastOptions whose root is no rank of a group of ``size``."""
    opts = dist.BroadcastOptions()
    opts.rootRank = size + 3
    return opts
