"""What every op module shares: the plan, the checks and the staging helpers.

A plan is what one call of an op needs, stated once by its op module's plan
function (``reduce.all_reduce(group, tensors, redop)`` ...) after every check
passed, and executed by :mod:`hpccomm._runner` in whichever form the call
takes: blocking in the calling thread, on the comm thread (``async_op=True``),
posted as a nonblocking MPI call, or through a GPU transport, which wraps it
(:mod:`hpccomm.gpu`).  A plan function never communicates: every refusal is
raised before anything is sent.  A plan is a tuple (one is made per call, and
a tuple costs a fraction of an object's constructor), its fields in the order
of :data:`FIELDS` (indexes :data:`CALL` ... :data:`NBYTES`):

``call``
    the blocking form, run as ``call(*args)``: the MPI call (a bound method of
    the group's communicator, such as ``comm.Allreduce``), or a function that
    makes it with the op's steps around it (:func:`with_steps`), or several;
    None for point-to-point ops, which are always posted;
``args``
    its arguments: MPI buffers on the tensors' memory (zero copy when they
    are contiguous), ``MPI_IN_PLACE``, counts, roots, the MPI op;
``icall``
    the nonblocking MPI call taking the same ``args`` and returning the
    request (``comm.Iallreduce``, ``p2p.Isend``), or None where this call has
    no nonblocking form.  Whether it has one depends only on what is equal on
    every rank (the op, dtype, ReduceOp, counts): MPI never matches a
    nonblocking collective with a blocking one;
``outputs``
    the op's result, the value of the Work's future (DDP reads it);
``keep``
    what MPI reads or writes (the tensors, staging buffers): alive until the
    op completes (the buffers in ``args`` hold addresses, not tensors);
``before``, ``after``
    the op's steps around its MPI call, where it reads its inputs and once
    its data is in place: a strided tensor copied into a contiguous buffer
    and back, PREMUL_SUM's scaling, an aliased input copied apart, AVG's
    division (None: none).  ``call`` runs them; the posted form runs them
    around ``icall`` and the request's completion;
``nbytes``
    the bytes of this rank's input (the posted form is taken up to
    ``hpccomm._runner.NONBLOCKING_MAX_BYTES``).

Example: a blocking all_reduce of a contiguous float32 tensor ``t`` has the
plan ``(comm.Allreduce, (MPI_IN_PLACE, [t's memory, n, MPI_FLOAT], MPI_SUM),
comm.Iallreduce, [t], t, None, None, 4 * n)``.

The parts of a plan that depend only on the dtype and the ReduceOp (the same
on every rank), the MPI op and datatype and whether the reduction has a
nonblocking form, are computed once per pair and cached (:func:`reduction`).
"""
from __future__ import annotations

from functools import partial
from typing import Sequence

import torch

from .. import _mpi, _status
from .._compat import RedOpType, premul_sum_factor, reduce_op_type
from ..errors import OpError, OpTypeError, OpValueError  # noqa: F401 - OpError for the op modules

#: The fields of a plan, in order, and their indexes (see the module docstring).
FIELDS = ("call", "args", "icall", "outputs", "keep", "before", "after", "nbytes")
CALL, ARGS, ICALL, OUTPUTS, KEEP, BEFORE, AFTER, NBYTES = range(len(FIELDS))
_R = RedOpType
_UNSIGNED_WIDE = (torch.uint16, torch.uint32, torch.uint64)
#: (dtype, RedOpType value) -> :func:`reduction`'s answer, for the pairs it accepted (never PREMUL_SUM, whose
#: factor varies).  Keyed by the enum's int: hashing or comparing torch's pybind enums costs several
#: thousand instructions each, more than the rest of a small op's checks.
_REDUCTIONS: dict = {}


_Tensor = torch.Tensor
_STRIDED = torch.strided


class NotOnCPU(OpTypeError):
    """A tensor on a device this path does not serve: hpccomm._runner takes a
    CUDA call to its GPU transport on catching it (so the CPU path pays
    nothing to learn that a call is on the CPU); to a direct caller it is the
    refusal it says."""


