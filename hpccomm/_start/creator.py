"""Start-up, second half: the backend creator torch calls for every hpccomm group.

torch calls :func:`create` on member ranks only, for the default (world)
group and for every subgroup; it returns the adapter this torch takes
(:func:`make_adapter`).  After a shrink (hpccomm.fault_tolerance) the world
is made again here (:func:`rebuild_world`, :func:`shrunk_backend`).
"""
from __future__ import annotations

import zlib
from datetime import timedelta

import torch.distributed as dist

from .. import _compat as compat
from .. import _mpi, config
from .._about import BACKEND_NAME
from .._adapters.backend import BackendHpccomm
from .._adapters.process_group import ProcessGroupHpccomm
from .._core import comm_thread, failures, signals, state, trace, ulfm
from .._core import group as _group
from .._core.watchdog import watchdog
from .._gpu import binding, overrides
from ..errors import ConfigError, InitError
from .bootstrap import (DEFAULT_TIMEOUT, RankInfo, _configure_logging, _nodes, _start, _text, agree, check_adapter,
                        make_store, rank_info, started)


def _tag(ranks) -> int:
    """The MPI_Comm_create_group tag for a group of ``ranks``: derived from the
    members alone, so it is equal on every member whatever else each created
    before (torch's group ids can differ under use_local_synchronization)."""
    tag_ub = _mpi.mpi().COMM_WORLD.Get_attr(_mpi.mpi().TAG_UB) or 32767
    return zlib.crc32(",".join(map(str, ranks)).encode()) % (tag_ub + 1)


def create(opts, backend_options=None):
    """The creator torch calls for every hpccomm group, on member ranks only;
    returns the adapter this torch takes (:func:`make_adapter`)."""
    ranks = list(opts.global_ranks_in_group)
    if not ranks:  # the default (world) group
        group = _world_group(opts)
    else:
        group = _subgroup(opts, ranks)
    if getattr(opts, "group_id", ""):  # torch's name for the group (torch 2.13 also sets it later)
        group.name = str(opts.group_id)
    device_backends = compat.requested_device_backends()
    overrides.note_backend_map(group, device_backends)
    return make_adapter(group, backend_options, config.get("HPCCOMM_ADAPTER"), device_backends)


def _world_group(opts) -> _group.Group:
    """The default group's MPI side: every MPI rank of the world calls this."""
    comm, started.world_comm = started.world_comm, None
    if comm is None:  # a torch rendezvous (env://, tcp://, mpi://, a store): MPI learns of it here
        base = _start(timeout=opts.timeout)
        comm = base.Dup()

        def same_ranks():
            if (opts.group_rank, opts.group_size) != (comm.Get_rank(), comm.Get_size()):
                raise InitError(
                    f"hpccomm init: torch's rendezvous says rank {opts.group_rank} of {opts.group_size} but MPI "
                    f"says rank {comm.Get_rank()} of {comm.Get_size()}. With env:// the RANK and WORLD_SIZE "
                    "variables must match the MPI launch; or use init_method='mpi://' (or "
                    "hpccomm.init_process_group()), which takes both from MPI")

        try:
            agree(comm, same_ranks)
            if started.info is None or started.info.size != comm.Get_size():
                started.info = rank_info(comm)
        except BaseException:
            comm.Free()
            started.info = None
            raise
    group = _group.Group(comm, range(comm.Get_size()), store=opts.store, timeout=opts.timeout)
    group.is_world = True
    state.set_world_group(group)
    binding.bind_later(started.info.local_rank, started.info.local_size)  # nothing of CUDA touched now
    _install_excepthook(comm.Get_rank(), comm.Get_size())
    signals.install(comm, opts.store)
    trace.start(comm)
    return group


def _subgroup(opts, ranks) -> _group.Group:
    """A subgroup's MPI side, built by its members only (torch calls the
    creator on members only), whatever backend the default group has."""
    pending, started.sub_comm = started.sub_comm, None
    if pending is not None:  # from_mpi4py: the user's communicator, reordered by world rank
        return _group.Group(pending, ranks, store=opts.store, timeout=opts.timeout)
    world = state.world.group
    creating = _group.Members(ranks, opts.group_rank, opts.group_size, opts.store, opts.timeout)
    if world is not None and not world.freed:
        comm_thread.flush(world)  # the comm thread must be done with the parent communicator
        parent = world.comm
    else:  # the default group is not hpccomm: its ranks must be MPI_COMM_WORLD's
        _members_agree(opts, ranks, creating)
        parent = _mpi.mpi().COMM_WORLD
    tag = _tag(ranks)
    token = watchdog.begin(creating, "new_group (MPI_Comm_create_group)", 0)
    try:
        if state.failures.tolerant:
            ulfm.meet(parent, ranks, tag)  # a member that died raises here, not a hang in MPI_Comm_create_group
        comm = _group.create_group(parent, ranks, tag)
    except _mpi.mpi().Exception as exc:
        failure = failures.failure(f"new_group ({creating.where()})", exc) if state.failures.tolerant else None
        if failure is None:
            raise
        raise failure from exc  # a member died (fault-tolerance mode): hpccomm.RankFailure
    finally:
        watchdog.end(token)
    return _group.Group(comm, ranks, store=opts.store, timeout=opts.timeout)


