"""Checks and staging shared by the op modules."""
from __future__ import annotations

import time
from typing import Sequence

import torch

from .. import _mpi, _status
from .._compat import RedOpType, premul_sum_factor, reduce_op_type
from ..errors import OpError, OpTypeError, OpValueError  # noqa: F401 - OpError for the op modules

_R = RedOpType
_UNSIGNED_WIDE = (torch.uint16, torch.uint32, torch.uint64)
#: (dtype, RedOpType value) -> :func:`reduction`'s answer, for the pairs it accepted (never PREMUL_SUM, whose
#: factor varies).  Keyed by the enum's int: hashing or comparing torch's pybind enums costs several
#: thousand instructions each, more than the rest of a small op's checks.
_REDUCTIONS: dict = {}


class NotOnCPU(OpTypeError):
    """A tensor on a device this path does not serve: hpccomm._runner takes a
    CUDA call to its GPU transport on catching it (so the CPU path pays
    nothing to learn that a call is on the CPU); to a direct caller it is the
    refusal it says."""


def check_tensor(group, op: str, t, what: str = "tensor") -> None:
    """``t`` is a dense tensor of a dtype hpccomm moves, on the CPU or on the
    device the group serves (``group.device_type``: a GPU transport's view of
    the group, see :mod:`hpccomm.gpu`)."""
    if not isinstance(t, torch.Tensor):
        raise OpTypeError(op, group.where(), f"{what} is a {type(t).__name__}, not a torch.Tensor")
    if t.layout != torch.strided:
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


_Tensor = torch.Tensor
_STRIDED = torch.strided


def plain_buffer(group, tensors):
    """The plain case of an op on one tensor (broadcast and send/recv, either
    form: hpccomm.ops.scatter.ibroadcast, hpccomm._runner.run_broadcast,
    run_send, run_recv): ``tensors`` a list of one dense contiguous CPU tensor
    of a dtype hpccomm has moved before (_mpi.host_types), within the count
    limit: ``[memory, count, MPI type]`` on the tensor's own memory
    (:func:`single`'s checks and _mpi.host_buffer without their calls); else
    None (the general case, which checks and refuses)."""
    if tensors.__class__ is list and len(tensors) == 1:
        t = tensors[0]
        if t.__class__ is _Tensor and t.layout is _STRIDED and t.is_cpu:
            kind = _mpi.host_types.get(t.dtype)
            if kind is not None and t.is_contiguous():
                count = t.numel()
                if count <= group.max_count:
                    return [_mpi.fromaddress(t.data_ptr(), count * kind[1]), count, kind[0]]
    return None


def single(group, op: str, tensors, what: str = "tensors") -> torch.Tensor:
    """``check_list(tensors, 1)`` and :func:`check_tensor` of its tensor in
    one call (a plain CPU tensor of a dtype hpccomm moves passes a quick test
    first); returns the tensor."""
    if tensors.__class__ is list and len(tensors) == 1:
        t = tensors[0]
        if t.__class__ is _Tensor and t.layout is _STRIDED and t.is_cpu and t.dtype in _mpi.DTYPES:
            return t
    check_list(group, op, tensors, 1, what)
    check_tensor(group, op, tensors[0])
    return tensors[0]


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
    """How an op module reduces one dtype with one ReduceOp (made by :func:`reduction`).

    ``kind``: the RedOpType; ``average``: divide the SUM by the group size
    afterwards (AVG); ``factor``: PREMUL_SUM's factor (else None); ``mop``:
    the MPI op, looked up on first use (MPI is not asked before anything
    communicates): read it as ``r.mop or r.resolve()``.
    """

    __slots__ = ("dtype", "kind", "average", "factor", "mop")

    def __init__(self, dtype, kind, factor) -> None:
        self.dtype, self.kind, self.factor, self.mop = dtype, kind, factor, None
        self.average = kind == _R.AVG

    def resolve(self):
        self.mop = _mpi.mpi_op(self.dtype, self.kind)
        return self.mop


def redop_code(redop):
    """The RedOpType value of ``redop`` (a ``ReduceOp`` or ``RedOpType``), the
    key the caches of reductions use (hashing torch's pybind enums themselves
    costs thousands of instructions); None if it is neither."""
    try:
        return redop.value if redop.__class__ is _R else redop.op.value
    except AttributeError:
        return None  # not a ReduceOp: reduce_op says so


def reduction(group, op: str, dtype: torch.dtype, redop) -> Reduction:
    """:class:`Reduction` of ``redop`` (a ``ReduceOp`` or ``RedOpType``) on
    ``dtype``.  Refuses as :func:`reduce_op` does, with its messages; a pair
    accepted once is looked up by the enum's value afterwards.

    Example::

        r = reduction(group, "all_reduce", t.dtype, dist.ReduceOp.AVG)
        comm.Allreduce(_mpi.IN_PLACE, _mpi.host_buffer(t), op=r.mop or r.resolve())
    """
    code = redop_code(redop)
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
    """``t`` itself when MPI can use its memory, else a contiguous copy."""
    return t if t.is_contiguous() else t.contiguous()


def out_buffer(t: torch.Tensor) -> torch.Tensor:
    """Where MPI writes a result for ``t``: ``t`` itself, or a fresh contiguous
    tensor whose data :func:`write_back` copies into ``t`` afterwards."""
    return t if t.is_contiguous() else torch.empty(t.shape, dtype=t.dtype, device=t.device)


def write_back(user: torch.Tensor, staged: torch.Tensor) -> None:
    if staged is not user:
        user.copy_(staged)


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


