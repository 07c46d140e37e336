"""Binding ranks to GPUs: which GPU this rank uses.

At init (hpccomm._start.creator) :func:`bind_later` arranges the binding
(``HPCCOMM_GPU_BIND=local_rank``, the default: GPU ``local_rank % count``)
for when the process first initialises CUDA, touching nothing of CUDA now:
torch runs it as CUDA starts, so a CPU job never makes a CUDA context.
:func:`bind` binds now (``hpccomm.gpu.bind()``), :func:`binding` says what
was done.  The node's rank count is kept for the point-to-point routes
(hpccomm._gpu.agreement: NCCL refuses ranks sharing a GPU).

This process's state, not a group's: one binding per process.
"""
from __future__ import annotations

import logging

import torch

from .. import config
from .. import _compat as compat

log = logging.getLogger("hpccomm")

_node: dict = {"local_rank": 0, "local_size": 1}
_binding: dict = {"device": None, "how": "not bound: no world group made"}


def bind_later(local_rank: int, local_size: int, cuda=None) -> dict:
    """Arrange this rank's GPU binding (HPCCOMM_GPU_BIND=local_rank, the
    default: GPU ``local_rank % count``) for when the process first
    initialises CUDA, touching nothing of CUDA now; or leave it (``none``, or
    CUDA already initialised: the device the user set stands).  Returns and
    remembers ``{"device": index or None, "how": sentence}``.

    :param local_rank: this rank among the ranks of its node.
    :param local_size: the ranks of its node.
    :param cuda: torch.cuda, or a stand-in.

    Example::

        bind_later(1, 2)   # {'device': None, 'how': 'not bound yet: local rank 1 of 2 binds to GPU 1 ...'}
    """
    cuda = torch.cuda if cuda is None else cuda
    _node.update(local_rank=local_rank, local_size=local_size)
    mode = config.get("HPCCOMM_GPU_BIND")
    if mode == "none":
        found = {"device": None, "how": "HPCCOMM_GPU_BIND=none: left to the user"}
    elif torch.version.cuda is None and cuda is torch.cuda:
        found = {"device": None, "how": "a CPU-only torch: no GPU to bind"}
    elif cuda.is_initialized():
        index = cuda.current_device()
        found = {"device": index, "how": f"CUDA was initialised before hpccomm's init: the current device "
                                         f"(cuda:{index}) stands"}
    else:
        found = {"device": None, "how": f"not bound yet: local rank {local_rank} of {local_size} binds to GPU "
                                        f"{local_rank} modulo the GPU count when this process first uses CUDA"}
        compat.on_cuda_init(lambda: _bind_now(local_rank, local_size, cuda))
    _binding.clear()
    _binding.update(found)
    return dict(found)


def _bind_now(local_rank: int, local_size: int, cuda) -> None:
    """Run by torch as CUDA starts in this process (never raises: torch would wrap it)."""
    try:
        count = cuda.device_count()
        index = local_rank % count
        cuda.set_device(index)
        how = (f"local rank {local_rank} of {local_size} on this node, {count} GPU(s): torch.cuda.set_device({index}) "
               "when the process first used CUDA")
        _binding.update(device=index, how=how)
        if local_size > count:
            log.warning("hpccomm: %d ranks share %d GPU(s) on this node: local rank %d uses GPU %d (NCCL cannot "
                        "serve shared GPUs: collectives go over CUDA-aware MPI or staged)", local_size, count,
                        local_rank, index)
    except Exception as exc:  # noqa: BLE001
        _binding.update(device=None, how=f"binding failed: {type(exc).__name__}: {exc}")


def bind(cuda=None) -> dict:
    """Bind now (``hpccomm.gpu.bind()``): initialises CUDA, which runs the
    arranged binding; returns the binding."""
    cuda = torch.cuda if cuda is None else cuda
    if cuda.is_available():
        cuda.init()
    return binding()


def binding() -> dict:
    """``{"device": index or None, "how": sentence}``: this rank's binding so far."""
    return dict(_binding)


def local_size() -> int:
    """The ranks on this node, as init found them (1 before init)."""
    return _node["local_size"]


def device_of(local_rank: int, cuda=None):
    """The GPU index this rank uses, or would once it uses CUDA, without
    initialising CUDA: the one bound (or current, CUDA being up), else the
    one HPCCOMM_GPU_BIND chooses for local rank ``local_rank``
    (HPCCOMM_GPU_BIND=none: the current device, 0 until the user sets one);
    None where torch sees no GPU (``hpccomm info`` names the GPU of every
    rank with it, before any binding ran).

    Example::

        device_of(3)      # 1 on a node whose torch sees 2 GPUs
    """
    cuda = torch.cuda if cuda is None else cuda
    if not cuda.is_available():
        return None
    if _binding["device"] is not None:
        return _binding["device"]
    if cuda.is_initialized():
        return cuda.current_device()
    if config.get("HPCCOMM_GPU_BIND") == "none":
        return 0  # (CUDA starts on its first device unless the user sets another)
    return local_rank % cuda.device_count()
