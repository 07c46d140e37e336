"""Every version-sensitive symbol of torch, in one place.

The rest of hpccomm imports torch's distributed internals only from here, so
that a new torch (for example one with ``dist.BackendBase``, a Python
trampoline for ``c10d::Backend``) can be supported by changing this module and
``process_group.py`` alone.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as _c10d

TORCH_VERSION = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])

#: The C++-backed base classes a Python backend derives from.
ProcessGroupBase = dist.ProcessGroup
WorkBase = dist.Work
ReduceOp = dist.ReduceOp
RedOpType = dist.ReduceOp.RedOpType


def reduce_op_type(op) -> "RedOpType":
    """The ``RedOpType`` of ``op`` (a ``ReduceOp`` or a ``RedOpType``)."""
    if isinstance(op, RedOpType):
        return op
    return op.op


def premul_sum_factor(op):
    """The factor of a PREMUL_SUM ReduceOp: a float or a 1-element tensor.

    torch keeps the factor in a C++ supplement; its pickling state is the only
    public door to it.
    """
    _, factor = op.__getstate__()
    return factor


def register_rendezvous_handler(scheme: str, handler) -> None:
    import importlib

    # ``from torch.distributed import rendezvous`` is a function; we need the module.
    rdzv_module = importlib.import_module("torch.distributed.rendezvous")

    if scheme not in rdzv_module._rendezvous_handlers:
        rdzv_module.register_rendezvous_handler(scheme, handler)


def register_backend(name: str, creator, devices) -> None:
    if name.upper() in dist.Backend._plugins:
        return
    dist.Backend.register_backend(name, creator, extended_api=True, devices=devices)


def world_group():
    """torch's default (world) process group."""
    return dist.group.WORLD


def default_group_or_none():
    from torch.distributed import distributed_c10d as c10d

    if not dist.is_initialized():
        return None
    return c10d._get_default_group()


TCPStore = _c10d.TCPStore


def nccl_available() -> bool:
    """True when torch was built with NCCL or cupy has NCCL (either can carry
    GPU tensors); False on a CPU-only build.  Imports cupy only if installed."""
    if dist.is_nccl_available():
        return True
    import importlib.util

    if importlib.util.find_spec("cupy") is None:
        return False
    try:
        from cupy.cuda import nccl
    except Exception:  # noqa: BLE001 - a cupy without a usable CUDA/NCCL raises various errors
        return False
    return bool(getattr(nccl, "available", True))
