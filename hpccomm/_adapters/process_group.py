"""The torch 2.13 adapter: a ``torch.distributed.ProcessGroup`` whose ops run on MPI.

torch 2.13 has no Python ``Backend``; a Python backend there is a whole
``ProcessGroup`` subclass, called directly by torch's Python functions and
through torch's C++ ``PyProcessGroup`` trampoline by C++ callers (DDP's
reducer, functional collectives).  The op methods are shared with the
torch >= 2.14 adapter (:mod:`hpccomm._adapters.methods`); this class adds what a
whole process group must answer: its name, description and lifetime.
"""
from __future__ import annotations

import torch

from .. import _compat as compat
from .._about import BACKEND_NAME
from .._compat import ProcessGroupBase
from ..barrier import monitored_barrier
from . import methods
from .backend import BackendHpccomm

__all__ = ["BACKEND_NAME", "ProcessGroupHpccomm"]


class ProcessGroupHpccomm(methods.TorchOps, ProcessGroupBase):
    """A torch process group over one MPI communicator (every supported torch).

    Made by ``dist.init_process_group("hpccomm")``, ``dist.new_group`` and
    :func:`hpccomm.from_mpi4py`; not usually constructed directly.  Every
    ``torch.distributed`` call on the group becomes MPI calls on the group's
    own communicators.  An op called with arguments it cannot accept raises
    :class:`hpccomm.OpValueError` or :class:`hpccomm.OpTypeError` before any
    communication; a failure during communication raises
    :class:`hpccomm.HpccommError` naming the op.

    :param group: hpccomm's internal description of the group (communicators,
        ranks, timeout), made by the backend creator.

    Example::

        pg = dist.new_group([0, 1], backend="hpccomm")
        dist.all_reduce(t, group=pg)
        pg.mpi_comm.Get_size()        # the group's mpi4py communicator (do not free it)
    """

    def __init__(self, group) -> None:
        super().__init__(group.rank, group.size)
        self._g = group
        if compat.py_backend():
            # torch >= 2.14 asks a group for its per-device Backend (batch_isend_irecv's
            # coalescing, split_group): answer with hpccomm's, over the same group.
            backend = BackendHpccomm(group)
            for device in ("cpu", "cuda"):
                self._register_backend(torch.device(device), ProcessGroupBase.BackendType.CUSTOM, backend)
            self._set_default_backend(ProcessGroupBase.BackendType.CUSTOM)

    # -- identity -------------------------------------------------------------
    def name(self) -> str:
        return BACKEND_NAME

    def getGroupName(self) -> str:
        return self._g.name

    def setGroupName(self, name: str) -> None:
        self._g.name = name

    def getGroupDesc(self) -> str:
        return self._g.desc

    def setGroupDesc(self, desc: str) -> None:
        self._g.desc = desc

    @property
    def group_name(self) -> str:
        return self._g.name

    def monitored_barrier(self, timeout=None, wait_all_ranks: bool = False) -> None:
        """``group.monitored_barrier(timeout, wait_all_ranks)`` (what
        ``dist.monitored_barrier`` calls; see :func:`hpccomm.monitored_barrier`)."""
        monitored_barrier(self._g, timeout=timeout, wait_all_ranks=wait_all_ranks)

    # (abort, shutdown: hpccomm._adapters.methods.TorchOps)


methods.add_legacy(ProcessGroupHpccomm)  # torch's older names, which only this route is called by
methods.hide_methods(ProcessGroupHpccomm)
