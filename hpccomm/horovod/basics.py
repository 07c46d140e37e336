"""Horovod's basics over hpccomm: what :func:`hvd.init <hpccomm.horovod.lifecycle.init>`
learnt about this process (rank, size, local and cross ranks), the queries
that read it, the build flags, and :class:`HorovodInternalError`.

The bottom of hpccomm.horovod: it imports no other module of the package.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

import hpccomm
from hpccomm.errors import HpccommError

NOT_INITIALIZED = "Horovod has not been initialized; use hvd.init()."


class HorovodInternalError(HpccommError):
    """A collective failed, or the ranks called it in ways that do not match
    (different ops, dtypes, shapes, root ranks, reduction ops or scale factors
    at the same position in the op sequence); raised on every rank taking part.

    Horovod's own class of that name (a :class:`RuntimeError`); here also an
    :class:`hpccomm.HpccommError`.

    Example::

        try:
            hvd.allreduce(torch.ones(hvd.rank() + 1))   # a different shape on each rank
        except hvd.HorovodInternalError as exc:
            print(exc)   # ... mismatched shapes: rank 0 sent float32[1], rank 1 sent float32[2] ...
    """


class _State:
    initialized = False
    owns_torch = False   # init() started torch.distributed (so shutdown() ends it)
    rank = size = local_rank = local_size = cross_rank = cross_size = 0
    homogeneous = True
    dynamic = False      # add/remove_process_set allowed after init


state = _State()


def require_init() -> None:
    if not state.initialized:
        raise ValueError(NOT_INITIALIZED)


def is_initialized() -> bool:
    """Whether :func:`init` has run (and :func:`shutdown` has not since). Never raises.

    Example::

        if not hvd.is_initialized():
            hvd.init()
    """
    return state.initialized


def size() -> int:
    """The number of Horovod processes (the world size).

    :raises ValueError: Horovod is not initialised.

    Example::

        lr = 0.01 * hvd.size()
    """
    require_init()
    return state.size


def rank() -> int:
    """This process's rank, 0..size()-1.

    :raises ValueError: Horovod is not initialised.

    Example::

        if hvd.rank() == 0:
            print("loss", loss.item())
    """
    require_init()
    return state.rank


def local_size() -> int:
    """The number of Horovod processes on this node.

    :raises ValueError: Horovod is not initialised.

    Example::

        threads = os.cpu_count() // hvd.local_size()
    """
    require_init()
    return state.local_size


def local_rank() -> int:
    """This process's rank among the processes on its node.

    :raises ValueError: Horovod is not initialised.

    Example::

        torch.cuda.set_device(hvd.local_rank())
    """
    require_init()
    return state.local_rank


def cross_size() -> int:
    """The number of nodes that have a process with this process's local rank
    (the number of nodes, on a homogeneous job).

    :raises ValueError: Horovod is not initialised.

    Example::

        nodes = hvd.cross_size()
    """
    require_init()
    return state.cross_size


def cross_rank() -> int:
    """This node's rank among the nodes that have a process with this
    process's local rank (the node index, on a homogeneous job).

    :raises ValueError: Horovod is not initialised.

    Example::

        node = hvd.cross_rank()
    """
    require_init()
    return state.cross_rank


def is_homogeneous() -> bool:
    """Whether every node runs the same number of processes.

    :raises ValueError: Horovod is not initialised.

    Example::

        assert hvd.is_homogeneous()
    """
    require_init()
    return state.homogeneous


def mpi_threads_supported() -> bool:
    """Whether MPI granted MPI_THREAD_MULTIPLE (other threads may call MPI, e.g. mpi4py).

    :raises ValueError: Horovod is not initialised.

    Example::

        if hvd.mpi_threads_supported():
            from mpi4py import MPI   # safe to use alongside Horovod
    """
    require_init()
    MPI = hpccomm.mpi_module()
    return MPI.Query_thread() == MPI.THREAD_MULTIPLE


def mpi_enabled() -> bool:
    """True when Horovod runs over MPI (hpccomm's backend) now. Never raises.

    Example::

        assert hvd.mpi_enabled()
    """
    return state.initialized and dist.is_initialized() and dist.get_backend() == hpccomm.BACKEND_NAME


def mpi_built() -> bool:
    """True when an MPI library is usable (hpccomm is MPI). Never raises.

    Example::

        assert hvd.mpi_built()
    """
    return hpccomm.is_mpi_available()


def gloo_enabled() -> bool:
    """False: hpccomm.horovod runs over MPI, not Horovod's Gloo controller. Never raises.

    Example::

        assert not hvd.gloo_enabled()
    """
    return False


def gloo_built() -> bool:
    """False: there is no Gloo controller in hpccomm.horovod. Never raises.

    Example::

        assert not hvd.gloo_built()
    """
    return False


def nccl_built() -> int:
    """NCCL's version code (``major*10000 + minor*100 + patch``) when torch has
    NCCL (hpccomm can carry CUDA tensors over it), else 0. Never raises.

    Example::

        if hvd.nccl_built():
            print("NCCL", hvd.nccl_built())
    """
    try:
        if not torch.cuda.is_available() and torch.version.cuda is None:
            return 0
        major, minor, patch = torch.cuda.nccl.version()[:3]
        return major * 10000 + minor * 100 + patch
    except Exception:  # noqa: BLE001 - a CPU build, or no NCCL in it
        return 0


def cuda_built() -> bool:
    """Whether torch was built with CUDA (hpccomm moves CUDA tensors then). Never raises.

    Example::

        device = "cuda" if hvd.cuda_built() and torch.cuda.is_available() else "cpu"
    """
    return torch.version.cuda is not None


def rocm_built() -> bool:
    """Whether torch was built with ROCm. Never raises.

    Example::

        assert not hvd.rocm_built() or torch.version.hip
    """
    return getattr(torch.version, "hip", None) is not None


def ddl_built() -> bool:
    """False (IBM DDL is not supported). Never raises.

    Example::

        assert not hvd.ddl_built()
    """
    return False


def ccl_built() -> bool:
    """False (oneCCL is not supported). Never raises.

    Example::

        assert not hvd.ccl_built()
    """
    return False


def start_timeline(file_path, mark_cycles=False) -> None:
    """Not supported: Horovod's timeline does not exist here.

    :param file_path: ignored.
    :param mark_cycles: ignored.
    :raises NotImplementedError: always; set ``HPCCOMM_TRACE=trace.json`` for a
        Perfetto timeline of every op on every rank.

    Example::

        # HPCCOMM_TRACE=trace.json mpirun -n 4 python train.py
    """
    raise NotImplementedError("hvd.start_timeline is not supported by hpccomm.horovod; set HPCCOMM_TRACE=trace.json "
                              "for a timeline of every op on every rank (see hpccomm's design docs)")


def stop_timeline() -> None:
    """Not supported (see :func:`start_timeline`).

    :raises NotImplementedError: always.

    Example::

        # HPCCOMM_TRACE=trace.json mpirun -n 4 python train.py
    """
    raise NotImplementedError("hvd.stop_timeline is not supported by hpccomm.horovod; set HPCCOMM_TRACE=trace.json "
                              "for a timeline of every op on every rank (see hpccomm's design docs)")