def check_tensor(group, op: str, t, what: str = "tensor") -> None:
    """``t`` is a dense tensor of a dtype hpccomm moves, on the CPU or on the
    device the group serves (``group.device_type``: a GPU transport's view of
    the group, see :mod:`hpccomm.gpu`).  The one test of a tensor every op
    runs (each condition a cheap identity or membership test when it holds)."""
    if not isinstance(t, _Tensor):
        raise OpTypeError(op, group.where(), f"{what} is a {type(t).__name__}, not a torch.Tensor")
    if t.layout is not _STRIDED:
        raise OpTypeError(op, group.where(), f"{what} has layout {t.layout}; only dense (strided) tensors can be sent",
                          "Call .to_dense() first")
    if not t.is_cpu and t.device.type != getattr(group, "device_type", "cpu"):
        dev = t.device.type
        if dev == "meta":
            raise OpTypeError(op, group.where(), f"{what} is a meta tensor: it has no data to communicate")
        raise NotOnCPU(op, group.where(), f"{what} is on device {t.device}; this path moves CPU tensors only",
                       "CUDA tensors go through torch.distributed calls, which route them to a GPU transport "
                       "(docs/gpu.md). Move it to the CPU with .cpu()")
    if t.dtype not in _mpi.DTYPES:
        raise OpTypeError(op, group.where(), f"{what} has dtype {t.dtype}, which hpccomm cannot send",
                          f"Supported: {', '.join(str(d).replace('torch.', '') for d in _mpi.DTYPES)}")


def single(group, op: str, tensors, what: str = "tensors") -> torch.Tensor:
    """``check_list(tensors, 1)`` and :func:`check_tensor` of its tensor;
    returns the tensor."""
    if tensors.__class__ is not list or len(tensors) != 1:
        check_list(group, op, tensors, 1, what)
    t = tensors[0]
    check_tensor(group, op, t)
    return t


def check_tensors(group, op: str, ts, what: str = "tensor") -> None:
    for i, t in enumerate(ts):
        check_tensor(group, op, t, f"{what}[{i}]")


def end_job(group, exc: Exception) -> None:
    """A refusal only this rank can see while its peers may already be
    inside MPI: print it, record it for the other ranks' lines, and end the
    job (MPI_Abort) rather than leave them waiting."""
    import sys

    print(f"{exc}; ending the job: the other ranks of group '{group.name}' may already be waiting in MPI",
          file=sys.stderr, flush=True)
    _status.record_failure(f"refused {exc.op}: {exc.what}" if isinstance(exc, OpError) else str(exc))
    _mpi.abort(1)


def check_list(group, op: str, ts, n: int, what: str) -> None:
    if not isinstance(ts, (list, tuple)):
        raise OpTypeError(op, group.where(), f"{what} is a {type(ts).__name__}, not a list of tensors")
    if len(ts) != n:
        raise OpValueError(op, group.where(), f"{what} has {len(ts)} tensors, expected {n}"
                           + (" (one per rank of the group)" if n == group.size else ""))


def check_same_dtype(group, op: str, ts, dtype, what: str) -> None:
    for i, t in enumerate(ts):
        if t.dtype != dtype:
            raise OpTypeError(op, group.where(), f"{what}[{i}] has dtype {t.dtype} but the input has {dtype}",
                              "All tensors of one op must have the same dtype")


def check_root(group, op: str, root: int, what: str = "root") -> None:
    if not isinstance(root, int) or not 0 <= root < group.size:
        raise OpValueError(op, group.where(), f"{what} {root!r} is not a rank of this group of size {group.size}",
                           "Pass a group rank in 0..size-1 (use group_src/group_dst, or dist.get_group_rank)")


def check_peer(group, op: str, peer: int, what: str) -> None:
    check_root(group, op, peer, what)
    if peer == group.rank:
        raise OpValueError(op, group.where(), f"{what} {peer} is this rank itself",
                           "MPI point-to-point needs two different ranks")