_made_before: dict = {}  # members -> groups of exactly them this process agreed on before


def _members_agree(opts, ranks, creating) -> None:
    """Under a default group of another backend, before any MPI call: every
    member checks that MPI is started, its settings, and that its torch rank
    is its MPI_COMM_WORLD rank; the members agree through the new group's
    store (they have no communicator yet), so a refusal raises on every
    member instead of leaving some waiting in MPI."""
    mine = ranks[opts.group_rank]
    verdict = ""
    if not _mpi.started():
        verdict = (f"MPI is not started on rank {mine}: an hpccomm group under a default group of another backend "
                   "needs MPI started on every rank beforehand (MPI_Init waits for all ranks, and torch calls "
                   "the group's creator on its members only). Initialise with "
                   "hpccomm.init_process_group(backend=...) or import mpi4py.MPI on every rank first")
    else:
        try:
            config.load()
        except ConfigError as exc:
            verdict = str(exc)
        else:
            mpi_rank = _mpi.mpi().COMM_WORLD.Get_rank()
            if mpi_rank != mine:
                verdict = (f"the default process group's ranks are not MPI's (torch rank {mine} is MPI rank "
                           f"{mpi_rank}): an hpccomm group under a default group of another backend needs the "
                           "default group's ranks to be MPI_COMM_WORLD's. Launch with the MPI launcher and let "
                           "RANK follow it (or initialise with hpccomm.init_process_group(backend=...))")
    # torch's name for the group (and so opts.store's prefix) can differ between members made with
    # use_local_synchronization=True (it counts each rank's groups): meet in the default store under a
    # key of the members alone, and how many groups of exactly these members this process made before.
    store = compat.default_store() or opts.store
    nth = _made_before.get(tuple(ranks), 0)
    _made_before[tuple(ranks)] = nth + 1
    prefix = f"hpccomm/members/{','.join(map(str, ranks))}/{nth}/"
    store.set(prefix + str(opts.group_rank), verdict)
    keys = [prefix + str(r) for r in range(opts.group_size)]
    try:
        store.wait(keys, opts.timeout)
    except Exception as exc:  # noqa: BLE001 - torch raises its own timeout types
        raise InitError(f"hpccomm new_group ({creating.where()}): not every member arrived within "
                        f"{opts.timeout} ({_text(exc)})") from None
    for r, key in enumerate(keys):
        said = store.get(key).decode()
        if said:
            raise InitError(f"hpccomm new_group ({creating.where()}): {said}"
                            + ("" if r == opts.group_rank else f" (as rank {ranks[r]} reports)"))
    if started.info is None:
        _configure_logging()


def make_adapter(group, backend_options=None, adapter: str = "auto", device_backends=None):
    """What the backend creator returns to torch for ``group`` (a
    :class:`hpccomm._core.group.Group`).

    torch 2.13 takes only a whole ``ProcessGroup``.  On torch >= 2.14 both
    adapters work; ``auto`` picks, per group, the faster one where both
    serve the request: the ``ProcessGroup`` adapter (with hpccomm's
    ``Backend`` registered in it for every device, so torch's per-device
    machinery reaches hpccomm too) for a plain ``"hpccomm"`` backend string,
    and the ``Backend`` when the string sends some device to another
    backend (``"cpu:hpccomm,cuda:nccl"``), which only a Backend lets torch
    honour.  ``HPCCOMM_ADAPTER`` forces one (docs/design.md, "Torch versions").
    """
    check_adapter(adapter)
    use_backend = compat.py_backend() and (
        adapter == "backend" or (adapter == "auto" and any(
            str(b).lower() != BACKEND_NAME for b in (device_backends or {}).values())))
    if use_backend:
        if backend_options is not None and not isinstance(backend_options, compat.BackendOptions):
            backend_options = None  # torch's own option objects (ProcessGroupGloo.Options...) are not ours
        return BackendHpccomm(group, backend_options)
    return ProcessGroupHpccomm(group)


_hook_installed = False


