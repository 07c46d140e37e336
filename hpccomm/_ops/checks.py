"""The checks every op runs before any communication, and the reductions.

Each raises :class:`hpccomm.errors.OpError` (an :class:`~hpccomm.errors.OpTypeError`
or :class:`~hpccomm.errors.OpValueError`) naming the op, its number on the
group, the rank and what is wrong, with the user's tensors untouched.
:func:`reduction` is the part of a reducing op's plan that depends only on
the dtype and the ReduceOp (the same on every rank), computed once per pair.
"""
from __future__ import annotations

import torch

from .. import _mpi
from .._compat import ReduceOp, RedOpType, premul_sum_factor, redop_code, reduce_op_type
from ..errors import OpError, OpTypeError, OpValueError  # noqa: F401 - OpError for the op modules


_R = RedOpType
#: The classes a ReduceOp argument may have: torch's ``ReduceOp`` and its kinds (``dist.ReduceOp.SUM``).
_REDOP_CLASSES = (ReduceOp, RedOpType)

#: (dtype, the kind's value) -> :func:`reduction`'s answer, for the pairs it accepted (never PREMUL_SUM, whose
#: factor varies).  Keyed by the kind's int (hpccomm._compat.redop_code): comparing torch's pybind enums
#: costs several thousand instructions each, more than the rest of a small op's checks.
_REDUCTIONS: dict = {}


_Tensor = torch.Tensor

_STRIDED = torch.strided


#: The device types hpccomm moves tensors of: the CPU's over MPI; CUDA's over the route its group
#: takes for that device (hpccomm._gpu.dispatch).
DEVICES = ("cpu", "cuda")


def check_tensor(group, op: str, t, what: str = "tensor") -> None:
    """``t`` is a dense tensor of a dtype hpccomm moves, on the CPU or a CUDA
    device (the op path finds the route of a CUDA call: hpccomm._gpu.dispatch).
    The one test of a tensor every op runs (each condition a cheap identity or
    membership test when it holds)."""
    if not isinstance(t, _Tensor):
        raise OpTypeError(op, group.where(), f"{what} is a {type(t).__name__}, not a torch.Tensor")
    if t.layout is not _STRIDED:
        raise OpTypeError(op, group.where(), f"{what} has layout {t.layout}; only dense (strided) tensors can be sent",
                          "Call .to_dense() first")
    if not t.is_cpu and t.device.type not in DEVICES:
        dev = t.device.type
        if dev == "meta":
            raise OpTypeError(op, group.where(), f"{what} is a meta tensor: it has no data to communicate")
        raise OpTypeError(op, group.where(), f"{what} is on device {t.device}; hpccomm moves CPU and CUDA tensors",
                          "Move it to the CPU with .cpu()")
    if t.dtype not in _mpi.DTYPES:
        raise OpTypeError(op, group.where(), f"{what} has dtype {t.dtype}, which hpccomm cannot send",
                          f"Supported: {', '.join(str(d).replace('torch.', '') for d in _mpi.DTYPES)}")


def single(group, op: str, tensors, what: str = "tensors", role: str = "tensor") -> torch.Tensor:
    """``check_list(tensors, 1)`` and :func:`check_tensor` of its tensor
    (called ``role`` in messages); returns the tensor."""
    if tensors.__class__ is not list or len(tensors) != 1:
        check_list(group, op, tensors, 1, what)
    t = tensors[0]
    check_tensor(group, op, t, role)
    return t


def check_pair(group, op: str, output, input, whole: str = "") -> None:
    """An op's ``output`` and ``input`` tensors: each checked (:func:`check_tensor`),
    one dtype; ``whole`` (``"output"`` or ``"input"``): that one holds every rank's
    part, the group size times the other's elements."""
    check_tensor(group, op, output, "output")
    check_tensor(group, op, input, "input")
    if input.dtype != output.dtype:
        raise OpTypeError(op, group.where(), f"input has dtype {input.dtype} but output has {output.dtype}")
    if whole:
        big, part = (output, input) if whole == "output" else (input, output)
        n = part.numel()
        if big.numel() != n * group.size:
            other = "input" if whole == "output" else "output"
            raise OpValueError(op, group.where(), f"{whole} has {big.numel()} elements, expected {other}'s "
                               f"{n} × group size {group.size} = {n * group.size}")


