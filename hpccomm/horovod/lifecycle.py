"""``hvd.init()`` and ``hvd.shutdown()``.

hpccomm.horovod runs on torch.distributed: ``init()`` starts hpccomm's world
group (``hpccomm.init_process_group``) unless torch.distributed is already
initialised, in which case it works on the existing default group, so
Horovod calls and plain ``dist.*`` calls mix in one program.

The top of hpccomm.horovod (below its ``__init__`` only): shutdown undoes what
the modules below set up.
"""
from __future__ import annotations

import os
import socket

import torch.distributed as dist

import hpccomm

from . import optimizer, process_sets as ps_mod
from .basics import state
from .ops import handles


def _comm_from_ranks(ranks):
    """An mpi4py communicator over ``ranks`` of MPI_COMM_WORLD (members only)."""
    world = hpccomm.mpi_module().COMM_WORLD
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
        if not isinstance(comm, hpccomm.mpi_module().Comm):
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
    if not state.initialized:
        return
    handles.reset()
    optimizer.teardown()
    ps_mod.teardown()
    state.initialized = False
    if state.owns_torch and dist.is_initialized():
        dist.destroy_process_group()
    state.owns_torch = False
