"""Staging: where MPI reads and writes when it cannot use a tensor's own memory.

A contiguous CPU tensor goes to MPI zero-copy; these helpers make the copies
the torch API's shape forces (a strided tensor, an aliased input, a list laid
out apart, PREMUL_SUM's scaled input) and the plan steps that fill them when
the op runs and copy results back (hpccomm._ops.plan).
"""
from __future__ import annotations

from functools import partial
from typing import Sequence

import torch


_UNSIGNED_WIDE = (torch.uint16, torch.uint32, torch.uint64)


def premultiplied(t: torch.Tensor, factor, inplace: bool) -> torch.Tensor:
    """``t * factor`` for PREMUL_SUM, in ``t`` when allowed, else in a new tensor."""
    if isinstance(factor, torch.Tensor):  # NCCL's form is a 1-element tensor: make it a scalar
        factor = factor.to(t).reshape(())
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
    return t if t.is_contiguous() else t.new_empty(t.shape)


def write_back(user: torch.Tensor, staged: torch.Tensor) -> None:
    if staged is not user:
        user.copy_(staged)


def staged_input(t: torch.Tensor):
    """``(buffer, before)``: where MPI reads ``t`` from, and the plan step
    that fills it when the op runs (None: ``t`` itself, contiguous)."""
    if t.is_contiguous():
        return t, None
    buf = t.new_empty(t.shape)
    return buf, partial(buf.copy_, t)


def staged_output(t: torch.Tensor):
    """``(buffer, after)``: where MPI writes ``t``'s result, and the plan step
    that copies it into ``t`` once it is there (None: ``t`` itself)."""
    if t.is_contiguous():
        return t, None
    buf = t.new_empty(t.shape)
    return buf, partial(t.copy_, buf)


def copy_apart(t: torch.Tensor):
    """``(buffer, before)``: a contiguous buffer of ``t``'s size and the plan
    step copying ``t`` into it when the op runs (MPI forbids aliased buffers)."""
    buf = t.new_empty(t.shape)
    return buf, partial(buf.copy_, t)


def scaled(t: torch.Tensor, factor):
    """``(buffer, before)``: PREMUL_SUM's ``t * factor`` in a new contiguous
    buffer, computed when the op runs (the user's tensor is left as it is
    should MPI fail)."""
    if isinstance(factor, torch.Tensor):  # NCCL's form is a 1-element tensor: make it a scalar
        factor = factor.to(t).reshape(())
    buf = torch.empty_like(t, memory_format=torch.contiguous_format)
    return buf, partial(torch.mul, t, factor, out=buf)


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
    base = first.new_empty(0)
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
