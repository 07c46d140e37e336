"""Which CUDA device a call is on, if any, and the tensors among its arguments.

The op path (hpccomm._ops.op_path) asks :func:`cuda_device` once per call
it checks (a call of a shape it checked before is a CPU call, found in its
group's cache): None sends the call to hpccomm's CPU path, a device to the
route its group takes there (hpccomm._gpu.dispatch).  A call that mixes
devices is refused before any communication.  :func:`future_devices` says
which devices the Work of a device call names.  :func:`tensors_in` lists a
call's tensors and :func:`translate` hands the user's tensors back in place of
a transport's stand-ins (the GPU transports).
"""
from __future__ import annotations

import torch

from ..errors import OpValueError

_Tensor = torch.Tensor


def _any_cuda(items) -> bool:
    """Whether any tensor among ``items`` (nested lists and tuples) is on a GPU."""
    for a in items:
        if isinstance(a, _Tensor):
            if a.is_cuda:
                return True
        elif isinstance(a, (list, tuple)) and _any_cuda(a):
            return True
    return False


def tensors_in(args):
    """Every tensor among an op's arguments (nested lists and tuples), in order."""
    for a in args:
        if isinstance(a, _Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            yield from tensors_in(a)


def translate(result, stand_ins: dict):
    """``result`` (an op's outputs) with each stand-in tensor replaced by the
    user's (``stand_ins``: ``id(stand-in) -> user tensor``): a Work's future
    holds the user's tensors, not a transport's copies."""
    if isinstance(result, _Tensor):
        return stand_ins.get(id(result), result)
    if isinstance(result, (list, tuple)):
        return type(result)(translate(r, stand_ins) for r in result)
    return result


def cuda_device(group, op, args):
    """The CUDA device of the call's tensors (``args``, a call of ``op``, a
    declaration of hpccomm._ops.op, on ``group``), or None if it has none.

    :raises OpValueError: the call mixes devices (a CPU input and a CUDA
        output, or two GPUs): checked before any communication.

    Example::

        cuda_device(group, registry.BY_NAME["all_reduce"], ([torch.ones(2, device="cuda")], ReduceOp.SUM))
        # device(type='cuda', index=0)
    """
    if not _any_cuda(args):
        return None  # no CUDA tensor: the CPU path (whose checks refuse other devices)
    devices = {t.device for t in tensors_in(args)}
    if len(devices) == 1:
        (device,) = devices
        return device
    listed = ", ".join(sorted(str(d) for d in devices))
    raise OpValueError(op.name, group.where_p2p() if op.p2p else group.where(), f"the call mixes devices ({listed})",
                       "Put every input and output of one call on the same device, with .to(device)")


def future_devices(device, cuda=None):
    """The devices a Work's future holding tensors of ``device`` must name
    (torch requires them for CUDA tensors); None where CUDA is not up (fake
    device tensors in tests hold host memory).  ``cuda``: torch.cuda, or a
    stand-in."""
    cuda = torch.cuda if cuda is None else cuda
    return [device] if cuda.is_available() else None
