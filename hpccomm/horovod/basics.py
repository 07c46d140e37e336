"""``hvd.init()`` and the rank queries: Horovod's basics over hpccomm.

hpccomm.horovod runs on torch.distributed: ``init()`` starts hpccomm's world
group (``hpccomm.init_process_group``) unless torch.distributed is already
initialised, in which case it works on the existing default group, so
Horovod calls and plain ``dist.*`` calls mix in one program.
"""
from __future__ import annotations

import os
import socket
from typing import Optional

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


def _comm_from_ranks(ranks):
    """An mpi4py communicator over ``ranks`` of MPI_COMM_WORLD (members only)."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    if any(not isinstance(r, int) or not 0 <= r < world.Get_size() for r in ranks):
        raise ValueError(f"hvd.init(comm={list(ranks)}): every entry must be a rank of MPI_COMM_WORLD "
                         f"(0..{world.Get_size() - 1})")
    if world.Get_rank() not in ranks:
        raise ValueError(f"hvd.init(comm={list(ranks)}): rank {world.Get_rank()} of MPI_COMM_WORLD is not in the "
                         "list; only the listed ranks may call hvd.init with it")
    group = world.Get_group().Incl(sorted(ranks))
    try:
        return world.Create_group(group, tag=0x5EED)
    finally:
        group.Free()


def init(comm=None, process_sets=None) -> None:
    """Initialise Horovod: torch.distributed over MPI (hpccomm), once per process.

    :param comm: None (every rank of MPI_COMM_WORLD), an mpi4py communicator
        (its ranks form the world; hpccomm works on a duplicate), or a list of
        MPI_COMM_WORLD ranks (only those ranks call ``init``).
    :param process_sets: None, a list of :class:`ProcessSet` to register now
        (every rank passes the same list, in the same order), or ``"dynamic"``
        to allow :func:`add_process_set`/:func:`remove_process_set` later (as
        ``HOROVOD_DYNAMIC_PROCESS_SETS=1`` does).
    :raises ValueError: ``comm`` is of another type, or lists ranks this process
        is not one of; a process set is a duplicate.
    :raises hpccomm.InitError: MPI or torch.distributed could not start.

    A second call does nothing, as in Horovod. If torch.distributed is already
    initialised (any backend), ``init()`` uses that default group.

    Example::

        import hpccomm.horovod as hvd
        hvd.init()
        print(hvd.rank(), hvd.size(), hvd.local_rank())
    """
    from . import process_sets as ps_mod

    if state.initialized:
        return
    if process_sets is None:
        process_sets = []
    elif isinstance(process_sets, str):
        if process_sets.lower() != "dynamic":
            raise ValueError(f"hvd.init(process_sets={process_sets!r}): expected a list of hvd.ProcessSet or 'dynamic'")
        process_sets = []
        os.environ["HOROVOD_DYNAMIC_PROCESS_SETS"] = "1"
    process_sets = list(process_sets)
    if comm is not None and not isinstance(comm, (list, tuple, range)):
        from mpi4py import MPI

        if not isinstance(comm, MPI.Comm):
            raise ValueError("Invalid type of argument comm. Expected list of rank integers or mpi4py.MPI.Comm object.")
    owns = False
    if dist.is_initialized():
        if comm is not None:
            raise ValueError("hvd.init(comm=...): torch.distributed is already initialised, so its default group is "
                             "Horovod's world; call hvd.init() without comm, or init before dist.init_process_group")
    else:
        if isinstance(comm, (list, tuple, range)):
            comm = _comm_from_ranks(list(comm))
        hpccomm.init_process_group(comm=comm)
        owns = True
    rank, size = dist.get_rank(), dist.get_world_size()
    if dist.get_backend() == hpccomm.BACKEND_NAME:
        where = (hpccomm.node_index(), hpccomm.local_rank())
    else:
        where = None
    everyone = [None] * size
    dist.all_gather_object(everyone, (where, socket.gethostname()))
    if any(w is None for w, _ in everyone):  # not hpccomm: nodes by host name
        hosts = list(dict.fromkeys(h for _, h in everyone))
        seen: dict = {}
        places = []
        for _, h in everyone:
            places.append((hosts.index(h), seen.get(h, 0)))
            seen[h] = seen.get(h, 0) + 1
    else:
        places = [w for w, _ in everyone]
    node, local = places[rank]
    state.rank, state.size = rank, size
    state.local_rank = local
    state.local_size = sum(1 for n, _ in places if n == node)
    same_local = [n for n, lr in places if lr == local]   # one rank per node with my local rank
    state.cross_rank = sorted(same_local).index(node)
    state.cross_size = len(same_local)
    per_node = {}
    for n, _ in places:
        per_node[n] = per_node.get(n, 0) + 1
    state.homogeneous = len(set(per_node.values())) == 1
    state.dynamic = os.environ.get("HOROVOD_DYNAMIC_PROCESS_SETS", "") not in ("", "0")
    state.owns_torch = owns
    state.initialized = True
    try:
        ps_mod.setup_global()
        ps_mod.register_at_init(process_sets)
    except BaseException:
        shutdown()
        raise


def shutdown() -> None:
    """Shut Horovod down: free its process groups, and end torch.distributed
    if :func:`init` started it. Pending async ops are dropped. Never raises;
    a later :func:`init` starts again.

    Example::

        hvd.shutdown()
        assert not hvd.is_initialized()
    """
    from . import ops, optimizer, process_sets as ps_mod

    if not state.initialized:
        return
    ops.reset()
    optimizer.teardown()
    ps_mod.teardown()
    state.initialized = False
    if state.owns_torch and dist.is_initialized():
        dist.destroy_process_group()
    state.owns_torch = False


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
    from mpi4py import MPI

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