def _install_excepthook(rank: int, size: int) -> None:
    """An uncaught exception on one rank ends the whole job at once, with
    what that rank says last (the failure policy: :func:`hpccomm._core.failures.uncaught_exit`),
    instead of leaving the other ranks in their next collective until the
    timeout."""
    global _hook_installed
    if _hook_installed or size == 1 or not config.get("HPCCOMM_ABORT_ON_EXCEPTION"):
        return
    _hook_installed = True
    import sys

    from ..errors import HpccommError

    previous = sys.excepthook

    def hook(kind, value, tb):
        if state.world.group is None or state.world.group.freed:
            previous(kind, value, tb)
            return
        # hpccomm's own errors are told short (failures.uncaught) unless another hook is in charge
        told = not (issubclass(kind, HpccommError) and previous is sys.__excepthook__)
        if told:
            previous(kind, value, tb)
            if sys.stderr is not sys.__stderr__:  # torch's own hook captures the traceback to prefix it
                import traceback

                traceback.print_exception(kind, value, tb, file=sys.__stderr__)
        failures.uncaught_exit(kind, value, tb, told)

    sys.excepthook = hook


def rebuild_world(comm, survivors, old_groups, timeout=None) -> dict:
    """torch's world made again over ``comm``, the survivors' communicator
    (hpccomm.fault_tolerance.shrink, after MPI_Comm_shrink; collective over ``comm``).

    ``survivors``: the old world ranks of ``comm``'s ranks, in order;
    ``old_groups``: every hpccomm Group of this rank (revoked, their queues
    drained).  A new key-value store is opened on the new rank 0 (the old
    one may have died with the old rank 0); the default group is destroyed
    and made again with the same backend string and timeout (``timeout``
    overrides it); every hpccomm subgroup that any survivor is a member of
    is made again over its surviving members, renumbered in the same order,
    by every survivor in one agreed order (``dist.new_group``).  Returns
    ``{old group: new group}`` for this rank's subgroups."""
    old_world = state.world.group
    timeout = timeout or old_world.timeout or DEFAULT_TIMEOUT
    backend = dist.get_backend()  # the string init was given (dist.get_backend() says the same after)
    info = rank_info(comm)
    store = make_store(comm, info, timeout)
    # Every survivor's hpccomm subgroups: each rank knows only its own, and dist.new_group wants all ranks.
    mine = {}
    for pg, ranks in compat.process_groups():
        g = compat.group_of(pg)
        if g is not None and g is not old_world:
            mine[g.key] = (tuple(ranks), g.timeout_s, dist.get_backend(pg), pg)
    known = {}
    for part in comm.allgather({key: entry[:3] for key, entry in mine.items()}):
        known.update(part)
    order = sorted(known, key=lambda key: (known[key][0], key))
    for g in old_groups:
        g.free(flush=False)  # revoked, drained by the caller: nothing runs on them any more
    started.info = info
    dist.destroy_process_group()
    started.world_comm = comm
    try:
        dist.init_process_group(backend=backend, store=store, rank=info.rank, world_size=info.size, timeout=timeout)
    finally:
        if started.world_comm is not None:  # torch failed before our creator took it
            started.world_comm.Free()
            started.world_comm = None
    new_rank = {old: new for new, old in enumerate(survivors)}
    made = {}
    for key in order:
        ranks, seconds, group_backend = known[key]
        members = [new_rank[r] for r in ranks if r in new_rank]
        if not members:
            continue
        kw = {} if not seconds else {"timeout": timedelta(seconds=seconds)}
        pg = dist.new_group(members, backend=group_backend, **kw)
        if key in mine:
            made[mine[key][3]] = pg
    return made


def shrunk_backend(g, comm, survivors, opts=None):
    """The Backend over ``comm``, the survivors of group ``g``'s
    communicator, for ``dist.shrink_group`` (torch >= 2.14; hpccomm.fault_tolerance).

    A new key-value store is opened on its rank 0 and handed to torch as the
    old group's store (torch clones it for the new group: the old one may
    have died with the old rank 0).  For the default group the new group
    becomes hpccomm's world."""
    world = g.is_world
    timeout = g.timeout or DEFAULT_TIMEOUT
    info = rank_info(comm) if world else None
    store = make_store(comm, info or RankInfo(comm.Get_rank(), comm.Get_size(), 0, 1, 0, _nodes(comm)), timeout)
    target = compat.default_group_or_none() if world else next(
        (pg for pg, _ in compat.process_groups() if compat.group_of(pg) is g), None)
    if target is not None:
        compat.replace_group_store(target, store)
    ranks = list(range(len(survivors))) if world else [g.global_ranks[r] for r in survivors]
    child = _group.Group(comm, ranks, store=store, timeout=g.timeout)
    g.free(flush=False)
    if world:
        child.is_world = True
        state.set_world_group(child)
        started.info = info
        signals.install(comm, store)  # every rank's host and pid, renumbered
    return BackendHpccomm(child, opts)
