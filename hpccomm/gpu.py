"""CUDA tensors: which routes carry them, and what ``hpccomm info`` says.

The transports (CUDA-aware MPI, NCCL through torch or CuPy, staged through
pinned host memory) are :mod:`hpccomm._gpu`'s, chosen per group, device and op
family from every member's findings; docs/gpu.md says how and why.

Example::

    hpccomm.gpu.set_transport("staged")          # every rank: force a transport for the world group
    dist.all_reduce(torch.ones(4, device="cuda"))
    hpccomm.gpu.routes()                         # {'cuda:0': {'reduction': 'staged', ...}}
    hpccomm.gpu.taken()                          # {'all_reduce': 'staged'}: what the last call ran
"""
from __future__ import annotations


def _group(group):
    from ._compat import group_of, world_group

    return group_of(group if group is not None else world_group())


def set_transport(name, group=None) -> None:
    """Force one transport for the CUDA ops of a group from its next op on;
    its routes are made anew (its NCCL communicators closed).  Call it on
    every member, between ops: the members compare their settings at the
    next collective on CUDA tensors and refuse together if they differ.

    :param name: ``auto``, ``mpi``, ``composed``, ``nccl`` or ``staged``, as ``HPCCOMM_GPU_TRANSPORT``;
        None: back to ``HPCCOMM_GPU_TRANSPORT``
    :param group: a process group of hpccomm (default: the world group)
    :raises ValueError: for an unknown name

    Example::

        hpccomm.gpu.set_transport("staged")     # every rank
        dist.all_reduce(torch.ones(4, device="cuda"))
    """
    from ._gpu import overrides

    overrides.set_transport(_group(group), name)


def set_routes(group=None, **families) -> None:
    """Force the route of single op families for the CUDA ops of a group from
    its next op on, on top of its transport (as ``HPCCOMM_GPU_ROUTES``); no
    family named: back to ``HPCCOMM_GPU_ROUTES``.  Call it on every member,
    between ops.

    :param group: a process group of hpccomm (default: the world group)
    :param families: ``reduction``, ``reduce_scatter`` (follows a forced ``reduction`` unless named),
        ``movement`` or ``p2p`` = ``mpi``, ``composed`` (the two reducing families only), ``nccl`` or ``staged``
    :raises ValueError: for an unknown family or route

    Example::

        hpccomm.gpu.set_routes(reduction="composed")   # every rank: hpccomm's ring over CUDA-aware MPI
    """
    from ._gpu import overrides

    overrides.set_routes(_group(group), families)


def routes(group=None) -> dict:
    """The routes a group has chosen so far, per device, and the
    point-to-point route this rank chose alone under ``"p2p:<device>"``.
    Never raises.

    :param group: a process group of hpccomm (default: the world group)

    Example::

        hpccomm.gpu.routes()
        # {'cuda:0': {'reduction': 'nccl', 'movement': 'mpi', 'p2p': 'mpi', 'fallback': 'mpi', 'reason': '...',
        #             'reduce_scatter': 'nccl'}}
    """
    from ._gpu import group_routes

    out = {}
    for device, r in group_routes.routes_of(_group(group)).items():
        out[device] = r if isinstance(r, str) else {"reduction": r.reduction, "movement": r.movement,
                                                     "p2p": r.p2p, "fallback": r.fallback, "reason": r.reason,
                                                     "reduce_scatter": r.reduce_scatter}
    return out


def taken(group=None) -> dict:
    """What the last CUDA call of each op ran on a group: ``{op name:
    route}``, with what was rewritten for NCCL.  Never raises.

    :param group: a process group of hpccomm (default: the world group)

    Example::

        dist.all_reduce(torch.ones(4, dtype=torch.int16, device="cuda"))
        hpccomm.gpu.taken()          # {'all_reduce': 'nccl (int16 SUM widened to int32)'}
    """
    from ._gpu import group_routes

    return group_routes.taken(_group(group))


def requested(group=None) -> dict:
    """What a group's CUDA routes are chosen from besides every member's
    findings: ``transport`` (set_transport's, else ``HPCCOMM_GPU_TRANSPORT``),
    ``routes`` (the per-family routes forced: set_routes's, else
    ``HPCCOMM_GPU_ROUTES``; ``{}`` for none) and ``cuda_backend`` (the
    backend torch's backend string named for cuda when the group was made,
    ``"nccl"``, or None).  Never raises.

    :param group: a process group of hpccomm (default: the world group)

    Example::

        dist.init_process_group("cpu:hpccomm,cuda:nccl")
        hpccomm.gpu.requested()      # {'transport': 'auto', 'routes': {}, 'cuda_backend': 'nccl'}
    """
    from ._gpu import overrides

    g = _group(group)
    return {"transport": overrides.requested(g), "routes": dict(overrides.forced_routes(g)),
            "cuda_backend": overrides.mapped(g)}