def check_tensors(group, op: str, ts, what: str = "tensor") -> None:
    for i, t in enumerate(ts):
        check_tensor(group, op, t, f"{what}[{i}]")


def check_list(group, op: str, ts, n: int, what: str) -> None:
    if not isinstance(ts, (list, tuple)):
        raise OpTypeError(op, group.where(), f"{what} is a {type(ts).__name__}, not a list of tensors")
    if len(ts) != n:
        raise OpValueError(op, group.where(), f"{what} has {len(ts)} tensors, expected {n}"
                           + (" (one per rank of the group)" if n == group.size else ""))


def per_rank(group, op: str, lists, outer: str, what: str, like, of: str = "", hint: str = "") -> list:
    """torch's ``[[t_0, ..., t_{size-1}]]`` argument of a gather, scatter or
    reduce_scatter: a list of one list of one tensor per rank of the group,
    each checked, of ``like``'s dtype; with ``of`` (how messages name
    ``like``), each of ``like``'s size too (``hint`` says what the op needs).
    Returns the inner list."""
    check_list(group, op, lists, 1, outer)
    ts = lists[0]
    check_list(group, op, ts, group.size, what)
    check_tensors(group, op, ts, what)
    check_same_dtype(group, op, ts, like.dtype, what)
    if of:
        n = like.numel()
        for i, t in enumerate(ts):
            if t.numel() != n:
                raise OpValueError(op, group.where(), f"{what}[{i}] has {t.numel()} elements but {of} has {n}", hint)
    return ts


def rooted(group, op: str, root: int, side: str, lists, outer: str, what: str, like, of: str, hint: str):
    """A rooted op's root (``side``: ``"dst"`` or ``"src"``, as torch names
    it) and its list argument that only the root fills (gather's
    ``gather_list``, scatter's ``scatter_list``): ``root`` a rank of the
    group; at the root :func:`per_rank` (returned), elsewhere empty or None
    (None returned)."""
    check_root(group, op, root, side)
    role = "destination" if side == "dst" else "source"
    if group.rank == root:
        return per_rank(group, op, lists, outer, what, like, of, hint)
    if lists and any(len(x) for x in lists):
        raise OpValueError(op, group.where(), f"{what} must be empty or None on rank {group.rank}, "
                           f"which is not the {role} (rank {root})")
    return None


def check_own_slot(group, op: str, outputs, input) -> None:
    """all_gather's list: this rank's own slot has the input's size (MPI
    gathers this rank's input into it)."""
    if outputs[group.rank].numel() != input.numel():
        raise OpValueError(op, group.where(), f"tensor_list[{group.rank}] (this rank's slot) has "
                           f"{outputs[group.rank].numel()} elements but the input has {input.numel()}")


def message(group, op: str, tensors, peer, side: str, tag: int):
    """A point-to-point op's checks: one tensor; ``peer`` a rank of the
    group (``side`` as torch names it: ``"dst"``, ``"src"``), None for any
    source; ``tag`` in MPI's range.  A refusal names this rank's next
    point-to-point op.  Returns the tensor."""
    try:
        t = single(group, op, tensors)
        if peer is not None:
            check_root(group, op, peer, side)
        check_tag(group, op, tag)
    except OpError as exc:
        raise type(exc)(exc.op, group.where_p2p(), exc.what, exc.fix) from None
    return t


def check_same_dtype(group, op: str, ts, dtype, what: str) -> None:
    for i, t in enumerate(ts):
        if t.dtype != dtype:
            raise OpTypeError(op, group.where(), f"{what}[{i}] has dtype {t.dtype} but the input has {dtype}",
                              "All tensors of one op must have the same dtype")


