"""What NCCL is handed: a call rewritten, exactly, into what NCCL accepts.

NCCL (through torch's ``ProcessGroupNCCL`` or CuPy) refuses what hpccomm's
CPU path accepts: strided tensors, dtypes it has no type for (int16, the
unsigned types but uint8, complex, some float8), ReduceOps it lacks (the
bitwise ones), AVG of integers and bools.  :func:`rewrite` turns a checked call
into one NCCL takes, with the same result as the CPU path, bit for bit where
the CPU path is exact:

- a strided tensor goes through a contiguous device copy (copied in where the
  op reads it, written back where it writes it); an input that overlaps an
  output other than in NCCL's in-place forms is copied apart;
- data movement of a dtype NCCL lacks moves the tensor's bytes (a uint8 view);
- reductions, per dtype and ReduceOp (:func:`reduction_form`): bool's
  SUM/PRODUCT/BAND/BOR as MAX/MIN (torch's meaning); unsigned SUM/PRODUCT
  on the signed view of the same width (two's complement: the same bits);
  unsigned MIN/MAX on the signed view with the sign bit flipped (order kept);
  int16/uint16 widened to int32 and narrowed back (wrapping as the CPU path
  does); complex SUM/AVG/PREMUL_SUM on the real view; integer AVG as SUM and
  then hpccomm's own truncating division (the CPU path's step); PREMUL_SUM
  where NCCL has none, or gets it wrong (bfloat16 through torch's group, any
  dtype in a one-rank communicator: :class:`Ability`), as SUM of a scaled copy
  (the CPU path's way);
- what has no exact rewrite (integer bitwise ops, bool BXOR, complex PRODUCT)
  is not NCCL's: :func:`rewrite` returns None and the call goes to the
  group's fallback route (CUDA-aware MPI, else staged), the same on every rank
  (it depends only on the op, dtype and ReduceOp).

Every copy and conversion is a kernel on the caller's current stream: NCCL's
stream waits for it (torch orders NCCL after the current stream), and the
steps after NCCL run once the current stream waits for NCCL's Work
(``Work.wait()``: a stream wait, not a host block).  Nothing here
communicates; the transports (:mod:`~hpccomm._gpu.nccl_torch`,
:mod:`~hpccomm._gpu.nccl_cupy`) declare what they take as an :class:`Ability`.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable, Optional

import torch

from .._core.steps import SIGNED, finish_average, overlaps, sign_flipped, signed_view
from .._compat import ReduceOp, RedOpType, reduce_op_type, premul_sum_factor
from .detect import tensors_in

_R = RedOpType

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_UNSIGNED = (torch.uint8, getattr(torch, "uint16", None), getattr(torch, "uint32", None),
             getattr(torch, "uint64", None))
#: bool's ReduceOps as the uint8 ops NCCL has (torch's meaning: SUM is OR, PRODUCT is AND).
_BOOL = {_R.SUM: _R.MAX, _R.PRODUCT: _R.MIN, _R.MIN: _R.MIN, _R.MAX: _R.MAX, _R.BAND: _R.MIN, _R.BOR: _R.MAX}


@dataclass(frozen=True)
class Ability:
    """What one NCCL transport takes: ``dtypes`` it moves and reduces,
    ``redops`` (RedOpTypes) it reduces with, ``avg`` the dtypes it averages
    itself, ``premul`` the dtypes it has PREMUL_SUM for (right: a dtype whose
    PREMUL_SUM answers wrongly is left out), ``premul_one_rank`` whether its
    PREMUL_SUM is right in a one-rank communicator (NCCL 2.28's reduce_scatter
    there drops the factor: measured, docs/gpu.md "Verified where"),
    ``declared`` the attribute of an op's declaration that holds how the
    transport calls it (hpccomm._ops.op.Op ``nccl``, ``cupy``): an op without
    one is not its."""

    dtypes: frozenset
    redops: frozenset
    avg: frozenset
    premul: frozenset
    declared: str = "nccl"
    premul_one_rank: bool = False


@dataclass(frozen=True)
class Form:
    """How one dtype reduces with one ReduceOp on NCCL.  Each of the call's
    tensors becomes, when ``convert`` is set, a new tensor of dtype
    ``converted`` filled by ``convert(t)`` before NCCL and written back by
    ``back(t, c)`` after it; NCCL gets ``view`` of that (or of the tensor
    itself).  ``kind``: the ReduceOp NCCL gets (None: the caller's own
    ReduceOp object, for PREMUL_SUM); ``average``: hpccomm divides by the group
    size afterwards.  ``name`` says which rewrite, for the log."""

    name: str
    view: Callable
    kind: Optional[RedOpType]
    average: bool = False
    convert: Optional[Callable] = None
    converted: Optional[torch.dtype] = None
    back: Optional[Callable] = None


def _same(t):
    return t


def bytes_view(t: torch.Tensor) -> torch.Tensor:
    """The bytes of contiguous ``t`` as uint8, one more dimension of the
    element size: dim 0 (all_to_all's split dimension) keeps its rows."""
    return t.reshape(*t.shape, 1).view(torch.uint8)


def _canonical(t: torch.Tensor) -> torch.Tensor:
    """Contiguous ``t`` with the strides of a new tensor of its shape (torch calls
    a tensor contiguous whatever the stride of a dimension of size 1, which a
    dtype view or ``view_as_real`` then refuses)."""
    strides, step = [], 1
    for size in reversed(t.shape):
        strides.append(step)
        step *= max(size, 1)
    strides = tuple(reversed(strides))
    return t if t.stride() == strides else t.as_strided(t.shape, strides, t.storage_offset())


def _flip(t: torch.Tensor) -> torch.Tensor:
    """Unsigned order as signed order: the signed view with its sign bit flipped (a new tensor)."""
    return sign_flipped(signed_view(t))


def _unflip(t: torch.Tensor, wire: torch.Tensor) -> None:
    signed_view(t).copy_(sign_flipped(wire))


def _back(t: torch.Tensor, wire: torch.Tensor) -> None:
    t.copy_(wire)  # (int32 -> 16 bits keeps the low bits: the CPU path's wrapping sum)


def _size(dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def reduction_form(ability: Ability, dtype: torch.dtype, kind: RedOpType, factor=None,
                   size: int = 2) -> Optional[Form]:
    """How ``dtype`` reduces with ``kind`` on an NCCL of ``ability`` in a
    communicator of ``size`` ranks, or None when no exact rewrite exists (the
    call goes to the fallback route).  ``factor``: PREMUL_SUM's.  Only pairs
    hpccomm's checks accepted reach here (no bool AVG, no float8 reduction)."""
    average = False
    if kind == _R.AVG and not (dtype in ability.avg and _R.AVG in ability.redops):
        kind, average = _R.SUM, True  # hpccomm divides after a SUM: the CPU path's own step
    if dtype == torch.bool:
        mapped = _BOOL.get(kind)
        if mapped is None or mapped not in ability.redops:
            return None
        view = _same if torch.bool in ability.dtypes else (lambda t: t.view(torch.uint8))
        return Form(f"bool {kind.name} as {mapped.name}", view, mapped, average)
    if kind == _R.PREMUL_SUM:
        if dtype in ability.premul and _R.PREMUL_SUM in ability.redops and (size > 1 or ability.premul_one_rank):
            return Form("native", _same, None)
        if dtype.is_complex and isinstance(factor, torch.Tensor) and factor.is_complex():
            return None  # a complex factor does not scale the real view componentwise
        inner = reduction_form(ability, dtype, _R.SUM)
        if inner is None:
            return None
        return Form(f"PREMUL_SUM as SUM of a scaled copy ({inner.name})", inner.view, inner.kind,
                    convert=partial(_scaled, factor=factor), converted=dtype, back=_back)
    if kind in (_R.BAND, _R.BOR, _R.BXOR) or kind not in ability.redops:
        return None
    if dtype.is_complex:
        if kind != _R.SUM:
            return None  # complex PRODUCT mixes the components
        real = {torch.complex64: torch.float32, torch.complex128: torch.float64}[dtype]
        return Form("complex as its real view", torch.view_as_real, kind, average) \
            if real in ability.dtypes else None
    if dtype in ability.dtypes:
        return Form("native", _same, kind, average)
    if dtype.is_floating_point:
        return None
    signed = SIGNED[_size(dtype)]
    if dtype in _UNSIGNED and signed in ability.dtypes:
        if kind in (_R.SUM, _R.PRODUCT):
            return Form(f"{_name(dtype)} {kind.name} on its {_name(signed)} view", signed_view, kind, average)
        return Form(f"{_name(dtype)} {kind.name} on its {_name(signed)} view, sign bit flipped", _same, kind,
                    average, convert=_flip, converted=signed, back=_unflip)
    if _size(dtype) == 2 and torch.int32 in ability.dtypes:
        return Form(f"{_name(dtype)} {kind.name} widened to int32", _same, kind, average,
                    convert=lambda t: t.to(torch.int32), converted=torch.int32, back=_back)
    return None


def _scaled(t: torch.Tensor, factor) -> torch.Tensor:
    if isinstance(factor, torch.Tensor):
        factor = factor.to(t).reshape(())
    return torch.mul(t, factor)


def _name(dtype) -> str:
    return str(dtype).replace("torch.", "")


@dataclass
class Wire:
    """A call as NCCL takes it: ``args`` (the op's arguments with wire tensors
    and ReduceOp), ``before`` (kernels filling the wire tensors: contiguous
    copies, conversions), ``after`` (kernels once NCCL is done: write-backs,
    hpccomm's division for AVG), ``outputs`` (the op's result: the user's
    tensors), ``keep`` (the wire tensors, alive until then) and ``rewrites`` (what
    was rewritten, one phrase each, for the once-per-kind log)."""

    args: tuple
    before: list
    after: list
    outputs: object
    keep: list
    rewrites: list

    @property
    def direct(self) -> bool:
        """Nothing rewritten: the user's tensors go to NCCL as they are."""
        return not (self.before or self.after or self.rewrites)


def _in_place_slot(op, output: torch.Tensor, input: torch.Tensor, rank: int) -> bool:
    """Whether the op's one tensor sits in this rank's slot of the other
    (its declaration's ``slot``: NCCL's in-place forms)."""
    whole = op.slot
    if whole is None or not (output.is_contiguous() and input.is_contiguous()):
        return False
    big, part = (output, input) if whole == "output" else (input, output)
    return part.data_ptr() == big.data_ptr() + rank * part.numel() * part.element_size()


def rewrite(ability: Ability, op, args: tuple, rank: int, size: int) -> Optional[Wire]:
    """``op`` (a declaration, hpccomm._ops.op.Op) called with checked ``args``
    on a rank of a group of ``size``, as NCCL of ``ability`` takes it, or None
    when it cannot take it exactly (see the module docstring).  Nothing runs
    yet: the Wire's steps do."""
    if getattr(op, ability.declared) is None:
        return None
    form = None
    if op.reducing:
        redop = args[-1]
        kind = reduce_op_type(redop)
        factor = premul_sum_factor(redop) if kind == _R.PREMUL_SUM else None
        dtype = next(tensors_in(args[:1])).dtype
        form = reduction_form(ability, dtype, kind, factor, size)
        if form is None:
            return None
    before: list = []
    after: list = []
    keep: list = []
    rewrites: list = [] if form is None or form.name == "native" else [form.name]
    # roles: the first argument's is the op's (reduce writes only at its root, broadcast only elsewhere);
    # the others are read
    first = op.role(args, rank)
    writes = list(tensors_in(args[:1])) if first != "in" else []

    def wire(t: torch.Tensor, reads: bool, written: bool) -> torch.Tensor:
        base = t
        apart = reads and not written and any(overlaps(t, w) for w in writes) and not \
            (len(writes) == 1 and _in_place_slot(op, writes[0], t, rank))
        if not t.is_contiguous() or apart:
            base = t.new_empty(t.shape)  # contiguous
            if reads:
                before.append(partial(base.copy_, t))
            if written:
                after.append(partial(t.copy_, base))
            keep.append(base)
            rewrites.append("strided tensor through a contiguous copy" if not t.is_contiguous()
                         else "input overlapping the output copied apart")
        base = _canonical(base)
        if form is not None:
            w = _converted(base, form, reads, written, before, after)
        elif t.dtype in ability.dtypes:
            return base
        else:
            w = bytes_view(base)
            rewrites.append(f"{_name(t.dtype)} moved as bytes")
        keep.append(w)
        return w

    def walk(x, reads: bool, written: bool):
        if isinstance(x, torch.Tensor):
            return wire(x, reads, written)
        if isinstance(x, list):
            return [walk(y, reads, written) for y in x]
        if isinstance(x, tuple):
            return tuple(walk(y, reads, written) for y in x)
        return x

    wired = [walk(args[0], first != "out", first != "in")]
    wired += [walk(a, True, False) for a in args[1:]]
    if form is not None:
        wired[-1] = args[-1] if form.kind is None else ReduceOp(form.kind)
        if form.average:
            for t in writes:
                after.append(partial(finish_average, t, size))  # after the write-back: on the user's tensor
    outputs = args[0] if isinstance(args[0], list) else [args[0]]
    return Wire(tuple(wired), before, after, outputs, keep, list(dict.fromkeys(rewrites)))


def _converted(base: torch.Tensor, form: Form, reads: bool, written: bool, before: list, after: list):
    """The wire tensor of ``base`` (contiguous) under a reduction ``form``:
    a view, or a view of a new tensor converted when the op runs (``before``)
    and converted back into ``base`` once NCCL is done (``after``)."""
    if form.convert is None:
        return form.view(base)
    c = base.new_empty(base.shape, dtype=form.converted)
    if reads:
        before.append(partial(_fill, c, base, form.convert))
    if written:
        after.insert(0, partial(form.back, base, c))  # before any write-back of base itself
    return form.view(c)


def _fill(c: torch.Tensor, base: torch.Tensor, convert) -> None:
    c.copy_(convert(base))


#: Short names of the rewrites, for the table of docs/gpu.md (:func:`markdown_table`).
_SHORT = (("scaled copy (complex", "scaled, real view"), ("scaled copy", "scaled"), ("native", "native"),
          ("as its real view", "real view"), ("widened to int32", "widened"), ("sign bit flipped", "flipped"),
          ("view", "signed view"), (" as ", "as {kind}"))


def markdown_table(ability: Ability, dtypes=None, redops=None) -> str:
    """The route of each dtype and ReduceOp on an NCCL of ``ability``, as a
    markdown table (docs/gpu.md holds it; tests/test_docs.py checks it is
    this): ``native``, the rewrite, ``+ avg`` when hpccomm divides after a
    SUM, ``fallback`` where NCCL cannot take the call exactly, ``-`` where
    hpccomm's CPU path refuses the pair too; and data movement (``bytes``: a
    uint8 view).  Default: every dtype hpccomm moves, every ReduceOp."""
    from .. import _mpi

    dtypes = list(_mpi.DTYPES) if dtypes is None else dtypes
    redops = [_R.SUM, _R.PRODUCT, _R.MIN, _R.MAX, _R.AVG, _R.PREMUL_SUM, _R.BAND, _R.BOR, _R.BXOR] \
        if redops is None else redops
    names = [str(k).split(".")[-1] for k in redops]
    lines = ["| dtype | " + " | ".join(names) + " | data movement |",
             "|---" * (len(names) + 2) + "|"]
    for dtype in dtypes:
        cells = []
        for kind in redops:
            if kind not in _mpi.ALLOWED_OPS[_mpi.DTYPES[dtype].kind]:
                cells.append("-")
                continue
            form = reduction_form(ability, dtype, kind, 2.0 if kind == _R.PREMUL_SUM else None)
            if form is None:
                cells.append("fallback")
                continue
            short = next(s for key, s in _SHORT if key in form.name)
            short = short.format(kind=form.kind.name if form.kind is not None else "")
            if form.average:
                short = ("SUM" if short == "native" else short) + " + avg"
            cells.append(short)
        cells.append("native" if dtype in ability.dtypes else "bytes")
        lines.append(f"| {_name(dtype)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