#: The largest async collective (bytes per rank's tensor) that takes the
#: nonblocking form.  Larger ones keep the blocking form on the comm thread:
#: with Open MPI nothing progresses a posted collective until someone tests or
#: waits, and even with the comm thread waiting on it, a posted 64 MiB
#: all_reduce overlapped compute far worse (both 280 ms for 100 ms of comm and
#: 60 ms of compute) than the blocking call on the comm thread (both 110 ms):
#: docs/benchmarks.md.  The size is equal on every rank, so the form is too.
NONBLOCKING_MAX_BYTES = 64 << 10


class Request:
    """A posted MPI request, as hpccomm._work's Pending protocol tests and
    waits on it (a point-to-point op, hpccomm.ops.p2p.Pending, and a
    nonblocking collective, :class:`Posted`): ``req``, the request;
    ``status``, the MPI status to fill (None: not needed); ``error``, the MPI
    error it completed with, which the subclass's ``finish()`` reports."""

    req = None
    status = None
    error = None
    after = None  # the finish step once the data is in place, or None
    traced = 0  # the tracer's start time (ns) when the tracer draws it (collectives only)
    is_recv = False  # a point-to-point receive (its finish() checks what arrived)

    def test(self) -> bool:
        """Non-blocking: True once the request completed (with or without error)."""
        try:
            return self.req.Test(self.status)
        except _mpi.mpi().Exception as exc:  # completed with an error: finish() reports it
            self.error = exc
            return True

    def wait(self, seconds) -> bool:
        """Block until complete (``seconds`` None) or for at most ``seconds``."""
        if seconds is None:
            try:
                self.req.Wait(self.status)
            except _mpi.mpi().Exception as exc:
                self.error = exc
            return True
        deadline = time.monotonic() + seconds
        idle = 1e-6
        while not self.test():
            if time.monotonic() > deadline:
                return False
            time.sleep(idle)
            idle = min(idle * 2, 1e-3)
        return True


class Posted(Request):
    """An ``async_op=True`` collective in its nonblocking MPI form
    (MPI_Iallreduce, MPI_Iallgather, MPI_Ireduce_scatter_block, MPI_Ibcast):
    how to post it, and its request once posted.

    Made by an op module's nonblocking form (``reduce.iallreduce`` ...) once
    its checks passed; :mod:`hpccomm._runner` posts it (``req = _start()``) and
    hands it to a Work as its Pending (``test``/``wait``/``finish``, see
    hpccomm._work), or, behind queued ops, lets the comm thread post it and
    wait (:meth:`run`).  While posted it is its own watchdog record in
    :mod:`hpccomm._status` (``group``, ``name``, ``seq``, ``start``,
    ``deadline``, ``kind``, ``peer``, ``where()``), which keeps it, and so
    its buffers, alive until it completes, and through which it is waited
    for at exit (MPI forbids cancelling or freeing a collective's request).

    ``_start()`` (the ``start`` argument) posts and returns the request; ``outputs``: the op's result
    (the future's value); ``keep``: the buffers MPI reads or writes; ``after``:
    the finish step once the data is in place (AVG's division, the write-back
    of a staged tensor), or None.
    """

    kind = "collective"
    peer = None
    engine_completes = False  # completed by whoever waits or tests (hpccomm._work), until handed to the comm thread
    group = None
    seq = 0
    start = deadline = None
    token = None

    def __init__(self, op: str, start, outputs, keep, after=None, nbytes: int = 0) -> None:
        self.op = self.name = op
        self._start = start
        self.outputs = outputs
        self.keep = keep  # the buffers MPI reads or writes: alive until the request completes
        self.after = after
        self.nbytes = nbytes

    def where(self) -> str:
        return self.group.where(self.seq) if self.group is not None else f"{self.op} not posted"

    def describe(self) -> str:
        return f"{self.op} ({self.where()})"

    def run(self):
        """Post and wait (the comm thread, or a callback there: the op runs at
        once, in its nonblocking form like on every other rank); the outputs."""
        self.req = self._start()
        self.req.Wait()
        if self.after is not None:
            self.after()
        return self.outputs

    def finish(self):
        """After completion: raise the MPI error naming the op, else the finish step."""
        if self.traced:
            from .. import _trace

            tracer = _trace._tracer
            if tracer:  # posted here, completed here or on another thread: drawn from post to completion
                tracer.record(self.op, self.group.name, self.seq, self.nbytes, self.traced, _trace.now_ns())
        if self.error is not None:
            from .. import _ft
            from ..errors import HpccommError

            what = self.describe()
            failure = _ft.failure(what, self.error) if _ft.state.enabled else None
            if failure is not None:
                raise failure
            raise HpccommError(f"hpccomm {what}: MPI failed: {self.error}")
        if self.after is not None:
            self.after()
        return None


def _settle_posted_at_exit() -> None:
    """At exit, before MPI_Finalize, once the comm and progress threads have
    stopped (hpccomm._engine's thread rule): every posted collective not yet
    complete is waited for.  MPI forbids cancelling or freeing a collective's
    request, and the other ranks run the same collective, so it completes;
    one still running past its group's timeout ends the job with the
    watchdog's kind of message (the watchdog may already have stopped)."""
    posted = [p for p in _status.records() if isinstance(p, Posted) and p.req is not None]
    for p in posted:
        try:
            while not p.req.Test():
                if p.deadline is not None and time.monotonic() > p.deadline + 2.0:
                    import sys

                    print(f"hpccomm: {p.describe()} did not complete within the group's timeout at exit "
                          "(a rank never posted it?); ending the job", file=sys.stderr, flush=True)
                    _status.record_failure(f"timed out in {p.describe()} at exit")
                    _mpi.abort(1)
                time.sleep(1e-4)
        except _mpi.mpi().Exception:  # completed with an error: at exit, settle the others
            pass


_mpi.at_exit.append((1.5, _settle_posted_at_exit))
