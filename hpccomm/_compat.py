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


# --------------------------------------------------------------------------
# GPU transports (hpccomm.gpu): torch's NCCL backend and the option objects
# its methods take.
# --------------------------------------------------------------------------

PrefixStore = _c10d.PrefixStore

#: torch's option classes, by the name hpccomm.gpu.nccl_torch uses.
OPTION_CLASSES = {
    "allreduce": _c10d.AllreduceOptions,
    "allreduce_coalesced": _c10d.AllreduceCoalescedOptions,
    "reduce": _c10d.ReduceOptions,
    "reduce_scatter": _c10d.ReduceScatterOptions,
    "broadcast": _c10d.BroadcastOptions,
    "scatter": _c10d.ScatterOptions,
    "gather": _c10d.GatherOptions,
    "allgather": _c10d.AllgatherOptions,
    "alltoall": _c10d.AllToAllOptions,
}


def torch_nccl_available() -> bool:
    """Whether this torch was built with NCCL (``dist.is_nccl_available()``)."""
    return bool(dist.is_nccl_available())


def make_nccl_backend(store, rank: int, size: int, timeout=None, name: str = "", global_ranks=None):
    """torch's ``ProcessGroupNCCL`` over ``store`` (no MASTER_ADDR: the store
    is hpccomm's own), set up as torch's ``_new_process_group_helper`` sets
    it up.  NCCL's communicator itself is made by torch at the first
    collective, through the store."""
    pg_nccl = getattr(dist, "ProcessGroupNCCL", None)
    if pg_nccl is None:
        raise RuntimeError("this torch has no NCCL (torch.distributed.is_nccl_available() is False)")
    options = pg_nccl.Options()
    options.is_high_priority_stream = False
    if timeout is not None:
        options._timeout = timeout
    if name and hasattr(options, "group_name"):
        options.group_name = name
    if global_ranks is not None and hasattr(options, "global_ranks_in_group"):
        options.global_ranks_in_group = list(global_ranks)
    return pg_nccl(store, rank, size, options)


def requested_device_backends():
    """The ``{device: backend}`` map torch is creating a group for, such as
    ``{"cpu": "hpccomm", "cuda": "nccl"}`` for ``backend="cpu:hpccomm,cuda:nccl"``,
    or None when not called from torch's group creation.

    torch 2.13 stops at the first backend that is a whole ProcessGroup (as
    hpccomm's is) and never builds the others, so hpccomm reads the map from
    torch's ``_new_process_group_helper`` frame to honour ``cuda:<backend>``.
    """
    import sys

    frame = sys._getframe(1)
    while frame is not None:
        config = frame.f_locals.get("backend_config") if frame.f_code.co_name == "_new_process_group_helper" else None
        if config is not None and hasattr(config, "get_device_backend_map"):
            return {str(k): str(v) for k, v in config.get_device_backend_map().items()}
        frame = frame.f_back
    return None


_hidden = []  # (class, method names) waiting for Dynamo to be imported


def hide_from_compiler(cls, names):
    """Run the methods ``names`` of ``cls`` with TorchDynamo off, from the
    moment Dynamo is imported (at once if it already is).

    torch's C++ layer calls a Python process group's methods (and its Works')
    from inside code that ``torch.compile`` is running, for example DDP's
    ``reducer._rebuild_buckets()`` broadcasting from a compiled forward.
    Dynamo then tries to compile the method's frame, where ``self`` is a
    ``ProcessGroup``, an opaque object to it since torch 2.13, and reading any
    attribute of ours is a hard error ("Attempted to access unregistered member
    on an OpaqueObject"), not a graph break.  ``torch._dynamo.disable``'s
    wrapper lives in a file Dynamo never traces; it costs about 1 us a call.
    Importing Dynamo costs about 1 s, so it is not imported for this: a
    process that never compiles keeps plain methods; ``torch.compile`` imports
    Dynamo before it can run anything, and the import hook below wraps the
    methods then.
    """
    import sys

    _hidden.append((cls, list(names)))
    if "torch._dynamo" in sys.modules and hasattr(sys.modules["torch._dynamo"], "disable"):
        _wrap_hidden()
    elif not any(isinstance(f, _DynamoImportHook) for f in sys.meta_path):
        sys.meta_path.insert(0, _DynamoImportHook())


def _wrap_hidden() -> None:
    import torch._dynamo

    while _hidden:
        cls, names = _hidden.pop()
        for name in names:
            setattr(cls, name, torch._dynamo.disable(cls.__dict__[name], recursive=True))


class _DynamoImportHook:
    """A one-shot ``sys.meta_path`` finder: lets ``torch._dynamo`` load as
    usual, then calls :func:`_wrap_hidden`, and removes itself."""

    def find_spec(self, name, path=None, target=None):
        if name != "torch._dynamo":
            return None
        import importlib.machinery
        import sys

        sys.meta_path[:] = [f for f in sys.meta_path if f is not self]
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader_exec = spec.loader.exec_module

        def exec_module(module):
            loader_exec(module)
            _wrap_hidden()

        spec.loader.exec_module = exec_module
        return spec
