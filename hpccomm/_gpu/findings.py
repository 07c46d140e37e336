"""What this process can do with CUDA tensors, asked once, and which GPU a
device is.

:func:`capabilities` asks the probes (hpccomm._gpu.probe) the first time a
route is chosen in the process, or for ``hpccomm info`` (MPI must be up),
and keeps the answer: whether the MPI library is CUDA-aware and how fast it
reduces and moves device memory, whether NCCL is there through torch or
CuPy.  :func:`identify` names the GPU of a device across processes (the
node and the GPU's UUID), so that ranks on one GPU are seen whatever their
``CUDA_VISIBLE_DEVICES``.  Both are this process's facts, the same for
every group; the choice made from every member's facts is
hpccomm._gpu.agreement's.

Tests without a GPU say what the probes would find (:func:`assumed`, a
supported hook): routes are then chosen from those findings.
"""
from __future__ import annotations

import contextlib
import socket

import torch

from .. import _compat as compat
from . import probe, select

_found: list = [None]  # this process's Capabilities, once asked (or assumed)
_identify: list = [None]  # identify's stand-in while assumed (None: the real one)


def capabilities() -> select.Capabilities:
    """This process's probe findings, asked once (MPI must be up: it is
    started otherwise).

    Example::

        capabilities().mpi_cuda.word()      # 'yes', 'no' or 'unknown'
    """
    if _found[0] is None:
        from .. import _mpi

        MPI = _mpi.mpi()
        cuda_aware = probe.probe_mpi_cuda(MPI)
        _found[0] = select.Capabilities(cuda_aware, probe.probe_nccl_torch(compat.torch_nccl_available),
                                        probe.probe_nccl_cupy(), *probe.probe_device_speed(MPI, cuda_aware))
    return _found[0]


def identify(device) -> tuple:
    """``((node, GPU), GPUs on the node)`` of ``device``: the GPU's UUID (so
    ranks on one GPU are seen whatever their CUDA_VISIBLE_DEVICES); ``((), 0)``
    where CUDA is not up (no GPU to tell apart).  Asking initialises CUDA.

    Example::

        identify(torch.device("cuda", 0))   # (('node1', 'GPU-8f6c...'), 4)
    """
    if _identify[0] is not None:
        return _identify[0](device)
    if not torch.cuda.is_available():
        return (), 0
    props = torch.cuda.get_device_properties(device)
    gpu = str(getattr(props, "uuid", "") or getattr(props, "pci_bus_id", "") or device.index)
    return (socket.gethostname(), gpu), torch.cuda.device_count()


@contextlib.contextmanager
def assumed(caps: select.Capabilities, identify=None):
    """Inside the block, this process's findings are ``caps`` and, when
    given, ``identify(device) -> ((node, GPU), GPUs on the node)`` names its
    GPUs; what was found (or assumed) before is back after.  A supported test
    hook: a machine without a GPU routes as one with the findings given.
    Routes a group chose before are kept (hpccomm._gpu.group_routes.release
    makes them anew).

    :param caps: the findings (hpccomm._gpu.select.Capabilities).
    :param identify: the GPU of a device, or None to keep asking CUDA.

    Example::

        with findings.assumed(select.Capabilities(Finding(True, "injected"), Finding(False, "injected"),
                                                  Finding(False, "injected"))):
            dist.all_reduce(fake_cuda_tensor)   # routed as over a CUDA-aware MPI without NCCL
    """
    saved = _found[0], _identify[0]
    assume(caps, identify)
    try:
        yield
    finally:
        _found[0], _identify[0] = saved


def assume(caps: select.Capabilities, identify=None) -> None:
    """:func:`assumed`'s findings from now on (inside its block: until it
    ends); ``caps`` None: ask the probes again at the next route chosen."""
    _found[0] = caps
    if identify is not None:
        _identify[0] = identify