def check_root(group, op: str, root: int, what: str = "root") -> None:
    if not isinstance(root, int) or not 0 <= root < group.size:
        raise OpValueError(op, group.where(), f"{what} {root!r} is not a rank of this group of size {group.size}",
                           "Pass a group rank in 0..size-1 (use group_src/group_dst, or dist.get_group_rank)")


def check_tag(group, op: str, tag: int) -> None:
    if not isinstance(tag, int) or not 0 <= tag <= group.tag_ub:
        raise OpValueError(op, group.where(), f"tag {tag!r} is outside 0..{group.tag_ub} (MPI_TAG_UB)")


def reduce_op_name(group, op: str, redop) -> str:
    """The name of ``redop``'s kind (``"SUM"``), for the signature of a call
    with no tensor to check it against (an empty coalesced list)."""
    try:
        return str(reduce_op_type(redop)).split(".")[-1]
    except AttributeError:
        raise OpTypeError(op, group.where(), f"{redop!r} is not a torch.distributed.ReduceOp") from None


def reduce_op(group, op: str, dtype: torch.dtype, redop):
    """``(RedOpType, premul factor or None)`` for ``redop`` on ``dtype``, or an
    error.  The op path calls it through :func:`reduction`, which remembers
    the pairs it accepted."""
    try:
        kind = reduce_op_type(redop)
    except AttributeError:
        raise OpTypeError(op, group.where(), f"{redop!r} is not a torch.distributed.ReduceOp") from None
    info = _mpi.DTYPES[dtype]
    if kind not in _mpi.ALLOWED_OPS[info.kind]:
        name = str(kind).split(".")[-1]
        if info.kind == "bytes":
            why = f"{dtype} can be moved but not reduced"
        elif kind in (_R.BAND, _R.BOR, _R.BXOR):
            why = f"ReduceOp.{name} needs an integer or bool tensor, got {dtype}"
        elif kind == _R.AVG and info.kind == "bool":
            why = "ReduceOp.AVG is not defined for bool tensors"
        elif kind in (_R.MIN, _R.MAX) and info.kind == "complex":
            why = f"ReduceOp.{name} is not defined for complex tensors"
        elif kind == _R.PREMUL_SUM:
            why = f"ReduceOp.PREMUL_SUM needs a floating-point or complex tensor, got {dtype}"
        else:
            why = f"ReduceOp.{name} is not supported for {dtype}"
        raise OpTypeError(op, group.where(), why)
    factor = None
    if kind == _R.PREMUL_SUM:
        try:
            factor = premul_sum_factor(redop)
        except (AttributeError, TypeError):
            raise OpTypeError(op, group.where(), "ReduceOp.PREMUL_SUM needs its factor",
                              "Make it with dist._make_nccl_premul_sum(factor)") from None
    return kind, factor


class Reduction:
    """How one dtype reduces with one ReduceOp: the part of a reducing op's
    plan that depends only on that pair (made once per pair by :func:`reduction`).

    ``kind``: the RedOpType, ``name`` its name (``"SUM"``); ``average``: divide the SUM by the group size
    afterwards (AVG); ``factor``: PREMUL_SUM's factor (else None); ``mop``:
    the MPI op; ``mtype``, ``itemsize``: the dtype's MPI datatype and bytes
    per element (:func:`hpccomm._mpi.kind_of`); ``nonblocking``: the reduction has a nonblocking form (MPI
    predefines its op: float16/bfloat16 reduce through user-defined ops,
    which MPI would call back into Python from whichever thread drives a
    posted request, so they keep the blocking form).
    """

    __slots__ = ("dtype", "kind", "name", "average", "factor", "mop", "nonblocking", "mtype", "itemsize")

    def __init__(self, dtype, kind, factor) -> None:
        self.dtype, self.kind, self.factor = dtype, kind, factor
        self.name = str(kind).split(".")[-1]  # (in signatures and messages: "SUM")
        self.average = kind == _R.AVG
        self.mop = _mpi.mpi_op(dtype, kind)
        self.mtype, self.itemsize = _mpi.kind_of(dtype)  # (how it travels: the plan's buffer specs)
        self.nonblocking = self.mop.is_predefined

    def on(self, dtype) -> "Reduction":
        """The same reduction of ``dtype``: the CUDA-aware route reduces
        float16/bfloat16 tensors through float32 stand-ins
        (hpccomm._gpu.cuda_mpi), whose plan needs float32's MPI op and
        datatype; the checks accepted the call itself, and every ReduceOp
        of a 16-bit float is one of float32's."""
        return Reduction(dtype, self.kind, self.factor)


