"""Horovod's reduction ops and dtypes, the checks every op makes of its
arguments on the calling rank, and the words an op's errors start with.

A check returns the exception instead of raising it: the op hands it to the
agreement step (:func:`..negotiation.negotiate`), which raises it on this rank
and tells the other ranks whose input was refused, so that nobody waits for
an op that will not run.
"""
from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

#: Horovod's reduction ops (the values of its C++ enum).
Average, Sum, Adasum, Min, Max, Product = 0, 1, 2, 3, 4, 5
OP_NAMES = {Average: "Average", Sum: "Sum", Adasum: "Adasum", Min: "Min", Max: "Max", Product: "Product"}
TORCH_OP = {Average: dist.ReduceOp.SUM, Sum: dist.ReduceOp.SUM, Min: dist.ReduceOp.MIN,
            Max: dist.ReduceOp.MAX, Product: dist.ReduceOp.PRODUCT}
#: dtypes the reductions take (Horovod's int32, int64, float16, float32, float64, and bfloat16).
REDUCE_DTYPES = (torch.int32, torch.int64, torch.float16, torch.bfloat16, torch.float32, torch.float64)
#: dtypes the moving ops (allgather, broadcast, alltoall) take.
MOVE_DTYPES = REDUCE_DTYPES + (torch.uint8, torch.int8, torch.int16, torch.bool)


def where(kind: str, ps, name=None, number=None) -> str:
    """The words an op's error starts with: the op, its name, its number on the
    process set (default: the last agreement step's), and this rank."""
    label = f"{kind} {name!r}" if name else kind
    number = ps.negotiations if number is None else number
    return (f"hpccomm.horovod {label} (op #{number} on process set {ps.process_set_id}, "
            f"rank {ps.rank()}/{len(ps.ranks)})")


def resolve_op(op, average):
    """Horovod's ``op``/``average`` rule: ``op`` wins, ``average`` is deprecated, Average by default."""
    if op is not None:
        if average is not None:
            raise ValueError("The op parameter supersedes average. Please provide only one of them.")
        return op
    if average is not None:
        warnings.warn("Parameter `average` has been replaced with `op` and will be removed in v1.0",
                      DeprecationWarning, stacklevel=3)
        return Average if average else Sum
    return Average


def first_error(*errors):
    return next((e for e in errors if e is not None), None)


def check_tensor(kind, t, dtypes):
    if not isinstance(t, torch.Tensor):
        return TypeError(f"hpccomm.horovod {kind}: expected a torch.Tensor, got {type(t).__name__}")
    if t.is_sparse:
        return ValueError(f"hpccomm.horovod {kind}: sparse tensors are not supported; pass tensor.to_dense()")
    if t.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        return ValueError(f"hpccomm.horovod {kind}: tensor type {t.type()} ({t.dtype}) is not supported; "
                          f"supported: {names}")
    return None


def check_tensors(kind, tensors, dtypes, why_rows=None):
    """Every tensor of ``tensors`` checked (dtype, dense); a grouped op's list
    not empty; with ``why_rows``, every tensor at least 1-D (the op works along
    the first dimension, ``why_rows`` says how)."""
    error = first_error(*(check_tensor(kind, t, dtypes) for t in tensors))
    if error is None and not tensors:
        error = ValueError(f"hpccomm.horovod {kind}: the list of tensors is empty")
    if error is None and why_rows and any(t.dim() == 0 for t in tensors):
        error = ValueError(f"hpccomm.horovod {kind}: cannot {kind.replace('grouped_', '')} a 0-dimensional tensor "
                           f"({why_rows}); reshape it to (1,)")
    return error


def check_gatherable(kind, tensors):
    """The checks of the ops whose result is concatenated along the first dimension."""
    return check_tensors(kind, tensors, MOVE_DTYPES, "the result is concatenated along the first dimension")


def check_reduce_op(kind, op, allowed=(Average, Sum, Min, Max, Product)):
    if op == Adasum:
        return NotImplementedError(f"hpccomm.horovod {kind}: op=hvd.Adasum is not supported (hpccomm.horovod has no "
                                   "Adasum reduction); use op=hvd.Average, the default")
    if op not in allowed:
        names = ", ".join(f"hvd.{OP_NAMES[o]}" for o in allowed)
        return ValueError(f"hpccomm.horovod {kind}: op={op!r} is not one of {names}")
    return None


def _float_or_error(kind, name, value):
    try:
        return float(value), None
    except (TypeError, ValueError):
        return 1.0, TypeError(f"hpccomm.horovod {kind}: {name} must be a number, got {value!r}")


def check_reduction(kind, tensors, op, op_error, prescale_factor, postscale_factor, why_rows=None):
    """What allreduce and reducescatter check alike: the scale factors, the
    reduction (``op_error``: the op's own verdict on ``op``) and the tensors.

    :returns: ``(pre, post, params, error)``: the factors as floats, the
        description's parameters for the agreement step, the first error or None.
    """
    pre, pre_error = _float_or_error(kind, "prescale_factor", prescale_factor)
    post, post_error = _float_or_error(kind, "postscale_factor", postscale_factor)
    error = first_error(pre_error, post_error, op_error, check_tensors(kind, tensors, REDUCE_DTYPES, why_rows))
    params = (("op", OP_NAMES.get(op, op)), ("prescale_factor", pre), ("postscale_factor", post))
    return pre, post, params, error


def scale_(t: torch.Tensor, factor: float) -> None:
    """Horovod's scaling: floats multiply; integers are multiplied in double
    precision and truncated toward zero."""
    if factor == 1.0:
        return
    if t.is_floating_point() or t.is_complex():
        t.mul_(factor)
    else:
        t.copy_(torch.trunc(t.double() * factor))
