"""Staging: where MPI reads and writes when it cannot use a tensor's own memory.

A contiguous CPU tensor goes to MPI zero-copy: each plan function takes the
tensor itself when it is contiguous (and apart from what the same call
writes), the one place it decides so.  These helpers make the copies the torch
API's shape forces otherwise (a strided tensor, an aliased input, a list laid
out apart, PREMUL_SUM's scaled input) and the plan steps that fill them when
the op runs and copy results back (hpccomm._core.plan).
"""
from __future__ import annotations

from functools import partial
from typing import Sequence

import torch

from .._core.plan import steps
from .._core.steps import finish_average, overlap, overlaps  # noqa: F401 - the op modules' steps, here too




def _factor(t: torch.Tensor, factor):
    """PREMUL_SUM's factor as ``t`` can be multiplied by it (NCCL's form is a
    1-element tensor: made a scalar of ``t``'s dtype and device)."""
    if isinstance(factor, torch.Tensor):
        return factor.to(t).reshape(())
    return factor


def scale_(t: torch.Tensor, factor) -> None:
    """PREMUL_SUM's scaling of a work buffer ``t``, in place."""
    t.mul_(_factor(t, factor))


def copy_in(t: torch.Tensor):
    """``(buffer, before)``: a contiguous buffer of ``t``'s size that MPI reads,
    and the plan step filling it from ``t`` when the op runs: for a strided
    ``t``, or one aliased with what the same call writes (MPI forbids
    aliased buffers).  A plan function takes ``t`` itself when it is
    contiguous (and apart): zero copy."""
    buf = t.new_empty(t.shape)
    return buf, partial(buf.copy_, t)


def copy_out(t: torch.Tensor):
    """``(buffer, after)``: a contiguous buffer that MPI writes ``t``'s result
    into, and the plan step copying it into strided ``t`` once it is there."""
    buf = t.new_empty(t.shape)
    return buf, partial(t.copy_, buf)


def copy_inout(t: torch.Tensor):
    """``(buffer, before, after)``: a contiguous copy of strided ``t`` that MPI
    reads and writes in place, the step filling it and the step copying it back."""
    buf = t.new_empty(t.shape)
    return buf, partial(buf.copy_, t), partial(t.copy_, buf)


def averaged(out: torch.Tensor, n: int, then=None):
    """The step after an AVG reduction into ``out``: the SUM divided by the
    group size ``n`` (:func:`finish_average`), then ``then`` (a staged
    output's copy back, or None)."""
    return steps(partial(finish_average, out, n), then)


def joined(ts: Sequence[torch.Tensor], total: int, like: torch.Tensor, avoid=None, factor=None):
    """``(buffer, before)``: where MPI reads the list ``ts`` from as one
    buffer of ``total`` elements: their own storage when they are laid end to
    end (:func:`flat_view`) apart from ``avoid`` (what the same call writes),
    else a new buffer that ``before`` fills.  ``factor``: PREMUL_SUM's, which
    the new buffer is multiplied by (the user's tensors are left as they are)."""
    flat = flat_view(ts) if factor is None else None
    if flat is not None and (avoid is None or not overlaps(flat, avoid)):
        return flat, None
    buf = like.new_empty(total)
    if not ts:
        return buf, None

    def before():
        torch.cat([t.reshape(-1) for t in ts], out=buf)
        if factor is not None:
            buf.mul_(_factor(buf, factor))

    return buf, before


def split(ts: Sequence[torch.Tensor], counts, like: torch.Tensor, avoid=None):
    """``(buffer, after)``: where MPI writes the list ``ts`` (``counts``
    elements each) as one buffer: their own storage when laid end to end
    apart from ``avoid`` (what the same call reads), else a new buffer that
    ``after`` copies out into them."""
    flat = flat_view(ts)
    if flat is not None and (avoid is None or not overlaps(avoid, flat)):
        return flat, None
    buf = like.new_empty(sum(counts))

    def after():
        for t, part in zip(ts, torch.split(buf, counts)):
            t.copy_(part.view(t.shape))

    return buf, after


def scaled(t: torch.Tensor, factor):
    """``(buffer, before)``: PREMUL_SUM's ``t * factor`` in a new contiguous
    buffer, computed when the op runs (the user's tensor is left as it is
    should MPI fail)."""
    buf = torch.empty_like(t, memory_format=torch.contiguous_format)
    return buf, partial(torch.mul, t, _factor(t, factor), out=buf)


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


def chunks(count: int, limit: int):
    """``(offset, n)`` pieces of at most ``limit`` elements covering ``count``
    (one empty piece when count is 0, so a collective still takes place)."""
    if count <= limit:
        yield 0, count
        return
    for off in range(0, count, limit):
        yield off, min(limit, count - off)