def reduction(group, op: str, dtype: torch.dtype, redop) -> Reduction:
    """:class:`Reduction` of ``redop`` (a ``ReduceOp`` or ``RedOpType``) on
    ``dtype``.  Refuses as :func:`reduce_op` does, with its messages; a pair
    accepted once is looked up by the enum's value afterwards (PREMUL_SUM,
    whose factor varies from call to call, is made each time).

    Example::

        r = reduction(group, "all_reduce", t.dtype, dist.ReduceOp.AVG)
        comm.Allreduce(_mpi.IN_PLACE, _mpi.buffer(t), op=r.mop)
    """
    code = redop_code(redop) if redop.__class__ in _REDOP_CLASSES else None  # (None: reduce_op says what it is)
    hit = _REDUCTIONS.get((dtype, code))
    if hit is not None:
        return hit
    kind, factor = reduce_op(group, op, dtype, redop)
    answer = Reduction(dtype, kind, factor)
    if factor is None:
        _REDUCTIONS[(dtype, code)] = answer
    return answer


def split_counts(group, op, t: torch.Tensor, splits, what: str):
    """The element counts of ``t``'s parts, one per rank: ``splits`` (rows of
    dim 0, one per rank, adding up to ``t``'s rows), or equal parts (the rows
    divisible by the group size); OpValueError otherwise."""
    rows = t.shape[0] if t.dim() else 1
    row = t.numel() // rows if rows else 0
    if not splits:
        if rows % group.size:
            raise OpValueError(op, group.where(), f"{what} has {rows} rows, not divisible by the group size "
                                 f"{group.size}", f"Pass {what}_split_sizes")
        return [rows // group.size * row] * group.size
    splits = list(splits)
    if len(splits) != group.size:
        raise OpValueError(op, group.where(), f"{what}_split_sizes has {len(splits)} entries, expected "
                             f"{group.size} (one per rank)")
    if any(s < 0 for s in splits) or sum(splits) != rows:
        raise OpValueError(op, group.where(), f"{what}_split_sizes {splits} do not add up to {what}'s "
                             f"{rows} rows (dim 0)")
    return [s * row for s in splits]


def sparse_sum(group, op: str, tensors, redop) -> torch.Tensor:
    """A sparse all_reduce's checks: one sparse COO CPU tensor of a dtype that
    sums, and ReduceOp.SUM (as gloo).  Returns the tensor."""
    check_list(group, op, tensors, 1, "tensors")
    t = tensors[0]
    if not isinstance(t, torch.Tensor) or t.layout != torch.sparse_coo:
        layout = getattr(t, "layout", type(t).__name__)
        raise OpTypeError(op, group.where(), f"a sparse all_reduce needs a sparse COO tensor, got {layout}")
    if t.dtype not in _mpi.DTYPES or _mpi.DTYPES[t.dtype].kind not in ("float", "half", "int", "complex"):
        raise OpTypeError(op, group.where(), f"sparse tensors of dtype {t.dtype} cannot be summed")
    if not t.is_cpu:
        raise OpTypeError(op, group.where(), f"sparse tensor on {t.device}; sparse all_reduce moves CPU tensors")
    try:
        kind = reduce_op_type(redop)
    except AttributeError:
        raise OpTypeError(op, group.where(), f"{redop!r} is not a torch.distributed.ReduceOp") from None
    if kind != _R.SUM:
        raise OpTypeError(op, group.where(), f"sparse tensors reduce with ReduceOp.SUM only (as gloo), "
                          f"not {str(kind).split('.')[-1]}", "Call .to_dense() first for other ReduceOps")
    return t