def check_tag(group, op: str, tag: int) -> None:
    if not isinstance(tag, int) or not 0 <= tag <= group.tag_ub:
        raise OpValueError(op, group.where(), f"tag {tag!r} is outside 0..{group.tag_ub} (MPI_TAG_UB)")


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

    ``kind``: the RedOpType; ``average``: divide the SUM by the group size
    afterwards (AVG); ``factor``: PREMUL_SUM's factor (else None); ``mop``:
    the MPI op; ``nonblocking``: the reduction has a nonblocking form (MPI
    predefines its op: float16/bfloat16 reduce through user-defined ops,
    which MPI would call back into Python from whichever thread drives a
    posted request, so they keep the blocking form).
    """

    __slots__ = ("dtype", "kind", "average", "factor", "mop", "nonblocking")

    def __init__(self, dtype, kind, factor) -> None:
        self.dtype, self.kind, self.factor = dtype, kind, factor
        self.average = kind == _R.AVG
        self.mop = _mpi.mpi_op(dtype, kind)
        self.nonblocking = self.mop.is_predefined


def reduction(group, op: str, dtype: torch.dtype, redop) -> Reduction:
    """:class:`Reduction` of ``redop`` (a ``ReduceOp`` or ``RedOpType``) on
    ``dtype``.  Refuses as :func:`reduce_op` does, with its messages; a pair
    accepted once is looked up by the enum's value afterwards (PREMUL_SUM,
    whose factor varies from call to call, is made each time).

    Example::

        r = reduction(group, "all_reduce", t.dtype, dist.ReduceOp.AVG)
        comm.Allreduce(_mpi.IN_PLACE, _mpi.host_buffer(t), op=r.mop)
    """
    try:  # the key is the enum's value: hashing torch's pybind enums costs more than a small op's checks
        code = redop.value if redop.__class__ is _R else redop.op.value
    except AttributeError:
        code = None  # not a ReduceOp: reduce_op says so
    hit = _REDUCTIONS.get((dtype, code))
    if hit is not None:
        return hit
    kind, factor = reduce_op(group, op, dtype, redop)
    answer = Reduction(dtype, kind, factor)
    if factor is None:
        _REDUCTIONS[(dtype, code)] = answer
    return answer


def premultiplied(t: torch.Tensor, factor, inplace: bool) -> torch.Tensor:
    """``t * factor`` for PREMUL_SUM, in ``t`` when allowed, else in a new tensor."""
    if isinstance(factor, torch.Tensor):  # NCCL's form is a 1-element tensor: make it a scalar
        factor = factor.to(device=t.device, dtype=t.dtype).reshape(())
    if inplace:
        return t.mul_(factor)
    # contiguous, whatever t's strides, on t's own memory kind
    return torch.mul(t, factor, out=torch.empty_like(t, memory_format=torch.contiguous_format))


def finish_average(t: torch.Tensor, n: int) -> None:
    """Divide a SUM by the group size: integers truncate toward zero, as NCCL's AVG."""
    if t.dtype.is_floating_point or t.dtype.is_complex:
        t.div_(n)
    elif t.dtype in _UNSIGNED_WIDE:  # torch has no integer division for these; numpy does
        host = t if t.device.type == "cpu" else t.cpu()  # a device tensor: divide a host copy
        a = host.numpy()
        a //= n
        if host is not t:
            t.copy_(host)
    else:
        t.copy_(torch.div(t, n, rounding_mode="trunc"))