def bind() -> dict:
    """Bind this rank to its GPU now (hpccomm otherwise binds when the
    process first uses CUDA: ``HPCCOMM_GPU_BIND``): initialises CUDA.
    Returns ``{"device": index or None, "how": sentence}``.  Never raises
    (a failed binding is said in ``how``).

    Example::

        hpccomm.init_process_group()
        hpccomm.gpu.bind()           # {'device': 1, 'how': 'local rank 1 of 2 on this node, 2 GPU(s): ...'}
    """
    from ._gpu import binding

    return binding.bind()


def info(everyone: bool = False) -> dict:
    """What ``hpccomm info`` reports about GPUs on this rank (MPI must be
    up; it starts MPI otherwise).  Never raises for a missing GPU or NCCL:
    each finding says what was found.

    Keys: ``mpi_cuda_aware`` (yes/no/unknown), ``mpi_cuda_aware_how``,
    ``mpi_cuda_advice`` (what would make it CUDA-aware, when it is not),
    ``mpi_device_reductions``, ``mpi_device_movement``, ``mpi_device_reduce_scatter``, ``nccl_torch``,
    ``nccl_cupy`` (yes/no with how),
    ``gpu_count``, ``gpu_transport`` (the setting), ``cpu_transport``,
    ``cuda_routes`` (the routes a group takes for its CUDA tensors, per op
    family, and why, or why none: a group of this rank alone, or of every
    rank with ``everyone``) and ``gpu_binding`` (rank -> GPU).  Asking for the
    GPU count asks CUDA's driver, as ``hpccomm info`` does; where torch sees a
    GPU, naming the one this rank uses (to find ranks that share one)
    initialises CUDA.

    :param everyone: every rank of MPI_COMM_WORLD calls ``info`` at once
        (``hpccomm info`` under a launcher does): the ranks exchange their
        findings and ``cuda_routes`` is what a group of them all takes, the
        same on every rank (two ranks on one GPU: no NCCL).  False: from this
        rank's findings alone, nothing exchanged.

    Example::

        hpccomm.gpu.info()["cuda_routes"]   # 'reduction: nccl, movement: mpi, p2p: mpi (fallback mpi): ...'
    """
    import torch

    from . import config, launcher
    from ._gpu import agreement, binding, findings, probe, select

    caps = findings.capabilities()
    requested = config.get("HPCCOMM_GPU_TRANSPORT")
    try:
        index = binding.device_of(launcher.detect().local_rank or 0)  # (None: no GPU here, and () its name)
        where = findings.identify(torch.device("cuda", index or 0))[0]
    except Exception:  # noqa: BLE001 - a broken CUDA set-up: its GPU unnamed (hpccomm info shows CUDA's state)
        where = ()
    mine = select.Facts.of(requested, None, caps, where, config.get("HPCCOMM_GPU_ROUTES"))
    if everyone:
        from . import _mpi

        facts = _mpi.mpi().COMM_WORLD.allgather(mine)
    else:
        facts = [mine]
    count = probe.probe_gpu_count()
    bound = binding.binding()
    return {
        "mpi_cuda_aware": caps.mpi_cuda.word(),
        "mpi_cuda_aware_how": caps.mpi_cuda.how,
        "mpi_cuda_advice": caps.mpi_cuda.advice or "-",
        "mpi_device_reductions": f"{caps.mpi_device_reductions.word()} ({caps.mpi_device_reductions.how})",
        "mpi_device_movement": f"{caps.mpi_device_movement.word()} ({caps.mpi_device_movement.how})",
        "mpi_device_reduce_scatter": f"{caps.mpi_device_reduce_scatter.word()} "
                                     f"({caps.mpi_device_reduce_scatter.how})",
        "nccl_torch": f"{caps.nccl_torch.word()} ({caps.nccl_torch.how})",
        "nccl_cupy": f"{caps.nccl_cupy.word()} ({caps.nccl_cupy.how})",
        "gpu_count": count.value,
        "gpu_transport": requested,
        "cpu_transport": "mpi (host memory)",
        "cuda_routes": agreement.job_routes(facts),
        "gpu_binding": (f"GPU {bound['device']}: " if bound["device"] is not None else "none: ") + bound["how"],
    }