def contiguous(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when MPI can use its memory, else a contiguous copy (made now)."""
    return t if t.is_contiguous() else t.contiguous()


def out_buffer(t: torch.Tensor) -> torch.Tensor:
    """Where MPI writes a result for ``t``: ``t`` itself, or a fresh contiguous
    tensor whose data :func:`write_back` copies into ``t`` afterwards."""
    return t if t.is_contiguous() else torch.empty(t.shape, dtype=t.dtype, device=t.device)


def write_back(user: torch.Tensor, staged: torch.Tensor) -> None:
    if staged is not user:
        user.copy_(staged)


def staged_input(t: torch.Tensor):
    """``(buffer, before)``: where MPI reads ``t`` from, and the plan step
    that fills it when the op runs (None: ``t`` itself, contiguous)."""
    if t.is_contiguous():
        return t, None
    buf = torch.empty(t.shape, dtype=t.dtype, device=t.device)
    return buf, partial(buf.copy_, t)


def staged_output(t: torch.Tensor):
    """``(buffer, after)``: where MPI writes ``t``'s result, and the plan step
    that copies it into ``t`` once it is there (None: ``t`` itself)."""
    if t.is_contiguous():
        return t, None
    buf = torch.empty(t.shape, dtype=t.dtype, device=t.device)
    return buf, partial(t.copy_, buf)


def copy_apart(t: torch.Tensor):
    """``(buffer, before)``: a contiguous buffer of ``t``'s size and the plan
    step copying ``t`` into it when the op runs (MPI forbids aliased buffers)."""
    buf = torch.empty(t.shape, dtype=t.dtype, device=t.device)
    return buf, partial(buf.copy_, t)


def scaled(t: torch.Tensor, factor):
    """``(buffer, before)``: PREMUL_SUM's ``t * factor`` in a new contiguous
    buffer, computed when the op runs (the user's tensor is left as it is
    should MPI fail)."""
    if isinstance(factor, torch.Tensor):  # NCCL's form is a 1-element tensor: make it a scalar
        factor = factor.to(device=t.device, dtype=t.dtype).reshape(())
    buf = torch.empty_like(t, memory_format=torch.contiguous_format)
    return buf, partial(torch.mul, t, factor, out=buf)


def steps(*fns):
    """One plan step doing ``fns`` in order (the Nones left out), or None."""
    todo = [f for f in fns if f is not None]
    if not todo:
        return None
    if len(todo) == 1:
        return todo[0]

    def in_order():
        for f in todo:
            f()

    return in_order


class Stepped:
    """The blocking form of a plan whose MPI call (or function) ``call`` has
    steps around it: ``before()``, ``call(*args)``, ``after()`` (either step
    may be None).  A GPU transport reaches ``call`` to put its own steps in
    between (hpccomm.gpu)."""

    __slots__ = ("before", "call", "after")

    def __init__(self, before, call, after) -> None:
        self.before, self.call, self.after = before, call, after

    def __call__(self, *args) -> None:
        if self.before is not None:
            self.before()
        self.call(*args)
        if self.after is not None:
            self.after()


def with_steps(call, args, icall, outputs, keep, before, after, nbytes: int):
    """The plan of an MPI call (or function) ``call`` with steps around it
    (``before``, ``after``, either may be None): its blocking form runs them
    around the call (:class:`Stepped`)."""
    if before is None and after is None:
        return (call, args, icall, outputs, keep, None, None, nbytes)
    return (Stepped(before, call, after), args, icall, outputs, keep, before, after, nbytes)


def sequence(plans, outputs, nbytes: int = 0):
    """The plan of an op made of other ops' plans run one after the other (the
    coalesced forms): blocking only."""
    plans = list(plans)

    def run():
        for p in plans:
            p[CALL](*p[ARGS])

    return (run, (), None, outputs, plans, None, None, nbytes)


def blocking(run, outputs, keep=None, nbytes: int = 0):
    """The plan of an op whose blocking form is ``run()`` (several MPI calls,
    or one chosen per rank, steps included), with no nonblocking form."""
    return (run, (), None, outputs, keep, None, None, nbytes)


def flat_view(ts: Sequence[torch.Tensor]):
    """A 1-D tensor viewing all of ``ts`` if they are contiguous and laid end
    to end in one storage, in order (as ``torch.empty(n).chunk(k)`` or
    ``split`` make them, empty pieces included); else None."""
    full = [t for t in ts if t.numel() > 0]  # an empty tensor's data_ptr() is 0
    if not full or not all(t.is_contiguous() for t in full):
        return None
    first = full[0]
    storage = first.untyped_storage().data_ptr()
    ptr = first.data_ptr()
    size = first.element_size()
    for t in full:
        if t.data_ptr() != ptr or t.untyped_storage().data_ptr() != storage:
            return None
        ptr += t.numel() * size
    total = sum(t.numel() for t in full)
    base = torch.empty(0, dtype=first.dtype, device=first.device)
    base.set_(first.untyped_storage(), first.storage_offset(), (total,), (1,))
    return base


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the memory of ``a`` and ``b`` intersects."""
    if a.numel() == 0 or b.numel() == 0:
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    a1 = a0 + a.numel() * a.element_size()
    b1 = b0 + b.numel() * b.element_size()
    return a0 < b1 and b0 < a1


def disjoint(a, b) -> bool:
    """Whether MPI buffers (``mpi4py.MPI.buffer``) ``a`` and ``b`` share no
    byte (:func:`overlaps` for the buffers of :func:`hpccomm._mpi.host_buffer`,
    without asking the tensors again)."""
    a0, b0 = a.address, b.address
    return a0 + a.nbytes <= b0 or b0 + b.nbytes <= a0 or not a.nbytes or not b.nbytes


def chunks(count: int, limit: int):
    """``(offset, n)`` pieces of at most ``limit`` elements covering ``count``
    (one empty piece when count is 0, so a collective still takes place)."""
    if count <= limit:
        yield 0, count
        return
    for off in range(0, count, limit):
        yield off, min(limit, count - off)


